"""Review findings: rejected replies restore client state, one atomic writer with the umask's mode,
a closed stdout at the CLI, and short unknown-key errors with a complete ``config --keys``."""

from __future__ import annotations

import ast
import dataclasses
import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TinyNet, make_federation
from fedhpro import reports
from fedhpro.config import FaultOptions, RunOptions, _all_keys, load_config
from fedhpro.engines import checkpoint
from fedhpro.engines.simulator import Faults, Simulator, derive_seed
from fedhpro.errors import ConfigError
from fedhpro.methods import METHODS, TrainSettings

SRC = Path(__file__).resolve().parents[1] / "src" / "fedhpro"
#: one step per round (batches larger than any client): a step that goes non-finite is the last one, so
#: fit returns a NaN update (training itself stops at a non-finite loss, which is the raising path)
TRAIN = TrainSettings(epochs=1, batch_size=64, lr=0.05, momentum=0.9, weight_decay=0.0)


# ---------------------------------------------------------------------------- 1. rejected replies


def small_simulator(method: str, faults: Faults | None = None, seed: int = 3) -> Simulator:
    spec = METHODS[method]
    options = spec.options()
    factory = TinyNet
    if spec.model_wrapper is not None:
        factory = lambda: spec.model_wrapper(TinyNet(), options, 4)  # noqa: E731
    return Simulator(spec, options, make_federation([24, 32, 28]), factory, TRAIN, rounds=4, seed=seed,
                     faults=faults)


def diverge_once(sim: Simulator, client: int) -> dict[str, bool]:
    """Make ``client``'s local training non-finite (SGD with lr=nan) while the returned switch is on."""
    switch = {"on": False}
    fit, data = sim.client.fit, sim.federation.clients[client]

    def diverging_fit(model, payload, client_data, state, generator):
        if not (switch["on"] and client_data is data):
            return fit(model, payload, client_data, state, generator)
        sim.client.train = dataclasses.replace(TRAIN, lr=float("nan"))
        try:
            return fit(model, payload, client_data, state, generator)
        finally:
            sim.client.train = TRAIN

    sim.client.fit = diverging_fit
    return switch


def all_finite(state: dict) -> bool:
    tensors = [v for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += [t for v in state.values() if isinstance(v, dict) for t in v.values() if isinstance(t, torch.Tensor)]
    return bool(tensors) and all(torch.isfinite(t.float()).all() for t in tensors)


@pytest.mark.parametrize("method,key", [("moon", "previous_weights"), ("fedsa", "last_prototypes")])
def test_a_rejected_update_restores_the_client_state_and_the_client_recovers(method, key):
    sim = small_simulator(method)
    switch = diverge_once(sim, client=0)
    sim.run_round(0)
    before = {k: v.clone() for k, v in sim.client_states[0][key].items()} if isinstance(
        sim.client_states[0][key], dict) else sim.client_states[0][key].clone()
    switch["on"] = True
    record = sim.run_round(1)
    switch["on"] = False
    assert [d["client"] for d in record.dropped] == [0] and "non-finite" in record.dropped[0]["reason"]
    # the state is the one from before the rejected round, not the NaN one fit wrote
    assert all_finite(sim.client_states[0])
    after = sim.client_states[0][key]
    if isinstance(before, dict):
        assert all(torch.equal(after[k], before[k]) for k in before)
    else:
        assert torch.equal(after, before)
    for r in (2, 3):
        assert sim.run_round(r).dropped == []  # before the fix: dropped every later round
    assert all_finite(sim.client_states[0])


def first_seed_with_corruption(rate: float) -> int:
    """A seed whose fault draws (read independently of the protocol) corrupt client 0, and only it, in
    round 1, and nobody in round 0 (so round 1's payload is the clean run's)."""
    def corrupt(seed, r, k):
        return np.random.default_rng(derive_seed(seed, 5, r, k)).random(2)[1] < rate

    for seed in range(200):
        if (not any(corrupt(seed, 0, k) for k in range(3)) and corrupt(seed, 1, 0)
                and not any(corrupt(seed, 1, k) for k in (1, 2))):
            return seed
    raise AssertionError("no seed found")


def test_a_transmission_fault_keeps_the_state_the_client_computed():
    seed = first_seed_with_corruption(0.3)
    faulty = small_simulator("moon", Faults(corrupt=0.3), seed=seed)
    clean = small_simulator("moon", seed=seed)
    for r in (0, 1):
        record = faulty.run_round(r)
        clean.run_round(r)
    assert [d["client"] for d in record.dropped] == [0]
    # the client's good update was spoiled on the way: on the client it happened, so its state moves on
    computed, kept = clean.client_states[0]["previous_weights"], faulty.client_states[0]["previous_weights"]
    assert all(torch.equal(kept[k], computed[k]) for k in computed)


def test_receive_says_why_a_reply_is_refused():
    from fedhpro.engines.protocol import Reception

    sim = small_simulator("fedavg", Faults(corrupt=1.0))
    current = sim.protocol.open(0)
    good = {"weights": {k: v.clone() for k, v in sim.server.global_weights().items()}, "num_examples": 5}
    bad = {"weights": {k: torch.full_like(v, float("nan")) for k, v in good["weights"].items()}, "num_examples": 5}
    assert current.receive(0, good, {}, 5) is Reception.CORRUPTED  # a good update, spoiled in transit
    assert current.receive(1, bad, {}, 5) is Reception.INVALID  # the client's own update was bad already
    clean = small_simulator("fedavg").protocol.open(0)
    assert clean.receive(0, good, {}, 5) is Reception.ACCEPTED
    assert clean.receive(1, bad, {}, 5) is Reception.INVALID
    # the Flower server only tests the truth of what receive returns
    assert [bool(r) for r in Reception] == [r is Reception.ACCEPTED for r in Reception]


# ---------------------------------------------------------------------------- 2. atomic writes


@pytest.fixture
def umask():
    previous = os.umask(0o022)
    os.umask(previous)

    def set_mask(mask: int) -> None:
        os.umask(mask)

    yield set_mask
    os.umask(previous)


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o007, 0o660)])
def test_result_files_get_the_mode_open_would_give(tmp_path, umask, mask, mode):
    umask(mask)
    reports.write_json(tmp_path / "summary.json", {"AVG": 1.0})
    reports.write_jsonl(tmp_path / "metrics.jsonl", [{"round": 0}])
    reports.write_yaml(tmp_path / "config.yaml", {"rounds": 1})
    saved = checkpoint.save(tmp_path, 1, {"server": {}}, [])
    with open(tmp_path / "plain.txt", "w"):  # the reference: what a plain open gives
        pass
    assert (tmp_path / "plain.txt").stat().st_mode & 0o777 == mode
    for path in (tmp_path / "summary.json", tmp_path / "metrics.jsonl", tmp_path / "config.yaml", saved):
        assert path.stat().st_mode & 0o777 == mode, path.name
    assert json.loads((tmp_path / "summary.json").read_text()) == {"AVG": 1.0}


def test_a_plot_gets_the_umask_mode_too(tmp_path, umask):
    from fedhpro.reports.plots import plot_curves

    umask(0o007)
    plot_curves({"a": ([1, 2], [3.0, 4.0])}, tmp_path / "curve.png")
    path = tmp_path / "curve.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_mode & 0o777 == 0o660
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]


def test_a_crash_mid_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    from fedhpro.files import write_atomic_with

    path = tmp_path / "summary.json"
    reports.write_json(path, {"old": True})
    old = path.read_bytes()

    def crash(handle):
        handle.write(b'{"new": tr')
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        write_atomic_with(path, crash)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    with pytest.raises(KeyboardInterrupt):
        write_atomic_with(tmp_path / "new.json", lambda handle: (_ for _ in ()).throw(KeyboardInterrupt()))
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def fedhpro_imports(path: Path) -> set[str]:
    """The fedhpro modules a source file imports (absolute imports only, as the project writes them)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedhpro"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith("fedhpro"))
    return names


def test_the_writer_is_low_level_and_nothing_low_imports_reports():
    assert fedhpro_imports(SRC / "files.py") <= {"fedhpro.errors"}
    for low in ("data/partition.py", "engines/checkpoint.py"):
        imported = fedhpro_imports(SRC / low)
        assert "fedhpro.files" in imported and not any(m.startswith("fedhpro.reports") for m in imported), low
    # one implementation: nobody but fedhpro.files makes temporary files or renames them into place
    for source in SRC.rglob("*.py"):
        text = source.read_text()
        if source.name == "files.py" or source.name == "loaders.py":  # loaders: a memory map needs a file name
            continue
        assert "mkstemp" not in text and "os.replace(" not in text, source


# ---------------------------------------------------------------------------- 3. a closed stdout


def test_a_reader_that_closes_the_pipe_gets_no_traceback(tmp_path):
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        pytest.skip("needs Linux pipes whose size can be set")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for _ in range(3):
        read_end, write_end = os.pipe()
        # a one-page pipe: the listing (about 11 kB) cannot be written ahead of the reader, so closing
        # after the first line always breaks the pipe under the writer (as `| head -1` sometimes does)
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)
        process = subprocess.Popen([sys.executable, "-m", "fedhpro", "config", "--keys"], stdout=write_end,
                                   stderr=subprocess.PIPE, cwd=tmp_path, env=env)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as reader:
            first = reader.readline()
        stderr = process.communicate(timeout=120)[1].decode()
        assert first.startswith(b"method ")
        assert stderr == "", stderr
        assert process.returncode == 1  # as Python's documentation does it (signal module, SIGPIPE note)


# ---------------------------------------------------------------------------- 4. unknown keys, --keys


@pytest.mark.parametrize("key,closest", [
    ("rouds", "rounds"),
    ("fedhpro.tua", "fedhpro.tau"),
    ("faults.corupt", "faults.corrupt"),
    ("zzzzzz", None),
])
def test_an_unknown_key_names_the_closest_keys_in_one_short_line(key, closest):
    with pytest.raises(ConfigError) as error:
        load_config(None, {key: 1})
    message = str(error.value)
    assert "\n" not in message and len(message) < 200, (len(message), message)
    assert f"unknown config key '{key}'" in message and "fedhpro config --keys" in message
    suggested = re.findall(r"'([^']+)'", message.split("did you mean", 1)[1]) if "did you mean" in message else []
    assert len(suggested) <= 3
    assert (suggested[:1] == [closest]) if closest else suggested == []


def test_an_unknown_data_key_of_another_data_set_points_to_its_listing():
    with pytest.raises(ConfigError) as error:
        load_config(None, {"dataset": "cifar10", "data.fration": 0.1})
    assert "fedhpro config --keys dataset=cifar10" in str(error.value)


def test_config_keys_lists_every_key_with_its_default(capsys):
    from fedhpro.cli import main

    assert main(["config", "--keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = {}
    for line in lines:
        match = re.match(r"^(\S+)(?: \[[^\]]*\])?: .*\(default:? ([^()]*)\)$", line)
        assert match, line
        listed[match.group(1)] = match.group(2)
    assert set(_all_keys(RunOptions.dataset)) <= set(listed)
    # defaults, read off the option classes by hand
    assert listed["rounds"] == "10" and listed["lr"] == "0.01" and listed["method"] == "fedhpro"
    assert listed["clients"] == "the data set's layout" and listed["partition.load"] == "null"
    assert listed["progress"] == "true" and listed["data.clients_per_domain"] == '{"mnist": 3, "optdigits": 7, ' \
        '"mnistm": 6, "syn": 4}'
    assert listed["faults.dropout"] == "0.0" and listed["faults.corrupt"] == "0.0"
    assert listed["fedhpro.tau"] == str(METHODS["fedhpro"].options().tau)
    assert listed["partition"] == listed["partition.scheme"]
    assert "transmission" in [f for f in dataclasses.fields(FaultOptions) if f.name == "corrupt"][0].metadata["help"]
