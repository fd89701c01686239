"""Process settings for training on the CPU, applied by every entry point (``fedhpro.run``, the Flower
apps, the benchmarks) so that all of them measure and run the same way.

* OpenMP's idle threads sleep at once instead of spinning
  (:data:`OPENMP_DEFAULTS`, ``OMP_WAIT_POLICY=PASSIVE``), set by ``import
  fedhpro`` when the user set neither ``OMP_WAIT_POLICY`` nor
  ``GOMP_SPINCOUNT`` and torch is not loaded yet: libgomp reads them once,
  when torch loads it. libgomp's own default spins 300,000 iterations
  between parallel regions; beside another busy process that spinning takes
  the time slice of the thread it waits for: a round of the default 2-thread
  run took 2.8x as long as on the idle machine, 1.7x with passive waits, at
  the same idle speed (bench/shared_machine.py, bench/RESULTS.md). The wait
  policy does not change the numbers: the same thread count splits the same
  work.
* Denormal floats are flushed to zero: tiny gradients (HPCL's saturated gate)
  produce denormals, which run ~10x slower on x86.
* glibc's allocator keeps freed memory for reuse. By default it returns
  large freed blocks to the kernel (``mmap``/``munmap`` above a moving
  threshold, heap trimming above 128 KiB free), so every training batch
  faulted its activation buffers back in: 250,000-550,000 page faults and
  0.3-0.7 s of kernel time per 3.5 s round of the default ``cnn`` on one
  thread (bench/RESULTS.md). With a fixed 32 MiB ``mmap`` threshold and no
  trimming below 1 GiB the buffers are reused: no faults, rounds 10-15 %
  faster. The cost: the process keeps its peak heap until it exits (the
  peak itself does not change). ``FEDHPRO_KEEP_FREED_MEMORY=0`` turns this
  off; nothing is done where glibc is not the C library.

:func:`configure_cpu_runtime` sets both for the rest of the process (the
Flower apps, the benchmarks: processes of their own). :func:`cpu_runtime`
sets them for a block, as ``fedhpro.run`` does inside the caller's process:
the flush-denormal state is put back as it was after the block; the
allocator thresholds stay (glibc has no way to read the previous ones back).

The hardware a run trains on (:func:`cpu_features`, one :class:`CpuFeatures`
read from ``/proc/cpuinfo`` and torch) decides its mixed precision
(``amp=bf16``): :func:`amp_precision` is what training runs in on a device
(bfloat16; float16 with a gradient scaler on a GPU without native bfloat16),
:func:`precision_problem` refuses bfloat16 on a CPU that has no native
bfloat16 instructions (neither AVX512-BF16 nor AMX), where it is slower than
float32, :func:`bf16_note` says when a CPU has them and the run does not use
them, and :func:`machine_record` is summary.json's ``machine`` block.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

#: libgomp's settings when the user set none: idle threads sleep at once (see the docstring)
OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
_OPENMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

#: glibc's ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: the largest mmap threshold glibc accepts on 64-bit systems (HEAP_MAX_SIZE / 2)
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 1024 * 1024 * 1024

_allocator_configured: bool | None = None


def set_openmp_defaults() -> bool:
    """Put :data:`OPENMP_DEFAULTS` in the environment unless the user set a wait variable or torch (and so
    its OpenMP runtime) is loaded already; True if set. Child processes (sweep workers, Flower's) inherit it."""
    if "torch" in sys.modules or any(name in os.environ for name in _OPENMP_WAIT_VARIABLES):
        return False
    os.environ.update(OPENMP_DEFAULTS)
    return True


def configure_cpu_runtime() -> None:
    """Flush denormals and let glibc reuse freed memory (see the module docstring); idempotent."""
    import torch

    torch.set_flush_denormal(True)
    keep_freed_memory()


@contextlib.contextmanager
def cpu_runtime(enabled: bool = True) -> Iterator[None]:
    """:func:`configure_cpu_runtime` for the block (nothing when not ``enabled``), then the calling thread's
    flush-denormal state as it was before; glibc's thresholds stay set (they cannot be read back)."""
    if not enabled:
        yield
        return
    import torch

    flushed = denormals_flushed()
    configure_cpu_runtime()
    try:
        yield
    finally:
        torch.set_flush_denormal(flushed)


def denormals_flushed() -> bool:
    """Whether the calling thread flushes denormal floats to zero now (PyTorch has no getter: a probe).

    ``1e-40`` is a float32 denormal; with flushing on, it reads back as 0.
    """
    import torch

    return float(torch.full((1,), 1e-40, dtype=torch.float32).mul_(1.0)[0]) == 0.0


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds once per process; True if they are set (now or before)."""
    global _allocator_configured
    if _allocator_configured is None:
        _allocator_configured = _set_malloc_thresholds()
    return _allocator_configured


def _set_malloc_thresholds() -> bool:
    if os.environ.get("FEDHPRO_KEEP_FREED_MEMORY", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):  # only glibc has it (musl does not)
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; the machine's count where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def auto_threads(jobs: int = 1) -> int:
    """``threads=auto``: ``$OMP_NUM_THREADS`` if set (as torch's own default), else :func:`available_cores`,
    divided among ``jobs`` runs at a time (at least 1)."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    cores = int(given) if given.isdigit() and int(given) >= 1 else available_cores()
    return max(1, cores // max(1, jobs))


def resolve_threads(setting: str | int, jobs: int = 1) -> int:
    """The thread count of a run's ``threads=`` setting (``"auto"`` or a whole number) in a sweep of ``jobs``."""
    return auto_threads(jobs) if str(setting) == "auto" else int(setting)


def client_parallelism(setting: str | int, threads: int, device: Any = "cpu") -> tuple[int, int]:
    """``(clients trained at once, threads each)`` of ``parallel_clients=`` in a run of ``threads`` threads on
    ``device``. ``auto``: on the CPU one client a thread (a small model's mini-batches keep one core busy, and
    two clients side by side train ~2x as fast as one on two threads, measured on the cnn in float32 and bf16);
    on a GPU one client at a time. A whole number ``n``: ``n`` clients (at most ``threads``) of ``threads // n``
    threads each."""
    threads = max(1, int(threads))
    if str(device).split(":")[0] != "cpu":
        return 1, threads
    workers = threads if str(setting) == "auto" else min(int(setting), threads)
    workers = max(1, workers)
    return workers, max(1, threads // workers)


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """``torch.set_num_threads(count)`` for the block (the inter-op threads too while none has started yet,
    which torch allows once per process); the previous intra-op count is put back afterwards."""
    import torch

    with intra_op_threads(count):
        with contextlib.suppress(RuntimeError):  # inter-op threads already started: they stay as they are
            torch.set_num_interop_threads(count)
        yield


@contextlib.contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """The calling thread's torch thread count (OpenMP's is per thread) set to ``count`` for the block, the
    previous one put back afterwards; None: left as it is."""
    import torch

    previous = torch.get_num_threads()
    if count is None or count == previous:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# ---------------------------------------------------------------------------- the hardware and the precision

#: ``/proc/cpuinfo`` flags that say the CPU computes bfloat16 natively (AVX512-BF16's dot products, AMX's tiles)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
#: the per-sample training time of the default ``cnn`` on a 2-core Intel Xeon with AMX and AVX512-BF16 (one
#: thread, digits-offline batches of 64), in microseconds: what ``amp=bf16`` gains where bfloat16 is native
MEASURED_US = {"float32": 372, "channels_last": 260, "bf16": 233, "bf16+channels_last": 126}
#: how much slower ``amp=bf16`` (with channels_last) trained the ``cnn`` than float32 where bfloat16 is emulated:
#: the same Xeon with oneDNN and torch limited to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2``, as
#: an AVX2-only CPU such as an older AMD EPYC runs): 5493 against 747 us per sample, one thread, batches of 64
EMULATED_BF16_SLOWDOWN = 7


@dataclass(frozen=True)
class CpuFeatures:
    """What fedhpro reads about the CPU (:func:`cpu_features`): its model name and the instruction sets that
    decide how fast it trains in float32 and in bfloat16."""

    model: str  # the model name, e.g. "Intel(R) Xeon(R) Platinum 8480+" ("unknown" where it cannot be read)
    avx2: bool
    avx512: bool  # AVX-512 Foundation (avx512f)
    avx512_bf16: bool  # AVX512-BF16: bfloat16 dot products
    amx: bool  # AMX with bfloat16 tiles (amx_bf16 and amx_tile)
    capability: str = "unknown"  # torch.backends.cpu.get_cpu_capability(): the kernels torch dispatches to

    @property
    def native_bf16(self) -> bool:
        """Whether the CPU computes bfloat16 natively (AVX512-BF16 or AMX); without either, oneDNN emulates it
        and bfloat16 convolutions run slower than float32."""
        return self.avx512_bf16 or self.amx

    def isa(self) -> dict[str, bool]:
        """The instruction sets summary.json records: ``{"avx2", "avx512", "avx512_bf16", "amx"}``."""
        return {"avx2": self.avx2, "avx512": self.avx512, "avx512_bf16": self.avx512_bf16, "amx": self.amx}

    def described(self) -> str:
        """The model name and its bfloat16 instructions, for a message: ``"Intel ... (AMX, AVX512-BF16)"``."""
        have = [name for name, on in (("AMX", self.amx), ("AVX512-BF16", self.avx512_bf16),
                                      ("AVX-512", self.avx512 and not self.avx512_bf16),
                                      ("AVX2", self.avx2 and not self.avx512)) if on]
        return f"{self.model} ({', '.join(have)})" if have else self.model


def cpu_features() -> CpuFeatures:
    """This machine's :class:`CpuFeatures`: on Linux from ``/proc/cpuinfo`` (``model name`` and ``flags``),
    elsewhere (or where it cannot be read) from torch's CPU capability alone; read once per process. Tests
    fake another CPU with ``monkeypatch.setattr(fedhpro.runtime, "cpu_features", lambda: CpuFeatures(...))``:
    every caller looks it up here."""
    return _read_cpu_features()


@functools.lru_cache(maxsize=1)
def _read_cpu_features() -> CpuFeatures:
    import torch

    try:
        capability = str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        capability = "unknown"
    model, flags = _cpuinfo()
    if flags is None:  # no /proc/cpuinfo: what torch dispatches to is the best we know
        upper = capability.upper()
        return CpuFeatures(model or "unknown", avx2=upper.startswith(("AVX2", "AVX512")),
                           avx512=upper.startswith("AVX512"), avx512_bf16=False, amx=False, capability=capability)
    return CpuFeatures(model or "unknown", avx2="avx2" in flags, avx512="avx512f" in flags,
                       avx512_bf16="avx512_bf16" in flags, amx="amx_bf16" in flags and "amx_tile" in flags,
                       capability=capability)


def _cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str | None, set[str] | None]:
    """``(model name, flags)`` of the first processor in ``path`` (None for what is not there)."""
    model: str | None = None
    flags: set[str] | None = None
    try:
        with open(path, encoding="utf-8", errors="replace") as text:
            for line in text:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = " ".join(value.split())
                elif key in ("flags", "Features") and flags is None:  # x86, arm64
                    flags = set(value.split())
                if model is not None and flags is not None:
                    break
    except OSError:
        return None, None
    return model, flags


def cuda_bf16_native(device: Any) -> bool:
    """Whether the CUDA ``device`` computes bfloat16 natively (compute capability 8.0 and up), not emulated."""
    import torch

    with torch.cuda.device(device):
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # an older torch: no emulation flag
            return bool(torch.cuda.is_bf16_supported())


def amp_precision(amp: str, device: Any) -> str:
    """What local training computes in for the ``amp`` setting on ``device``: ``"float32"`` (amp=off),
    ``"bf16"`` (bfloat16 autocast), or ``"fp16"`` (amp=bf16 on a GPU without native bfloat16: float16 autocast
    with a gradient scaler, :class:`torch.amp.GradScaler`). The weights, the losses and everything the server
    does stay float32 in every case."""
    if amp == "off":
        return "float32"
    if getattr(device, "type", str(device).split(":")[0]) == "cuda" and not cuda_bf16_native(device):
        return "fp16"
    return "bf16"


def precision_problem(amp: str, device: Any) -> str | None:
    """Why ``amp`` cannot train on ``device``, in one line naming the reason and the fix, or None: amp=bf16 on a
    CPU without native bfloat16 (neither AVX512-BF16 nor AMX), where oneDNN emulates bfloat16 and its
    convolutions are reported several times slower than float32."""
    if amp != "bf16" or getattr(device, "type", str(device).split(":")[0]) != "cpu":
        return None
    cpu = cpu_features()
    if cpu.native_bf16:
        return None
    return (f"amp=bf16 refused: this CPU ({cpu.described()}) has no native bfloat16 (neither AVX512-BF16 nor "
            f"AMX), so bfloat16 is emulated and trains the cnn about {EMULATED_BF16_SLOWDOWN:g}x slower than float32, "
            "typical of such CPUs; use amp=off")


def bf16_note(amp: str, device: Any, models: Iterable[Any] | None = None) -> str | None:
    """The start-up line of a float32 run on a CPU that computes bfloat16 natively (``fedhpro run`` prints it;
    it is kept out of summary.json, so a float32 run's files do not depend on the CPU), else None. ``models``:
    the run's built models; the line is said only if one has a Conv2d (where bfloat16 was measured faster: a
    tabular MLP gains nothing); None: not known, said."""
    if amp != "off" or getattr(device, "type", str(device).split(":")[0]) != "cpu":
        return None
    if models is not None and not any(has_conv2d(model) for model in models):
        return None
    cpu = cpu_features()
    if not cpu.native_bf16:
        return None
    speedup = MEASURED_US["float32"] / MEASURED_US["bf16+channels_last"]
    return (f"this CPU has native bfloat16 ({cpu.described()}): amp=bf16 trains convolutional models up to "
            f"{speedup:.1f}x faster per sample (measured on the cnn); its digits differ from float32's")


def has_conv2d(model: Any) -> bool:
    """Whether ``model`` (an ``nn.Module``) has a ``Conv2d`` layer: ``channels_last=auto`` is on for such models."""
    import torch

    return any(isinstance(module, torch.nn.Conv2d) for module in model.modules())


def trains_channels_last(channels_last: bool | None, amp: str, model: Any) -> bool:
    """Whether local training of ``model`` runs in ``channels_last``: ``channels_last`` as set (True or False),
    or for None (``channels_last=auto``) exactly when mixed precision is on and the model has a Conv2d."""
    if channels_last is not None:
        return bool(channels_last)
    return amp != "off" and has_conv2d(model)


def memory_format(channels_last: bool | None, amp: str, models: Iterable[Any] = ()) -> str:
    """summary.json's memory format of local training: ``"channels_last"``, ``"contiguous"``, ``"mixed"`` (the
    clients' architectures differ in it), or ``"auto"`` (``channels_last=auto`` with mixed precision and no
    model given: channels_last for convolutional models)."""
    if channels_last is not None or amp == "off":
        return "channels_last" if channels_last else "contiguous"
    formats = {trains_channels_last(None, amp, model) for model in models}
    if not formats:
        return "auto"
    if len(formats) > 1:
        return "mixed"
    return "channels_last" if formats.pop() else "contiguous"


def machine_record(device: Any, precision: str, memory_format: str, threads: int | None = None,
                   parallel_clients: str | int = 1) -> dict[str, Any]:
    """summary.json's ``machine`` block: the CPU's model name and instruction sets, the GPU's name (null unless
    the device is CUDA), the torch thread count (``threads``, else torch's current one), how many clients trained
    at once and with how many threads each (:func:`client_parallelism` of ``parallel_clients``), the precision
    local training ran in (``"float32"``, ``"bf16"``, ``"fp16"``) and its memory format. It describes the
    machine, not the result (bench/identical_runs.py leaves it out of the result's hash)."""
    import torch

    cpu = cpu_features()
    name = str(device)
    gpu = None
    if name.startswith("cuda"):
        with contextlib.suppress(RuntimeError, AssertionError, AttributeError):
            gpu = torch.cuda.get_device_name(torch.device(name))
    threads = int(threads if threads is not None else torch.get_num_threads())
    workers, client_threads = client_parallelism(parallel_clients, threads, device)
    return {"cpu": cpu.model, "isa": cpu.isa(), "gpu": gpu, "threads": threads,
            "parallel_clients": workers, "client_threads": client_threads,
            "precision": precision, "memory_format": memory_format}
