"""The examples in ``examples/`` run as a user runs them, and the out-of-package method they show is right.

Each example runs as a subprocess with tiny settings. The FedAvgM method of
``examples/own_method`` is found through a real entry point: a
``fedhpro_fedavgm-0.1.dist-info`` folder (METADATA + entry_points.txt) on
PYTHONPATH stands in for ``pip install ./examples/own_method``, so the venv is
left untouched. Its server update is checked against a hand computation.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_python(args: list[str], cwd: Path, pythonpath: list[Path] = (), timeout: int = 240
               ) -> subprocess.CompletedProcess:
    paths = [str(p) for p in pythonpath] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_own_datasets_example_trains_both_methods_on_the_three_sites(tmp_path):
    result = run_python([str(EXAMPLES / "own_datasets.py"), "--rounds", "1", "--out", str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stderr
    printed = dict(re.findall(r"^(fedhpro|fedavg): test accuracy ([\d.]+)%", result.stdout, re.M))
    assert set(printed) == {"fedhpro", "fedavg"}
    for method, accuracy in printed.items():
        summary = json.loads((tmp_path / method / "summary.json").read_text())
        assert summary["dataset"] == "digits-3-sites" and summary["data_source"] == "python"
        assert summary["clients"] == 3 and f"{summary['accuracy']:.2f}" == accuracy
        config = yaml.safe_load((tmp_path / method / "config.yaml").read_text())
        assert config["federation"] == "python:digits-3-sites" and config["clients"] == 3
    # the sites hold the class sets the example gives them (label skew survives from_datasets)
    assert "clinic-a: " in result.stdout and "classes [0, 1, 2, 3, 4, 5]" in result.stdout


@pytest.mark.slow
def test_own_model_example_trains_a_split_torchvision_resnet(tmp_path):
    result = run_python([str(EXAMPLES / "own_model.py"), "--samples", "16", "--out", str(tmp_path / "run")],
                        tmp_path)
    assert result.returncode == 0, result.stderr
    assert "features -> 512-d" in result.stdout and "11.2 M parameters" in result.stdout
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["model"] == "python:__main__.resnet18"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["params_up"] > 3 * 11_000_000  # three clients sent a whole ResNet-18


def write_dist_info(root: Path, package: str, version: str, entry_points: dict[str, str]) -> None:
    """What ``pip install`` leaves for importlib.metadata: a dist-info folder with METADATA and entry_points.txt."""
    folder = root / f"{package.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    lines = [f"{name} = {target}" for name, target in entry_points.items()]
    (folder / "entry_points.txt").write_text("[fedhpro.methods]\n" + "\n".join(lines) + "\n")


@pytest.mark.slow
def test_an_installed_entry_point_adds_the_method_to_the_cli(tmp_path, digits_data_dir):
    write_dist_info(tmp_path / "site", "fedhpro_fedavgm", "0.1", {"fedavgm": "fedhpro_fedavgm:METHOD"})
    pythonpath = [tmp_path / "site", EXAMPLES / "own_method"]
    out = tmp_path / "run"
    settings = ["method=fedavgm", "fedavgm.server_momentum=0.5", "rounds=2", "clients=4", "data.fraction=0.02",
                f"data.syn_size={DIGITS_SYN_SIZE}", f"data.test_fraction={DIGITS_TEST_FRACTION}", "feature_dim=16",
                "local_epochs=1", "progress=false", "device=cpu", f"data_dir={digits_data_dir}", f"out={out}"]
    result = run_python(["-m", "fedhpro", "run", *settings], tmp_path, pythonpath)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "fedavgm" and summary["rounds"] == 2
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["fedavgm"] == {"server_lr": 1.0, "server_momentum": 0.5}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(row["server"]["velocity_norm"] > 0 for row in rows)  # the plugin's server ran every round

    keys = run_python(["-m", "fedhpro", "config", "--keys"], tmp_path, pythonpath)
    assert keys.returncode == 0, keys.stderr
    assert "fedavgm.server_momentum: heavy-ball momentum" in keys.stdout
    assert re.search(r"^method \[[a-z|]*\|fedavgm\]", keys.stdout, re.M)


@pytest.fixture
def fedavgm(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES / "own_method"))
    import fedhpro_fedavgm

    return fedhpro_fedavgm


def test_fedavgm_server_update_matches_a_hand_computation(fedavgm):
    from fedhpro.methods import MethodContext, TrainSettings

    model = nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(0.0)
    options = fedavgm.FedAvgMOptions(server_lr=1.0, server_momentum=0.9)
    server = fedavgm.METHOD.server(MethodContext(model=model, num_classes=1, options=options, train=TrainSettings()))

    def reply(w: float, b: float, n: int) -> dict:
        return {"weights": {"weight": torch.tensor([[w]]), "bias": torch.tensor([b])}, "num_examples": n}

    # round 1: average of weight = (1 * 0.0 + 3 * 0.6) / 4 = 0.45; v = 1.0 - 0.45 = 0.55; w = 1.0 - 0.55 = 0.45
    server.aggregate(0, [reply(0.0, 0.4, 1), reply(0.6, 0.0, 3)])
    # round 2: average = (0.25 + 0.25) / 2 = 0.25; v = 0.9 * 0.55 + (0.45 - 0.25) = 0.695; w = 0.45 - 0.695
    server.aggregate(1, [reply(0.25, 0.0, 2), reply(0.25, 0.0, 2)])
    assert server.global_weights()["weight"].item() == pytest.approx(-0.245, abs=1e-6)
    # bias: average 0.1, v = -0.1, b = 0.1; then average 0, v = 0.9 * -0.1 + 0.1 = 0.01, b = 0.1 - 0.01
    assert server.global_weights()["bias"].item() == pytest.approx(0.09, abs=1e-6)
    # FedAvg would have the round-2 average itself: the momentum really changes the result
    assert abs(server.global_weights()["weight"].item() - 0.25) > 0.4

    # the momentum buffer is part of the server's state (checkpoints, resume)
    copy = fedavgm.METHOD.server(MethodContext(model=model, num_classes=1, options=options, train=TrainSettings()))
    copy.load_state_dict(server.state_dict())
    assert copy.velocity["weight"].item() == pytest.approx(0.695, abs=1e-6)


def test_fedavgm_without_momentum_is_fedavg(fedavgm):
    from fedhpro.methods import MethodContext, Server, TrainSettings

    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))  # with an integer buffer (num_batches_tracked)
    generator = torch.Generator().manual_seed(0)
    replies = [{"weights": {k: (torch.randn(v.shape, generator=generator) if v.is_floating_point()
                                else v + k_client) for k, v in model.state_dict().items()},
                "num_examples": n} for k_client, n in enumerate([5, 2, 7])]
    options = fedavgm.FedAvgMOptions(server_lr=1.0, server_momentum=0.0)
    momentum = fedavgm.METHOD.server(MethodContext(model=model, num_classes=2, options=options, train=TrainSettings()))
    plain = Server(MethodContext(model=model, num_classes=2, options=None, train=TrainSettings()))
    momentum.aggregate(0, replies)
    plain.aggregate(0, replies)
    for name, value in plain.global_weights().items():
        torch.testing.assert_close(momentum.global_weights()[name], value, rtol=0, atol=1e-6)
