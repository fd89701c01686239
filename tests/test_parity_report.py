"""The float32-against-bf16 parity table of ``fedhpro report``: comparison folders that differ only in precision
(``amp``, ``channels_last``) are paired per setting; per pair the mean ± sample std over the seeds on each
side, the difference of means, the larger seed std and the verdict (within when |difference| <= that std).

The study here is tiny and real: two settings (the default run and ``lr=0.05``, named by their folders
``default`` and ``faster``) at both precisions, 2 seeds, one round on a small digits-offline. On a CPU without
native bfloat16 (``fedhpro run`` refuses ``amp=bf16`` there) the bf16 folders are the float32 runs copied with
their ``config.yaml`` saying ``amp: bf16`` and their summary.json's ``machine`` block ``precision: bf16``: what
the report reads to tell the precisions apart. The expected numbers are computed here from the runs'
summary.json (or set by hand), never by the report's code.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
import statistics
from pathlib import Path

import pytest
import yaml
from scipy import stats

from fedhpro.cli import main as cli_main
from fedhpro.errors import ConfigError
from fedhpro.reports.run_data import RunData
from fedhpro.reports.runs import report
from fedhpro.runtime import cpu_features
from tests.conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

ROOT = Path(__file__).resolve().parents[1]
SEEDS = [0, 1]
#: the study's settings: folder name -> overrides of the tiny base run
SETTINGS = {"default": {}, "faster": {"lr": 0.05}}
PRECISIONS = {"float32": "off", "bf16": "bf16"}
NATIVE_BF16 = cpu_features().native_bf16


def base_settings(data_dir: Path) -> dict:
    return {"rounds": 1, "clients": 3, "local_epochs": 1, "feature_dim": 16, "progress": False, "threads": 1,
            "device": "cpu", "data_dir": str(data_dir), "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
            "data.test_fraction": DIGITS_TEST_FRACTION}


def fake_bf16(float32: Path, bf16: Path) -> None:
    """The float32 comparison folder copied as a bf16 one (for a CPU that cannot train in bf16): each run's
    config.yaml says amp: bf16 and its summary.json's machine block precision bf16, channels_last."""
    shutil.copytree(float32, bf16)
    for run in bf16.glob("fedhpro-seed*"):
        config = yaml.safe_load((run / "config.yaml").read_text())
        config.update(amp="bf16", out=str(run))
        (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        summary = json.loads((run / "summary.json").read_text())
        summary["machine"].update(precision="bf16", memory_format="channels_last")
        (run / "summary.json").write_text(json.dumps(summary))


@pytest.fixture(scope="module")
def study(digits_data_dir, tmp_path_factory) -> Path:
    """``<root>/<setting>/<precision>/``: one ``fedhpro compare methods=[fedhpro] seeds=[0,1]`` folder each."""
    from fedhpro.compare import compare

    root = tmp_path_factory.mktemp("parity") / "study"
    for name, overrides in SETTINGS.items():
        settings = {**base_settings(digits_data_dir), **overrides}
        compare(["fedhpro"], SEEDS, {**settings, "amp": "off"}, root / name / "float32", echo=False)
        if NATIVE_BF16:
            compare(["fedhpro"], SEEDS, {**settings, "amp": "bf16"}, root / name / "bf16", echo=False)
        else:
            fake_bf16(root / name / "float32", root / name / "bf16")
    return root


def summaries(folder: Path) -> list[dict]:
    return [json.loads((folder / f"fedhpro-seed{seed}" / "summary.json").read_text()) for seed in SEEDS]


def parity_rows(out: Path) -> dict[tuple[str, str], dict]:
    return {(row["setting"], row["measure"]): row for row in csv.DictReader((out / "parity.csv").open())}


@pytest.mark.slow
def test_parity_of_a_study_folder_is_the_hand_computed_mean_std_difference_and_verdict(study, tmp_path):
    out = tmp_path / "report"
    assert cli_main(["report", str(study), f"out={out}"]) == 0
    rows = parity_rows(out)
    assert {setting for setting, _ in rows} == set(SETTINGS)
    markdown = (out / "parity.md").read_text()
    for name in SETTINGS:
        float32, bf16 = summaries(study / name / "float32"), summaries(study / name / "bf16")
        assert all(s["machine"]["precision"] == "float32" for s in float32)
        assert all(s["machine"]["precision"] == "bf16" for s in bf16)
        for measure in ["AVG"] + list(float32[0]["per_domain"]):
            on32, on16 = ([s["accuracy"] if measure == "AVG" else s["per_domain"][measure] for s in runs]
                          for runs in (float32, bf16))
            mean32, std32 = statistics.mean(on32), statistics.stdev(on32)
            mean16, std16 = statistics.mean(on16), statistics.stdev(on16)
            difference, larger = mean16 - mean32, max(std32, std16)
            row = rows[(name, measure)]
            assert (row["reference"], row["compared"]) == ("float32", "bf16")
            assert row["reference_seeds"] == row["compared_seeds"] == "0,1"
            assert float(row["reference_mean"]) == pytest.approx(mean32, abs=5e-4)
            assert float(row["reference_std"]) == pytest.approx(std32, abs=5e-4)
            assert float(row["compared_mean"]) == pytest.approx(mean16, abs=5e-4)
            assert float(row["compared_std"]) == pytest.approx(std16, abs=5e-4)
            assert float(row["difference"]) == pytest.approx(difference, abs=5e-4)
            assert float(row["larger_std"]) == pytest.approx(larger, abs=5e-4)
            assert row["verdict"] == ("within" if abs(difference) <= larger else "outside")
        avg32, avg16 = [s["accuracy"] for s in float32], [s["accuracy"] for s in bf16]
        assert (f"| {name} | 0,1 | {statistics.mean(avg32):.2f} ± {statistics.stdev(avg32):.2f} | "
                f"{statistics.mean(avg16):.2f} ± {statistics.stdev(avg16):.2f} |") in markdown
    record = json.loads((out / "parity.json").read_text())
    assert [pair["setting"] for pair in record["pairs"]] == list(SETTINGS)
    assert record["pairs"][0]["compared"]["amp"] == "bf16" and record["pairs"][0]["reference"]["amp"] == "off"
    assert record["left_out"] == []
    assert (out / "table.md").is_file()  # the seed table of all four groups, as before


def final_row(run: Path, accuracy: float) -> None:
    """Set ``run``'s final AVG accuracy (its last metrics row and summary.json) to ``accuracy``."""
    metrics = run / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows[-1]["accuracy"]["AVG"] = accuracy
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = json.loads((run / "summary.json").read_text())
    summary["accuracy"] = accuracy
    (run / "summary.json").write_text(json.dumps(summary))


@pytest.mark.slow
def test_the_verdict_is_within_or_outside_the_larger_seed_spread(study, tmp_path):
    """Numbers set by hand. default: float32 80, 82 (mean 81, std sqrt(2) = 1.414), bf16 80.5, 83.5 (mean 82,
    std sqrt(4.5) = 2.121): difference +1.00 within 2.12. faster: float32 70, 70 (std 0), bf16 72, 73
    (mean 72.5, std sqrt(0.5) = 0.707): difference +2.50 outside 0.71."""
    copy = tmp_path / "study"
    shutil.copytree(study, copy, ignore=shutil.ignore_patterns("report"))
    chosen = {("default", "float32"): [80.0, 82.0], ("default", "bf16"): [80.5, 83.5],
              ("faster", "float32"): [70.0, 70.0], ("faster", "bf16"): [72.0, 73.0]}
    for (name, precision), values in chosen.items():
        for seed, value in zip(SEEDS, values):
            final_row(copy / name / precision / f"fedhpro-seed{seed}", value)
    out = report([copy], echo=False)
    assert out == copy / "report"  # the default out: beside the settings
    rows = parity_rows(out)
    expected = {"default": (81.0, 2 ** 0.5, 82.0, 4.5 ** 0.5, 1.0, 4.5 ** 0.5, "within"),
                "faster": (70.0, 0.0, 72.5, 0.5 ** 0.5, 2.5, 0.5 ** 0.5, "outside")}
    for name, (mean32, std32, mean16, std16, difference, larger, verdict) in expected.items():
        row = rows[(name, "AVG")]
        got = [float(row[key]) for key in ("reference_mean", "reference_std", "compared_mean", "compared_std",
                                           "difference", "larger_std")]
        assert got == pytest.approx([mean32, std32, mean16, std16, difference, larger], abs=1e-5)
        assert row["verdict"] == verdict
    markdown = (out / "parity.md").read_text()
    assert "| default | 0,1 | 81.00 ± 1.41 | 82.00 ± 2.12 | +1.00 | 2.12 | within | no test (2 shared seeds) |" \
        in markdown
    assert "| faster | 0,1 | 70.00 ± 0.00 | 72.50 ± 0.71 | +2.50 | 0.71 | outside | no test (2 shared seeds) |" \
        in markdown
    assert rows[("default", "AVG")]["p_paired"] == ""  # 2 seeds: no test
    low, high = stats.t.interval(0.95, 1, loc=81.0, scale=stats.sem([80.0, 82.0]))
    assert float(rows[("default", "AVG")]["reference_ci_low"]) == pytest.approx(low, abs=1e-4)
    assert float(rows[("default", "AVG")]["reference_ci_high"]) == pytest.approx(high, abs=1e-4)
    # the same runs given as their four comparison folders: the same table, the report refreshed in place
    folders = [str(copy / name / precision) for name in SETTINGS for precision in PRECISIONS]
    assert report(folders, echo=False) == out
    assert parity_rows(out) == rows


@pytest.mark.slow
def test_folders_that_differ_besides_the_precision_are_refused_in_one_line(study, tmp_path, capsys):
    out = tmp_path / "report"
    with pytest.raises(ConfigError) as refused:
        report([study / "default" / "float32", study / "faster" / "bf16"], out, echo=False)
    message = str(refused.value)
    assert "\n" not in message
    assert "differ in lr 0.01 against 0.05, not only in the precision (amp, channels_last)" in message
    assert str((study / "default" / "float32").resolve()) in message
    assert not out.exists()  # refused before anything is written
    assert cli_main(["report", str(study / "default" / "float32"), str(study / "faster" / "bf16"),
                     f"out={out}"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.slow
def test_a_setting_at_one_precision_is_named_and_left_out(study, tmp_path, capsys):
    out = tmp_path / "report"
    assert cli_main(["report", str(study / "default" / "float32"), str(study / "default" / "bf16"),
                     str(study / "faster" / "float32"), f"out={out}"]) == 0
    printed = capsys.readouterr().out
    line = (f"faster: float32 only ({(study / 'faster' / 'float32').resolve()}), no bf16 comparison folder of the "
            "same settings given: left out of the parity table")
    assert line in printed and line in (out / "parity.md").read_text()
    assert {setting for setting, _ in parity_rows(out)} == {"default"}
    assert json.loads((out / "parity.json").read_text())["left_out"] == [line]


@pytest.mark.slow
def test_an_unfinished_run_is_left_out_of_its_side_and_named(study, tmp_path):
    copy = tmp_path / "study"
    shutil.copytree(study / "default", copy / "default")
    (copy / "default" / "bf16" / "fedhpro-seed1" / "summary.json").unlink()
    out = report([copy], echo=False)
    row = parity_rows(out)[("default", "AVG")]
    finished = summaries(study / "default" / "bf16")[0]["accuracy"]
    assert (row["compared_seeds"], float(row["compared_mean"]), float(row["compared_std"])) == \
        ("0", pytest.approx(finished, abs=5e-4), 0.0)
    assert any("fedhpro-seed1 is unfinished" in line for line in json.loads((out / "parity.json").read_text())
               ["left_out"])


@pytest.mark.slow
def test_a_report_of_one_precision_has_no_parity_table(study, tmp_path):
    out = report([study / "default" / "float32", study / "faster" / "float32"], tmp_path / "report", echo=False)
    assert (out / "table.md").is_file() and not (out / "parity.md").exists()


@pytest.mark.slow
@pytest.mark.skipif(not NATIVE_BF16, reason="amp=bf16 trains only on a CPU with native bfloat16 (AVX512-BF16, AMX)")
def test_the_study_script_reuses_finished_runs_and_writes_the_parity_report(study, digits_data_dir, tmp_path):
    copy = tmp_path / "study"
    shutil.copytree(study, copy, ignore=shutil.ignore_patterns("report"))
    stamps = {path: path.stat().st_mtime_ns for path in copy.glob("*/*/*/summary.json")}
    spec = importlib.util.spec_from_file_location("precision_parity", ROOT / "bench" / "precision_parity.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    base = " ".join(f"{key}={value}" for key, value in base_settings(digits_data_dir).items()
                    if key not in ("threads", "progress"))  # the script sets these two
    settings = [f"{name}={base} " + " ".join(f"{key}={value}" for key, value in overrides.items())
                for name, overrides in SETTINGS.items()]
    assert script.main(["--out", str(copy), "--seeds", "0", "1", "--threads", "1", "--settings", *settings]) == 0
    assert {path: path.stat().st_mtime_ns for path in copy.glob("*/*/*/summary.json")} == stamps  # nothing rerun
    assert {setting for setting, _ in parity_rows(copy / "report")} == set(SETTINGS)


def test_the_paired_test_over_three_shared_seeds_is_scipys():
    """Hand-made runs: float32 80, 82, 81 and bf16 79, 80.5, 79.5 on seeds 0-2 (bf16 lower on every seed, by
    varying margins); the p value is scipy's ttest_rel on them, and bf16 is marked worse."""
    from fedhpro.reports.parity import PrecisionGroup, _measures

    def run(seed: int, accuracy: float, amp: str) -> RunData:
        rows = [{"round": 0, "accuracy": {"mnist": accuracy, "AVG": accuracy}}]
        return RunData(Path(f"{amp}-seed{seed}"), {"method": "fedhpro", "seed": seed, "amp": amp}, rows,
                       {"accuracy": accuracy})

    float32, bf16 = [80.0, 82.0, 81.0], [79.0, 80.5, 79.5]
    reference = PrecisionGroup({"amp": "off"}, [run(seed, value, "off") for seed, value in enumerate(float32)])
    compared = PrecisionGroup({"amp": "bf16"}, [run(seed, value, "bf16") for seed, value in enumerate(bf16)])
    measure = _measures(reference, compared)["AVG"]
    p = stats.ttest_rel(bf16, float32).pvalue
    assert measure.p_paired == pytest.approx(p, rel=1e-9) and p < 0.05
    assert measure.test_text == f"p = {p:.3g} ▼"
    low, high = stats.t.interval(0.95, 2, loc=statistics.mean(bf16), scale=stats.sem(bf16))
    assert measure.intervals[2:] == pytest.approx([low, high])
