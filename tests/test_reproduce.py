"""Tests of ``fedhpro reproduce`` (the paper's tables and figures) and ``fedhpro report``.

The shipped YAML files are checked for shape (every published number belongs to a row and a column);
an end-to-end reproduction runs tiny targets on a small digits-offline build, checking the Digits
fallback, the one line naming an absent data set, the tables (ours beside the paper's numbers) and
the PNGs.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import pytest
import yaml

from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from fedhpro import reproduce as R
from fedhpro.errors import ConfigError

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SHIPPED = R.available_targets()
#: the CPU-scale studies (tests/test_reproduce_studies.py): their own budgets, not the paper's
STUDY_LAYOUTS = ("label_skew", "gradient_matching", "robustness", "faithfulness")


def test_every_table_and_figure_of_the_digits_experiments_has_a_target():
    wanted = {"table3", "table4", "table5", "table6", "tableA3", "tableA4", "tableA6", "tableA7", "tableA8",
              "figure2", "figure4", "figure6", "figure7", "figure8"}
    assert wanted <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("scale", ["paper", "smoke"])
def test_shipped_targets_have_one_published_number_per_row_and_column(name, scale):
    target = R.load_target(name, scale)
    assert target.parts and target.seeds
    if scale == "paper" and target.layout not in STUDY_LAYOUTS:
        assert target.settings["rounds"] >= 5 and target.settings["local_epochs"] == 10
        assert target.settings["lr"] == 0.01 and target.settings["batch_size"] == 64
    for part in target.parts:
        labels = {v.label for v in part.variants}
        assert set(part.paper) <= labels, f"{name}/{part.name}: paper rows {set(part.paper) - labels} are not rows"
        if target.layout == "domains":
            width = len(part.columns) + 1
        elif target.layout in ("scenarios", "sweep"):
            width = len(part.scenarios) + (1 if part.extra.get("average_column") else 0)
        elif target.layout == "convergence":
            width = len(part.extra["thresholds"]) + 2
        elif target.layout in STUDY_LAYOUTS:  # one number per paper column
            width = len(part.columns)
        else:
            width = 4
        for row, values in part.paper.items():
            if scale == "paper" or target.layout not in ("scenarios", "sweep"):
                assert len(values) == width, f"{name}/{part.name}/{row}: {len(values)} numbers for {width} columns"


def test_unknown_target_and_scale_are_one_clear_error():
    with pytest.raises(ConfigError, match="no reproduce target 'table99'.*table3"):
        R.load_target("table99")
    with pytest.raises(ConfigError, match="scale=.*paper or scale=smoke"):
        R.load_target("table3", "huge")


# ----------------------------------------------------------------------------
# end to end on a tiny digits-offline build
# ----------------------------------------------------------------------------

VARIANTS = [{"label": "FedAvg", "method": "fedavg"}, {"label": "FedHPro", "method": "fedhpro"}]
DIGITS_PART = {"name": "Digits", "benchmark": "digits", "settings": {"dataset": "digits"},
               "columns": ["MNIST", "USPS", "SVHN", "SYN"],
               "paper": {"FedAvg": [96.68, 90.43, 76.35, 51.85, 78.82], "FedHPro": [98.52, 93.13, 84.95, 62.59, 84.80]}}
ABSENT_PART = {"name": "CIFAR10", "benchmark": "cifar10", "settings": {"dataset": "cifar10"},
               "scenarios": [{"label": "NID1_0.5"}]}


@pytest.fixture(scope="module")
def targets(tmp_path_factory, digits_data_dir):
    folder = tmp_path_factory.mktemp("configs")
    smoke = {"seeds": [0], "settings": {"model": "cnn", "feature_dim": 16, "rounds": 2, "local_epochs": 1,
                                        "clients": 4, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
                                        "data.test_fraction": DIGITS_TEST_FRACTION, "data_dir": str(digits_data_dir),
                                        "checkpoint_every": 0, "device": "cpu", "fedhpro.match_steps": 2}}
    base = {"seeds": [0, 1, 2], "settings": {"rounds": 100, "local_epochs": 10}, "smoke": smoke, "variants": VARIANTS}
    documents = {
        "tiny_domains": {"title": "Table T: tiny", "layout": "domains", "parts": [DIGITS_PART, ABSENT_PART]},
        "tiny_fairness": {"title": "Table F: fairness", "layout": "fairness",
                          "parts": [{**DIGITS_PART, "paper": {"FedAvg": [36.85, 73.09, 56.39, 12.81]}}]},
        "tiny_convergence": {"title": "Table C: convergence", "layout": "convergence",
                             "parts": [{**DIGITS_PART, "thresholds": [5, 10], "speedup_at": 10, "paper": {}}]},
        "tiny_gm": {"title": "Figure G: L_GM", "layout": "gm_loss", "parts": [DIGITS_PART],
                    "variants": [VARIANTS[1]]},
        "tiny_tsne": {"title": "Figure S: t-SNE", "layout": "tsne", "parts": [DIGITS_PART],
                      "settings": {"tsne": True}},
    }
    for name, document in documents.items():
        merged = {**base, **document, "name": name, "settings": {**base["settings"], **document.get("settings", {})}}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(merged, allow_unicode=True))
    return folder


@pytest.fixture(scope="module")
def reproduced(targets, tmp_path_factory):
    """Every tiny target reproduced once (the runs are shared); returns (out folder, captured stdout)."""
    out = tmp_path_factory.mktemp("reproduce")
    patch = pytest.MonkeyPatch()
    patch.setattr(R.targets, "configs_dir", lambda: targets)
    buffer = io.StringIO()
    stdout, sys.stdout = sys.stdout, buffer
    try:
        for name in ("tiny_domains", "tiny_fairness", "tiny_convergence", "tiny_gm", "tiny_tsne"):
            R.reproduce(name, "smoke", out=out)
    finally:
        sys.stdout = stdout
        patch.undo()
    return out, buffer.getvalue()


@pytest.mark.slow
def test_absent_data_set_is_one_line_naming_it_and_digits_falls_back_to_digits_offline(reproduced):
    out, printed = reproduced
    absent = [line for line in printed.splitlines() if line.startswith("fedhpro reproduce tiny_domains:")]
    assert len(absent) == 1 and "'cifar10'" in absent[0] and "not available" in absent[0]
    assert "digits-offline" in printed and "optdigits stands in for USPS" in printed
    table = (out / "tiny_domains" / "table.md").read_text()
    assert "not run: CIFAR10" in table


@pytest.mark.slow
def test_domains_table_puts_ours_beside_the_papers_numbers(reproduced):
    out, _ = reproduced
    table = (out / "tiny_domains" / "table.md").read_text()
    assert "| Methods | MNIST | USPS (ours: optdigits) | SVHN (ours: mnistm) | SYN | AVG | Δ |" in table
    assert "/ 84.80" in table and "/ 78.82" in table and "scale=smoke" in table
    assert "Ordering against the paper" in table
    rows = list(csv.DictReader(io.StringIO((out / "tiny_domains" / "table.csv").read_text())))
    fedhpro_avg = [r for r in rows if r["row"] == "FedHPro" and r["column"] == "AVG"]
    assert len(fedhpro_avg) == 1 and float(fedhpro_avg[0]["paper"]) == 84.80
    assert 0.0 <= float(fedhpro_avg[0]["ours_mean"]) <= 100.0
    assert (out / "tiny_domains" / "accuracy_digits.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_runs_are_shared_between_targets(reproduced):
    out, printed = reproduced
    assert len(list((out / "runs").glob("fedavg-*-seed0"))) == 2  # tiny_domains' run and tiny_tsne's (tsne=true)
    assert "reused" in printed


@pytest.mark.slow
def test_fairness_convergence_gm_and_tsne_outputs(reproduced):
    out, _ = reproduced
    fairness = (out / "tiny_fairness" / "table.md").read_text()
    assert "Worst 10%" in fairness and "/ 36.85" in fairness and "Std (ours)" in fairness
    assert "R_5%" in (out / "tiny_convergence" / "table.md").read_text()
    gm = (out / "tiny_gm" / "table.csv").read_text().splitlines()
    assert gm[0] == "part,scenario,round,gm_loss_before,gm_loss_after" and len(gm) == 3  # header + 2 rounds
    for png in ("tiny_fairness/fairness_digits.png", "tiny_convergence/convergence_digits.png",
                "tiny_gm/gm_loss_digits.png", "tiny_tsne/tsne_digits.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC, png
    assert "silhouette" in (out / "tiny_tsne" / "table.md").read_text()


@pytest.mark.slow
def test_report_builds_tables_and_plots_from_run_folders(reproduced, tmp_path):
    from fedhpro.reports.runs import report

    out, _ = reproduced
    folders = sorted(str(p) for p in (out / "runs").iterdir() if not p.name.startswith("."))
    written = report(folders, tmp_path / "report", echo=False)
    table = (written / "table.md").read_text()
    assert "worst 10%" in table and "MB up/round" in table
    for png in ("accuracy.png", "gm_loss.png", "fairness.png"):
        assert (written / png).read_bytes()[:8] == PNG_MAGIC, png


def test_report_of_a_folder_that_is_not_a_run_is_one_clear_error(tmp_path):
    from fedhpro.reports.runs import report

    with pytest.raises(ConfigError, match="not a run folder.*metrics.jsonl"):
        report([tmp_path])
    with pytest.raises(ConfigError, match="at least one run folder"):
        report([])


def test_tensorboard_missing_is_one_message_to_pip_install_it(monkeypatch, tmp_path):
    from fedhpro.config import RunOptions
    from fedhpro.measurements import TensorBoardLog, observers_for

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    messages = []
    chosen = observers_for(RunOptions(tensorboard=True), tmp_path, messages.append, "t")
    assert not any(isinstance(o, TensorBoardLog) for o in chosen)
    assert len(messages) == 1 and "pip install tensorboard" in messages[0]
    assert observers_for(RunOptions(tensorboard=False), tmp_path, messages.append, "t") == [] and len(messages) == 1


# ----------------------------------------------------------------------------
# the other layouts, on hand-written run folders (no training)
# ----------------------------------------------------------------------------


def fake_run(folder: Path, method: str, avg: list[float], **extra) -> "R.RunData":
    """A run folder whose metrics.jsonl has the given AVG per round plus the keys the builders read."""
    import json

    from fedhpro.reports.runs import load_run

    folder.mkdir(parents=True)
    rows, timing = [], []
    for r, value in enumerate(avg):
        row = {"round": r, "participants": [0, 1], "train": {}, "server": {}, "bytes_up": 1000, "bytes_down": 3000,
               "params_up": 200, "params_down": 600, "accuracy": {"mnist": value, "AVG": value},
               "client_accuracy": [value, value], "fairness": {"mean": value, "worst_10": value, "best_10": value,
                                                               "variance": 0.0, "std": 0.0}}
        for key, values in extra.items():
            row[key] = values[r]
        rows.append(row)
        timing.append({"round": r, "clients": 2.0, "server": 0.1, "eval": 0.5, "elapsed": 3.0 * (r + 1)})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "timing.jsonl").write_text("".join(json.dumps(row) + "\n" for row in timing))
    (folder / "config.yaml").write_text(yaml.safe_dump({"method": method}))
    return load_run(folder)


def build_one(target: "R.Target", part: "R.Part", runs: dict, out: Path):
    """One part's output as reproduce writes it: its Markdown sections, the checks and the figure files drawn."""
    table = R.build_table(target, [R.PartResult(part, "", runs, ["mnist"])])
    return [R.section_markdown(s) for s in table.sections], table.checks, R.draw_figures(table.figures, out)


def test_scenarios_layout_with_an_average_column_and_a_sweep_plot(tmp_path):
    variants = [R.Variant("FedProto†", "fedproto"), R.Variant("FedHPro", "fedhpro")]
    part = R.Part("Digits", "digits", {}, [R.Scenario("d=64"), R.Scenario("d=256")], [],
                  {"FedProto†": [75.96, 78.43, 77.0], "FedHPro": [80.28, 83.37, 81.0]},
                  {"average_column": True, "xlabel": "d"}, variants)
    runs = {("d=64", "FedProto†"): [fake_run(tmp_path / "a", "fedproto", [50.0, 60.0])],
            ("d=256", "FedProto†"): [fake_run(tmp_path / "b", "fedproto", [50.0, 70.0])],
            ("d=64", "FedHPro"): [fake_run(tmp_path / "c", "fedhpro", [50.0, 65.0])],
            ("d=256", "FedHPro"): [fake_run(tmp_path / "d", "fedhpro", [50.0, 75.0])]}
    target = R.Target("t", "Table A6: d", "scenarios", [0], {}, variants, [part], [])
    sections, checks, figures = build_one(target, part, runs, tmp_path / "out")
    assert "| FedHPro | 65.00 / 80.28 | 75.00 / 83.37 | 70.00 / 81.00 |" in sections[0]
    assert any("d=256" in line and "matches" in line for line in checks)
    assert figures[0].read_bytes()[:8] == PNG_MAGIC


def test_efficiency_layout_reads_parameters_bytes_flops_and_training_time(tmp_path):
    variants = [R.Variant("FedAvg", "fedavg"), R.Variant("FedHPro", "fedhpro")]
    part = R.Part("Digits", "digits", {}, [R.Scenario("Digits")], [],
                  {"FedAvg": [10.87, 380.42, 1.02, 23.11], "FedHPro": [10.90, 387.57, 1.35, 35.16]}, {}, variants)
    runs = {("Digits", "FedAvg"): [fake_run(tmp_path / "a", "fedavg", [10.0, 20.0], flops_train=[1e10, 1e10])],
            ("Digits", "FedHPro"): [fake_run(tmp_path / "b", "fedhpro", [10.0, 20.0], flops_train=[2e10, 2e10])]}
    target = R.Target("t", "Table 4: efficiency", "efficiency", [0], {}, variants, [part], [])
    sections, checks, figures = build_one(target, part, runs, tmp_path / "out")
    # 200 parameters up = 2e-5 x 10^7; 4000 bytes = 0.0038 MiB; 2e10 FLOPs = 2 x 10^10; 2 s of training
    assert "| FedHPro | 0.0000 / 10.9 | 0.0038 / 387.57 | 2.0000 / 1.35 | 2.00 / 35.16 |" in sections[0]
    assert any("FLOPs" in line and "matches" in line for line in checks)


def test_prototype_layout_finds_the_closest_prototypes(tmp_path):
    variants = [R.Variant("FedAvg", "fedavg"), R.Variant("FedHPro", "fedhpro")]
    part = R.Part("Digits", "digits", {}, [R.Scenario("Digits")], [], {}, {}, variants)
    far = {"centralized_norm": 3.0, "clients_mean": {"l2": 2.0, "l2_normalized": 0.5}}
    near = {"centralized_norm": 3.0, "server": {"kind": "hyper", "l2": 1.0, "l2_normalized": 0.2},
            "clients_mean": {"l2": 2.0, "l2_normalized": 0.5}}
    runs = {("Digits", "FedAvg"): [fake_run(tmp_path / "a", "fedavg", [1.0, 2.0], prototype_distance=[far, far])],
            ("Digits", "FedHPro"): [fake_run(tmp_path / "b", "fedhpro", [1.0, 2.0], prototype_distance=[near, near])]}
    target = R.Target("t", "Figure 2", "prototypes", [0], {}, variants, [part], [])
    sections, checks, figures = build_one(target, part, runs, tmp_path / "out")
    assert "| FedHPro | server | 1.000 | 0.200 | 3.000 |" in sections[0]
    assert "closest = FedHPro -> matches" in checks[0]
    assert all(f.read_bytes()[:8] == PNG_MAGIC for f in figures)


def test_domains_layout_marks_a_row_only_where_scipys_paired_test_says_so(tmp_path):
    """Three seeds per row, numbers set by hand: FedHPro above FedAvg on every seed by 5, 6 and 5 points. The
    interval and the p value are scipy's on those numbers; with one seed the same rows are not marked."""
    from scipy import stats

    variants = [R.Variant("FedAvg", "fedavg"), R.Variant("FedHPro", "fedhpro")]
    part = R.Part("Digits", "digits", {}, [R.Scenario("Digits")], [],
                  {"FedAvg": [96.68, 78.82], "FedHPro": [98.52, 84.80]}, {}, variants)
    numbers = {"FedAvg": [50.0, 52.0, 51.0], "FedHPro": [55.0, 58.0, 56.0]}
    runs = {}
    for variant in variants:
        runs[("Digits", variant.label)] = []
        for seed, value in enumerate(numbers[variant.label]):
            run = fake_run(tmp_path / f"{variant.method}-{seed}", variant.method, [value - 10, value])
            run.config["seed"] = seed
            runs[("Digits", variant.label)].append(run)
    target = R.Target("t", "Table 3: t", "domains", [0, 1, 2], {}, variants, [part], [])
    table = R.build_table(target, [R.PartResult(part, "", runs, ["mnist"])])
    markdown = R.section_markdown(table.sections[0])
    low, high = stats.t.interval(0.95, 2, loc=stats.tmean(numbers["FedHPro"]), scale=stats.sem(numbers["FedHPro"]))
    p = stats.ttest_rel(numbers["FedHPro"], numbers["FedAvg"]).pvalue
    assert p < 0.05
    assert f"| FedHPro | {stats.tmean(numbers['FedHPro']):.2f} [{low:.2f}, {high:.2f}] ★▲ / 98.52 |" in markdown
    assert "over the 3 seeds every row shares (0, 1, 2)" in markdown and "better/worse than FedAvg" in markdown
    rows = {(row[1], row[2]): dict(zip(table.csv_header, row)) for row in table.csv_rows}
    assert rows[("FedHPro", "AVG")]["p_vs_first_row"] == pytest.approx(p, rel=1e-9)
    assert rows[("FedHPro", "AVG")]["ours_ci_low"] == pytest.approx(low)
    assert rows[("FedHPro", "AVG")]["mark"] == "★▲" and rows[("FedAvg", "AVG")]["mark"] == ""
    one = {key: value[:1] for key, value in runs.items()}
    single = R.section_markdown(R.build_table(target, [R.PartResult(part, "", one, ["mnist"])]).sections[0])
    assert "| FedHPro | 55.00 / 98.52 | 55.00 / 84.80 | +5.00 / +5.98 |" in single
    assert "No significance test is possible with 1 shared seed" in single


# ----------------------------------------------------------------------------
# strict target files, the emitter, the data check
# ----------------------------------------------------------------------------

GOOD_TARGET = {"name": "t", "title": "Table T: t", "layout": "convergence", "seeds": [0],
               "settings": {"rounds": 2}, "smoke": {"seeds": [0], "settings": {"rounds": 1}},
               "variants": VARIANTS,
               "parts": [{"name": "Digits", "benchmark": "digits", "settings": {"dataset": "digits"},
                          "thresholds": [5, 10], "smoke": {"thresholds": [1]}}]}


def _with(path: list, value) -> dict:
    """GOOD_TARGET with ``value`` set at ``path`` (keys and list indices)."""
    import copy

    document = copy.deepcopy(GOOD_TARGET)
    place = document
    for step in path[:-1]:
        place = place[step]
    place[path[-1]] = value
    return document


@pytest.mark.parametrize("path, key, where, valid", [
    (["treshold"], "treshold", "the top level", "name, title, layout, seeds"),
    (["smoke", "options"], "options", "smoke", "seeds, settings"),
    (["parts", 0, "delta"], "delta", "parts[0] (Digits)", "thresholds, speedup_at"),  # a domains key
    (["parts", 0, "smoke", "columns"], "columns", "parts[0] (Digits) smoke", "settings, scenarios, thresholds"),
    (["variants", 1, "lable"], "lable", "variants[1]", "label, method, settings"),
])
def test_an_unknown_key_in_a_target_is_one_line_naming_file_key_and_valid_keys(tmp_path, monkeypatch, path, key,
                                                                               where, valid):
    monkeypatch.setattr(R.targets, "configs_dir", lambda: tmp_path)
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(GOOD_TARGET))
    assert R.load_target("good", "smoke").parts[0].extra == {"thresholds": [1]}  # the part's smoke replaces it
    assert R.load_target("good").parts[0].extra == {"thresholds": [5, 10]}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(_with(path, 1)))
    for scale in ("paper", "smoke"):  # a smoke section is checked at paper scale too
        with pytest.raises(ConfigError) as error:
            R.load_target("bad", scale)
        message = str(error.value)
        assert "\n" not in message and str(tmp_path / "bad.yaml") in message
        assert f"unknown key {key!r} in {where};" in message and valid in message


def test_a_target_whose_benchmark_disagrees_with_its_dataset_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(R.targets, "configs_dir", lambda: tmp_path)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(_with(["parts", 0, "benchmark"], "cifar10")))
    with pytest.raises(ConfigError, match=r"parts\[0\] \(Digits\) has benchmark: cifar10 but runs dataset: digits"):
        R.load_target("bad")
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(_with(["variants", 0], {"label": "FedAvg"})))
    with pytest.raises(ConfigError, match=r"variants\[0\] has no 'method'"):
        R.load_target("bad")


def _hand_table() -> "R.Table":
    rows = [["FedAvg", "50.00 / 78.82"], ["FedHPro", "60.00 / –"]]
    return R.Table(csv_header=["part", "row", "column", "ours_mean", "ours_std", "paper"],
                   sections=[R.Section("Digits", ["Methods", "AVG"], rows, ["a note"]),
                             R.Section("CIFAR10", skipped="CIFAR10: no data")],
                   csv_rows=[["Digits", "FedAvg", "AVG", 50.0, 0.0, 78.82],
                             ["Digits", "FedHPro", "AVG", 60.0, None, None]],
                   checks=["Digits (AVG): a check"])


def test_the_emitter_writes_the_same_table_for_the_same_rows(tmp_path):
    import json
    import time

    target = R.Target("t", "Table T: t", "domains", [0], {}, [], [], ["a target note"])
    for folder in (tmp_path / "a", tmp_path / "b"):
        written = R.emit(target, _hand_table(), folder, scale="smoke", seeds=[0], notes=["CIFAR10: no data"],
                         started=time.perf_counter(), echo=False)
        assert written == [folder / "table.md", folder / "table.csv"]
    expected_md = (
        "# Table T: t\n\nReproduced with `fedhpro reproduce t scale=smoke` (seeds [0]); ours: the mean over seeds "
        "with its 95 % t-interval in brackets (table.csv: also the std, the p values and the marks); paper: the "
        "published number. Wall time 0 s.\n\n" + R.emitter.SMOKE_WARNING + "\n\n- a target note\n\n"
        "## Digits\n\n| Methods | AVG |\n|---|---|\n| FedAvg | 50.00 / 78.82 |\n| FedHPro | 60.00 / – |\n\n"
        "- a note\n\n"
        "## CIFAR10\n\nnot run: CIFAR10: no data\n\n## Ordering against the paper\n\n- Digits (AVG): a check\n")
    expected_csv = ("part,row,column,ours_mean,ours_std,paper\r\nDigits,FedAvg,AVG,50,0,78.82\r\n"
                    "Digits,FedHPro,AVG,60,,\r\n")
    for folder in (tmp_path / "a", tmp_path / "b"):
        assert (folder / "table.md").read_text() == expected_md
        assert (folder / "table.csv").read_bytes().decode() == expected_csv
        record = json.loads((folder / "reproduce.json").read_text())
        assert record["checks"] == ["Digits (AVG): a check"] and record["notes"] == ["CIFAR10: no data"]
        assert record["figures"] == [] and record["seeds"] == [0] and record["target"] == "t"


def _no_build(monkeypatch):
    """Make building any federation, or opening any loader, fail the test."""
    from fedhpro.data import benchmarks, loaders

    def refuse(*args, **kwargs):
        raise AssertionError("the data check built a federation or opened a loader")

    for cls in (benchmarks.DomainBenchmark, benchmarks.LabelSkewBenchmark, benchmarks.TextBenchmark):
        monkeypatch.setattr(cls, "build", refuse)
    monkeypatch.setattr(loaders, "open_loader", refuse)
    monkeypatch.setattr(benchmarks, "open_loader", refuse)


def test_the_data_check_names_the_missing_data_set_without_building_it(tmp_path, monkeypatch):
    from fedhpro.data.loaders import missing

    _no_build(monkeypatch)
    digits = {"dataset": "digits", "data_dir": str(tmp_path)}
    for name in ("MNIST/raw/train-images-idx3-ubyte", "MNIST/raw/train-labels-idx1-ubyte",
                 "MNIST/raw/t10k-images-idx3-ubyte", "MNIST/raw/t10k-labels-idx1-ubyte", "usps.bz2", "usps.t.bz2"):
        folder = tmp_path / ("mnist" if name.startswith("MNIST") else "usps")
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"")
    # MNIST and USPS are there: two clients use only them; four need SVHN (the first missing) and SYN
    assert R.missing_data({**digits, "clients": 2}) is None
    assert R.missing_data({**digits, "clients": 4}) == str(missing("svhn", tmp_path / "svhn"))
    assert R.missing_data({**digits, "data.clients_per_domain": {"mnist": 1, "syn": 2}}) == str(
        missing("syn", tmp_path / "syn"))
    (tmp_path / "syn" / "train").mkdir(parents=True)
    (tmp_path / "syn" / "test").mkdir()
    assert R.missing_data({**digits, "data.clients_per_domain": {"mnist": 1, "syn": 2}}) is None
    cifar = {"dataset": "cifar10", "data_dir": str(tmp_path)}
    assert R.missing_data(cifar).startswith("cifar10: data not found in")
    assert R.missing_data({**cifar, "data.download": True}) is None  # torchvision fetches it when the run starts
    assert R.missing_data({"dataset": "digits-offline", "data_dir": str(tmp_path)}) is None
    assert "not registered" in R.missing_data({"dataset": "mnist-9000"})
    settings, note = R.resolve_data("Digits", {**digits, "data.fraction": 0.5}, "smoke")
    assert settings["dataset"] == "digits-offline" and "svhn: data not found" in note
    settings, note = R.resolve_data("Digits", digits, "paper")
    assert settings is None and note.startswith("Digits: needs data set 'digits', which is not available here: svhn")


@pytest.mark.parametrize("name", ["cifar10", "syn", "tinyimagenet", "ag_news", "office-caltech"])
def test_the_data_check_says_what_the_loader_itself_says_of_an_empty_folder(tmp_path, name):
    from fedhpro.data.loaders import LOADERS, missing, open_loader
    from fedhpro.errors import DataError

    options = {"domain": "amazon"} if name == "office-caltech" else {}
    with pytest.raises(DataError) as error:
        open_loader(name, tmp_path, True, **options)
    root = tmp_path / LOADERS[name].folder if LOADERS[name].folder else tmp_path
    assert str(error.value) == str(missing(name, root))  # the loader's own message is the one the check gives
    assert not R.availability._present(root, R.availability.LOADER_FILES[name], "amazon")


def test_every_loader_and_benchmark_is_known_to_the_data_check():
    from fedhpro.config import load_config
    from fedhpro.data.benchmarks import BENCHMARKS
    from fedhpro.data.loaders import LOADERS

    assert set(R.availability.LOADER_FILES) == set(LOADERS)
    for dataset in BENCHMARKS:
        used = R.availability.loaders_used(load_config(None, {"dataset": dataset}))
        assert used and {name for name, _ in used} <= set(LOADERS), dataset


def _tiny_files(name: str, root: Path) -> None:
    """The least a loader opens without error: one tiny image (or text row) per split."""
    from PIL import Image

    def image(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4)).save(path)

    if name == "syn":
        for split in ("train", "val"):
            for digit in range(10):
                image(root / split / str(digit) / "a.png")
    elif name == "office-caltech":
        for k in range(4):
            image(root / "office_caltech_10" / "amazon" / "mug" / f"{k}.jpg")
    elif name == "ag_news":
        root.mkdir(parents=True)
        for split in ("train", "test"):
            (root / f"{split}.csv").write_text('"1","a title","a description"\n')


@pytest.mark.parametrize("name", ["syn", "office-caltech", "ag_news"])
def test_the_data_check_finds_what_the_loader_opens(tmp_path, name):
    from fedhpro.data.loaders import LOADERS, open_loader

    root = tmp_path / LOADERS[name].folder if LOADERS[name].folder else tmp_path
    _tiny_files(name, root)
    options = {"domain": "amazon", "test_fraction": 0.5} if name == "office-caltech" else {}
    for train in (True, False):
        assert len(open_loader(name, tmp_path, train, **options)) >= 1
    assert R.availability._present(root, R.availability.LOADER_FILES[name], "amazon")
    if name == "office-caltech":  # each domain is its own folder
        assert not R.availability._present(root, R.availability.LOADER_FILES[name], "dslr")


def test_a_run_folders_identity_spells_channels_last_false_and_auto_alike_without_amp():
    # folders made before channels_last=auto existed (config false) keep their names; true, or auto with amp,
    # train in another memory format (other float digits) and get another folder
    from fedhpro.config import load_config
    from fedhpro.reproduce.running import identity

    default = identity(load_config(None, {}))
    assert identity(load_config(None, {"channels_last": "false"})) == default
    assert identity(load_config(None, {"channels_last": "true"})) != default
    assert identity(load_config(None, {"amp": "bf16"})) != identity(load_config(None, {"amp": "bf16",
                                                                                   "channels_last": "false"}))
