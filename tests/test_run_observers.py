"""fedhpro.run takes observers (callbacks on its rounds, as pfl-research's loop takes them), through the one run
setup every entry point shares; fedhpro tune's trials go through the same setup with their own observer only;
engines are told apart by their kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FEATURE_DIM, TinyNet, make_federation

import fedhpro
from fedhpro.config import load_config
from fedhpro.engines.interface import FLOWER, SIMULATOR, kind_named
from fedhpro.engines.observers import RoundObserver
from fedhpro.engines.simulator import Simulator
from fedhpro.engines.summary import run_summary
from fedhpro.tune import trial_run

#: every test starts whole (tiny) runs
pytestmark = pytest.mark.slow


def settings(out: Path, **extra) -> dict:
    return {"rounds": 3, "local_epochs": 1, "batch_size": 8, "progress": False, "device": "cpu", "out": str(out),
            "feature_dim": FEATURE_DIM, "method": "fedavg", "seed": 2, **extra}


class Recorder(RoundObserver):
    """Every hook it sees, in order; adds one key of its own to each round's row."""

    def __init__(self, stop_after: int | None = None):
        self.seen: list[tuple] = []
        self.stop_after = stop_after

    def attach(self, simulator) -> None:
        super().attach(simulator)
        self.seen.append(("attach", type(simulator).__name__))

    def on_round_start(self, round: int, evaluating: bool) -> None:
        self.seen.append(("start", round))

    def training_measurements(self) -> dict:
        return {"recorded": len(self.seen)}

    def on_round_end(self, record) -> None:
        self.seen.append(("end", record.round, record.to_json()))
        if record.round == self.stop_after:
            raise StopIteration(f"stopped after round {record.round}")

    def on_run_end(self) -> None:
        self.seen.append(("run end", (Path(self.out) / "summary.json").is_file()))


def test_run_calls_the_observers_it_is_given_and_they_change_no_number(tmp_path):
    federation = make_federation([10, 12, 14], seed=3)
    plain = fedhpro.run(federation=federation, model=TinyNet, **settings(tmp_path / "plain"))
    recorder = Recorder()
    recorder.out = tmp_path / "observed"
    observed = fedhpro.run(federation=federation, model=TinyNet, observers=[recorder],
                           **settings(tmp_path / "observed"))
    hooks = [entry[:2] for entry in recorder.seen]
    assert hooks == [("attach", "Simulator"), ("start", 0), ("end", 0), ("start", 1), ("end", 1), ("start", 2),
                     ("end", 2), ("run end", True)]  # the run's end after summary.json is written
    # each round's record is its metrics.jsonl row; the observer's key is the only difference from the plain run
    rows = [json.loads(line) for line in (observed.out / "metrics.jsonl").read_text().splitlines()]
    assert [entry[2] for entry in recorder.seen if entry[0] == "end"] == rows == observed.metrics
    assert [row.pop("recorded") for row in rows] == [2, 4, 6]  # attach and start(s) seen before the row's keys
    assert rows == plain.metrics
    assert observed.summary["accuracy"] == plain.summary["accuracy"]


def test_an_observer_that_raises_stops_the_run_with_the_rounds_before_kept(tmp_path):
    federation = make_federation([10, 12, 14], seed=3)
    recorder = Recorder(stop_after=1)
    recorder.out = tmp_path / "stopped"
    with pytest.raises(StopIteration, match="stopped after round 1"):
        fedhpro.run(federation=federation, model=TinyNet, observers=[recorder], checkpoint_every=1,
                    **settings(tmp_path / "stopped"))
    out = tmp_path / "stopped"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1  # round 1's row was not kept
    assert not (out / "summary.json").exists()
    assert ("run end", False) not in recorder.seen and ("run end", True) not in recorder.seen


def test_a_trial_runs_with_its_observer_only_and_writes_no_model(tmp_path):
    pytest.importorskip("optuna")
    data = tmp_path / "data"
    folder = tmp_path / "trial"
    config = load_config(None, {**settings(folder, rounds=2, flops=True), "clients": 3, "data.fraction": 0.02,
                                "data.syn_size": 200, "data.test_fraction": 0.05, "data_dir": str(data),
                                "validation": 0.2, "threads": "1"})
    recorder = Recorder()
    recorder.out = folder
    summary = trial_run(config, folder, recorder)
    assert summary == {**json.loads((folder / "summary.json").read_text()), "seconds": summary["seconds"]}
    assert [entry[:2] for entry in recorder.seen][-1] == ("run end", True)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert all("flops_train" not in row and "recorded" in row for row in rows)  # the config's FLOPs are not a trial's
    assert not (folder / "model.pt").exists() and not (folder / "models").exists()


def test_engines_are_told_apart_by_their_kind():
    assert Simulator.kind is SIMULATOR and SIMULATOR.in_process and not FLOWER.in_process
    # a checkpoint names the engine that wrote it; one written before engines were named is the simulator's
    assert kind_named("flower") is FLOWER and kind_named("simulator") is SIMULATOR
    assert kind_named(None) is SIMULATOR and kind_named(3) is SIMULATOR
    assert "flwr run" in FLOWER.resume_hint and "fedhpro run resume=" in SIMULATOR.resume_hint

    class Options:
        method, seed, rounds, amp, channels_last, parallel_clients = "fedavg", 0, 1, "off", "auto", 2

    rows = [{"round": 0, "bytes_up": 1, "bytes_down": 1}]
    # summary.json names an engine whose clients train outside this process; the simulator's runs carry no key
    assert run_summary(Options(), "d", 2, "cpu", rows, 1.0, [], engine=FLOWER)["engine"] == "flower"
    assert "engine" not in run_summary(Options(), "d", 2, "cpu", rows, 1.0, [])
