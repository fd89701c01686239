"""The run driver (fedhpro.engines.driver) is the one run around any engine: a second, sequential engine
(tests/sequential_engine.py) run through it writes the simulator's bytes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import FEATURE_DIM, TinyNet, make_federation
from sequential_engine import SequentialEngine

import fedhpro
from fedhpro.api import build_experiment
from fedhpro.engines import driver
from fedhpro.runtime import cpu_runtime, resolve_threads, torch_threads


def settings(out: Path, method: str) -> dict:
    return {"rounds": 3, "local_epochs": 1, "batch_size": 8, "progress": False, "device": "cpu", "out": str(out),
            "feature_dim": FEATURE_DIM, "method": method, "eval_every": 2, "seed": 2,
            **({"fedhpro.match_steps": 2} if method == "fedhpro" else {})}


def without_seconds(path: Path) -> dict:
    summary = json.loads(path.read_text())
    assert isinstance(summary.pop("seconds"), float)
    return summary


@pytest.mark.parametrize("method", ["fedavg", "fedhpro"])
def test_a_sequential_engine_through_the_driver_gives_the_simulators_bytes(method, tmp_path):
    federation = make_federation([10, 12, 14], seed=3)
    expected = fedhpro.run(federation=federation, model=TinyNet, **settings(tmp_path / "simulator", method))
    config, out = expected.config, tmp_path / "sequential"
    device = torch.device("cpu")
    started = time.perf_counter()
    with cpu_runtime(), torch_threads(resolve_threads(config.run.threads)):  # as fedhpro.run runs
        parts = build_experiment(config, device, federation=federation, model_factory=TinyNet)
        engine = SequentialEngine(config, parts, device)
        folder = driver.RunFolder(out, config.run, started=started)
        folder.start(config.to_dict(), parts.federation.partition)
        driver.train(engine, folder, "sequential", progress=False)
        summary = driver.run_summary(config.run, federation.name, federation.num_clients, device,
                                     folder.rows.metrics, time.perf_counter() - started, parts.federation.notes,
                                     from_python=True)
        folder.finish(summary, engine.server.state_dict())
    for name in ("metrics.jsonl", "config.yaml", "partition.json"):
        assert (out / name).read_bytes() == (expected.out / name).read_bytes(), name
    assert without_seconds(out / "summary.json") == without_seconds(expected.out / "summary.json")
    assert list(json.loads((out / "summary.json").read_text())) == list(expected.summary)  # the keys' order too
    ours, theirs = (torch.load(where / "server_state.pt", weights_only=True) for where in (out, expected.out))
    assert ours["completed_rounds"] == theirs["completed_rounds"] == 3
    assert all(torch.equal(ours["server"]["weights"][key], value)
               for key, value in theirs["server"]["weights"].items())
