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


def write_method_summary(folder: Path, method: str, seed: int, accuracy: float, sigma: float | None = None,
                         epsilon: float = 7.9) -> None:
    run = folder / f"{method}-seed{seed}"
    run.mkdir(parents=True)
    summary: dict = {"accuracy": accuracy}
    if sigma is not None:
        summary["privacy"] = {"noise_multiplier": sigma, "clip": 3.0, "epsilon": epsilon}
    (run / "summary.json").write_text(json.dumps(summary))


def test_per_method_study_noise_cohorts_above_the_trained_cohort(script, tmp_path):
    assert script.method_cohort_settings(["rounds=40"], 2000, 50, 50) == ["rounds=40", "clients=2000",
                                                                         "participation=0.025"]
    assert script.method_cohort_settings([], 2000, 50, 1000)[-1] == "privacy.noise_cohort=1000"
    with pytest.raises(ValueError, match="trained"):
        script.method_cohort_settings([], 2000, 100, 50)  # a noise cohort smaller than the trained one
    commands = script.method_commands(tmp_path, ["rounds=40"], ["fedavg", "fedhpro"], 2000, 50, [50, 300], [0, 1],
                                      "8", 2, tmp_path / "tuned.yaml")
    # seed by seed: no DP, then per cohort the fixed and the adaptive clip
    outs = [next(c for c in command if c.startswith("out=")) for command in commands]
    assert outs[:5] == [f"out={tmp_path / 'no-dp'}", f"out={tmp_path / 'cohort-50' / 'fixed'}",
                        f"out={tmp_path / 'cohort-50' / 'adaptive'}", f"out={tmp_path / 'cohort-300' / 'fixed'}",
                        f"out={tmp_path / 'cohort-300' / 'adaptive'}"] and len(commands) == 10
    assert all(f"tuned={tmp_path / 'tuned.yaml'}" in command and "methods=[fedavg,fedhpro]" in command
               for command in commands)
    assert "privacy.target_epsilon=8" not in commands[0] and "privacy.target_epsilon=8" in commands[1]
    assert "privacy.clip_quantile=0.5" in commands[2] and "privacy.clip_quantile=0.5" not in commands[1]
    assert "privacy.noise_cohort=300" in commands[3] and not any("noise_cohort" in c for c in commands[1])


def test_per_method_study_table_against_hand_values(script, tmp_path):
    write_method_summary(tmp_path / "no-dp", "fedhpro", 0, 90.0)
    write_method_summary(tmp_path / "no-dp", "fedhpro", 1, 94.0)
    write_method_summary(tmp_path / "cohort-50" / "fixed", "fedhpro", 0, 20.0, sigma=0.6)
    write_method_summary(tmp_path / "cohort-50" / "fixed", "fedhpro", 1, 30.0, sigma=0.6)
    write_method_summary(tmp_path / "cohort-1000" / "adaptive", "fedhpro", 0, 88.0, sigma=1.1, epsilon=8.0)
    stopped = tmp_path / "cohort-1000" / "adaptive" / "fedhpro-seed1"  # started, stopped on a non-finite loss
    stopped.mkdir()
    (stopped / "metrics.jsonl").write_text('{"round": 0}\n')
    rows = script.collect_methods(tmp_path, ["fedhpro"], [50, 1000], [0, 1], 50)
    small, large = rows
    assert small["no_dp_mean"] == 92.0 and small["fixed_mean"] == 25.0 and small["fixed_gap"] == 67.0
    assert small["fixed_std"] == pytest.approx(math.sqrt(50)) and small["adaptive"] == [] and not small["noise_cohort"]
    assert large["noise_cohort"] and large["adaptive_gap"] == 4.0 and large["fixed"] == []
    assert large["adaptive_failed"] == [1] and large["fixed_failed"] == [] and small["no_dp_failed"] == []
    assert large["noise_multiplier"] == 1.1 and large["epsilon_reached"] == 8.0
    table = script.methods_markdown(rows, "8", [0, 1], "caption")
    assert "| FedHPro | 50 | 0.600 | 92.00 ± 2.83 | 25.00 ± 7.07 | 67.00 | not run | – | 7.90 |" in table
    assert ("| FedHPro | 1,000 (noise cohort; 50 train) | 1.100 | 92.00 ± 2.83 | not run | – | "
            "88.00 ± 0.00 (1 seed); 1 diverged | 4.00 | 8.00 |") in table
    lines = script.methods_csv(rows).splitlines()
    assert lines[0].startswith("method,cohort,trained,noise_cohort") and lines[0].endswith(",adaptive_diverged_seeds")
    assert lines[1].endswith(",90.0000 94.0000,20.0000 30.0000,,,,") and lines[2].endswith(",88.0000,,,1")
    assert script._failed_cell([], None, None, 2, [0, 1]) == "diverged (2 of 2 seeds)"
