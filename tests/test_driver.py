"""The run lifecycle (fedhpro.engines.lifecycle) is the one run around any engine: a second, sequential engine
(tests/sequential_engine.py) run through it writes the simulator's bytes."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from conftest import FEATURE_DIM, TinyNet, make_federation
from sequential_engine import SequentialEngine

import fedhpro
from fedhpro.engines import lifecycle, printout, size_claims
from fedhpro.engines import summary as summaries
from fedhpro.experiment import build_experiment
from fedhpro.runtime import cpu_runtime, resolve_threads, torch_threads

#: privacy=client with max_epsilon: the client step privatizes on this engine too, and the run stops before the
#: round that would spend more than the budget (2 of 3 rounds run), with the summary's privacy block
PRIVATE = {"privacy": "client", "privacy.noise_multiplier": 1.0, "privacy.secure_noise": False,
           "privacy.max_epsilon": 2.0}


def settings(out: Path, method: str) -> dict:
    name, _, variant = method.partition("-")
    return {"rounds": 3, "local_epochs": 1, "batch_size": 8, "progress": False, "device": "cpu", "out": str(out),
            "feature_dim": FEATURE_DIM, "method": name, "eval_every": 2, "seed": 2,
            **({"fedhpro.match_steps": 2} if name == "fedhpro" else {}), **(PRIVATE if variant else {})}


def without_seconds(path: Path) -> dict:
    summary = json.loads(path.read_text())
    assert isinstance(summary.pop("seconds"), float)
    return summary


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedavg", "fedhpro", "fedavg-private"])
def test_a_sequential_engine_through_the_driver_gives_the_simulators_bytes(method, tmp_path):
    federation = make_federation([10, 12, 14], seed=3)
    expected = fedhpro.run(federation=federation, model=TinyNet, **settings(tmp_path / "simulator", method))
    config, out = expected.config, tmp_path / "sequential"
    device = torch.device("cpu")
    started = time.perf_counter()
    with cpu_runtime(), torch_threads(resolve_threads(config.run.threads)):  # as fedhpro.run runs
        parts = build_experiment(config, device, federation=federation, model_factory=TinyNet)
        engine = SequentialEngine(config, parts, device)
        run = lifecycle.Run(out, config.run, engine.protocol, started=started)
        lifecycle.execute(engine, run, config, data_name=federation.name, partition=parts.federation.partition,
                          notes=parts.federation.notes, resume_from=None, write_model=lambda folder: None,
                          voice=printout.ConsoleVoice())
    for name in ("metrics.jsonl", "config.yaml", "partition.json"):
        assert (out / name).read_bytes() == (expected.out / name).read_bytes(), name
    assert without_seconds(out / "summary.json") == without_seconds(expected.out / "summary.json")
    assert list(json.loads((out / "summary.json").read_text())) == list(expected.summary)  # the keys' order too
    ours, theirs = (torch.load(where / "server_state.pt", weights_only=True) for where in (out, expected.out))
    assert ours["completed_rounds"] == theirs["completed_rounds"] == (2 if "private" in method else 3)
    if "private" in method:
        assert expected.summary["privacy"]["stopped"].startswith("privacy budget: stopped before round 2 of 3")
    assert all(torch.equal(ours["server"]["weights"][key], value)
               for key, value in theirs["server"]["weights"].items())


# ---------------------------------------------------------------------------- the summary's per-client figures


def test_site_accuracy_is_the_unweighted_mean_and_median_of_the_last_evaluated_rounds_clients():
    # the hostile case of a 3-site run: site 2 forged correct = total = 10^9, so the pooled figure is
    # 100 * (300 + 0 + 10^9) / (300 + 300 + 10^9) ~ 99.99994 %; every site weighs alike here
    rows = [{"round": 0, "accuracy": {"all": 50.0, "AVG": 50.0}, "client_accuracy": [10.0, 20.0, 30.0]},
            {"round": 1, "accuracy": {"all": 99.99994, "AVG": 99.99994}, "client_accuracy": [100.0, 0.0, 100.0]},
            {"round": 2}]  # not evaluated: the figures are round 1's
    site = summaries.site_accuracy(rows)
    assert site["mean"] == pytest.approx(200.0 / 3) and site["median"] == 100.0
    assert site["tested"] == 3 and site["per_client"] == [100.0, 0.0, 100.0]
    # an untested client (None) is left out of both; an even count's median is the mean of the middle two
    site = summaries.site_accuracy([{"accuracy": {"AVG": 1.0}, "client_accuracy": [90.0, None, 10.0, 40.0, 20.0]}])
    assert (site["mean"], site["median"], site["tested"]) == (pytest.approx(40.0), 30.0, 4)
    assert printout.site_accuracy_line(site, 5) == "per client (unweighted, 4 of 5 tested): mean 40.0, median 30.0"
    # no evaluated round: None, which summary.json writes as null
    assert summaries.site_accuracy([{"round": 0}]) == {"mean": None, "median": None, "tested": 0, "per_client": []}


def test_no_evaluated_round_gives_none_not_nan():
    assert summaries.final_accuracy([{"round": 0}, {"round": 1}]) == {"AVG": None}


@pytest.mark.parametrize("sizes, max_share, warned", [
    # the forged claim: 10^9 of 10^9 + 600 samples, 99.99994 %
    ([("all", 300), ("all", 300), ("all", 10 ** 9)], 0.5, {2: ("1000000000 of the 1000000600", "(100.0%)")}),
    # 60 of 100 on "a"; "b" is tested on by one client only: nothing pooled, no warning
    ([("a", 60), ("a", 40), ("b", 10)], 0.5, {0: ("60 of the 100", "(60.0%)")}),
    ([("a", 60), ("a", 40), ("b", 10)], 0.6, {}),  # 60 % is not more than 0.6
    ([("a", 50), ("a", 50)], 0.5, {}),  # exactly half each
    ([("a", 3), ("a", 1), ("a", 0)], 0.7, {0: ("3 of the 4", "(75.0%)")}),
    ([("a", 100), ("a", 0)], 0.5, {}),  # the other client is not tested: one client, nothing pooled
    ([("a", 900), ("a", 100)], 1.0, {}),  # max_share=1: no cap, never a warning
    ([], 0.5, {}),  # one global model on shared test sets: no client's count is pooled
])
def test_pooled_share_warnings_name_each_client_above_max_share(sizes, max_share, warned):
    lines = size_claims.pooled_share_warnings(sizes, max_share)
    assert len(lines) == len(warned)
    for line, (k, words) in zip(lines, sorted(warned.items())):
        assert line.startswith(f"client {k} holds {words[0]} test samples of test set '{sizes[k][0]}' {words[1]}")
        assert f"aggregation.max_share={max_share:g}" in line and "site_accuracy" in line and "\n" not in line


def test_the_privacy_line_carries_epsilon_delta_and_the_stop():
    privacy = {"mode": "client", "delta": 3 ** -1.1, "epsilon": 1.23456, "rounds_run": 2}
    assert printout.privacy_line(privacy) == "privacy (client): (epsilon, delta) = (1.235, 0.299) after 2 rounds"
    stopped = {**privacy, "epsilon": 0.0, "rounds_run": 0, "stopped": "privacy budget: stopped before round 0"}
    assert printout.privacy_line(stopped) == ("privacy (client): (epsilon, delta) = (0, 0.299) after 0 rounds; "
                                              "stopped at privacy.max_epsilon")


def test_a_summary_holds_null_where_no_round_has_a_finite_accuracy():
    from types import SimpleNamespace

    options = SimpleNamespace(method="fedavg", seed=0, rounds=3)
    row = {"bytes_up": 1, "bytes_down": 2}
    rows = [{"round": 0, **row}, {"round": 1, **row, "accuracy": {"AVG": float("nan")}},  # every client untested
            {"round": 2, **row}]
    summary = summaries.run_summary(options, "d", 2, "cpu", rows, 1.0, [])
    assert (summary["accuracy"], summary["best_accuracy"]) == (None, None)
    text = json.dumps(summary, allow_nan=False)  # strict JSON: NaN would raise here
    assert json.loads(text)["accuracy"] is None
    rows[2]["accuracy"] = {"a": 40.0, "AVG": 40.0}
    summary = summaries.run_summary(options, "d", 2, "cpu", rows, 1.0, [])
    assert (summary["accuracy"], summary["best_accuracy"], summary["per_domain"]) == (40.0, 40.0, {"a": 40.0})
