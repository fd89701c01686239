"""Process supervision for :mod:`fedhpro.deploy.up`: starting, watching and stopping its children, and their logs.

Every child runs in its own process group, its output appended to its log, its pid in ``STATE/run/<name>.pid``.
A child that dies is restarted with backoff after its group and every process it had started are killed (so no
``flwr-clientapp`` of a dead node keeps knocking on its successor); one that keeps failing for :data:`GIVE_UP`
seconds is left down. ``up --stop STATE`` (:func:`stop_running`) ends a running ``up``, or what a killed one left.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from fedhpro.deploy.namespaces import Namespace
from fedhpro.errors import ConfigError

#: seconds a process may keep failing (each start living less than STABLE) before the supervisor gives up
GIVE_UP = 180.0
STABLE = 60.0
BACKOFF = (2.0, 4.0, 8.0, 15.0, 30.0)
REFUSED_EXIT = 305  # flower-supernode: the SuperLink refused to activate it (Flower 1.42)
PR_SET_CHILD_SUBREAPER = 36


def descendants_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    return children


def below(pid: int, children: dict[int, list[int]]) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_all(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def become_subreaper() -> bool:
    """Orphans of our children (a killed node's ``flwr-clientapp``) become ours: we can end and reap them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False



@dataclass
class Child:
    """A supervised process: its command, log, and restart bookkeeping."""

    name: str
    args: list[str]
    log: Path
    ready: Callable[[], bool] | None = None  # a callable returning True once the process serves (None: at once)
    namespace: Namespace | None = None  # the private network namespace it runs in (None: the host's)
    sockets: tuple[Path, ...] = ()  # Unix sockets it listens on (a stale one from a killed start is removed)
    process: subprocess.Popen | None = None
    seen: set[int] = field(default_factory=set)  # every process it started, remembered while it lived
    started_at: float = 0.0
    failing_since: float | None = None
    failures: int = 0
    next_start: float | None = None
    given_up: bool = False
    said_refused: bool = False
    log_start: int = 0  # where the latest start's output begins in the log


class Supervisor:
    """The children of a deployment and their supervision (a mixin: :class:`fedhpro.deploy.up.Deployment` sets
    the attributes below and decides what to start, and in which order to stop)."""

    state: Path  # logs in STATE/logs, pids in STATE/run
    env: dict[str, str]  # the environment every child starts with
    out: IO[str]
    children: dict[str, Child]
    stopping: bool

    def say(self, text: str) -> None:
        print(f"fedhpro up: {text}", file=self.out, flush=True)

    def add(self, name: str, args: list[str], ready=None, namespace: Namespace | None = None,
            sockets: tuple[Path, ...] = ()) -> Child:
        child = Child(name, args, self.state / "logs" / f"{name}.log", ready, namespace, sockets)
        self.children[name] = child
        return child

    def launch(self, child: Child) -> None:
        for path in child.sockets:
            path.unlink(missing_ok=True)  # nginx refuses to bind over the socket file a killed start left
        with open(child.log, "ab") as log:
            child.log_start = log.tell()
            where = f" (network namespace {child.namespace.name})" if child.namespace else ""
            log.write(f"--- fedhpro up: starting {' '.join(child.args)}{where}\n".encode())
            log.flush()
            child.process = subprocess.Popen(child.args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=child.namespace.enter if child.namespace else None)
        child.started_at, child.next_start, child.seen = time.monotonic(), None, set()
        (self.state / "run" / f"{child.name}.pid").write_text(f"{child.process.pid}\n")

    def end(self, child: Child, sig: int = signal.SIGKILL) -> None:
        """``sig`` to the child's process group and to everything it started."""
        if child.process is not None:
            child.seen |= below(child.process.pid, descendants_map())
            try:
                os.killpg(child.process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        kill_all(child.seen, sig)

    def refused(self, child: Child) -> bool:
        """Whether the latest start of a SuperNode ended with Flower's exit code 305 (activation refused;
        the process itself exits with 1)."""
        with open(child.log, "rb") as handle:
            handle.seek(child.log_start)
            return f"Exit Code: {REFUSED_EXIT}".encode() in handle.read()

    def wait_ready(self, child: Child, seconds: float = 300) -> None:
        deadline = time.monotonic() + seconds
        process = child.process
        assert process is not None, child.name
        while child.ready is not None and not child.ready():
            if process.poll() is not None:
                raise ConfigError(f"{child.name} exited with code {process.returncode} while starting; "
                                  f"see {child.log}")
            if time.monotonic() > deadline or self.stopping:
                raise ConfigError(f"{child.name} is not ready after {seconds:.0f} s; see {child.log}")
            time.sleep(0.5)

    def reap_orphans(self, children: dict[int, list[int]]) -> None:
        """End and reap the processes adopted as subreaper (not ours: left by a child that died)."""
        ours = {c.process.pid for c in self.children.values() if c.process is not None}
        for pid in children.get(os.getpid(), []):
            if pid not in ours:
                kill_all({pid} | below(pid, children), signal.SIGKILL)
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass

    def check(self) -> None:
        """One supervision step: remember descendants, restart what died (with backoff)."""
        children = descendants_map()
        now = time.monotonic()
        for child in self.children.values():
            if child.process is None or child.given_up:
                continue
            code = child.process.poll()
            if code is None:
                child.seen |= below(child.process.pid, children)
                if child.failing_since is not None and now - child.started_at > STABLE:
                    child.failing_since, child.failures, child.said_refused = None, 0, False
                continue
            if child.next_start is None:  # it just died
                self.end(child)
                if now - child.started_at > STABLE:
                    child.failing_since, child.failures = None, 0
                child.failing_since = child.failing_since or now
                delay = BACKOFF[min(child.failures, len(BACKOFF) - 1)]
                child.failures += 1
                if now - child.failing_since > GIVE_UP:
                    child.given_up = True
                    self.say(f"{child.name} keeps failing (exit code {code}, {child.failures} starts in "
                             f"{now - child.failing_since:.0f} s); left down, see {child.log}")
                    continue
                refused = self.refused(child)
                if refused and not child.said_refused:
                    self.say(f"{child.name} refused (Flower exit code {REFUSED_EXIT}): the SuperLink still has its "
                             "previous session online (up to ~60 s after a kill -9); retrying with backoff")
                    child.said_refused = True
                elif not refused:
                    self.say(f"{child.name} exited with code {code}; restarting in {delay:.0f} s")
                child.next_start = now + delay
            elif now >= child.next_start:
                self.launch(child)
        self.reap_orphans(children)

    def supervise(self) -> None:
        while not self.stopping:
            self.check()
            time.sleep(1.0)

    def stop_groups(self, order: list[list[Child | None]]) -> None:
        """Each group of ``order`` in turn: SIGTERM, SIGKILL after 15 s; then the orphans, and the pid files."""
        self.stopping = True
        for candidates in order:
            group = [(c, c.process) for c in candidates if c is not None and c.process is not None]
            for child, _ in group:
                self.end(child, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and any(
                    process.poll() is None or any(alive(p) for p in child.seen) for child, process in group):
                time.sleep(0.2)
            for child, process in group:
                self.end(child, signal.SIGKILL)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
        self.reap_orphans(descendants_map())
        for name in list(self.children):
            (self.state / "run" / f"{name}.pid").unlink(missing_ok=True)


def end_left_behind(state: Path) -> list[int]:
    """SIGTERM, then SIGKILL, to the process group of every pid in ``STATE/run`` (an ``up`` killed with
    SIGKILL could not stop its children); returns those that were running."""
    groups = []
    for pid_file in sorted((state / "run").glob("*.pid")):
        pid = int(pid_file.read_text())
        try:
            if alive(pid) and os.getpgid(pid) == pid:  # still the group leader up started, not a reused pid
                groups.append(pid)
        except ProcessLookupError:
            pass
        pid_file.unlink()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in groups:
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(alive(p) for p in groups):
            time.sleep(0.3)
    return groups


def stop_running(state: str | os.PathLike, seconds: float = 90) -> int:
    """``up --stop STATE``: SIGTERM to the ``up`` process of ``STATE`` and wait until it ended."""
    pid_file = Path(state) / "up.pid"
    if not pid_file.exists():
        print(f"fedhpro up: nothing runs from {state} (no up.pid)", file=sys.stderr)
        return 1
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pid_file.unlink(missing_ok=True)
        left = end_left_behind(Path(state))
        print(f"fedhpro up: process {pid} of {state} was not running"
              + (f"; ended the process groups it had left: {left}" if left else ""), file=sys.stderr)
        return 1
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.3)
    if alive(pid):
        print(f"fedhpro up: process {pid} still runs after {seconds:.0f} s", file=sys.stderr)
        return 1
    print(f"fedhpro up: stopped (pid {pid})")
    return 0

