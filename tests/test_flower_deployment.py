"""A real Flower deployment on loopback: a SuperLink, 2 SuperNodes and ``flwr run examples/flower``.

The run must finish as ``finished:completed`` (read from ``flwr ls --format json``:
``flwr run --stream`` exits 0 even when the ServerApp failed), give the
in-process simulator's numbers exactly (same reasoning as test_flower.py: same
code, same seeds, one thread per process, exact array transport), and leave
no process behind. Everything runs with a temporary FLWR_HOME and free ports,
with runtime dependency installation off (else flwr would ``uv sync`` the
app's dependencies into a fresh environment at run time).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from test_flower import CORE_KEYS, REPO, assert_same_state, core, read_rows, reference, tiny_config  # noqa: E402

RUN_TIMEOUT = 600  # seconds for the whole flwr run (2 tiny rounds took 90 s on a busy 2-core machine)
#: the environment before any test ran (Flower's simulation engine rewrites PYTHONPATH in-process)
ENVIRONMENT = dict(os.environ)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (SuperLink and SuperNode start helpers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Running (a zombie left for init to reap is not running)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Processes:
    """The processes a test starts; :meth:`stop` ends them and everything they started, and checks it."""

    def __init__(self, env: dict[str, str], logs: Path):
        self.env, self.logs = env, logs
        self.started: list[subprocess.Popen] = []
        self.seen: set[int] = set()

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        log.close()
        self.started.append(process)
        return process

    def remember_children(self) -> None:
        for process in self.started:
            self.seen |= descendants(process.pid)

    def stop(self) -> list[int]:
        """SIGTERM, then SIGKILL after 15 s; returns the pids still running afterwards (should be none)."""
        self.remember_children()
        pids = {process.pid for process in self.started} | self.seen
        for process in self.started:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in self.seen:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(alive(pid) for pid in pids):
            time.sleep(0.2)
        for pid in pids:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for process in self.started:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.5)
        return sorted(pid for pid in pids if alive(pid))


def wait_healthy(port: int, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the SuperLink exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"the SuperLink on port {port} is not healthy after {seconds:.0f} s")


def flower_tool(name: str) -> str:
    """A console script of the flwr package, next to this interpreter (the venv's bin)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else shutil.which(name) or name


def loopback_run(tmp_path: Path, node_configs: list[str], run_config: dict) -> dict:
    """A SuperLink and one SuperNode per ``--node-config`` string on 127.0.0.1, then ``flwr run
    examples/flower`` with ``run_config`` (every key through ``--run-config``); every process is stopped
    and none may be left. Returns the run's record from ``flwr ls --format json`` (its status checked)."""
    home, logs = tmp_path / "flwr-home", tmp_path / "logs"
    home.mkdir()
    logs.mkdir()
    link_port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{link_port}"\n'
        "insecure = true\n")
    env = {**ENVIRONMENT, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("FEDHPRO_DATA_DIR", None)  # the nodes get their data from their node config only
    processes = Processes(env, logs)
    try:
        link = processes.start("superlink", [flower_tool("flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                             "--port", str(link_port), "--disable-runtime-dependency-installation"])
        wait_healthy(link_port, link)
        for k, node_config in enumerate(node_configs):
            processes.start(f"supernode-{k}", [
                flower_tool("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                "--host", "127.0.0.1", "--port", str(free_port()), "--node-config", node_config])
        text = " ".join(f"{key}={json.dumps(value)}" for key, value in run_config.items())
        run = subprocess.run([flower_tool("flwr"), "run", str(REPO / "examples" / "flower"), "loopback",
                              "--run-config", text, "--stream"],
                             env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT)
        processes.remember_children()
        (logs / "flwr-run.log").write_text(run.stdout + run.stderr)
        listing = subprocess.run([flower_tool("flwr"), "ls", "loopback", "--format", "json"], env=env,
                                 capture_output=True, text=True, timeout=60)
        runs = json.loads(listing.stdout)["runs"]
        assert len(runs) == 1 and runs[0]["status"] == "finished:completed", (runs, run.stdout[-3000:])
    finally:
        left = processes.stop()
    assert left == [], f"processes left running: {left}"
    return runs[0]


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
