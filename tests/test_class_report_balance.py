"""The per-class report's head / tail groups and its verdicts, on hand-made re-test counts (no runs).

References independent of the code under test: the class groups and their means computed by hand, the
intervals and the paired tests by ``scipy.stats`` here, Holm's correction written out for two comparisons."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

import fedhpro.methods  # noqa: F401  (registers the methods: FedSA is shown as the paper writes it)
from fedhpro.errors import ConfigError
from fedhpro.reports.classes import class_split, write_class_report

TOTAL = 200  # test samples per class: accuracies in steps of 0.5 %


def measured(correct, counts, samples=None, seed=None) -> dict:
    """A re-test's counts: one test set holding TOTAL samples of each class, ``correct[c]`` of them right."""
    out = {"train_counts": list(counts), "classes": None, "accuracy": {"AVG": 0.0}, "reported": None,
           "test_sets": {"all": {"correct": [int(v) for v in correct], "total": [TOTAL] * len(counts)}}}
    if samples is not None:
        out["samples"] = samples
    if seed is not None:
        out["seed"] = seed
    return out


def rows_of(folder: Path) -> dict[str, dict[str, str]]:
    return {row["method"]: row for row in csv.DictReader(io.StringIO((folder / "per_class.csv").read_text()))}


def test_a_balanced_split_reports_no_tail(tmp_path):
    """321 against 320 training images a class: before, the three classes of 320 were "the tail" and the
    report compared methods on them as on a finding."""
    counts = [321] * 7 + [320] * 3
    correct = [190, 180, 170, 160, 150, 140, 130, 60, 50, 40]
    write_class_report(tmp_path, {"fedavg": [(tmp_path / "fedavg-seed1", measured(correct, counts))]}, echo=False)
    text = (tmp_path / "per_class.md").read_text()
    assert "the classes are balanced: 320 to 321 training samples a class" in text
    assert "tail" not in text.split("the classes are balanced")[0] and "| tail" not in text and "head (" not in text
    row = rows_of(tmp_path)["fedavg"]
    assert "tail_mean" not in row and "head_mean" not in row
    assert float(row["balanced_mean"]) == pytest.approx(np.mean(correct) / TOTAL * 100)
    assert class_split(counts) is None
    # two classes, one 100x the other: not "balanced", only too few classes for groups
    write_class_report(tmp_path, {"fedavg": [(tmp_path / "fedavg-seed1", measured([150, 20], [1000, 10]))]},
                       echo=False)
    text = (tmp_path / "per_class.md").read_text()
    assert "2 classes: too few for head, middle and tail groups" in text and "balanced:" not in text


def test_an_imbalanced_split_keeps_its_hand_computed_groups(tmp_path):
    counts = [640, 600, 500, 400, 350, 330, 325, 322, 321, 320]  # the largest exactly 2x the smallest
    assert class_split(counts) == ([0, 1, 2], [3, 4, 5, 6], [7, 8, 9])
    assert class_split([639] + counts[1:]) is None  # just under 2x: balanced
    assert class_split(counts, tail_ratio=3) is None
    correct = [190, 180, 170, 160, 150, 140, 130, 60, 50, 40]
    write_class_report(tmp_path, {"fedavg": [(tmp_path / "fedavg-seed1", measured(correct, counts, "rows"))]},
                       echo=False)
    row = rows_of(tmp_path)["fedavg"]
    assert float(row["head_mean"]) == pytest.approx((95 + 90 + 85) / 3)
    assert float(row["middle_mean"]) == pytest.approx((80 + 75 + 70 + 65) / 4)
    assert float(row["tail_mean"]) == pytest.approx((30 + 25 + 20) / 3)
    text = (tmp_path / "per_class.md").read_text()
    assert "| method | seeds | balanced accuracy | head (3 classes) | middle (4 classes) | tail (3 classes) |" in text
    # tabular data: its rows, never "images"; every column named in the caption
    assert "training rows" in text and "images" not in text
    assert "largest class has 640 training rows, at least 2x the smallest's 320" in text
    assert "| 0 | 640 | 95.0 |" in text  # the per-class table: a row per class, largest first
    write_class_report(tmp_path, {"fedavg": [(tmp_path / "fedavg-seed1", measured(correct, counts))]},
                       echo=False, tail_ratio=3)
    assert "the classes are balanced: 320 to 640 training samples a class" in (tmp_path / "per_class.md").read_text()
    with pytest.raises(ConfigError) as error:
        write_class_report(tmp_path, {"fedavg": [(tmp_path / "x", measured(correct, counts))]}, tail_ratio=0.5)
    assert "tail_ratio=0.5" in str(error.value) and "\n" not in str(error.value)


COUNTS = [900, 800, 700, 300, 250, 200, 150, 60, 50, 40]
SEEDS = [0, 1, 2, 3, 4]


def accuracies() -> dict[str, np.ndarray]:
    """Per method a seeds x classes array of correct counts: FedSA about 20 points better than FedAvg on the
    tail classes on every seed (by a different amount), FedProx FedAvg plus noise."""
    rng = np.random.default_rng(7)
    fedavg = rng.integers(100, 160, size=(len(SEEDS), len(COUNTS)))
    fedsa = fedavg + rng.integers(-6, 7, size=fedavg.shape)
    fedsa[:, 7:] = fedavg[:, 7:] + 40 + rng.integers(-8, 9, size=(len(SEEDS), 3))
    fedprox = fedavg + rng.integers(-10, 11, size=fedavg.shape)
    return {"fedavg": fedavg, "fedsa": fedsa, "fedprox": fedprox}


def expected_marks(per_seed: dict[str, np.ndarray]) -> dict[str, str]:
    """The marks by hand: FedAvg the baseline, each other method's paired t-test against it (scipy), Holm over
    the two; the top mean's tests against the other two, Holm over the two, best only when both hold."""
    def holm_two(p: dict[str, float]) -> dict[str, float]:
        (a, pa), (b, pb) = sorted(p.items(), key=lambda item: (item[1], item[0]))
        return {a: min(1.0, 2 * pa), b: max(min(1.0, 2 * pa), min(1.0, pb))}

    marks = {name: "" for name in per_seed}
    against = holm_two({name: stats.ttest_rel(per_seed[name], per_seed["fedavg"]).pvalue
                        for name in ("fedsa", "fedprox")})
    top = max(per_seed, key=lambda name: per_seed[name].mean())
    versus = holm_two({name: stats.ttest_rel(per_seed[top], per_seed[name]).pvalue for name in per_seed
                       if name != top})
    if all(p <= 0.05 and per_seed[top].mean() > per_seed[name].mean() for name, p in versus.items()):
        marks[top] += "★"
    for name, p in against.items():
        if p <= 0.05:
            marks[name] += "▲" if per_seed[name].mean() > per_seed["fedavg"].mean() else "▼"
    return marks


def report_of(tmp_path: Path, seeds: list[int]) -> Path:
    counts = accuracies()
    groups = {name: [(tmp_path / f"{name}-seed{s}", measured(counts[name][s], COUNTS, "images", seed=s))
                     for s in seeds] for name in ("fedavg", "fedsa", "fedprox")}
    out = tmp_path / f"report-{len(seeds)}"
    out.mkdir()
    write_class_report(out, groups, echo=False)
    return out


def test_marks_and_intervals_per_class_group_follow_scipy_over_five_seeds_and_none_over_two(tmp_path):
    correct = accuracies()
    out = report_of(tmp_path, SEEDS)
    rows = rows_of(out)
    percent = {name: correct[name] / TOTAL * 100 for name in correct}
    for group, classes in (("head", [0, 1, 2]), ("tail", [7, 8, 9]), ("balanced", list(range(10)))):
        per_seed = {name: values[:, classes].mean(1) for name, values in percent.items()}
        marks = expected_marks(per_seed)
        for name, values in per_seed.items():
            assert rows[name][f"{group}_mark"] == marks[name], (group, name)
            low, high = stats.t.interval(0.95, len(values) - 1, loc=values.mean(), scale=stats.sem(values))
            assert float(rows[name][f"{group}_low"]) == pytest.approx(low, rel=1e-5)
            assert float(rows[name][f"{group}_high"]) == pytest.approx(high, rel=1e-5)
        if group == "tail":
            assert marks["fedsa"] == "★▲"  # the verdict the hand-picked numbers were made for
    for c in range(10):  # each class its own test
        marks = expected_marks({name: values[:, c] for name, values in percent.items()})
        assert [rows[name][f"class_{c}_mark"] for name in percent] == [marks[name] for name in percent]
    text = (out / "per_class.md").read_text()
    assert "paired t-tests (scipy.stats.ttest_rel) over the 5 seeds every row shares (0, 1, 2, 3, 4)" in text
    assert "Each class is tested on its own: the correction is across the methods compared within it" in text
    assert "| FedSA | 0,1,2,3,4 |" in text and "★▲" in text

    # two shared seeds: the same numbers, no test and nothing marked
    few = report_of(tmp_path, SEEDS[:2])
    text = (few / "per_class.md").read_text()
    assert "No significance test is possible with 2 shared seeds" in text
    assert not any(mark in text for mark in "★▲▼")
    assert all(not value for row in rows_of(few).values() for key, value in row.items() if key.endswith("_mark"))


def test_what_a_runs_examples_are_called_comes_from_its_model_json():
    from fedhpro.trained.evaluation import samples_kind

    assert samples_kind({"input_shape": [13], "input": {"kind": "tensor", "shape": [13], "dtype": "float32"}}) == "rows"
    assert samples_kind({"input_shape": [3, 32, 32], "input": {"kind": "image", "size": 32}}) == "images"
    assert samples_kind({"input_shape": [1, 28, 28], "input": {"kind": "tensor", "dtype": "float32"}}) == "images"
    assert samples_kind({"input_shape": [64], "input": {"kind": "tensor", "dtype": "int64"}}) == "sequences"
    assert samples_kind({"input_shape": [4, 4], "input": {"kind": "tensor", "dtype": "float32"}}) == "samples"
