"""A real Flower deployment on loopback: a SuperLink, 2 SuperNodes and ``flwr run examples/flower``.

The run must finish as ``finished:completed`` (read from ``flwr ls --format json``:
``flwr run --stream`` exits 0 even when the ServerApp failed), give the
in-process simulator's numbers exactly (same reasoning as test_flower.py: same
code, same seeds, one thread per process, exact array transport), and leave
no process behind. Everything runs with a temporary FLWR_HOME and free ports,
with runtime dependency installation off (else flwr would ``uv sync`` the
app's dependencies into a fresh environment at run time).

The helpers (:class:`Loopback`, :func:`loopback_run`) serve every deployment
test (TLS and node authentication, own data, node failures, resume):

.. code-block:: python

    with Loopback(tmp_path, certificates=folder) as net:   # no certificates: --insecure everywhere
        net.start_superlink(["--enable-supernode-auth"])  # waits for /health
        net.register(folder / "supernode-1.pub")           # flwr supernode register -> node id
        net.start_supernode("a", "partition-id=0 num-partitions=2",
                            ["--auth-supernode-private-key", str(folder / "supernode-1.key")])
        run_id = net.flwr_run({"rounds": 2})               # waits until finished:*; wait=False returns at once
        record = net.assert_completed(run_id)              # the flwr ls record, finished:completed
        net.kill("a", signal.SIGKILL)                      # the node's process tree; restart: start_supernode("a", ...)
        # (with node auth, first net.wait_supernode_status(net.node_id("a"), "offline"): see that method)
    # leaving the block stops every process it started and checks that none is left

Every wait is on a readiness signal (the SuperLink's ``/health``, a node's
"SuperNode ID" log line, a run's status in ``flwr ls``) with limits of minutes
(the test machine has 2 busy cores); a failed wait or check raises an
AssertionError holding the tails of every log (SuperLink, nodes, flwr calls,
runs' logs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from test_flower import CORE_KEYS, REPO, assert_same_state, core, read_rows, reference, tiny_config  # noqa: E402

from fedhpro.deploy.up import alive, below, descendants_map, kill_all  # noqa: E402

RUN_TIMEOUT = 600  # seconds for the whole flwr run (2 tiny rounds took 90 s on a busy 2-core machine)
START_TIMEOUT = 300  # seconds for a SuperLink to be healthy or a SuperNode to connect (a few on an idle machine)
EXIT_TIMEOUT = 120  # seconds for a process to exit after a signal, or a refused node to give up
FLWR_TIMEOUT = 180  # seconds for one flwr CLI call
CONNECTED = "SuperNode ID:"  # the line a SuperNode logs once the SuperLink accepted it (flwr 1.42)
TAIL_LINES = 40
#: the environment before any test ran (Flower's simulation engine rewrites PYTHONPATH in-process)
ENVIRONMENT = dict(os.environ)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (SuperLink and SuperNode start helpers in sessions of their own)."""
    return below(pid, descendants_map())


class Processes:
    """The processes a test starts, by name; :meth:`stop` ends them and everything they started, and checks it.

    Each process runs in a session of its own with its output appended to ``logs/<name>.log``; a name
    started again (a restart) appends to the same log. Children are remembered whenever
    :meth:`remember_children` runs (the waits call it), so that those a killed parent leaves behind
    are stopped too."""

    def __init__(self, env: dict[str, str], logs: Path):
        self.env, self.logs = env, logs
        self.started: list[subprocess.Popen] = []
        self.by_name: dict[str, subprocess.Popen] = {}
        self.log_start: dict[str, int] = {}  # where the latest start of a name begins in its log
        self.seen: set[int] = set()

    def log_path(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        path = self.log_path(name)
        self.log_start[name] = path.stat().st_size if path.exists() else 0
        log = open(path, "ab")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        log.close()
        self.started.append(process)
        self.by_name[name] = process
        return process

    def latest_log(self, name: str) -> str:
        """The log of the latest start of ``name``."""
        with open(self.log_path(name), "rb") as handle:
            handle.seek(self.log_start.get(name, 0))
            return handle.read().decode("utf-8", "replace")

    def remember_children(self) -> None:
        for process in self.started:
            if process.poll() is None:
                self.seen |= descendants(process.pid)

    def signal(self, name: str, sig: int) -> None:
        """``sig`` to the process ``name``, its process group and every descendant."""
        process = self.by_name[name]
        below = descendants(process.pid)
        self.seen |= below
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        kill_all(below, sig)

    def stop(self) -> list[int]:
        """SIGTERM, then SIGKILL after 15 s; returns the pids still running afterwards (should be none)."""
        self.remember_children()
        pids = {process.pid for process in self.started} | self.seen
        for process in self.started:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        kill_all(self.seen, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(pid) for pid in pids):
            time.sleep(0.2)
        kill_all({pid for pid in pids if alive(pid)}, signal.SIGKILL)
        for process in self.started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.5)
        return sorted(pid for pid in pids if alive(pid))


def health_context(ca_certificate: Path | None) -> ssl.SSLContext | None:
    return None if ca_certificate is None else ssl.create_default_context(cafile=str(ca_certificate))


def wait_healthy(port: int, process: subprocess.Popen, seconds: float = START_TIMEOUT,
                 ca_certificate: Path | None = None) -> None:
    """Until the SuperLink on ``port`` answers 200 on ``/health`` (https, checked against
    ``ca_certificate``, when given); RuntimeError if it exits first, TimeoutError after ``seconds``."""
    scheme = "http" if ca_certificate is None else "https"
    context = health_context(ca_certificate)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the SuperLink exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/health", timeout=2,
                                        context=context) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"the SuperLink on port {port} is not healthy after {seconds:.0f} s")


def flower_tool(name: str) -> str:
    """A console script of the flwr package, next to this interpreter (the venv's bin)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else shutil.which(name) or name


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def json_object(text: str) -> dict[str, Any]:
    """The JSON object a flwr ``--format json`` call printed (anything before its first ``{`` skipped)."""
    return json.loads(text[text.index("{"):])


class Loopback:
    """A Flower deployment on 127.0.0.1 for tests (see the module docstring for an example).

    ``certificates``: a folder written by :func:`fedhpro.deploy.certificates.create` for host 127.0.0.1
    (``ca.crt``, ``server.pem``, ``server.key``); the SuperLink then serves TLS, nodes and the flwr
    connection trust ``ca.crt``. Without it, everything runs ``--insecure``. The SuperLink keeps its
    port across restarts and each node name its port, so a restarted process is the same address.
    The SuperLink keeps its state (registered keys, runs) in memory unless ``extra_args`` holds
    ``--database PATH``: restarted without it, it has forgotten both. A node stopped with SIGTERM
    says goodbye (it is "offline" at once); one killed with SIGKILL stays "online" for 60 s (see
    :meth:`wait_supernode_status`). ``flwr`` calls use the connection ``loopback`` of a temporary
    ``FLWR_HOME``."""

    CONNECTION = "loopback"

    def __init__(self, tmp_path: Path, certificates: Path | None = None, app: Path = REPO / "examples" / "flower"):
        self.root, self.certificates, self.app = Path(tmp_path), certificates, app
        self.home, self.logs = self.root / "flwr-home", self.root / "logs"
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.link_port = free_port()
        self.node_ports: dict[str, int] = {}
        self.run_ids: list[int] = []
        trust = ("insecure = true\n" if certificates is None
                 else f'root-certificates = "{(Path(certificates) / "ca.crt").resolve()}"\n')
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{self.CONNECTION}"\n\n[superlink.{self.CONNECTION}]\n'
            f'address = "127.0.0.1:{self.link_port}"\n' + trust)
        self.env = {**ENVIRONMENT, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.env.pop("FEDHPRO_DATA_DIR", None)  # the nodes get their data from their node config only
        self.processes = Processes(self.env, self.logs)

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        left = self.processes.stop()
        if error is None:  # an assertion already on its way is the more useful message
            assert left == [], f"processes left running: {left}"

    def ca_certificate(self) -> Path | None:
        return None if self.certificates is None else Path(self.certificates) / "ca.crt"

    # ------------------------------------------------------------------ diagnostics
    def tails(self) -> str:
        """The last lines of every log: SuperLink, SuperNodes, flwr calls, the runs' own logs."""
        parts = []
        for path in sorted(self.logs.glob("*.log")):
            parts.append(f"----- {path.name} (last {TAIL_LINES} lines)\n"
                         + tail(path.read_text(encoding="utf-8", errors="replace")))
        return "\n".join(parts)

    def fail(self, message: str) -> None:
        """Raise an AssertionError: ``message``, then the tails of every log (runs' logs fetched first)."""
        for run_id in self.run_ids:
            self.save_run_log(run_id, seconds=30)
        raise AssertionError(f"{message}\n{self.tails()}")

    # ------------------------------------------------------------------ processes
    def start_superlink(self, extra_args: Sequence[str] = (), wait: bool = True) -> subprocess.Popen:
        """Start (or restart) the SuperLink on its port: TLS with the certificates, else ``--insecure``;
        ``extra_args`` e.g. ``["--enable-supernode-auth"]`` or ``["--database", path]``. With ``wait``,
        returns once ``/health`` answers."""
        if self.running("superlink"):
            self.fail("start_superlink: the SuperLink is already running; kill('superlink') first")
        if self.certificates is None:
            security = ["--insecure"]
        else:
            folder = Path(self.certificates)
            security = ["--ssl-ca-certfile", str(folder / "ca.crt"), "--ssl-certfile", str(folder / "server.pem"),
                        "--ssl-keyfile", str(folder / "server.key")]
        link = self.processes.start("superlink", [
            flower_tool("flower-superlink"), *security, "--host", "127.0.0.1", "--port", str(self.link_port),
            "--disable-runtime-dependency-installation", *extra_args])
        if wait:
            try:
                wait_healthy(self.link_port, link, START_TIMEOUT, self.ca_certificate())
            except (RuntimeError, TimeoutError) as error:
                self.fail(f"start_superlink: {error}")
        return link

    def start_supernode(self, name: str, node_config: str | None = None, extra_args: Sequence[str] = (),
                        wait: bool = True, trust_ca: bool = True) -> subprocess.Popen:
        """Start (or restart) SuperNode ``name`` (its own port, its log ``logs/<name>.log``) with
        ``--node-config node_config`` and ``extra_args`` (e.g. ``["--auth-supernode-private-key", key]``).
        With TLS it trusts ``ca.crt`` unless ``trust_ca=False`` (then it checks the SuperLink against the
        system's CAs). With ``wait``, returns once the node logged that it connected."""
        if self.running(name):
            self.fail(f"start_supernode: {name} is already running; kill({name!r}) first")
        port = self.node_ports.setdefault(name, free_port())
        if self.certificates is None:
            security = ["--insecure"]
        else:
            security = ["--root-certificates", str(self.ca_certificate())] if trust_ca else []
        config = ["--node-config", node_config] if node_config else []
        node = self.processes.start(name, [
            flower_tool("flower-supernode"), *security, "--superlink", f"127.0.0.1:{self.link_port}",
            "--host", "127.0.0.1", "--port", str(port), *config, *extra_args])
        if wait:
            self.wait_connected(name)
        return node

    def running(self, name: str) -> bool:
        process = self.processes.by_name.get(name)
        return process is not None and process.poll() is None

    def wait_log(self, name: str, text: str, seconds: float = START_TIMEOUT) -> str:
        """Until ``text`` is in the log of the latest start of ``name``; returns that log. Fails if the
        process exits first or after ``seconds``."""
        process = self.processes.by_name[name]
        deadline = time.monotonic() + seconds
        while True:
            self.processes.remember_children()
            log = self.processes.latest_log(name)
            if text in log:
                return log
            if process.poll() is not None:
                self.fail(f"{name} exited with code {process.returncode} before logging {text!r}")
            if time.monotonic() > deadline:
                self.fail(f"{name} did not log {text!r} within {seconds:.0f} s")
            time.sleep(0.5)

    def wait_connected(self, *names: str, seconds: float = START_TIMEOUT) -> None:
        """Until every SuperNode in ``names`` logged that the SuperLink accepted it."""
        for name in names:
            self.wait_log(name, CONNECTED, seconds)

    def node_id(self, name: str) -> int:
        """The Flower node id SuperNode ``name`` logged when it connected (its latest start)."""
        return int(re.search(re.escape(CONNECTED) + r"\s*(\d+)", self.wait_log(name, CONNECTED)).group(1))

    def wait_exit(self, name: str, seconds: float = EXIT_TIMEOUT) -> int:
        """Until the latest process ``name`` exits; returns its exit code (fails after ``seconds``)."""
        process = self.processes.by_name[name]
        deadline = time.monotonic() + seconds
        while process.poll() is None:
            self.processes.remember_children()
            if time.monotonic() > deadline:
                self.fail(f"{name} still runs after {seconds:.0f} s")
            time.sleep(0.5)
        return process.returncode

    def kill(self, name: str, sig: int = signal.SIGTERM, seconds: float = EXIT_TIMEOUT) -> int:
        """Send ``sig`` to ``name`` ("superlink" or a node name) and every process below it (a crashed
        machine: ``signal.SIGKILL``); waits until it exited and returns its exit code."""
        self.processes.signal(name, sig)
        return self.wait_exit(name, seconds)

    # ------------------------------------------------------------------ flwr CLI
    def flwr(self, *args: str, seconds: float = FLWR_TIMEOUT) -> subprocess.CompletedProcess:
        """``flwr *args`` with this FLWR_HOME; command and output are appended to ``logs/flwr.log``."""
        try:
            done = subprocess.run([flower_tool("flwr"), *args], env=self.env, capture_output=True, text=True,
                                  timeout=seconds)
        except subprocess.TimeoutExpired as error:
            with open(self.logs / "flwr.log", "a") as log:
                log.write(f"$ flwr {' '.join(args)}\n(timed out after {seconds:.0f} s)\n")
            self.fail(f"flwr {' '.join(args)} did not return within {seconds:.0f} s: {error}")
        with open(self.logs / "flwr.log", "a") as log:
            log.write(f"$ flwr {' '.join(args)}  (exit {done.returncode})\n{done.stdout}{done.stderr}\n")
        return done

    def register(self, public_key: str | os.PathLike) -> int:
        """``flwr supernode register`` a node's public key (OpenSSH line); returns the node id."""
        done = self.flwr("supernode", "register", str(public_key), self.CONNECTION, "--format", "json")
        try:
            return int(json_object(done.stdout)["node-id"])
        except (ValueError, KeyError, TypeError):
            self.fail(f"flwr supernode register {public_key} failed (exit {done.returncode})")

    def supernodes(self) -> list[dict[str, Any]]:
        """``flwr supernode ls --format json``: one record per registered node ("node-id", "status", ...)."""
        done = self.flwr("supernode", "ls", self.CONNECTION, "--format", "json")
        try:
            return json_object(done.stdout)["nodes"]
        except (ValueError, KeyError):
            self.fail(f"flwr supernode ls failed (exit {done.returncode})")

    def wait_supernode_status(self, node_id: int, status: str, seconds: float = START_TIMEOUT) -> None:
        """Until ``flwr supernode ls`` shows node ``node_id`` with ``status`` ("online", "offline", ...).

        With ``--enable-supernode-auth`` a node keeps its id (its key), and Flower 1.42 refuses to
        activate an id that is still "online": a node killed with SIGKILL (no goodbye) can start again
        only once the SuperLink marked it "offline", 2 heartbeat intervals (60 s) after its last
        heartbeat; wait for that before restarting it. Without authentication a restarted node gets
        a fresh key and id, and needs no wait."""
        deadline = time.monotonic() + seconds
        while True:
            statuses = {int(node["node-id"]): node["status"] for node in self.supernodes()}
            if statuses.get(node_id) == status:
                return
            if time.monotonic() > deadline:
                self.fail(f"node {node_id} is {statuses.get(node_id)!r}, not {status!r}, after {seconds:.0f} s")
            time.sleep(2)

    def flwr_run(self, run_config: dict[str, Any], wait: bool = True, seconds: float = RUN_TIMEOUT) -> int:
        """``flwr run <app> loopback`` with every key of ``run_config`` through ``--run-config`` (values
        as JSON, which TOML reads the same for strings, numbers and booleans); returns the run id. With
        ``wait``, returns once the run finished (any ``finished:*`` status: see :meth:`assert_completed`)."""
        text = " ".join(f"{key}={json.dumps(value)}" for key, value in run_config.items())
        done = self.flwr("run", str(self.app), self.CONNECTION, "--run-config", text, "--format", "json")
        try:
            run_id = int(json_object(done.stdout)["run-id"])
        except (ValueError, KeyError, TypeError):
            self.fail(f"flwr run was not accepted (exit {done.returncode})")
        self.run_ids.append(run_id)
        if wait:
            self.wait_run(run_id, seconds)
        return run_id

    def runs(self) -> list[dict[str, Any]]:
        """``flwr ls --format json``: one record per run ("run-id", "status", "network-traffic", ...)."""
        done = self.flwr("ls", self.CONNECTION, "--format", "json")
        try:
            return json_object(done.stdout)["runs"]
        except (ValueError, KeyError):
            self.fail(f"flwr ls failed (exit {done.returncode})")

    def run_record(self, run_id: int) -> dict[str, Any]:
        records = [run for run in self.runs() if str(run["run-id"]) == str(run_id)]
        if len(records) != 1:
            self.fail(f"run {run_id} is not listed by flwr ls")
        return records[0]

    def wait_run(self, run_id: int, seconds: float = RUN_TIMEOUT, status: str = "finished") -> dict[str, Any]:
        """Until the run's status starts with ``status`` (``finished``, ``running``, ...); returns its record.
        A finished run's own log is saved as ``logs/run-<id>.log``."""
        deadline = time.monotonic() + seconds
        while True:
            self.processes.remember_children()
            record = self.run_record(run_id)
            if record["status"].startswith(status):
                if record["status"].startswith("finished"):
                    self.save_run_log(run_id)
                return record
            if time.monotonic() > deadline:
                self.fail(f"run {run_id} is {record['status']!r}, not {status!r}, after {seconds:.0f} s")
            time.sleep(2)

    def assert_completed(self, run_id: int) -> dict[str, Any]:
        """The run's record; fails (with every log's tail) unless its status is ``finished:completed``."""
        record = self.run_record(run_id)
        if record["status"] != "finished:completed":
            self.fail(f"run {run_id} is {record['status']!r}, not 'finished:completed': {record}")
        return record

    def save_run_log(self, run_id: int, seconds: float = FLWR_TIMEOUT) -> None:
        """``flwr log <id> --show`` (the ServerApp's output) into ``logs/run-<id>.log``; best effort."""
        try:
            done = subprocess.run([flower_tool("flwr"), "log", str(run_id), self.CONNECTION, "--show"],
                                  env=self.env, capture_output=True, text=True, timeout=seconds)
            (self.logs / f"run-{run_id}.log").write_text(done.stdout + done.stderr)
        except (subprocess.TimeoutExpired, OSError) as error:
            (self.logs / f"run-{run_id}.log").write_text(f"flwr log {run_id} failed: {error}\n")


def loopback_run(tmp_path: Path, node_configs: list[str], run_config: dict) -> dict:
    """A SuperLink and one SuperNode per ``--node-config`` string on 127.0.0.1 (all ``--insecure``), then
    ``flwr run examples/flower`` with ``run_config`` (every key through ``--run-config``); every process is
    stopped and none may be left. Returns the run's record from ``flwr ls --format json`` (its status checked)."""
    with Loopback(tmp_path) as net:
        net.start_superlink()
        names = [f"supernode-{k}" for k in range(len(node_configs))]
        for name, node_config in zip(names, node_configs):
            net.start_supernode(name, node_config, wait=False)
        net.wait_connected(*names)
        return net.assert_completed(net.flwr_run(run_config))


@pytest.mark.deploy
def test_superlink_and_two_supernodes_run_fedhpro_like_the_simulator(digits_data_dir, tmp_path):
    out = tmp_path / "out"
    # every fedhpro key through --run-config; clients comes from the nodes' num-partitions (2)
    settings = tiny_config(digits_data_dir)
    settings.pop("clients")
    record = loopback_run(tmp_path, [f"partition-id={k} num-partitions=2" for k in range(2)],
                          {**settings, "out": str(out)})
    assert record["network-traffic"]["total-bytes"] > 0  # it really went over the network

    rows = read_rows(out / "metrics.jsonl")
    state = torch.load(out / "server_state.pt", weights_only=True)
    expected_rows, expected_state = reference({**settings, "clients": 2}, tmp_path / "reference")
    assert len(rows) == 2 and all(row["participants"] == [0, 1] for row in rows)
    assert core(rows) == core(expected_rows), CORE_KEYS
    assert_same_state(state["server"], expected_state)
