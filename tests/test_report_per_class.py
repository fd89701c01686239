"""``fedhpro report ... per_class=true`` (issue 27): per-class accuracy of finished runs, re-tested from their folders.

References independent of the code under test: each run's own evaluation (summary.json, measured by the engine
on its own modules), a per-sample loop over the rebuilt test set for the per-class counts, the partition.json the
run wrote for the training images per class, and hand-computed head / tail splits and means."""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch

import fedhpro
from fedhpro.cli import main as cli_main
from fedhpro.config import load_config
from fedhpro.data import get_dataset
from fedhpro.errors import FedHProError
from fedhpro.reports.classes import class_split, per_class_accuracy, summarize
from fedhpro.reports.runs import report
from fedhpro.trained import class_accuracy
from tests.conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION


def tiny(data_dir, out, **extra) -> dict:
    return {"rounds": 1, "clients": 3, "local_epochs": 1, "feature_dim": 16, "progress": False, "threads": 1,
            "device": "cpu", "seed": 1, "data_dir": str(data_dir), "out": str(out), "data.fraction": 0.02,
            "data.syn_size": DIGITS_SYN_SIZE, "data.test_fraction": DIGITS_TEST_FRACTION, **extra}


def test_head_middle_tail_are_thirds_by_training_images_and_balanced_data_has_none():
    counts = [400, 239, 143, 86, 51, 30, 18, 11, 6, 4]
    assert class_split(counts) == ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9])
    assert class_split([5, 9, 9, 1, 7, 3]) == ([1, 2], [4, 0], [5, 3])  # ties by class index
    assert class_split([10, 6, 6, 5, 5, 5]) == ([0, 1], [2, 3], [4, 5])  # 10 = 2 x 5: a tail
    assert class_split([9, 6, 6, 5, 5, 5]) is None  # under 2x: balanced
    assert class_split([400] * 10) is None
    assert class_split([3, 1]) is None


def test_per_class_accuracy_is_the_mean_over_the_test_sets_holding_the_class():
    measured = {"train_counts": [10, 5, 1],
                "test_sets": {"a": {"correct": [1, 2, 0], "total": [2, 4, 0]},
                              "b": {"correct": [3, 0, 1], "total": [3, 5, 4]}}}
    assert per_class_accuracy(measured) == pytest.approx([(50 + 100) / 2, (50 + 0) / 2, 25.0])
    summary = summarize(measured)
    assert summary["balanced"] == pytest.approx((75 + 25 + 25) / 3)
    assert (summary["head"], summary["middle"], summary["tail"]) == pytest.approx((75.0, 25.0, 25.0))


@pytest.fixture(scope="module")
def compare_folder(digits_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("per-class") / "compare"
    for seed in (1, 2):
        fedhpro.run(**tiny(digits_data_dir, out / f"fedavg-seed{seed}", method="fedavg", seed=seed))
    return out


@pytest.mark.slow
def test_class_accuracy_counts_what_a_per_sample_loop_counts_and_what_the_run_reported(compare_folder):
    run = compare_folder / "fedavg-seed1"
    measured = class_accuracy(run)
    summary = json.loads((run / "summary.json").read_text())
    assert measured["reported"] == summary["accuracy"]
    assert measured["accuracy"]["AVG"] == summary["accuracy"]  # the run's own evaluation, to the bit
    config = load_config(run / "config.yaml")
    federation = get_dataset(config.run.dataset).build(config.data, config.run.clients, config.run.seed,
                                                       data_dir=config.run.data_dir, partition=config.partition)
    model = fedhpro.load_model(run)
    assert set(measured["test_sets"]) == set(federation.test_sets) and len(federation.test_sets) > 1
    for name, (x, y) in federation.test_sets.items():
        correct, total = [0] * 10, [0] * 10
        with torch.no_grad():
            for i in range(len(y)):  # one sample at a time
                label = int(y[i])
                total[label] += 1
                correct[label] += int(int(model(x[i:i + 1]).argmax(1)) == label)
        assert measured["test_sets"][name] == {"correct": correct, "total": total}
        assert measured["accuracy"][name] == summary["per_domain"][name]
    partition = json.loads((run / "partition.json").read_text())
    assert measured["train_counts"] == [sum(client["class_counts"][c] for client in partition["clients"])
                                        for c in range(10)]


@pytest.mark.slow
def test_personal_models_are_tested_client_by_client_as_the_run_did(digits_data_dir, tmp_path):
    result = fedhpro.run(**tiny(digits_data_dir, tmp_path / "run", method="fedproto",
                                **{"fedproto.protocol": "proto-only", "fedproto.inference": "nearest-prototype"}))
    measured = class_accuracy(result.out)
    assert measured["accuracy"]["AVG"] == result.summary["accuracy"]
    for name, value in result.summary["per_domain"].items():
        assert measured["accuracy"][name] == value


@pytest.mark.slow
def test_report_per_class_over_seeds_writes_tables_that_match_the_counts(compare_folder, capsys):
    assert cli_main(["report", str(compare_folder), "per_class=true"]) == 0
    report = compare_folder / "report"
    assert {"per_class.md", "per_class.csv", "per_class.png", "table.md"} <= {p.name for p in report.iterdir()}
    rows = list(csv.DictReader(io.StringIO((report / "per_class.csv").read_text())))
    assert len(rows) == 1 and rows[0]["seeds"] == "1,2"
    measured = [class_accuracy(compare_folder / f"fedavg-seed{seed}") for seed in (1, 2)]
    by_class = [per_class_accuracy(m) for m in measured]
    for c in range(10):
        present = [a[c] for a in by_class if a[c] is not None]
        assert float(rows[0][f"class_{c}"]) == pytest.approx(sum(present) / len(present), rel=1e-5)
    balanced = [sum(a) / len(a) for a in by_class]
    assert float(rows[0]["balanced_mean"]) == pytest.approx(sum(balanced) / 2, rel=1e-5)
    text = (report / "per_class.md").read_text()
    assert "| FedAvg | 1,2 |" in text and "training images" in text  # digits are images: named so
    assert "changed since the run" not in text
    assert "One method: nothing is compared or marked." in text and "Data: digits-offline" in text
    # the confusion figure of the method, with its PDF, from the counts confusion.csv holds
    assert {"confusion_fedavg.png", "confusion_fedavg.pdf"} <= {p.name for p in report.iterdir()}
    assert measured[0]["seed"] == 1 and measured[0]["samples"] == "images"
    capsys.readouterr()
    assert cli_main(["report", str(compare_folder), "per_class=maybe", "force=true"]) != 0
    error = capsys.readouterr().err.strip()
    assert "per_class='maybe' is not a boolean; use per_class=true" in error and "\n" not in error
    for wrong, said in (("tail_ratio=0.5", "tail_ratio=0.5 is not a number of at least 1"),
                        ("tail_ratio=two", "tail_ratio='two' is not a number of at least 1")):
        assert cli_main(["report", str(compare_folder), "per_class=true", wrong, "force=true"]) != 0
        error = capsys.readouterr().err.strip()
        assert said in error and "\n" not in error
    assert cli_main(["report", str(compare_folder), "tail_ratio=3"]) != 0
    assert "add per_class=true" in capsys.readouterr().err


@pytest.mark.slow
def test_a_model_changed_after_the_run_is_said_in_the_report(compare_folder, tmp_path):
    import shutil

    run = tmp_path / "fedavg-seed1"
    shutil.copytree(compare_folder / "fedavg-seed1", run)
    state = torch.load(run / "model.pt", weights_only=True)
    torch.save({k: torch.zeros_like(v) if v.is_floating_point() else v for k, v in state.items()}, run / "model.pt")
    report([run], out=tmp_path / "report", echo=False, class_accuracy=class_accuracy)
    assert "fedavg-seed1: re-tested at" in (tmp_path / "report" / "per_class.md").read_text()


@pytest.mark.slow
def test_a_run_without_its_model_files_is_refused_in_one_line(compare_folder, tmp_path):
    import shutil

    run = tmp_path / "fedavg-seed1"
    shutil.copytree(compare_folder / "fedavg-seed1", run)
    (run / "model.json").unlink()
    with pytest.raises(FedHProError) as error:
        report([run], out=tmp_path / "report", echo=False, class_accuracy=class_accuracy)
    assert "model.json" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_an_unfinished_run_is_left_out_of_the_per_class_tables_and_named(compare_folder, tmp_path):
    import shutil

    folder = tmp_path / "compare"
    shutil.copytree(compare_folder, folder, ignore=shutil.ignore_patterns("report"))
    (folder / "fedavg-seed2" / "summary.json").unlink()  # as a run still training looks
    report([folder], out=tmp_path / "report", echo=False, class_accuracy=class_accuracy)
    text = (tmp_path / "report" / "per_class.md").read_text()
    assert "left out, unfinished (no saved model yet): fedavg-seed2" in text and "| FedAvg | 1 |" in text
