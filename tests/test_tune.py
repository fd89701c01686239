"""``fedhpro tune``: the search finds a better learning rate than a bad one, by validation accuracy measured apart;
a study resumes where it stopped; two workers share one SQLite study without duplicating trials; a plug-in
method's declared space is searched; bad input is refused in one line."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from test_plugins import restored

import fedhpro.tune
from fedhpro import api
from fedhpro.cli import main as cli_main
from fedhpro.errors import ConfigError
from fedhpro.methods import Client, MethodSpec, Server
from fedhpro.options import option
from fedhpro.search_space import SHARED, Categorical, LogUniform
from fedhpro.tune import STUDY_FILE, TUNING_SEED, parse, tune

pytestmark = pytest.mark.slow


def settings(data_dir: Path, **extra) -> dict:
    """A tiny digits federation on which the learning rate matters: lr 0.001 stays near chance in 3 rounds,
    lr 0.01-0.1 learns."""
    return {"rounds": 3, "clients": 4, "data.fraction": 0.1, "data.syn_size": DIGITS_SYN_SIZE,
            "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 16, "local_epochs": 2, "device": "cpu",
            "data_dir": str(data_dir), **extra}


def argv(values: dict) -> list[str]:
    return [f"{key}={json.dumps(value) if not isinstance(value, str) else value}" for key, value in values.items()]


def trials_of(out: Path, method: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=method, storage=f"sqlite:///{out / STUDY_FILE}").get_trials()


def test_tune_finds_a_better_learning_rate_than_a_bad_one(digits_data_dir, tmp_path, capsys):
    out = tmp_path / "tune"
    # the gradient cap fixed (off), so that the six draws search lr alone, as this test's thresholds were set for
    tuned = tune(parse(["methods=[fedavg]", "trials=6", "pruner=none", f"out={out}",
                        *argv(settings(digits_data_dir, max_grad_norm=0))]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fedavg trial")]
    assert len(lines) == 6  # one line per finished trial
    best = tuned["methods"]["fedavg"]
    assert set(best) == {"lr"}  # local_epochs and max_grad_norm were given: fixed, not searched
    # the reference, measured apart from the study: the bad lr and the tuned one, each run here on its own
    reference = dict(settings(digits_data_dir), method="fedavg", seed=TUNING_SEED, validation=0.2, progress=False)
    bad = api.run(reference, {"lr": 0.001, "out": str(tmp_path / "bad")}).summary["validation"]["accuracy"]
    good = api.run(reference, {**best, "out": str(tmp_path / "good")}).summary["validation"]["accuracy"]
    assert good >= bad + 20
    assert 0.005 <= best["lr"] <= 0.2
    # the study's value is that run's validation accuracy (the same bytes), and every trial reported each round
    trials = trials_of(out, "fedavg")
    chosen = max((t for t in trials if t.value is not None), key=lambda t: t.value)
    assert chosen.value == pytest.approx(good, abs=1e-9)
    assert all(sorted(t.intermediate_values) == [0, 1, 2] for t in trials)
    rows = list(csv.DictReader((out / "fedavg" / "trials.csv").open()))
    assert [int(row["number"]) for row in rows] == list(range(6))
    assert yaml.safe_load((out / "tuned.yaml").read_text())["methods"]["fedavg"] == best
    assert yaml.safe_load((out / "fedavg" / "best.yaml").read_text())["settings"] == best


def test_a_study_resumes_where_it_stopped_and_refuses_other_settings(digits_data_dir, tmp_path):
    out = tmp_path / "tune"
    base = settings(digits_data_dir, rounds=1)
    tune(parse(["methods=[fedprox]", "trials=2", f"out={out}", *argv(base)]), echo=False)
    first = [(t.number, t.params, t.value) for t in trials_of(out, "fedprox")]
    assert len(first) == 2
    tune(parse(["methods=[fedprox]", "trials=3", f"out={out}", *argv(base)]), echo=False)
    after = trials_of(out, "fedprox")
    assert [(t.number, t.params, t.value) for t in after[:2]] == first  # kept, not run again
    assert len(after) == 3 and all(t.state.name in ("COMPLETE", "PRUNED") for t in after)
    assert len({t.params["lr"] for t in after}) == 3  # the resumed sampler does not draw trial 0's settings again
    assert sorted(p.name for p in (out / "fedprox").glob("trial-*")) == ["trial-0000", "trial-0001", "trial-0002"]
    with pytest.raises(ConfigError, match="other settings.*rounds"):
        tune(parse(["methods=[fedprox]", "trials=3", f"out={out}", *argv(dict(base, rounds=2))]), echo=False)


def test_two_workers_share_one_sqlite_study_without_duplicating_trials(digits_data_dir, tmp_path):
    out = tmp_path / "tune"
    tune(parse(["methods=[fedavg]", "trials=5", "jobs=2", f"out={out}", *argv(settings(digits_data_dir, rounds=1))]),
         echo=False)
    trials = trials_of(out, "fedavg")
    assert [t.number for t in trials] == list(range(5))  # exactly the budget, none past it
    assert all(t.state.name in ("COMPLETE", "PRUNED") for t in trials)
    assert len({t.params["lr"] for t in trials}) == 5  # no configuration tried twice
    assert len(list((out / "fedavg").glob("trial-*"))) == 5  # each ran once


@dataclasses.dataclass
class ScaledOptions:
    """A plug-in's knobs: one searched on a log scale, one among choices, one not searched."""

    weight: float = option(1.0, min=0.0, help="a weight", search=LogUniform(0.5, 2.0))
    mode: str = option("a", choices=("a", "b"), help="a mode", search=Categorical(["a", "b"]))
    fixed: int = option(3, min=0, help="not searched")


@dataclasses.dataclass
class SilentOptions:
    weight: float = option(1.0, help="declares no search space")


def test_a_plug_in_method_declaring_a_space_is_tuned_the_same_way(digits_data_dir, tmp_path, monkeypatch):
    from fedhpro import methods

    with restored(methods.REGISTRY, monkeypatch):
        methods.register("scaled", MethodSpec(name="scaled", options=ScaledOptions, server=Server,
                                              client=Client))
        out = tmp_path / "tune"
        tuned = tune(parse(["methods=[scaled]", "trials=3", f"out={out}", "pruner=none",
                            *argv(settings(digits_data_dir, rounds=1))]), echo=False)
        trials = trials_of(out, "scaled")
        assert len(trials) == 3
        for trial in trials:
            assert set(trial.params) == {"lr", "max_grad_norm", "scaled.weight", "scaled.mode"}
            assert 0.5 <= trial.params["scaled.weight"] <= 2.0 and trial.params["scaled.mode"] in ("a", "b")
            saved = yaml.safe_load((out / "scaled" / f"trial-{trial.number:04d}" / "config.yaml").read_text())
            assert saved["scaled"]["weight"] == trial.params["scaled.weight"]  # the run got the trial's value
            assert saved["scaled"]["fixed"] == 3 and saved["validation"] == 0.2
        assert set(tuned["methods"]["scaled"]) == {"lr", "max_grad_norm", "scaled.weight", "scaled.mode"}

        methods.register("silent", MethodSpec(name="silent", options=SilentOptions, server=Server,
                                              client=Client))
        with pytest.raises(ConfigError, match="'silent' declares no search space"):
            tune(parse(["methods=[silent]", "trials=2", f"out={tmp_path / 'x'}"]), echo=False)


@pytest.mark.parametrize("given, problem", [
    (["methods=[nosuch]"], "method='nosuch' is not valid"),
    (["trials=0"], "trials=0 gives no trial"),
    (["validation=0"], "validation=0 leaves no validation data"),
    (["pruner=hyperband"], "pruner='hyperband' is not valid"),
    (["method=fedavg"], "method= is set by tune"),
])
def test_bad_input_is_refused_in_one_line_before_any_trial(tmp_path, capsys, given, problem):
    out = tmp_path / "tune"
    assert cli_main(["tune", f"out={out}", *given]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and problem in err[0] and err[0].startswith("fedhpro: error:")
    assert not (out / STUDY_FILE).exists()


def test_the_median_pruner_stops_trials_below_the_median_of_the_finished_ones(digits_data_dir, tmp_path):
    out = tmp_path / "tune"
    tune(parse(["methods=[fedavg]", "trials=8", "pruner=median", f"out={out}",
                *argv(settings(digits_data_dir, max_grad_norm=0))]), echo=False)  # the draws of lr alone
    trials = trials_of(out, "fedavg")
    assert len(trials) == 8
    pruned = [t for t in trials if t.state.name == "PRUNED"]
    assert pruned  # the learning rates spread over [0.001, 0.1]: some trials fall behind
    for trial in pruned:
        step = max(trial.intermediate_values)
        assert 1 <= step < 2  # not in the first third of the 3 rounds, and before the last
        rows = [json.loads(line) for line in (out / "fedavg" / f"trial-{trial.number:04d}" / "metrics.jsonl")
                .read_text().splitlines()]
        assert len(rows) == step  # the run stopped in that round: its row was not written
        assert all(trial.intermediate_values[row["round"]] == row["validation"]["AVG"] for row in rows)
        earlier = sorted(t.intermediate_values[step] for t in trials
                         if t.state.name == "COMPLETE" and t.number < trial.number)
        assert len(earlier) >= 3 and trial.intermediate_values[step] < statistics.median(earlier)
    best = max((t for t in trials if t.state.name == "COMPLETE"), key=lambda t: t.value)
    assert yaml.safe_load((out / "tuned.yaml").read_text())["methods"]["fedavg"] == best.params


def test_a_tuning_killed_mid_trial_resumes_running_that_trials_place_again(digits_data_dir, tmp_path, monkeypatch):
    out = tmp_path / "tune"
    given = ["methods=[fedavg]", "trials=2", "pruner=none", f"out={out}",
             *argv(settings(digits_data_dir, rounds=6, progress=False))]
    worker = subprocess.Popen([sys.executable, "-m", "fedhpro", "tune", *given], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # until its first trial's run is under way
            if (out / "fedavg" / "trial-0000" / "metrics.jsonl").is_file():
                break
            time.sleep(0.2)
        else:
            pytest.fail("the first trial did not start within 90 s")
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
    assert [t.state.name for t in trials_of(out, "fedavg")] == ["RUNNING"]  # left behind by the killed process
    monkeypatch.setattr(fedhpro.tune, "GRACE_SECONDS", 1)  # its heartbeat stops: failed a second later
    time.sleep(1.5)
    tune(parse(given), echo=False)
    states = [t.state.name for t in trials_of(out, "fedavg")]
    assert states[0] == "FAIL" and states[1:] == ["COMPLETE", "COMPLETE"]  # the budget: two finished trials
    rows = list(csv.DictReader((out / "fedavg" / "trials.csv").open()))
    assert [row["state"] for row in rows] == ["failed", "complete", "complete"]
    assert "not counted, its place was run again" in rows[0]["why"]


def test_a_diverging_trial_counts_as_the_worst_result_and_the_study_goes_on(digits_data_dir, tmp_path, capsys):
    """Before, one learning rate that diverged (a NaN loss) stopped the whole tuning with an error; then it was
    chosen as the best when every trial diverged."""
    out = tmp_path / "tune"
    # FedProx's mu is searched; the learning rate is fixed where SGD with momentum 0.9 blows up
    tune(parse(["methods=[fedprox]", "trials=2", "pruner=none", f"out={out}",
                *argv(settings(digits_data_dir, rounds=1, lr=1e30))]))
    trials = trials_of(out, "fedprox")
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"] and [t.value for t in trials] == [0.0, 0.0]
    assert all("diverged in round 1: its mean cross-entropy" in t.user_attrs["diverged"] for t in trials)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("fedprox trial")]
    assert len(lines) == 2 and all("diverged (client 0 diverged in round 1" in line for line in lines)
    rows = list(csv.DictReader((out / "fedprox" / "trials.csv").open()))
    assert [row["state"] for row in rows] == ["diverged", "diverged"]
    assert all(row["why"].startswith("client 0 diverged in round 1: its mean cross-entropy") for row in rows)
    assert yaml.safe_load((out / "tuned.yaml").read_text())["methods"] == {}  # no complete trial: none chosen


def hostile_study(tuning: fedhpro.tune.Tuning, params: dict, distributions: dict) -> None:
    """``tuning``'s study of fedavg made by hand (as a study.db handed over would be): the settings it records are
    this tuning's, and it holds one finished trial of ``params``."""
    tuning.out.mkdir(parents=True)
    study = optuna.create_study(study_name="fedavg", storage=tuning.storage_url, direction="maximize")
    study.set_user_attr("settings", json.loads(json.dumps(fedhpro.tune._fixed_settings(tuning, "fedavg"),
                                                          default=str)))
    study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, value=99.0))


@pytest.mark.parametrize("params, problem", [
    ({"lr": 0.1, "tracker": "mlflow", "tracker_uri": "http://127.0.0.1:18765"}, "tracker=, a key it does not search"),
    ({"lr": "=HYPERLINK(1)"}, "lr='=HYPERLINK(1)' outside its space"),
    ({"lr": 7.5}, "lr=7.5 outside its space"),
])
def test_a_study_holding_other_keys_or_values_is_refused_and_nothing_is_written(tmp_path, capsys, params, problem):
    """A study.db whose best trial carries a tracker destination, a formula or a value outside the space: one
    line, and no best.yaml, tuned.yaml or trials.csv (before: copied into all three)."""
    out = tmp_path / "tune"
    given = ["methods=[fedavg]", "trials=1", f"out={out}", "local_epochs=1", "max_grad_norm=0"]
    distributions = {key: optuna.distributions.CategoricalDistribution([value]) for key, value in params.items()}
    hostile_study(parse(given), params, distributions)
    assert cli_main(["tune", *given]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and problem in err[0] and "was not written by this tuning" in err[0], err
    assert not any((out / name).exists() for name in ("tuned.yaml", "fedavg/best.yaml", "fedavg/trials.csv"))


def test_a_study_of_searched_values_is_written_with_its_best_trial(tmp_path):
    """The same hand-made study holding only a searched value in its space gives that value in tuned.yaml."""
    out = tmp_path / "tune"
    tuning = parse(["methods=[fedavg]", "trials=1", f"out={out}", "local_epochs=1", "max_grad_norm=0"])
    lr = optuna.distributions.FloatDistribution(SHARED["lr"].low, SHARED["lr"].high, log=True)
    hostile_study(tuning, {"lr": 0.0625}, {"lr": lr})
    assert tune(tuning, echo=False)["methods"] == {"fedavg": {"lr": 0.0625}}
    assert list(csv.reader((out / "fedavg" / "trials.csv").open())) == [
        ["number", "state", "why", "validation", "rounds_reported", "lr"],
        ["0", "complete", "", "99.0000", "0", "0.0625"]]


def test_lr_range_narrows_where_lr_is_searched_and_tuned_yaml_says_so(tmp_path, capsys):
    """``lr_range=[low,high]`` is the lr space: a study's lr of 0.0625 lies outside [0.001, 0.01] (refused, as any
    value outside the space) and inside [0.01, 0.1] (written, the range recorded in tuned.yaml)."""
    given = ["methods=[fedavg]", "trials=1", "local_epochs=1", "max_grad_norm=0"]
    lr = optuna.distributions.FloatDistribution(0.001, 0.1, log=True)
    narrow = parse([*given, f"out={tmp_path / 'narrow'}", "lr_range=[0.001,0.01]"])
    assert narrow.lr_space == LogUniform(0.001, 0.01)
    hostile_study(narrow, {"lr": 0.0625}, {"lr": lr})
    assert cli_main(["tune", *given, f"out={tmp_path / 'narrow'}", "lr_range=[0.001,0.01]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lr=0.0625 outside its space" in err[0], err
    wide = parse([*given, f"out={tmp_path / 'wide'}", "lr_range=[0.01,0.1]"])
    hostile_study(wide, {"lr": 0.0625}, {"lr": lr})
    tuned = tune(wide, echo=False)
    assert tuned["methods"] == {"fedavg": {"lr": 0.0625}} and tuned["tuning"]["lr_range"] == [0.01, 0.1]
    assert yaml.safe_load((tmp_path / "wide" / "tuned.yaml").read_text())["tuning"]["lr_range"] == [0.01, 0.1]
    # without lr_range= the space is the shared one, and tuned.yaml is as it always was: no lr_range in it
    default = parse([*given, f"out={tmp_path / 'default'}"])
    assert default.lr_space == SHARED["lr"] == LogUniform(0.001, 0.1)
    hostile_study(default, {"lr": 0.0625}, {"lr": lr})
    assert "lr_range" not in tune(default, echo=False)["tuning"]


def test_every_trial_draws_its_lr_inside_lr_range(digits_data_dir, tmp_path):
    out = tmp_path / "tune"
    tune(parse(["methods=[fedavg]", "trials=2", "pruner=none", f"out={out}", "lr_range=[0.0002,0.0004]",
                *argv(settings(digits_data_dir, rounds=1, local_epochs=1, max_grad_norm=0))]), echo=False)
    drawn = [trial.params["lr"] for trial in trials_of(out, "fedavg")]
    assert len(drawn) == 2 and all(0.0002 <= lr <= 0.0004 for lr in drawn), drawn
