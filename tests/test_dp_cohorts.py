"""bench/dp_cohorts.py: its settings per cohort and its table, from hand-written run summaries (no training)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # it imports its sibling privacy_utility
    spec = importlib.util.spec_from_file_location("dp_cohorts", ROOT / "bench" / "dp_cohorts.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_summary(out: Path, cohort: int, epsilon: str, seed: int, accuracy: float,
                  sigma: float | None = None) -> None:
    folder = out / f"cohort-{cohort}" / "client" / f"eps-{epsilon}" / f"fedavg-seed{seed}"
    folder.mkdir(parents=True)
    summary: dict = {"accuracy": accuracy}
    if sigma is not None:
        summary["privacy"] = {"noise_multiplier": sigma, "clip": 3.0, "epsilon": 7.9}
    (folder / "summary.json").write_text(json.dumps(summary))


def test_cohort_settings_sample_m_of_n(script):
    assert script.cohort_settings(["rounds=30"], 10000, 1000) == ["rounds=30", "clients=10000", "participation=0.1"]
    assert script.cohort_settings([], 10000, 100)[-1] == "participation=0.01"
    with pytest.raises(ValueError, match="does not fit"):
        script.cohort_settings([], 1000, 5000)
    assert script.rounds_of(["rounds=30", "lr=0.05", "rounds=120"]) == "120"  # the last one wins, as in a run


def test_collect_and_table_against_hand_values(script, tmp_path):
    write_summary(tmp_path, 100, "8", 0, 10.0, sigma=0.44)
    write_summary(tmp_path, 100, "8", 1, 12.0, sigma=0.44)
    write_summary(tmp_path, 100, "inf", 0, 40.0)
    write_summary(tmp_path, 100, "inf", 1, 44.0)
    write_summary(tmp_path, 1000, "8", 0, 30.0, sigma=0.75)  # seed 1 missing; no run without DP
    rows = script.collect(tmp_path, [100, 1000], [0, 1], "8")
    small, large = rows
    assert small["dp"] == [10.0, 12.0] and small["dp_mean"] == 11.0 and small["dp_std"] == pytest.approx(math.sqrt(2))
    assert small["no_dp_mean"] == 42.0 and small["gap"] == 31.0
    assert small["noise_multiplier"] == 0.44 and small["noise_std"] == pytest.approx(0.44 * 3.0 / 100)
    assert small["epsilon_reached"] == 7.9
    assert large["dp"] == [30.0] and large["no_dp"] == [] and large["gap"] is None
    assert large["noise_std"] == pytest.approx(0.75 * 3.0 / 1000)
    table = script.markdown(rows, "8", [0, 1], "caption")
    assert "| 100 | 0.440 | 1.32e-02 | 11.00 ± 1.41 | 42.00 ± 2.83 | 31.00 | 7.90 |" in table
    assert "| 1,000 | 0.750 | 2.25e-03 | 30.00 ± 0.00 (1 seed) | not run | – | 7.90 |" in table
    lines = script.csv_text(rows).splitlines()
    assert lines[0].startswith("cohort,noise_multiplier,clip,noise_std")
    assert lines[1].split(",")[6] == "10.0000 12.0000"


def test_the_clip_only_control_gets_its_own_column(script, tmp_path):
    write_summary(tmp_path, 100, "8", 0, 50.0, sigma=0.44)
    write_summary(tmp_path, 100, "inf", 0, 30.0)
    write_summary(tmp_path, 100, "clip-only", 0, 60.0, sigma=script.CLIP_ONLY_SIGMA)
    (row,) = script.collect(tmp_path, [100], [0], "8")
    assert row["clip_only"] == [60.0] and row["gap"] == -20.0
    assert row["noise_multiplier"] == 0.44  # the DP runs' sigma, not the control's
    table = script.markdown([row], "8", [0], "caption")
    assert "clip only, no noise |" in table
    assert table.rstrip().endswith("| 100 | 0.440 | 1.32e-02 | 50.00 ± 0.00 | 30.00 ± 0.00 | -20.00 | 7.90 | "
                                   "60.00 ± 0.00 |")
    command = script.clip_only_command(tmp_path / "cohort-100", ["rounds=30"], 2)
    assert f"out={tmp_path / 'cohort-100' / 'client' / 'eps-clip-only'}" in command
    assert command[-3:] == ["privacy=client", "privacy.noise=central", "privacy.noise_multiplier=0.01"]
