"""``fedhpro compare``: a list given to a one-value key is a grid (one named row per point, each the run at that
value); list-valued keys stay lists; ``tuned=`` runs each method at its tuned settings, apart from the tuning's
seed; a tuning trial stops where its pruner says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

from fedhpro import api
from fedhpro.compare import compare, grid_points
from fedhpro.config import load_config
from fedhpro.errors import ConfigError
from fedhpro.tune import ValidationReporter, trial_run


def settings(data_dir: Path, **extra) -> dict:
    return {"rounds": 1, "clients": 4, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
            "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 16, "local_epochs": 1,
            "progress": False, "device": "cpu", "data_dir": str(data_dir), **extra}


def table_rows(out: Path) -> dict[str, list[str]]:
    rows = {row[0]: row for row in (line.split(",") for line in (out / "table.csv").read_text().splitlines())}
    rows.pop("method")
    return rows


@pytest.mark.slow
def test_a_list_for_a_one_value_key_is_a_grid_of_named_rows(digits_data_dir, tmp_path):
    out = tmp_path / "grid"
    learns = settings(digits_data_dir, rounds=3, local_epochs=2, **{"data.fraction": 0.1})  # lr 0.001 does not
    table = compare(["fedavg"], [0], dict(learns, lr=[0.001, 0.05]), out, echo=False)
    rows = table_rows(out)
    assert list(rows) == ["fedavg lr=0.001", "fedavg lr=0.05"]
    assert "| FedAvg lr=0.05 |" in table["markdown"]
    for lr in (0.001, 0.05):  # each row is the run at its point, run here on its own
        alone = api.run(dict(learns, method="fedavg", seed=0, lr=lr, out=str(tmp_path / f"a{lr}")))
        assert float(rows[f"fedavg lr={lr:g}"][1 + 4]) == pytest.approx(alone.accuracy, abs=5e-5)  # AVG_mean
        saved = yaml.safe_load((out / f"fedavg-lr={lr:g}-seed0" / "config.yaml").read_text())
        assert saved["lr"] == lr
    assert float(rows["fedavg lr=0.05"][1 + 4]) > float(rows["fedavg lr=0.001"][1 + 4]) + 5


def test_list_valued_keys_are_not_grids(digits_data_dir):
    pairs = {"dataset": "digits-offline", "lr": [0.01, 0.05], "data.domains": ["mnist", "syn"], "local_epochs": [1, 2],
             "data_dir": str(digits_data_dir)}
    points = grid_points(pairs)
    assert points == [{"lr": 0.01, "local_epochs": 1}, {"lr": 0.01, "local_epochs": 2},
                      {"lr": 0.05, "local_epochs": 1}, {"lr": 0.05, "local_epochs": 2}]
    assert grid_points(settings(digits_data_dir, **{"data.domains": ["mnist", "syn"]})) == [{}]


@pytest.mark.slow
def test_tuned_settings_are_run_on_other_seeds_and_named(digits_data_dir, tmp_path):
    tuned = tmp_path / "tuned.yaml"
    tuned.write_text(yaml.safe_dump({"tuning": {"trials": 4, "seed": 1000, "validation": 0.2},
                                     "methods": {"fedavg": {"lr": 0.2},
                                                 "fedprox": {"lr": 0.05, "fedprox.mu": 0.5}}}))
    out = tmp_path / "cmp"
    table = compare(["fedavg", "fedprox"], [0], settings(digits_data_dir), out, echo=False, tuned=tuned)
    for method, extra in (("fedavg", {"lr": 0.2}), ("fedprox", {"lr": 0.05, "fedprox.mu": 0.5})):
        saved = yaml.safe_load((out / f"{method}-seed0" / "config.yaml").read_text())
        assert saved["lr"] == extra["lr"] and saved["seed"] == 0
        alone = api.run(dict(settings(digits_data_dir), method=method, seed=0, out=str(tmp_path / method), **extra))
        summary = json.loads((out / f"{method}-seed0" / "summary.json").read_text())
        assert summary["accuracy"] == alone.accuracy
    assert yaml.safe_load((out / "fedprox-seed0" / "config.yaml").read_text())["fedprox"]["mu"] == 0.5
    caption = table["markdown"].split("\n\n")[2]  # after the table's caption and its significance sentence
    assert caption.startswith("Each method at its tuned settings") and "seed 1000" in caption
    assert "fedavg: lr=0.2;" in caption and "fedprox.mu=0.5" in caption.split("fedprox:")[1]
    with pytest.raises(ConfigError, match="seed 1000 is the seed"):
        compare(["fedavg"], [0, 1000], settings(digits_data_dir), tmp_path / "c2", echo=False, tuned=tuned)
    with pytest.raises(ConfigError, match="moon is not in"):
        compare(["moon"], [0], settings(digits_data_dir), tmp_path / "c3", echo=False, tuned=tuned)
    with pytest.raises(ConfigError, match="lr= is set by"):
        compare(["fedavg"], [0], settings(digits_data_dir, lr=0.1), tmp_path / "c4", echo=False, tuned=tuned)


class PruneAfter:
    """A stand-in for an Optuna trial whose pruner says stop once ``rounds`` rounds are reported."""

    def __init__(self, rounds: int) -> None:
        self.rounds, self.reported = rounds, {}

    def report(self, value: float, step: int) -> None:
        self.reported[step] = value

    def should_prune(self) -> bool:
        return len(self.reported) >= self.rounds


def test_a_trial_reports_each_rounds_validation_and_stops_where_its_pruner_says(digits_data_dir, tmp_path):
    config = load_config(None, settings(digits_data_dir, rounds=4, validation=0.2, method="fedavg",
                                        out=str(tmp_path / "t")))
    trial = PruneAfter(2)
    with pytest.raises(optuna.TrialPruned):
        trial_run(config, tmp_path / "t", ValidationReporter(trial))
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    # stopped in the second round of four, before its row was written; the first round's was its validation AVG
    assert [row["round"] for row in rows] == [0] and sorted(trial.reported) == [0, 1]
    assert trial.reported[0] == rows[0]["validation"]["AVG"]
    assert not (tmp_path / "t" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("entry, problem", [
    ({"lr": 0.1, "tracker": "mlflow", "tracker_uri": "http://127.0.0.1:18765"}, "sets tracker= for fedavg"),
    ({"out": "/tmp/elsewhere"}, "sets out= for fedavg"),
    ({"lr": {"nested": 1}}, "gives lr= of fedavg as dict"),
])
def test_a_tuned_file_setting_more_than_searched_keys_is_refused_before_any_run(tmp_path, entry, problem):
    """A tuned.yaml handed over may set only what fedhpro tune searches: a tracker destination (before: the whole
    run uploaded to it) or any other key is one line, before anything is written."""
    tuned = tmp_path / "tuned.yaml"
    tuned.write_text(yaml.safe_dump({"tuning": {"trials": 4, "seed": 1000}, "methods": {"fedavg": entry}}))
    out = tmp_path / "cmp"
    with pytest.raises(ConfigError, match=re.escape(problem)) as refused:
        compare(["fedavg"], [0], {"rounds": 1}, out, echo=False, tuned=tuned)
    assert "\n" not in str(refused.value) and not out.exists()
