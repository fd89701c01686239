"""bench/cohorts.py --digits: the run it measures (the issue's 5,000 clients of 20 images) and its peak of a
child process, against a child that holds a known amount of memory."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cohorts(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # it imports its sibling harness
    spec = importlib.util.spec_from_file_location("cohorts", ROOT / "bench" / "cohorts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_command_is_the_issues_run(cohorts):
    command = cohorts.digits_command(5000, 20, 100, "/data", "/out")
    assert command[:4] == [sys.executable, "-m", "fedhpro", "run"]
    assert command[4:] == ["dataset=digits-offline", "data.domains=[syn]", "data.syn_size=100000", "partition=iid",
                           "clients=5000", "participation=0.02", "rounds=1", "local_epochs=1", "feature_dim=64",
                           "privacy=client", "privacy.noise_multiplier=1", "threads=1", "data_dir=/data",
                           "out=/out"]


@pytest.mark.slow
def test_peak_of_a_child_is_its_own(cohorts):
    # 300 MiB written (so resident) by the child: its peak is at least that, and far below 1 GiB. Measured from a
    # fresh small parent, as the bench runs: a vfork child starts at its parent's high-water mark (a test worker's
    # after the data tests is over 1 GiB)
    probe = ("import json, sys; sys.path.insert(0, sys.argv[1]); import cohorts; "
             "print(json.dumps(cohorts.peak_of([sys.executable, '-c', 'held = b\\'x\\' * (300 * 2 ** 20)'])))")
    done = subprocess.run([sys.executable, "-c", probe, str(ROOT / "bench")], capture_output=True, text=True,
                          timeout=120, check=True)
    seconds, peak = json.loads(done.stdout)
    assert 300 / 1024 <= peak < 1 and seconds > 0
    with pytest.raises(SystemExit, match="failed"):
        cohorts.peak_of([sys.executable, "-c", "raise SystemExit(3)"])
