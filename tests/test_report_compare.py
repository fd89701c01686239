"""Reports for people (issue 26, stumble 11): ``fedhpro report <compare folder>`` gives per-method mean curves with
a band over seeds and a table of means with their 95 % t-intervals; every curve is told apart by colour, line
style and marker; rounds get whole-number ticks.

The reference numbers are computed here by hand from the runs' summary.json and metrics.jsonl."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
from scipy import stats

from fedhpro.cli import main as cli_main
from fedhpro.errors import ConfigError
from tests.conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METHODS = ["fedavg", "fedprox"]
#: how table.md names them (the paper's spelling)
SHOWN = {"fedavg": "FedAvg", "fedprox": "FedProx"}
SEEDS = [0, 1]


@pytest.fixture(scope="module")
def compared(digits_data_dir, tmp_path_factory) -> Path:
    from fedhpro.compare import compare

    out = tmp_path_factory.mktemp("compare") / "cmp"
    settings = {"rounds": 2, "clients": 3, "local_epochs": 1, "feature_dim": 16, "progress": False, "threads": 1,
                "device": "cpu", "data_dir": str(digits_data_dir), "data.fraction": 0.02,
                "data.syn_size": DIGITS_SYN_SIZE, "data.test_fraction": DIGITS_TEST_FRACTION}
    compare(METHODS, SEEDS, settings, out, echo=False)
    return out


def summaries(folder: Path, method: str) -> list[dict]:
    return [json.loads((folder / f"{method}-seed{seed}" / "summary.json").read_text()) for seed in SEEDS]


def avg_curve(folder: Path, method: str, seed: int) -> dict[int, float]:
    lines = (folder / f"{method}-seed{seed}" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return {row["round"] + 1: row["accuracy"]["AVG"] for row in rows if "accuracy" in row}


@pytest.mark.slow
def test_report_of_a_compare_folder_is_the_mean_std_and_interval_over_seeds(compared, tmp_path):
    out = tmp_path / "report"
    assert cli_main(["report", str(compared), f"out={out}"]) == 0
    rows = {row["method"]: row for row in csv.DictReader((out / "table.csv").open())}
    assert sorted(rows) == METHODS
    for method in METHODS:
        runs = summaries(compared, method)
        row = rows[method]
        assert row["seeds"] == "0,1"
        accuracy = [s["accuracy"] for s in runs]
        assert float(row["AVG_mean"]) == pytest.approx(statistics.mean(accuracy), abs=5e-4)
        assert float(row["AVG_std"]) == pytest.approx(statistics.stdev(accuracy), abs=5e-4)
        for domain in runs[0]["per_domain"]:
            values = [s["per_domain"][domain] for s in runs]
            assert float(row[f"{domain}_mean"]) == pytest.approx(statistics.mean(values), abs=5e-4)
            assert float(row[f"{domain}_std"]) == pytest.approx(statistics.stdev(values), abs=5e-4)
        best = [max(avg_curve(compared, method, seed).values()) for seed in SEEDS]
        assert float(row["best AVG_mean"]) == pytest.approx(statistics.mean(best), abs=5e-4)
        markdown = (out / "table.md").read_text()
        half = stats.t.ppf(0.975, 1) * statistics.stdev(accuracy) / 2 ** 0.5  # the 95 % t-interval of 2 seeds
        mean = statistics.mean(accuracy)
        shown = f"{mean:.2f} [{mean - half:.2f}, {mean + half:.2f}]"
        assert f"| {SHOWN[method]} | 0,1 |" in markdown and shown in markdown
        assert "No significance test is possible with 2 shared seeds" in markdown
    png = (out / "accuracy.png").read_bytes()
    assert png[:8] == PNG_MAGIC
    from PIL import Image

    with Image.open(out / "accuracy.png") as image:
        image.verify()
    assert json.loads((out / "report.json").read_text())["runs"] == sorted(
        str((compared / f"{m}-seed{s}").resolve()) for m in METHODS for s in SEEDS)


@pytest.mark.slow
def test_the_default_out_is_the_compare_folders_report(compared):
    from fedhpro.reports.runs import report

    assert report([compared], echo=False, force=True) == compared / "report"
    assert (compared / "report" / "table.md").is_file()
    # the report folder inside the compare folder is not taken for a run on the next report
    assert report([compared], echo=False) == compared / "report"


@pytest.mark.slow
def test_mean_curves_band_and_integer_ticks(compared, tmp_path):
    from fedhpro.reports.plots import plot_mean_curves
    from fedhpro.reports.runs import accuracy_series, load_run

    groups = {m: [accuracy_series(load_run(compared / f"{m}-seed{s}")) for s in SEEDS] for m in METHODS}
    figure = plot_mean_curves(groups, tmp_path / "curves.png", ylabel="test accuracy (%)")
    axis = figure.axes[0]
    ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    lines = axis.get_lines()
    assert len(lines) == 2
    for line, method in zip(lines, METHODS):
        curves = [avg_curve(compared, method, seed) for seed in SEEDS]
        rounds = sorted(curves[0])
        assert list(line.get_xdata()) == rounds == [1, 2]
        assert list(line.get_ydata()) == pytest.approx([statistics.mean(c[r] for c in curves) for r in rounds])
    styles = {(line.get_color() if isinstance(line.get_color(), str) else tuple(line.get_color()),
               line.get_linestyle(), line.get_marker()) for line in lines}
    assert len({s[0] for s in styles}) == 2 and len({s[1] for s in styles}) == 2 and len({s[2] for s in styles}) == 2
    bands = [c for c in axis.collections]  # fill_between: one band per method, min to max over the seeds
    assert len(bands) == 2
    low_high = bands[0].get_paths()[0].vertices[:, 1]
    curves = [avg_curve(compared, METHODS[0], seed) for seed in SEEDS]
    assert min(low_high) == pytest.approx(min(min(c.values()) for c in curves))
    assert max(low_high) == pytest.approx(max(max(c.values()) for c in curves))


def test_run_report_lines_are_told_apart_and_ticks_are_whole_rounds(tmp_path):
    from fedhpro.reports.plots import plot_curves

    series = {f"run {i}": ([1, 2], [10.0, 20.0]) for i in range(10)}  # identical curves: only style tells them apart
    figure = plot_curves(series, tmp_path / "a.png", ylabel="accuracy")
    axis = figure.axes[0]
    ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    lines = axis.get_lines()
    colours = {tuple(line.get_color()) for line in lines}
    assert len(colours) == 10
    neighbours = list(zip(lines, lines[1:]))
    assert all(a.get_linestyle() != b.get_linestyle() and a.get_marker() != b.get_marker() for a, b in neighbours)
    assert len(axis.get_legend().get_texts()) == 10


def test_a_folder_without_runs_is_still_one_clear_error(tmp_path):
    from fedhpro.reports.runs import report

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a run folder.*out= folder of `fedhpro compare`"):
        report([tmp_path / "empty"], echo=False)


def test_ablation_groups_are_labelled_by_what_each_changes():
    """Among variants of one method, the value most of them share is the unchanged one: left out of the labels;
    a tie (two variants) shows the setting on both; runs of distinct methods are labelled by the method alone."""
    from fedhpro.reports.runs import RunData, run_labels

    def run(name: str, method: str, **options) -> RunData:
        base = {"hpal_weight": 1.0, "match_steps": 30, "hyper_init": "gaussian"}
        own = {"lambda1": 0.1} if method == "fedsa" else {**base, **options}
        return RunData(Path(name), {"method": method, "lr": 0.01, method: own, "out": name}, [], None)

    runs = [run("a", "fedavg"), run("b", "fedhpro"), run("c", "fedhpro", match_steps=0),
            run("d", "fedhpro", hpal_weight=0.0), run("e", "fedhpro", hyper_init="simplex"),
            run("f", "fedsa")]
    assert run_labels(runs) == ["fedavg", "fedhpro", "fedhpro match_steps=0", "fedhpro hpal_weight=0.0",
                                "fedhpro hyper_init=simplex", "fedsa"]
    assert run_labels(runs[1:3]) == ["fedhpro match_steps=30", "fedhpro match_steps=0"]
    assert run_labels([runs[0], runs[5]]) == ["fedavg", "fedsa"]


def test_the_seed_table_shows_how_far_matching_moved_the_hyper_prototypes():
    """FedHPro's last logged hyper_movement, in percent, mean ± std over seeds (hand values); "–" for a method
    without one; no such column when no run logged it."""
    from fedhpro.reports.runs import MOVEMENT, RunData, seed_table

    def run(method: str, seed: int, moved: list[float] | None) -> RunData:
        rows = [{"round": r, "accuracy": {"AVG": 50.0 + r}, "server": {} if moved is None else
                 {"hyper_movement": moved[r]}} for r in range(2)]
        return RunData(Path(f"{method}-seed{seed}"), {"method": method, "seed": seed}, rows, {})

    groups = {"fedhpro": [run("fedhpro", 0, [0.001, 0.004]), run("fedhpro", 1, [0.002, 0.006])],
              "fedavg": [run("fedavg", 0, None), run("fedavg", 1, None)]}
    header, markdown, table, _ = seed_table(groups)
    assert header[-2] == MOVEMENT
    half = stats.t.ppf(0.975, 1) * statistics.stdev([0.4, 0.6]) / 2 ** 0.5
    assert markdown[0][-2] == f"{0.5:.2f} [{0.5 - half:.2f}, {0.5 + half:.2f}]" and markdown[1][-2] == "–"
    header, _, _, _ = seed_table({"fedavg": groups["fedavg"]})
    assert MOVEMENT not in header
