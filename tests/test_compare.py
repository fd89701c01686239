"""``fedhpro compare``: the table against the runs' own summaries, reuse of finished runs, stale folders."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import yaml

from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from fedhpro.cli import main as cli_main
from fedhpro.compare import compare, run_settings, setting_differences
from fedhpro.errors import ConfigError

METHODS = ["fedprox", "fedavg"]  # not in the paper's order: the table keeps the order given
SEEDS = [0, 1]


def settings(data_dir: Path, **extra) -> dict:
    return {"rounds": 1, "clients": 4, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
            "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 16, "local_epochs": 1,
            "progress": False, "device": "cpu", "data_dir": str(data_dir), **extra}


@pytest.fixture(scope="module")
def compared(digits_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    compare(METHODS, SEEDS, settings(digits_data_dir), out, echo=False)
    return out


def summaries(out: Path, method: str) -> list[dict]:
    return [json.loads((out / f"{method}-seed{seed}" / "summary.json").read_text()) for seed in SEEDS]


@pytest.mark.slow
def test_table_is_the_mean_and_std_of_each_runs_summary(compared):
    rows = {row[0]: row for row in (line.split(",") for line in (compared / "table.csv").read_text().splitlines())}
    header = rows.pop("method")
    assert list(rows) == ["fedprox", "fedavg"]  # the order given
    domains = ["mnist", "optdigits", "mnistm", "syn"]
    assert header[1:6] == [f"{d}_mean" for d in domains] + ["AVG_mean"]
    fedavg_avg = statistics.mean(s["accuracy"] for s in summaries(compared, "fedavg"))
    for method in METHODS:
        runs = summaries(compared, method)
        assert [s["seed"] for s in runs] == SEEDS and {s["method"] for s in runs} == {method}
        for d, domain in enumerate(domains + ["AVG"]):
            values = [s["accuracy"] if domain == "AVG" else s["per_domain"][domain] for s in runs]
            assert float(rows[method][1 + d]) == pytest.approx(statistics.mean(values), abs=5e-5)
            assert float(rows[method][6 + d]) == pytest.approx(statistics.stdev(values), abs=5e-5)
    delta = statistics.mean(s["accuracy"] for s in summaries(compared, "fedprox")) - fedavg_avg
    at = header.index("delta_avg")
    assert at == 11  # the mean and std columns and delta where scripts read them; the intervals and tests after
    assert float(rows["fedprox"][at]) == pytest.approx(delta, abs=5e-5) and rows["fedavg"][at] == ""
    assert header[-3:] == ["AVG_p_vs_baseline", "AVG_p_vs_baseline_holm", "AVG_mark"]
    assert rows["fedprox"][-3:] == ["", "", ""]  # 2 seeds: no test, no mark
    markdown = (compared / "table.md").read_text()
    assert "| FedAvg |" in markdown and f"{delta:+.2f}" in markdown  # named as the paper writes it
    assert "No significance test is possible with 2 shared seeds" in markdown


@pytest.mark.slow
def test_finished_runs_with_the_same_settings_are_reused_not_rerun(compared, digits_data_dir, monkeypatch):
    import fedhpro.api

    def no_run(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(fedhpro.api, "run", no_run)
    before = (compared / "table.csv").read_text()
    # presentational settings (progress, device, checkpoints) do not make a run stale
    compare(METHODS, SEEDS, settings(digits_data_dir, checkpoint_every=3), compared, echo=False)
    assert (compared / "table.csv").read_text() == before


@pytest.mark.slow
def test_a_finished_run_with_other_settings_stops_the_comparison_before_anything_runs(
        compared, digits_data_dir, monkeypatch):
    import fedhpro.api

    calls = []
    monkeypatch.setattr(fedhpro.api, "run", lambda *a, **k: calls.append(a))
    with pytest.raises(ConfigError) as error:
        compare(METHODS + ["fedhpro"], SEEDS, settings(digits_data_dir, rounds=2), compared, echo=False)
    message = str(error.value)
    assert "fedprox-seed0" in message and "rounds: 1 there, 2 asked" in message and "another out=" in message
    assert calls == []  # fedhpro's runs were not started either

    with pytest.raises(ConfigError, match=r"fedprox\.mu: 0\.01 there, 0\.5 asked"):
        compare(METHODS, SEEDS, settings(digits_data_dir, **{"fedprox.mu": 0.5}), compared, echo=False)
    # another method's options do not concern FedAvg's runs: only the fedprox folder is named
    with pytest.raises(ConfigError, match="fedprox-seed0"):
        compare(["fedavg", "fedprox"], SEEDS, settings(digits_data_dir, **{"fedprox.mu": 0.5}), compared,
                echo=False)
    compare(["fedavg"], SEEDS, settings(digits_data_dir, **{"fedprox.mu": 0.5}), compared, echo=False)
    assert calls == []


def test_a_setting_the_stored_config_does_not_record_counts_as_different(tmp_path):
    # an option added after the run (e.g. a new method option with a default) cannot be assumed unchanged
    stored = {"rounds": 10, "fedgmkd": {"lam": 0.6}, "data": {"clients_per_domain": {"mnist": 3}}}
    wanted = {"rounds": 10, "fedgmkd": {"lam": 0.6, "kl_reduction": "mean"},
              "data": {"clients_per_domain": {"mnist": 3}}}
    assert setting_differences(stored, wanted) == ["fedgmkd.kl_reduction: not recorded there, 'mean' asked"]
    assert setting_differences(wanted, wanted) == []
    assert setting_differences({"sizes": [1, 2]}, {"sizes": (1, 2)}) == []  # YAML reads a tuple back as a list
    nested = {"out": "a", "progress": True, "seed": 1, "fedavg": {}, "fedprox": {"mu": 0.1}, "data": {}}
    assert run_settings(nested, "fedavg") == {"seed": 1, "fedavg": {}, "data": {}}


@pytest.mark.parametrize(("stored", "same"), [
    ({"amp": "off", "channels_last": False}, True),    # a config.yaml from before channels_last=auto
    ({"amp": "off", "channels_last": "false"}, True),
    ({"amp": "off", "channels_last": True}, False),    # NHWC training: other float digits
    ({"amp": "bf16", "channels_last": False}, False),  # with amp, auto means NHWC for a cnn
])
def test_channels_last_false_is_the_default_without_amp(stored, same):
    wanted = {"amp": stored["amp"], "channels_last": "auto"}
    differences = setting_differences(run_settings(stored, "fedavg"), run_settings(wanted, "fedavg"))
    assert (differences == []) is same, differences


@pytest.mark.slow
def test_an_unreadable_stored_config_is_one_clear_error(compared, digits_data_dir, tmp_path):
    out = tmp_path / "broken"
    folder = out / "fedavg-seed0"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text("{}")
    for text, reason in (("rounds: [1\n", "expected ',' or ']'"), ("- 1\n", "not a mapping"), (None, "No such file")):
        if text is None:
            (folder / "config.yaml").unlink()
        else:
            (folder / "config.yaml").write_text(text)
        with pytest.raises(ConfigError) as error:
            compare(["fedavg"], [0], settings(digits_data_dir), out, echo=False)
        message = str(error.value)
        assert "config.yaml cannot be read" in message and reason in message and "delete that folder" in message
        assert "\n" not in message


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["methods=[fedavg,fedfoo]"], "unknown method 'fedfoo'"),
    (["methods=[fedavg]", "seed=3"], "seed= is set by compare"),
    (["methods=[fedavg]", "seeds=[a]"], "must be integers"),
])
def test_compare_cli_errors_are_one_line(args, words, capsys, tmp_path):
    assert cli_main(["compare", f"out={tmp_path}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err and "Traceback" not in err


@pytest.mark.slow
def test_stored_config_round_trip_matches_what_compare_asks(compared, digits_data_dir):
    # the check compares config.yaml as written by a run with the config resolved now
    from fedhpro.config import load_config

    stored = yaml.safe_load((compared / "fedavg-seed0" / "config.yaml").read_text())
    asked = load_config(None, {**settings(digits_data_dir), "method": "fedavg", "seed": 0,
                               "out": str(compared / "fedavg-seed0")}).to_dict()
    assert setting_differences(run_settings(stored, "fedavg"), run_settings(asked, "fedavg")) == []


@pytest.mark.slow
def test_an_interrupted_run_continues_from_its_checkpoint_one_without_starts_again(digits_data_dir, tmp_path,
                                                                                   monkeypatch):
    import fedhpro.api

    out = tmp_path / "cmp"
    two_rounds = settings(digits_data_dir, rounds=2, checkpoint_every=1)
    compare(["fedavg"], [0], two_rounds, out, echo=False)
    folder = out / "fedavg-seed0"
    reference = json.loads((folder / "summary.json").read_text())
    calls = []
    real_run = fedhpro.api._run  # run_or_continue's run, under the claim it holds on the folder
    monkeypatch.setattr(fedhpro.api, "_run", lambda *a, **k: calls.append(a) or real_run(*a, **k))

    # killed after round 1's checkpoint: continued from it, to the same numbers
    (folder / "summary.json").unlink()
    (folder / "checkpoints" / "round-000002.pt").unlink()
    compare(["fedavg"], [0], two_rounds, out, echo=False)
    assert calls[-1][1]["resume"] == str(folder)
    again = json.loads((folder / "summary.json").read_text())
    assert {k: again[k] for k in ("accuracy", "per_domain", "bytes_up")} == \
        {k: reference[k] for k in ("accuracy", "per_domain", "bytes_up")}
    # continuing it with other settings is refused like a finished run
    (folder / "summary.json").unlink()
    with pytest.raises(ConfigError, match="unfinished run with other settings.*lr: 0.01 there, 0.02 asked"):
        compare(["fedavg"], [0], {**two_rounds, "lr": 0.02}, out, echo=False)

    # killed before its first checkpoint: its files are removed and it runs from the start
    import shutil
    shutil.rmtree(folder / "checkpoints")
    (folder / "metrics.jsonl").write_text('{"round": 0, "partial": true}\n')
    compare(["fedavg"], [0], {**two_rounds, "lr": 0.02}, out, echo=False)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["round"] for row in rows] == [0, 1] and "partial" not in rows[0]
    assert yaml.safe_load((folder / "config.yaml").read_text())["lr"] == 0.02


@pytest.mark.slow
def test_a_comparison_folder_in_use_is_refused_before_any_run(digits_data_dir, tmp_path):
    from fedhpro.files import RunFolderInUse, claim_run_folder

    out = tmp_path / "cmp"
    with claim_run_folder(out), pytest.raises(RunFolderInUse, match=f"out={out} is in use by run pid"):
        compare(["fedavg"], [0], settings(digits_data_dir, rounds=1), out, echo=False)
    assert not out.exists()  # nothing ran, nothing was left
