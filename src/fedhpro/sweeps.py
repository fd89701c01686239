"""Where a sweep's runs (``fedhpro compare``, ``fedhpro reproduce``) execute, and with how many threads.

* ``jobs=1`` (the default): one run after the other in this process, as
  always (:func:`fedhpro.compare.run_all`).
* ``jobs=N``: ``N`` worker processes on this machine
  (``concurrent.futures.ProcessPoolExecutor``, "spawn" context: torch and
  ``fork`` do not mix).
* ``executor=ray``: each run a Ray task asking for ``num_cpus`` = its
  threads, on a local Ray started for the sweep (default) or on a running
  cluster (``ray.address=auto`` or ``HOST:PORT``).

A worker runs :func:`fedhpro.api.run_or_continue` (the job the caller gives) on its run's folder, so
reuse and continuing from a checkpoint stay per run, and its progress bar is
off; the parent shows one line over the whole sweep instead. Each run is
pinned to its thread count (``threads=``, auto: this machine's cores divided
by ``N``), so a run gives the same bytes as in a sequential sweep with that
thread count. A run that fails is reported in one line and the others go on;
the caller lists the failures at the end (:class:`SweepFailed`).

The keys ``jobs``, ``executor`` and ``ray.address`` are declared (help, default, checks) by
:class:`fedhpro.command_options.sweep.Sweep`, which ``fedhpro config --keys`` lists.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fedhpro.bounded import read_json_file
from fedhpro.command_options.keys import read, take
from fedhpro.command_options.sweep import Sweep
from fedhpro.config import Config
from fedhpro.errors import ConfigError, DataError, FedHProError
from fedhpro.runtime import auto_threads, available_cores, resolve_threads, torch_threads  # noqa: F401 (kept importable)

RAY_INSTALL = 'pip install "fedhpro[flower]"'


class SweepFailed(FedHProError):
    """Some runs of a sweep failed (the others finished); the message lists each with its error."""


@dataclass
class Failure:
    """A run that failed: how the sweep names it, its folder and its error in one line."""

    label: str
    folder: Path
    error: str

    def line(self) -> str:
        return f"{self.label} ({self.folder}): {self.error}"


def sweep_options(pairs: dict[str, Any]) -> Sweep:
    """Take ``jobs``, ``executor`` and ``ray.address`` (:class:`~fedhpro.command_options.sweep.Sweep`'s keys) out
    of command-line ``pairs`` as a checked :class:`Sweep`."""
    return checked(take(Sweep, pairs))


def make_sweep(jobs: Any = 1, executor: Any = "local", ray_address: Any = None) -> Sweep:
    """A checked :class:`Sweep`: ``jobs`` a whole number >= 1, ``executor`` local or ray."""
    return checked(read(Sweep, {"jobs": jobs, "executor": executor, "ray.address": ray_address}))


def checked(sweep: Sweep) -> Sweep:
    """``sweep``, once its keys agree with each other and Ray is there if it asks for it (before any run starts)."""
    if sweep.ray_address is not None and sweep.executor != "ray":
        raise ConfigError("ray.address= is used only with executor=ray; add executor=ray")
    if sweep.executor == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError(f"executor=ray needs Ray, which is not installed; {RAY_INSTALL}")
    return sweep


def worker_config(config: Config, jobs: int) -> Config:
    """``config`` as a worker runs it: its thread count fixed (auto divided among ``jobs``), no progress bar."""
    threads = str(resolve_threads(config.run.threads, jobs))
    return replace(config, run=replace(config.run, threads=threads, progress=False))


#: a worker's job: the summary of ``config`` in ``folder``, read back, continued or run; a module-level function
#: (pickled by name), in practice :func:`fedhpro.api.run_or_continue`, given by the caller (this module is below
#: the API and imports nothing of it)
Job = Callable[[Any, Path], "dict[str, Any]"]


def error_line(error: BaseException) -> str:
    """An error in one line: a fedhpro error's message, else its type and message."""
    text = " ".join(str(error).split()) or "no message"
    return text if isinstance(error, FedHProError) else f"{type(error).__name__}: {text}"


class Display:
    """One progress line over the whole sweep on stderr: runs done / running / failed, elapsed and ETA
    (the time per run finished so far times the runs left)."""

    def __init__(self, total: int, done: int, echo: bool) -> None:
        self.total, self.done, self.running, self.failed = total, done, 0, 0
        self.echo, self.started, self.first_done = echo, time.perf_counter(), done
        self.shown: tuple[int, int, int] | None = None

    def show(self) -> None:
        """The line again: rewritten in place on a terminal, a new line per change elsewhere (a log file)."""
        state = (self.done, self.running, self.failed)
        if not self.echo or state == self.shown:
            return
        self.shown = state
        elapsed = time.perf_counter() - self.started
        finished = self.done + self.failed - self.first_done
        left = self.total - self.done - self.failed
        eta = _clock(elapsed / finished * left) if finished else "?"
        line = (f"sweep: {self.done}/{self.total} done, {self.running} running, {self.failed} failed, "
                f"{_clock(elapsed)} elapsed, ETA {eta}")
        if sys.stderr.isatty():
            print(f"\r{line}  ", end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    def report(self, failure: Failure) -> None:
        """A failed run's line, when it fails."""
        if self.echo:
            start = "\n" if sys.stderr.isatty() else ""
            print(f"{start}failed: {failure.line()}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Ends the line on a terminal."""
        if self.echo and sys.stderr.isatty():
            print(file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    minutes, second = divmod(int(seconds), 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours}:{minute:02d}:{second:02d}" if hours else f"{minute:02d}:{second:02d}"


def execute(tasks: Sequence[tuple[Any, Path]], labels: Sequence[str], sweep: Sweep, job: Job,
            echo: bool = True) -> tuple[list[dict[str, Any] | None], list[Failure]]:
    """Every task's summary (None where it failed) and the failures, the runs spread as ``sweep`` says, each
    run by ``job`` in a worker (:data:`Job`).

    A finished run (its ``summary.json``) is read back here without a worker; the others go to the workers.
    """
    summaries: list[dict[str, Any] | None] = [None] * len(tasks)
    pending = []
    for index, (_, folder) in enumerate(tasks):
        done = Path(folder) / "summary.json"
        if done.is_file():
            summary = read_json_file(done, DataError)
            if not isinstance(summary, dict):
                raise DataError(f"{done} holds a JSON {type(summary).__name__}, not a run's summary; it is damaged: "
                                "delete it to run that job again")
            summaries[index] = summary
        else:
            pending.append(index)
    display = Display(len(tasks), len(tasks) - len(pending), echo)
    failures: list[Failure] = []
    if not pending:
        return summaries, failures
    threads = {index: resolve_threads(tasks[index][0].run.threads, sweep.jobs) for index in pending}
    configs = {index: worker_config(tasks[index][0], sweep.jobs) for index in pending}
    run = _run_ray if sweep.executor == "ray" else _run_processes

    def finished(index: int, summary: dict[str, Any] | None, error: BaseException | None) -> None:
        if error is None:
            summaries[index] = summary
            display.done += 1
        else:
            failure = Failure(labels[index], Path(tasks[index][1]), error_line(error))
            failures.append(failure)
            display.failed += 1
            display.report(failure)
        display.show()

    def running(count: int) -> None:
        display.running = count
        display.show()

    try:
        run([(index, configs[index], Path(tasks[index][1]), threads[index]) for index in pending], sweep,
            running, finished, job)
    finally:
        display.close()
    failures.sort(key=lambda failure: labels.index(failure.label))
    return summaries, failures


Running = Callable[[int], None]
Finished = Callable[[int, "dict[str, Any] | None", "BaseException | None"], None]


def _run_processes(work: list[tuple[int, Any, Path, int]], sweep: Sweep, running: Running,
                   finished: Finished, job: Job) -> None:
    """``sweep.jobs`` spawned worker processes, each run pinned to its threads by its config."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(sweep.jobs, len(work)), mp_context=context) as pool:
        futures: dict[Future[dict[str, Any]], int] = {
            pool.submit(job, config, folder): index for index, config, folder, _ in work}
        waiting = set(futures)
        try:
            while waiting:
                running(min(sweep.jobs, len(waiting)))
                done, waiting = wait(waiting, return_when=FIRST_COMPLETED)
                for future in done:
                    error = future.exception()
                    finished(futures[future], None if error else future.result(), error)
        except BaseException:  # Ctrl-C: the queued runs do not start (the running ones keep their checkpoints)
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        running(0)


#: set to "0" before ray is imported, a local Ray binds to 127.0.0.1 only (ray_constants.ENABLE_RAY_CLUSTER)
RAY_LOCAL_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _run_ray(work: list[tuple[int, Any, Path, int]], sweep: Sweep, running: Running, finished: Finished,
             job: Job) -> None:
    """One Ray task per run with ``num_cpus`` = its threads; a local Ray is started (and stopped) unless one is
    running in this process or ``sweep.ray_address`` names a cluster.

    A local Ray listens on 127.0.0.1 only: ray 2.55 binds its services to the machine's network address
    (on every interface) unless RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is set before it is imported, which is
    done here unless the user set that variable (a process that imported ray before keeps what it had)."""
    if sweep.ray_address is None:
        os.environ.setdefault(RAY_LOCAL_ONLY, "0")
    try:
        import ray  # lazy: optional (the flower extra), and imported after RAY_LOCAL_ONLY is set
    except ImportError:
        raise ConfigError(f"executor=ray needs Ray, which is not installed; {RAY_INSTALL}") from None
    ours = not ray.is_initialized()
    if ours:
        local: dict[str, Any] = {"_node_ip_address": "127.0.0.1"} if sweep.ray_address is None else {}
        ray.init(address=sweep.ray_address, include_dashboard=False, log_to_driver=False, **local)
    try:
        task = ray.remote(job)
        refs = {task.options(num_cpus=threads).remote(_absolute(config, folder), folder.resolve()): index
                for index, config, folder, threads in work}
        waiting = list(refs)
        while waiting:
            running(len(waiting))  # Ray queues what the cluster cannot run yet: all not done count
            done, waiting = ray.wait(waiting, num_returns=1)
            for ref in done:
                try:
                    finished(refs[ref], ray.get(ref), None)
                except Exception as error:  # a RayTaskError wraps the run's own error as its cause
                    finished(refs[ref], None, getattr(error, "cause", None) or error)
        running(0)
    finally:
        if ours:
            ray.shutdown()


def _absolute(config: Config, folder: Path) -> Config:
    """``config`` with its folders absolute: a Ray worker does not start in this process's working directory."""
    data_dir = config.run.data_dir and str(Path(config.run.data_dir).expanduser().resolve())
    return replace(config, run=replace(config.run, out=str(folder.resolve()), data_dir=data_dir))
