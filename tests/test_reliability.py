"""Reliability: exact resume after a kill, client faults and invalid updates, and bad input at the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION, TinyNet, make_federation

from fedhpro.cli import main as cli_main
from fedhpro.engines.fault_options import FaultOptions
from fedhpro.engines import checkpoint
from fedhpro.engines.simulator import Simulator, derive_seed
from fedhpro.errors import UpdateError
from fedhpro.methods import METHODS, TrainSettings

TRAIN = TrainSettings(epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=0.0)


def tiny_settings(data_dir: Path, out: Path, **extra) -> list[str]:
    settings = {"rounds": 6, "clients": 4, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
                "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 32, "local_epochs": 2,
                "progress": "false", "device": "cpu", "data_dir": str(data_dir), "out": str(out), "seed": 4,
                "checkpoint_every": 1, **extra}
    return [f"{key}={value}" for key, value in settings.items()]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_result(digits_data_dir, tmp_path):
    reference = tmp_path / "reference"
    assert cli_main(["run", *tiny_settings(digits_data_dir, reference)]) == 0

    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "fedhpro", "run", *tiny_settings(digits_data_dir, killed)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    target = killed / "checkpoints" / "round-000002.pt"
    deadline = time.monotonic() + 300
    while not target.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "summary.json").exists()
    completed = int(checkpoint.latest(killed).stem.split("-")[1])
    assert 2 <= completed < 6

    assert cli_main(["run", f"resume={killed}", "progress=false"]) == 0
    assert (killed / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()
    summary_killed = json.loads((killed / "summary.json").read_text())
    summary_reference = json.loads((reference / "summary.json").read_text())
    for summary in (summary_killed, summary_reference):
        summary.pop("seconds")
    assert summary_killed == summary_reference
    assert [row["round"] for row in read_rows(killed / "timing.jsonl")] == list(range(6))


@pytest.mark.slow
def test_checkpoints_are_weights_only_and_pruned(digits_data_dir, tmp_path):
    out = tmp_path / "run"
    assert cli_main(["run", *tiny_settings(digits_data_dir, out, rounds=4, keep_checkpoints=2)]) == 0
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["round-000003.pt", "round-000004.pt"]
    blob = torch.load(out / "checkpoints" / "round-000004.pt", weights_only=True)  # no pickled code
    assert blob["completed_rounds"] == 4
    assert {"server", "client_states"} <= set(blob[checkpoint.STATE])
    assert "hyper_prototypes" in blob[checkpoint.STATE]["server"]


@pytest.mark.slow
def test_resume_refuses_changed_settings_and_missing_runs(digits_data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli_main(["run", *tiny_settings(digits_data_dir, out, rounds=2)]) == 0
    capsys.readouterr()
    assert cli_main(["run", f"resume={out}", "lr=0.5"]) == 2
    assert "remove lr" in capsys.readouterr().err
    assert cli_main(["run", f"resume={tmp_path / 'nothing'}"]) == 2
    assert "no config.yaml" in capsys.readouterr().err


# ---------------------------------------------------------------------------- faults and validation


def fault_simulator(method="fedhpro", faults=None, min_clients=1, seed=3, messages=None):
    spec = METHODS[method]
    federation = make_federation([24, 32, 40, 28, 36, 20])
    return Simulator(spec, spec.options(), federation, TinyNet, TRAIN, rounds=6, seed=seed,
                     faults=faults, min_clients=min_clients,
                     on_drop=(messages.append if messages is not None else None))


def expected_fault_draws(seed, rounds, clients, dropout, corrupt):
    """The faults an independent reading of the seeding rule predicts: (dropped, corrupted) per round."""
    out = []
    for r in range(rounds):
        dropped, corrupted = [], []
        for k in range(clients):
            first, second = np.random.default_rng(derive_seed(seed, 5, r, k)).random(2)
            if first < dropout:
                dropped.append(k)
            elif second < corrupt:
                corrupted.append(k)
        out.append((dropped, corrupted))
    return out


def test_corrupt_updates_are_dropped_reported_and_harmless():
    messages: list[str] = []
    faulty = fault_simulator(faults=FaultOptions(corrupt=0.3), messages=messages)
    clean = fault_simulator()
    for r in range(6):
        faulty.run_round(r)
        clean.run_round(r)
    expected = expected_fault_draws(3, 6, 6, 0.0, 0.3)
    assert sum(len(c) for _, c in expected) > 0
    for record, (_, corrupted) in zip(faulty.history, expected):
        assert [d["client"] for d in record.dropped] == corrupted
        assert all("non-finite" in d["reason"] for d in record.dropped)
    assert len(messages) == sum(len(c) for _, c in expected)
    assert all("dropped" in m for m in messages)
    # the warnings count rounds from 1, as the plots and checkpoints do (metrics.jsonl's round r is round r + 1)
    said = [(r + 1, k) for r, (_, corrupted) in enumerate(expected) for k in corrupted]
    assert [m.split(" dropped")[0] for m in messages] == [f"round {r}: client {k}" for r, k in said]
    for tensor in faulty.server.global_weights().values():
        assert torch.isfinite(tensor.float()).all()
    assert torch.isfinite(faulty.server.hyper).all()
    assert abs(faulty.history[-1].accuracy["AVG"] - clean.history[-1].accuracy["AVG"]) <= 10.0


def test_dropout_is_seeded_and_only_answering_clients_count():
    faulty = fault_simulator(method="fedavg", faults=FaultOptions(dropout=0.4))
    for r in range(6):
        faulty.run_round(r)
    expected = expected_fault_draws(3, 6, 6, 0.4, 0.0)
    for record, (dropped, _) in zip(faulty.history, expected):
        assert [d["client"] for d in record.dropped] == dropped
    assert any(dropped for dropped, _ in expected)


def test_too_few_valid_updates_skip_the_round_and_keep_the_model():
    sim = fault_simulator(method="fedavg", faults=FaultOptions(corrupt=1.0), min_clients=1)
    before = {k: v.clone() for k, v in sim.server.global_weights().items()}
    record = sim.run_round(0)
    assert record.skipped and record.to_json()["skipped"] is True
    assert len(record.dropped) == 6
    for key, value in sim.server.global_weights().items():
        assert torch.equal(value, before[key])


def test_a_client_that_raises_is_dropped_but_a_universal_failure_is_shown():
    sim = fault_simulator(method="fedavg")
    original_fit = sim.client.fit

    def flaky_fit(model, payload, data, state, generator):
        if data is sim.federation.clients[2]:
            raise RuntimeError("disk full")
        return original_fit(model, payload, data, state, generator)

    sim.client.fit = flaky_fit
    record = sim.run_round(0)
    assert record.dropped == [{"client": 2, "reason": "raised RuntimeError: disk full"}]
    assert not record.skipped

    def broken_fit(*args):
        raise ValueError("a bug")

    sim.client.fit = broken_fit
    with pytest.raises(ValueError, match="a bug"):
        sim.run_round(1)


def test_malformed_fedhpro_update_is_dropped_with_its_reason():
    sim = fault_simulator()
    original_fit = sim.client.fit

    def bad_fit(model, payload, data, state, generator):
        reply, metrics = original_fit(model, payload, data, state, generator)
        if data is sim.federation.clients[1]:
            reply["class_gradients"] = reply["class_gradients"][:, :3]
        return reply, metrics

    sim.client.fit = bad_fit
    record = sim.run_round(0)
    assert [d["client"] for d in record.dropped] == [1]
    assert "class_gradients" in record.dropped[0]["reason"]
    with pytest.raises(UpdateError):
        sim.server.validate_reply({"weights": sim.server.global_weights(), "num_examples": float("nan")})


# ---------------------------------------------------------------------------- bad input at the CLI

BAD_INPUTS = [
    (["method=nosuch"], "method='nosuch' is not valid; choose one of: fedavg"),
    (["rounds=-1"], "rounds=-1 is too small"),
    (["rounds=0"], "rounds=0 is too small"),
    (["rounds=ten"], "rounds='ten' is not an integer"),
    (["rouds=3"], "did you mean 'rounds'"),
    (["fedhpro.tua=1"], "did you mean 'fedhpro.tau'"),
    (["fedhpro.tau=0"], "fedhpro.tau=0"),
    (["fedhpro.tau=-0.1"], "must be > 0"),
    (["fedhpro.margin=big"], "choose one of: raw, normalized, off"),
    (["fedhpro.num_hyper=0"], "fedhpro.num_hyper=0 is too small"),
    (["participation=0"], "participation=0"),
    (["participation=1.5"], "participation=1.5 is too large"),
    (["lr=abc"], "lr='abc' is not a number"),
    (["lr=nan"], "must be a finite number"),
    (["progress=maybe"], "not a boolean"),
    (["dataset=cifar"], "dataset='cifar' is not valid"),
    (["model=vgg"], "model='vgg' is not valid"),
    (["device=tpu"], "device='tpu'"),
    (["heterogeneity=htfe4"], "choose one of: none, htfe2"),
    (["data.fraction=0"], "data.fraction=0"),
    (["data.clients_per_domain.svhn=2"], "unknown domains"),
    (["faults.corrupt=2"], "faults.corrupt=2"),
    (["nosuchsection.key=1"], "unknown config key"),
    (["rounds"], "is not KEY=VALUE"),
    (["missing.yaml"], "does not exist"),
    (["clients=400", "data.fraction=0.1"], "lower data.fraction or the client count"),
]


@pytest.mark.parametrize("arguments, message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_gives_one_clear_line_and_no_output(arguments, message, digits_data_dir, tmp_path, capsys):
    out = tmp_path / "out"
    code = cli_main(["run", *arguments, f"data_dir={digits_data_dir}", f"out={out}",
                     f"data.syn_size={DIGITS_SYN_SIZE}", f"data.test_fraction={DIGITS_TEST_FRACTION}"]
                    if arguments != ["missing.yaml"] else ["run", "missing.yaml"])
    captured = capsys.readouterr()
    assert code == 2
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedhpro: error: "), captured.err
    assert message in lines[0]
    assert "Traceback" not in captured.err
    assert not out.exists()  # nothing half-written


# ---------------------------------------------------------------------------- every method resumes exactly


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_resumes_bit_for_bit_from_a_weights_only_checkpoint(method, tmp_path):
    """Rounds 0-2 straight equal rounds 0-1, a checkpoint through torch.save/load(weights_only=True), round 2."""
    spec = METHODS[method]
    federation = make_federation([24, 32, 20], classes=[[0, 1, 2], [1, 2, 3], [0, 3]])

    def factory():
        model = TinyNet()
        return spec.model_wrapper(model, spec.options(), 4) if spec.model_wrapper else model

    def build():
        options = spec.options()
        if hasattr(options, "server_epochs"):
            options.server_epochs = 2  # FedTGP's server training, kept short
        return Simulator(spec, options, federation, factory, TRAIN, rounds=3, seed=11)

    straight = build()
    for r in range(3):
        straight.run_round(r)

    first = build()
    for r in range(2):
        first.run_round(r)
    path = checkpoint.save(tmp_path, 2, first.state_dict(), [record.to_json() for record in first.history])
    blob = checkpoint.load(path)
    resumed = build()
    resumed.load_state_dict(blob[checkpoint.STATE])
    resumed.run_round(2)

    assert resumed.history[0].to_json() == straight.history[2].to_json()
    for key, value in straight.server.global_weights().items():
        assert torch.equal(value, resumed.server.global_weights()[key]), key


# ---------------------------------------------------------------------------- run folders


@pytest.mark.slow
def test_a_new_run_never_writes_into_another_runs_folder(digits_data_dir, tmp_path, capsys):
    folder = tmp_path / "run"
    assert cli_main(["run", *tiny_settings(digits_data_dir, folder, rounds=2)]) == 0
    before = {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}
    capsys.readouterr()
    # finished: refused, one line, and nothing in the folder changes
    assert cli_main(["run", *tiny_settings(digits_data_dir, folder, rounds=3)]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds a finished run" in err and "another out=" in err and "\n" not in err
    assert {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()} == before
    # unfinished with a checkpoint: the message offers resume=
    (folder / "summary.json").unlink()
    assert cli_main(["run", *tiny_settings(digits_data_dir, folder, rounds=3)]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds an unfinished run" in err and f"resume={folder}" in err
    # an empty folder, or one holding other files, is fine
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert cli_main(["run", *tiny_settings(digits_data_dir, other, rounds=1)]) == 0
    assert (other / "notes.txt").read_text() == "mine" and (other / "summary.json").is_file()
