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
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from collections.abc import Iterator

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


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """``torch.set_num_threads(count)`` for the block (the inter-op threads too while none has started yet,
    which torch allows once per process); the previous intra-op count is put back afterwards."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    with contextlib.suppress(RuntimeError):  # inter-op threads already started: they stay as they are
        torch.set_num_interop_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
