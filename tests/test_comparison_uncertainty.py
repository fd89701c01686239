"""Every comparison table says whether a difference is real: each mean with its 95 % t-interval over the seeds, a
method marked best, or better / worse than FedAvg, only when two-sided paired t-tests over the shared seeds say so
after Holm's correction, and no mark with fewer than 3 shared seeds.

The references are computed here with scipy, independently, from the per-seed numbers each run wrote
(``summary.json``; ``metrics.jsonl`` for the report), and Holm's correction by hand. Real runs (tiny: 1 round of
4 clients) for compare and its report; the comparisons with hand-picked numbers do not train
(``fedhpro.api.run_or_continue`` is replaced by :func:`fake_run`, which writes a run folder as a run does)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from scipy import stats

from fake_runs import finished_run_writer

import fedhpro.methods  # noqa: F401 - the registry that names the methods
from fedhpro import api
from fedhpro.compare import compare
from fedhpro.reports.runs import report

pytestmark = pytest.mark.slow

SEEDS = [0, 1, 2]
#: the rows: FedAvg at two learning rates (a grid), the first its baseline; their numbers differ by seed
ROWS = ["fedavg lr=0.01", "fedavg lr=0.1"]


def settings(data_dir: Path) -> dict:
    return {"rounds": 1, "clients": 4, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
            "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 16, "local_epochs": 1,
            "progress": False, "device": "cpu", "data_dir": str(data_dir), "data.domains": ["mnist", "syn"],
            "lr": [0.01, 0.1]}


@pytest.fixture(scope="module")
def compared(digits_data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uncertainty") / "cmp"
    compare(["fedavg"], SEEDS, settings(digits_data_dir), out, echo=False)
    report([out], echo=False)
    return out


def csv_rows(path: Path, key: str = "method") -> dict[str, dict[str, str]]:
    with path.open(encoding="utf-8") as handle:
        return {row[key]: row for row in csv.DictReader(handle)}


def per_seed(out: Path, row: str, seeds=SEEDS) -> list[float]:
    folder = row.replace(" ", "-")
    return [json.loads((out / f"{folder}-seed{seed}" / "summary.json").read_text())["accuracy"] for seed in seeds]


def scipy_interval(values: list[float]) -> tuple[float, float]:
    """scipy's 95 % t-interval of the mean, cut to 0..100 (an accuracy's mean cannot leave it)."""
    low, high = stats.t.interval(0.95, len(values) - 1, loc=stats.tmean(values), scale=stats.sem(values))
    return max(low, 0.0), min(high, 100.0)


def check_against_scipy(row: dict[str, str], values: list[float], base: list[float] | None, digits: float) -> None:
    low, high = scipy_interval(values)
    assert float(row["AVG_ci_low"]) == pytest.approx(low, abs=digits)
    assert float(row["AVG_ci_high"]) == pytest.approx(high, abs=digits)
    if base is None:
        assert row["AVG_p_vs_baseline"] == row["AVG_p_vs_baseline_holm"] == ""
        return
    p = stats.ttest_rel(values, base).pvalue
    assert float(row["AVG_p_vs_baseline"]) == pytest.approx(p, rel=1e-5)
    assert float(row["AVG_p_vs_baseline_holm"]) == pytest.approx(p, rel=1e-5)  # one comparison: Holm is p
    against_baseline = "" if p > 0.05 else ("▲" if sum(values) > sum(base) else "▼")
    assert row["AVG_mark"].removeprefix("★") == against_baseline


def test_compare_table_intervals_and_p_values_are_scipys_on_the_runs_numbers(compared):
    rows = csv_rows(compared / "table.csv")
    base, other = per_seed(compared, ROWS[0]), per_seed(compared, ROWS[1])
    assert len({b - o for b, o in zip(base, other)}) > 1  # differences that vary: a t-test with a spread
    check_against_scipy(rows[ROWS[0]], base, None, 5e-5)
    check_against_scipy(rows[ROWS[1]], other, base, 5e-5)
    for domain in ("mnist", "syn"):  # the domain columns: intervals too
        values = [json.loads((compared / f"fedavg-lr=0.1-seed{seed}" / "summary.json").read_text())["per_domain"][
            domain] for seed in SEEDS]
        low, high = scipy_interval(values) if len(set(values)) > 1 else (values[0], values[0])
        assert float(rows[ROWS[1]][f"{domain}_ci_low"]) == pytest.approx(low, abs=5e-5)
        assert float(rows[ROWS[1]][f"{domain}_ci_high"]) == pytest.approx(high, abs=5e-5)
    markdown = (compared / "table.md").read_text()
    low, high = scipy_interval(other)
    assert "| FedAvg lr=0.1 | " in markdown and f"{stats.tmean(other):.2f} [{low:.2f}, {high:.2f}]" in markdown
    assert "paired t-tests (scipy.stats.ttest_rel) over the 3 seeds every row shares (0, 1, 2), alpha = 0.05, " \
           "Holm's correction" in markdown
    assert "better/worse than FedAvg lr=0.01" in markdown and "Tested: the AVG column" in markdown


def test_the_report_over_seeds_has_the_same_intervals_and_tests(compared):
    rows = csv_rows(compared / "report" / "table.csv")
    base, other = per_seed(compared, ROWS[0]), per_seed(compared, ROWS[1])
    check_against_scipy(rows[ROWS[0]], base, None, 1e-4)
    check_against_scipy(rows[ROWS[1]], other, base, 1e-4)
    best = [max(json.loads(line)["accuracy"]["AVG"] for line in
                (compared / f"fedavg-lr=0.1-seed{seed}" / "metrics.jsonl").read_text().splitlines()
                if "accuracy" in json.loads(line)) for seed in SEEDS]
    low, high = scipy_interval(best)
    assert float(rows[ROWS[1]]["best AVG_ci_low"]) == pytest.approx(low, abs=1e-4)
    assert float(rows[ROWS[1]]["best AVG_ci_high"]) == pytest.approx(high, abs=1e-4)
    markdown = (compared / "report" / "table.md").read_text()
    assert "over the 3 seeds every row shares (0, 1, 2)" in markdown and "Holm's correction across the groups" \
        in markdown
    assert "worst 10%: the mean accuracy of the tenth of clients" in markdown  # every column explained


# ---------------------------------------------------------------------------------------------------------------
# hand-picked numbers: what is marked, and when

#: each method's final AVG per seed, chosen so that FedHPro beats FedAvg on every seed by a varying margin, and
#: FedProx is FedAvg's twin plus noise
ACCURACY = {"fedavg": [50.0, 54.0, 52.0, 51.0, 53.0],
            "fedprox": [50.5, 53.0, 52.5, 51.5, 52.0],
            "fedhpro": [55.0, 58.0, 58.5, 55.5, 57.5]}


fake_run = finished_run_writer(ACCURACY)


@pytest.fixture()
def no_training(monkeypatch):
    monkeypatch.setattr(api, "run_or_continue", fake_run)


HAND = {"rounds": 2, "progress": False}


def holm_by_hand(p: dict[str, float]) -> dict[str, float]:
    """Holm's adjusted p values of two hypotheses, written out: the smaller times 2, the larger times 1 but never
    below the smaller's adjusted value."""
    low, high = sorted(p, key=p.get)
    first = min(1.0, 2 * p[low])
    return {low: first, high: max(first, min(1.0, p[high]))}


def test_the_verdict_appears_with_5_seeds_and_not_with_2(no_training, tmp_path):
    methods = ["fedavg", "fedprox", "fedhpro"]
    compare(methods, [0, 1], HAND, tmp_path / "two", echo=False)
    two = (tmp_path / "two" / "table.md").read_text()
    assert "No significance test is possible with 2 shared seeds" in two
    assert not any(mark in two for mark in "★▲▼")
    assert all(row["AVG_mark"] == "" and row["AVG_p_vs_baseline"] == ""
               for row in csv_rows(tmp_path / "two" / "table.csv").values())

    seeds = [0, 1, 2, 3, 4]
    compare(methods, seeds, HAND, tmp_path / "five", echo=False)
    rows = csv_rows(tmp_path / "five" / "table.csv")
    base = ACCURACY["fedavg"]
    raw = {method: stats.ttest_rel(ACCURACY[method], base).pvalue for method in ("fedprox", "fedhpro")}
    adjusted = holm_by_hand(raw)
    for method in ("fedprox", "fedhpro"):
        assert float(rows[method]["AVG_p_vs_baseline"]) == pytest.approx(raw[method], rel=1e-5)
        assert float(rows[method]["AVG_p_vs_baseline_holm"]) == pytest.approx(adjusted[method], rel=1e-5)
    assert adjusted["fedhpro"] < 0.05 < adjusted["fedprox"]  # the numbers were picked for this
    # FedHPro against each other row, Holm across the two: best only when both are below alpha
    against = holm_by_hand({m: stats.ttest_rel(ACCURACY["fedhpro"], ACCURACY[m]).pvalue for m in ("fedavg", "fedprox")})
    assert max(against.values()) < 0.05
    assert rows["fedhpro"]["AVG_mark"] == "★▲" and rows["fedprox"]["AVG_mark"] == rows["fedavg"]["AVG_mark"] == ""
    five = (tmp_path / "five" / "table.md").read_text()
    low, high = scipy_interval(ACCURACY["fedhpro"])
    assert f"| FedHPro | {stats.tmean(ACCURACY['fedhpro']):.2f} [{low:.2f}, {high:.2f}] ★▲ |" in five
    assert "over the 5 seeds every row shares (0, 1, 2, 3, 4)" in five

    out = report([tmp_path / "five"], echo=False)  # the report over seeds marks the same
    assert {m: row["AVG_mark"] for m, row in csv_rows(out / "table.csv").items()} == {
        "fedavg": "", "fedprox": "", "fedhpro": "★▲"}
    assert "★▲" in (out / "table.md").read_text()


def test_only_the_seeds_every_row_shares_are_paired(no_training, tmp_path):
    """FedAvg on seeds 0-4, FedHPro on 0-2 (a comparison cut short): the test pairs the 3 shared seeds only."""
    compare(["fedavg"], [0, 1, 2, 3, 4], HAND, tmp_path / "cmp", echo=False)
    compare(["fedhpro"], [0, 1, 2], HAND, tmp_path / "cmp2", echo=False)
    for seed in (0, 1, 2):
        (tmp_path / "cmp2" / f"fedhpro-seed{seed}").rename(tmp_path / "cmp" / f"fedhpro-seed{seed}")
    out = report([tmp_path / "cmp"], echo=False)
    rows = csv_rows(out / "table.csv")
    p = stats.ttest_rel(ACCURACY["fedhpro"][:3], ACCURACY["fedavg"][:3]).pvalue
    assert float(rows["fedhpro"]["AVG_p_vs_baseline"]) == pytest.approx(p, rel=1e-5)
    low, high = scipy_interval(ACCURACY["fedavg"])  # the interval: over the row's own 5 seeds
    assert float(rows["fedavg"]["AVG_ci_low"]) == pytest.approx(low, abs=1e-4)
    assert float(rows["fedavg"]["AVG_ci_high"]) == pytest.approx(high, abs=1e-4)
    assert "over the 3 seeds every row shares (0, 1, 2)" in (out / "table.md").read_text()
