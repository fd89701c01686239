"""The CPU-scale studies as ``fedhpro reproduce`` targets (once scripts in ``bench/``): ``label_skew``,
``gradient_matching``, ``robustness`` and ``faithfulness``, each reproduced at ``scale=smoke`` on the tests'
small digits-offline build, checking their tables and CSV columns; and a robustness run that diverges counted
as diverged instead of stopping the reproduction."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest

from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from fedhpro import reproduce as R
from fedhpro.reproduce.studies import robustness_cell

STUDIES = ("label_skew", "gradient_matching", "robustness", "faithfulness")


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("studies")


def smoke(name: str, out: Path, data_dir: Path) -> tuple[str, list[dict[str, str]], list[str]]:
    """Reproduce ``name`` at scale=smoke on the tests' digits build: its table.md, table.csv rows and header."""
    overrides = {"data_dir": str(data_dir), "data.syn_size": DIGITS_SYN_SIZE,
                 "data.test_fraction": DIGITS_TEST_FRACTION}
    folder = R.reproduce(name, "smoke", out=out, overrides=overrides, echo=False)
    text = (folder / "table.csv").read_text()
    return (folder / "table.md").read_text(), list(csv.DictReader(io.StringIO(text))), text.splitlines()[0].split(",")


def test_the_studies_are_targets_with_their_paper_numbers_as_data():
    assert set(STUDIES) <= set(R.available_targets())
    paper = R.load_target("label_skew").parts[0].paper
    assert paper["fedhpro"] == [85.98, 89.56, 79.70, 64.75] and len(paper) == 9
    assert len(R.load_target("label_skew", "smoke").parts[0].scenarios) < 4  # smoke: fewer scenarios
    assert [s.label for s in R.load_target("robustness").parts[0].scenarios][0] == "clean-mean"


@pytest.mark.slow
def test_label_skew_table_and_csv(out, digits_data_dir):
    table, rows, header = smoke("label_skew", out, digits_data_dir)
    assert "| Methods | NID1_0.2 (Δ) | paper Δ | NID2 (Δ) | paper Δ |" in table
    assert "| fedhpro | " in table and "+5.39" in table  # FedHPro's published Δ at NID1_0.2 (85.98 - 80.59)
    tests = ["ci_low", "ci_high", "p_vs_first_row", "p_vs_first_row_holm", "mark"]
    assert header == ["method", *(f"{s} {c}" for s in ("NID1_0.2", "NID2") for c in ["mean", "std", "runs", *tests])]
    assert "No significance test is possible with 1 shared seed" in table  # smoke: one seed, nothing marked
    assert [r["method"] for r in rows][:2] == ["fedavg", "fedprox"] and len(rows) == 9
    assert all(0.0 <= float(r["NID2 mean"]) <= 100.0 and r["NID2 runs"] == "1" for r in rows)


@pytest.mark.slow
def test_gradient_matching_table_and_csv(out, digits_data_dir):
    table, rows, header = smoke("gradient_matching", out, digits_data_dir)
    assert header == ["setting", "variant", "seed", "accuracy", "accuracy_last3", "gm_loss_before", "gm_loss_after",
                      "hyper_movement", "distance_l2", "distance_unit", "clients_mean_unit"]
    assert "| NID1_0.1 | learned (M=30) |" in table and "| NID1_0.1, adam | frozen (M=0) |" in table
    frozen = [r for r in rows if r["variant"] == "frozen"]
    assert len(rows) == 4 and float(frozen[0]["hyper_movement"]) == 0.0
    assert frozen[0]["accuracy"] == frozen[1]["accuracy"]  # adam's frozen runs are NID1_0.1's (same folder)
    assert len(list((out / "runs").glob("fedhpro-*-seed0"))) >= 3


@pytest.mark.slow
def test_robustness_table_and_csv(out, digits_data_dir):
    table, rows, header = smoke("robustness", out, digits_data_dir)
    assert header == ["method", "attack", "clean (mean)", "mean", "median", "trimmed-mean", "norm-clip"]
    assert [(r["method"], r["attack"]) for r in rows] == [(m, a) for m in ("fedavg", "fedhpro")
                                                          for a in ("none", "scale", "sign-flip")]
    scale = rows[1]
    assert scale["mean"] == "–" and float(scale["median"]) >= 0 and float(scale["clean (mean)"]) >= 0  # one seed
    assert "| fedhpro | sign-flip |" in table


@pytest.mark.slow
def test_a_study_table_is_rebuilt_from_its_run_folders(out, digits_data_dir, tmp_path, capsys):
    """Reproducing again reuses every run and writes the same CSV; ``fedhpro report`` reads the same folders."""
    from fedhpro.reports.runs import report

    first = smoke("robustness", out, digits_data_dir)
    capsys.readouterr()
    overrides = {"data_dir": str(digits_data_dir), "data.syn_size": DIGITS_SYN_SIZE,
                 "data.test_fraction": DIGITS_TEST_FRACTION}
    folder = R.reproduce("robustness", "smoke", out=out, overrides=overrides)
    printed = capsys.readouterr().out
    assert printed.count("reused") == 6 and "AVG" not in printed.split("# Robustness")[0]
    assert list(csv.DictReader(io.StringIO((folder / "table.csv").read_text()))) == first[1]
    runs = sorted(str(p) for p in (out / "runs").glob("fedavg-*-seed0"))
    written = report(runs, tmp_path / "report", echo=False)
    assert (written / "table.md").is_file() and (written / "table.csv").is_file()


@pytest.mark.slow
def test_faithfulness_table_and_csv(out, digits_data_dir):
    table, rows, header = smoke("faithfulness", out, digits_data_dir)
    assert header == ["variant", "seed", "mnist", "optdigits", "mnistm", "syn", "AVG", "seconds"]
    assert "| variant | mnist | optdigits | mnistm | syn | AVG | seconds/run |" in table
    assert len(rows) == 9 and rows[-1]["variant"] == "fedavg recipe=authors"


@pytest.mark.slow
def test_a_run_that_diverges_is_kept_and_counted_and_a_bad_setting_still_stops(out, digits_data_dir, monkeypatch):
    """run_part(tolerate_diverged=True): "every client failed" stops that run only; a ConfigError stops all."""
    import fedhpro.api
    from fedhpro.errors import ConfigError, FedHProError

    real = fedhpro.api.run_or_continue

    def scaled_runs_diverge(config, folder):
        if config.to_dict().get("faults", {}).get("scale"):
            raise FedHProError("round 0: every client failed; client 1 sent non-finite values")
        return real(config, folder)

    monkeypatch.setattr(fedhpro.api, "run_or_continue", scaled_runs_diverge)
    target = R.load_target("robustness", "smoke")
    part = target.parts[0]
    part.scenarios = part.scenarios[:2]  # clean-mean and scale-median
    settings = {**target.settings, **part.settings, "data_dir": str(digits_data_dir),
                "data.syn_size": DIGITS_SYN_SIZE, "data.test_fraction": DIGITS_TEST_FRACTION}
    result = R.run_part(part, settings, "", {}, [0], out / "diverging", echo=False, tolerate_diverged=True)
    table = R.build_table(target, [result])
    assert table.csv_rows[1][:4] == ["fedavg", "scale", table.csv_rows[0][2], "–"]
    assert table.csv_rows[1][4] == "diverged (1/1)"
    monkeypatch.setattr(fedhpro.api, "run_or_continue", lambda config, folder: (_ for _ in ()).throw(
        ConfigError("bad setting")))
    with pytest.raises(ConfigError, match="bad setting"):
        R.run_part(part, settings, "", {}, [1], out / "diverging", echo=False, tolerate_diverged=True)


def test_a_diverged_robustness_run_is_counted_not_fatal():
    finished = R.RunData(Path("a"), {"seed": 0}, [], {"accuracy": 50.0})
    stopped = R.RunData(Path("b"), {"seed": 1}, [], None)
    assert robustness_cell([finished, finished, stopped]) == "50.00 [50.00, 50.00] (1 of 3 diverged)"
    assert robustness_cell([stopped, stopped]) == "diverged (2/2)"
    assert robustness_cell(None) == "–"
