"""``fedhpro report`` of a comparison run at tuned settings (``fedhpro compare tuned=``) names each method's tuned
settings, the tuning budget and its seed, as compare's own table does (before: only compare's ``table.md`` said
so; the report's ``table.md`` showed tuned runs without a word). A record that cannot be read is one note line.

The comparisons here do not train: ``fedhpro.api.run_or_continue`` is replaced by :func:`fake_run`, which writes a
run folder as a run does, with accuracies chosen here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fake_runs import finished_run_writer

import fedhpro.methods  # noqa: F401 - the registry that names the methods
from fedhpro import api
from fedhpro.cli import main as cli_main
from fedhpro.compare import compare
from fedhpro.reports.runs import report

pytestmark = pytest.mark.slow

ACCURACY = {"fedavg": [50.0, 54.0], "fedprox": [51.0, 53.0]}
SETTINGS = {"rounds": 2, "progress": False}
TUNED = {"tuning": {"trials": 5, "seed": 1000, "validation": 0.2, "objective": "last round's validation AVG",
                    "outcomes": {"fedavg": {"complete": 3, "diverged": 2, "summary": "5 trials: 3 complete, 2 diverged"}}},
         "methods": {"fedavg": {"lr": 0.0312}, "fedprox": {"lr": 0.05, "fedprox.mu": 0.5}}}


fake_run = finished_run_writer(ACCURACY)


@pytest.fixture()
def tuned_comparison(monkeypatch, tmp_path) -> Path:
    monkeypatch.setattr(api, "run_or_continue", fake_run)
    tuned = tmp_path / "tuned.yaml"
    tuned.write_text(yaml.safe_dump(TUNED, sort_keys=False))
    out = tmp_path / "cmp"
    compare(["fedavg", "fedprox"], [0, 1], SETTINGS, out, echo=False, tuned=tuned)
    return out


def test_the_report_names_the_tuned_settings_budget_and_seed(tuned_comparison, tmp_path):
    assert cli_main(["report", str(tuned_comparison), f"out={tmp_path / 'report'}"]) == 0
    table = (tmp_path / "report" / "table.md").read_text()
    (line,) = [text for text in table.split("\n\n") if text.startswith("Tuned settings")]
    assert "FedAvg: lr=0.0312" in line and "FedProx: lr=0.05, fedprox.mu=0.5" in line
    assert "5 trials per method" in line and "tuning seed 1000" in line and "validation=0.2" in line
    assert "FedAvg: lr=0.0312 (of 5 trials: 3 complete, 2 diverged); FedProx: lr=0.05, fedprox.mu=0.5." in line
    assert str(tmp_path / "tuned.yaml") in line
    # the report of the runs themselves (one row per run) says it too
    out = report([tuned_comparison / "fedavg-seed0", tuned_comparison / "fedprox-seed1"], out=tmp_path / "runs",
                 echo=False)
    assert "FedAvg: lr=0.0312 (of 5 trials: 3 complete, 2 diverged); FedProx: lr=0.05, fedprox.mu=0.5" in \
        (out / "table.md").read_text()


def test_an_untuned_comparison_says_nothing_of_tuning(monkeypatch, tmp_path):
    monkeypatch.setattr(api, "run_or_continue", fake_run)
    compare(["fedavg"], [0, 1], SETTINGS, tmp_path / "cmp", echo=False)
    assert "tuned" not in json.loads((tmp_path / "cmp" / "compare.json").read_text())  # its bytes as before
    assert "Tuned" not in (report([tmp_path / "cmp"], echo=False) / "table.md").read_text()


@pytest.mark.parametrize("entry, words", [
    ("not a mapping", "neither their settings nor their tuned file"),
    ({"file": "/nonexistent/tuned.yaml"}, "/nonexistent/tuned.yaml"),
])
def test_a_damaged_or_missing_tuning_record_is_one_note_line(tuned_comparison, entry, words):
    record_path = tuned_comparison / "compare.json"
    record = json.loads(record_path.read_text())
    record["tuned"] = entry
    record_path.write_text(json.dumps(record))
    table = (report([tuned_comparison], echo=False, force=True) / "table.md").read_text()
    (line,) = [text for text in table.split("\n\n") if text.startswith("Tuned settings not named")]
    assert words in line and "\n" not in line


def test_the_tuned_file_is_read_when_the_record_holds_only_its_name(tuned_comparison, tmp_path):
    record_path = tuned_comparison / "compare.json"
    record = json.loads(record_path.read_text())
    record["tuned"] = {"file": str(tmp_path / "tuned.yaml")}
    record_path.write_text(json.dumps(record))
    table = (report([tuned_comparison], echo=False, force=True) / "table.md").read_text()
    assert "FedProx: lr=0.05, fedprox.mu=0.5" in table and "tuning seed 1000" in table


def test_the_per_class_report_names_them_too(tuned_comparison):
    """``per_class=true``: the tuned line is among ``per_class.md``'s notes (counts set here by hand)."""
    def counts(folder: Path) -> dict:
        return {"train_counts": [10, 10], "test_sets": {"mnist": {"correct": [5, 6], "total": [10, 10]}}}

    out = report([tuned_comparison], echo=False, force=True, class_accuracy=counts)
    assert "FedProx: lr=0.05, fedprox.mu=0.5" in (out / "per_class.md").read_text()
