"""``fedhpro tune``: a trial whose run diverged is recorded as diverged (trials.csv, the study, tuned.yaml's counts,
tuning.md, the printed lines), counted in the budget, shown apart from the complete trials and never chosen as the
best."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import optuna
import pytest
import torch
import yaml
from test_tune import argv, settings, trials_of

import fedhpro.tune
from fedhpro.search_space import SHARED
from fedhpro.tune import DIVERGED_VALUE, collapsed_outputs, diverged_models, nonfinite_outputs, parse, tune


@pytest.mark.slow
def test_a_run_whose_model_went_nan_without_the_check_firing_is_recorded_as_diverged(digits_data_dir, tmp_path,
                                                                                    capsys):
    """One local SGD step a round (a batch holds a client's whole data) at lr 1e30: the step's loss is finite, so the
    local training's check has nothing to see, but the weights it leaves give NaN logits; in the last round no later
    round's first batch stops the run. Before, such a trial was "complete" at a chance-level validation (7.71)."""
    out = tmp_path / "tune"
    tune(parse(["methods=[fedprox]", "trials=1", "pruner=none", f"out={out}",
                *argv(settings(digits_data_dir, rounds=1, local_epochs=1, batch_size=1024, max_grad_norm=0,
                               lr=1e30))]))
    printed = capsys.readouterr().out
    trials = trials_of(out, "fedprox")
    # the study: complete (counted in the budget), the worst value to the sampler, and why, per trial
    assert [t.state.name for t in trials] == ["COMPLETE"] and [t.value for t in trials] == [DIVERGED_VALUE]
    why = "after round 1 the global model gives NaN or infinite outputs on client 0's validation data"
    assert trials[0].user_attrs["diverged"].startswith(why)
    rows = list(csv.DictReader((out / "fedprox" / "trials.csv").open()))
    assert [row["state"] for row in rows] == ["diverged"]
    assert rows[0]["why"].startswith(why) and rows[0]["validation"] == ""
    tuned = yaml.safe_load((out / "tuned.yaml").read_text())
    assert "fedprox" not in tuned["methods"]  # a diverged trial is never the best: nothing to choose here
    assert tuned["tuning"]["outcomes"]["fedprox"] == {"trials": 1, "complete": 0, "diverged": 1, "pruned": 0,
                                                      "failed": 0, "running": 0,
                                                      "summary": "1 trial: 0 complete, 1 diverged"}
    assert not (out / "fedprox" / "best.yaml").exists()
    summary_md = (out / "tuning.md").read_text()
    assert "| fedprox | 1 | 0 | 1 | 0 | 0 | – | – | no complete trial: nothing chosen |" in summary_md
    assert summary_md.count(f"| fedprox | 0 | {why}") == 1
    lines = [line for line in printed.splitlines() if line.startswith("fedprox")]
    assert len(lines) == 2 and f"diverged ({why}" in lines[0]
    assert lines[1].startswith("fedprox: 1 trial: 0 complete, 1 diverged; no complete trial")


@pytest.mark.slow
def test_the_best_trial_is_never_a_diverged_one_and_every_outcome_is_counted_apart(tmp_path):
    """A study holding a diverged trial of a higher value (as one recorded before the value was the worst), a
    complete, a pruned and a failed one: the complete one is chosen, each is named and counted by its outcome."""
    out = tmp_path / "tune"
    tuning = parse(["methods=[fedavg]", "trials=3", f"out={out}", "local_epochs=1", "max_grad_norm=0"])
    lr = optuna.distributions.FloatDistribution(SHARED["lr"].low, SHARED["lr"].high, log=True)
    tuning.out.mkdir(parents=True)  # the study made by hand, with this tuning's settings (as tune_method makes it)
    study = optuna.create_study(study_name="fedavg", storage=tuning.storage_url, direction="maximize")
    study.set_user_attr("settings", json.loads(json.dumps(fedhpro.tune._fixed_settings(tuning, "fedavg"),
                                                          default=str)))
    state = optuna.trial.TrialState
    for params, value, trial_state, attrs, curve in [
            (0.0625, 99.0, state.COMPLETE, {"diverged": "client 1 diverged in round 2: x"}, {}),
            (0.01, 40.0, state.COMPLETE, {}, {}),
            (0.002, None, state.PRUNED, {}, {1: 12.5}),
            (0.003, None, state.FAIL, {}, {})]:
        study.add_trial(optuna.trial.create_trial(params={"lr": params}, distributions={"lr": lr}, value=value,
                                                  state=trial_state, user_attrs=attrs, intermediate_values=curve))
    tuned = tune(tuning, echo=False)  # three counted trials: none run
    assert tuned["methods"] == {"fedavg": {"lr": 0.01}}
    assert tuned["tuning"]["outcomes"]["fedavg"]["summary"] == ("3 trials: 1 complete, 1 diverged, 1 pruned; 1 failed "
                                                                "(not counted)")
    assert yaml.safe_load((out / "fedavg" / "best.yaml").read_text())["trial"] == 1
    rows = list(csv.DictReader((out / "fedavg" / "trials.csv").open()))
    assert [(row["state"], row["validation"]) for row in rows] == [
        ("diverged", ""), ("complete", "40.0000"), ("pruned", ""), ("failed", "")]
    assert rows[0]["why"] == "client 1 diverged in round 2: x (counted as validation 0)"
    assert rows[2]["why"] == "stopped by the pruner after round 2 at validation 12.50"
    assert "not counted" in rows[3]["why"] and rows[1]["why"] == ""
    summary_md = (out / "tuning.md").read_text()
    assert "| fedavg | 3 | 1 | 1 | 1 | 1 | 40.00 | 1 | lr=0.01 |" in summary_md
    assert "| fedavg | 0 | client 1 diverged in round 2: x | lr=0.0625 |" in summary_md


def simulator_of(model: torch.nn.Module, parts: list[torch.Tensor]) -> SimpleNamespace:
    """What :func:`diverged_models` reads of an engine: one global ``model`` validated on each client's ``parts``."""
    return SimpleNamespace(federation=SimpleNamespace(client_validation=[(x, torch.zeros(len(x))) for x in parts]),
                           models=SimpleNamespace(personal=False, eval_model=model),
                           server=SimpleNamespace(global_weights=model.state_dict, inference_model=lambda m: m),
                           tests=SimpleNamespace(amp="off"))


def test_a_model_whose_features_died_on_every_clients_data_is_diverged_not_one_dead_on_a_single_domain():
    """A hidden layer whose every unit is below zero for every input gives one output for all (the issue's 10.01:
    one prediction for every image); a layer dead on one client's inputs only still tells the others apart."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, -1.0]]))
        model[0].bias.zero_()
    positive, negative = torch.rand(8, 2) + 0.1, -torch.rand(8, 2) - 0.1  # two clients' inputs
    assert diverged_models(simulator_of(model, [positive, negative]), 2) is None  # most units dead on the negatives
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every unit below zero for every input
    why = diverged_models(simulator_of(model, [positive, negative]), 2)
    assert why == ("after round 3 the global model gives the same output for every validation sample of every client "
                   "(its features died: one prediction for every input)")
    assert diverged_models(simulator_of(model, [positive, negative]), 2, collapse=False) is None  # before the last
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
        model[0].bias.zero_()
    assert diverged_models(simulator_of(model, [positive, negative]), 0) == (
        "after round 1 the global model gives NaN or infinite outputs on client 0's validation data (its weights "
        "exploded)")


def test_outputs_count_as_diverged_on_a_nan_or_inf_or_one_output_for_all_not_on_a_class_without_a_prototype():
    """A nearest-prototype rule gives -inf to a class no client has a prototype of: a healthy model's outputs."""
    inf, nan = float("inf"), float("nan")
    assert not nonfinite_outputs(torch.tensor([[-1.0, 2.0], [0.0, 0.5]]))
    assert not nonfinite_outputs(torch.tensor([[-1.0, -inf], [-0.5, -inf]]))
    assert nonfinite_outputs(torch.tensor([[-1.0, nan], [0.0, 0.5]]))
    assert nonfinite_outputs(torch.tensor([[-1.0, 2.0], [inf, 0.5]]))
    assert nonfinite_outputs(torch.tensor([[-1.0, 2.0], [-inf, -inf]]))  # no class left to choose
    inputs = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]])
    assert collapsed_outputs(torch.tensor([[0.1, 0.7]] * 3), inputs)
    assert not collapsed_outputs(torch.tensor([[0.1, 0.7], [0.1, 0.7], [0.1, 0.70001]]), inputs)
    assert not collapsed_outputs(torch.tensor([[0.1, 0.7]] * 3), torch.ones(3, 2))  # the same input thrice
    assert not collapsed_outputs(torch.tensor([[0.1, 0.7]]), inputs[:1])
