"""The geometric median (``aggregation=geometric-median``, Weiszfeld's iterations): against closed forms (the
centre of a square, the middle of three points on a line, the Fermat point of a triangle) and an independent
float64 numpy Weiszfeld loop; on the simulator a x100 hostile client barely moves it while it drags the mean, and
Flower's real ServerApp and ClientApp give the same numbers to the bit. Its knob ``aggregation.iterations`` is the
rule's own (declared beside its code), listed by ``fedhpro config --keys`` and left out of the config.yaml of a run
that neither chooses the rule nor sets it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_robust_aggregation import SIZES, _hostile_round, float_weights

from fedhpro.config import AggregationOptions, load_config
from fedhpro.config_command import key_lines
from fedhpro.engines.robust import robust_replies
from fedhpro.errors import ConfigError
from fedhpro.privacy import check_combinations
from fedhpro.robust import AGGREGATION_RULES, REGISTRY
from fedhpro.robust.geometric_median import EPS, GeometricMedian, GeometricMedianOptions, geometric_median


def numpy_weiszfeld(points: np.ndarray, iterations: int) -> np.ndarray:
    """The reference: Weiszfeld's loop written out point by point in float64 numpy, from the mean."""
    z = points.mean(axis=0)
    for _ in range(iterations):
        numerator, denominator = np.zeros_like(z), 0.0
        for x in points:
            d = max(math.sqrt(float(((x - z) ** 2).sum())), EPS)
            numerator += x / d
            denominator += 1.0 / d
        z = numerator / denominator
    return z


def test_closed_forms():
    # the four corners of a square: the centre, at once (the mean is the median, every step stays there)
    square = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
    assert geometric_median(square, 1).tolist() == [1.0, 1.0]
    # three points on a line: the middle one (the mean 2 is pulled to 1 as the steps go on)
    line = torch.tensor([[0.0, 0.0], [1.0, 0.0], [5.0, 0.0]])
    torch.testing.assert_close(geometric_median(line, 200), torch.tensor([1.0, 0.0], dtype=torch.float64),
                               rtol=0, atol=1e-6)
    # an equilateral triangle with its centroid at the origin: the Fermat point is the centroid
    triangle = torch.tensor([[1.0, 0.0], [-0.5, math.sqrt(3) / 2], [-0.5, -math.sqrt(3) / 2]], dtype=torch.float64)
    torch.testing.assert_close(geometric_median(triangle, 5), torch.zeros(2, dtype=torch.float64),
                               rtol=0, atol=1e-12)
    # a right triangle (0,0), (4,0), (0,3): every angle < 120 degrees, so the Fermat point sees each side at
    # 120 degrees; the sum of distances there is sqrt((a^2 + b^2 + c^2) / 2 + 2 sqrt(3) * area)
    corners = torch.tensor([[0.0, 0.0], [4.0, 0.0], [0.0, 3.0]])
    z = geometric_median(corners, 500)
    total = float((corners.double() - z).norm(dim=1).sum())
    sides = [16.0, 9.0, 25.0]
    assert total == pytest.approx(math.sqrt(sum(sides) / 2 + 2 * math.sqrt(3) * 6.0), abs=1e-9)


def test_against_a_numpy_weiszfeld_loop():
    points = np.random.default_rng(3).normal(size=(7, 5))
    points[6] *= 100.0  # one far point: the median stays among the others, the mean does not
    for iterations in (1, 2, 10, 50):
        z = geometric_median(torch.from_numpy(points), iterations).numpy()
        np.testing.assert_allclose(z, numpy_weiszfeld(points, iterations), rtol=0, atol=1e-12)


def test_every_reply_gets_the_median_of_all_float_tensors_together_and_each_class_its_holders_row():
    rule = GeometricMedian(GeometricMedianOptions(iterations=20))
    replies = [{"a": torch.tensor([float(k), 0.0]), "b": torch.tensor([[float(k * k)]]),
                "n": torch.tensor(k)} for k in range(4)]
    out, metrics = rule.weights(replies, {}, [0, 1, 2, 3])
    points = np.array([[k, 0.0, k * k] for k in range(4)], dtype=np.float64)
    expected = numpy_weiszfeld(points, 20)  # one point per reply: a and b together
    for k, w in enumerate(out):
        np.testing.assert_allclose(w["a"].numpy(), expected[:2], rtol=0, atol=1e-6)
        np.testing.assert_allclose(w["b"].numpy(), expected[2:].reshape(1, 1), rtol=0, atol=1e-5)
        assert w["a"].dtype == torch.float32 and int(w["n"]) == k  # counters stay each reply's own
    assert metrics == {}
    rows = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
    new, changed = rule.rows(rows)
    assert new.tolist() == [[1.0, 1.0]] * 4 and changed == 0


def test_the_rule_and_its_knob_are_declared_beside_it():
    assert REGISTRY["geometric-median"] is GeometricMedian
    assert AGGREGATION_RULES["geometric-median"] == "the distances between updates"
    config = load_config(None, ["aggregation=geometric-median", "aggregation.iterations=7"])
    assert config.aggregation.rule == "geometric-median" and config.aggregation.iterations == 7
    assert config.to_dict()["aggregation"]["iterations"] == 7
    # a run that does not use the rule: config.yaml as before the rule existed
    assert "iterations" not in load_config(None, []).to_dict()["aggregation"]
    assert load_config(None, ["aggregation.iterations=9"]).to_dict()["aggregation"]["iterations"] == 9
    assert any(line.startswith("aggregation.iterations: geometric-median") for line in key_lines("digits-offline"))
    with pytest.raises(ConfigError, match=r"aggregation.iterations=0 is too small; it must be >= 1"):
        load_config(None, ["aggregation.iterations=0"])
    with pytest.raises(ConfigError, match="privacy=client cannot go with aggregation=geometric-median"):
        check_combinations(load_config(None, ["aggregation=geometric-median", "privacy=client"]))


def test_protocol_applies_the_rule_with_its_own_knob():
    replies = [{"weights": {"w": torch.tensor([float(x), 0.0])}, "num_examples": 1} for x in (0, 1, 5)]
    out, _ = robust_replies(replies, {"w": torch.zeros(2)}, AggregationOptions("geometric-median", iterations=200),
                            num_classes=2)
    for reply in out:
        torch.testing.assert_close(reply["weights"]["w"], torch.tensor([1.0, 0.0]), rtol=0, atol=1e-5)
    once, _ = robust_replies(replies, {"w": torch.zeros(2)}, AggregationOptions("geometric-median", iterations=1),
                             num_classes=2)
    first = numpy_weiszfeld(np.array([[0.0, 0.0], [1.0, 0.0], [5.0, 0.0]]), 1)
    np.testing.assert_allclose(once[0]["weights"]["w"].numpy(), first, rtol=0, atol=1e-6)


def test_a_registered_rule_brings_its_own_knobs_and_a_taken_name_is_refused():
    """The shape docs/how-to/robust-aggregation.md shows: a rule registered from Python with an options class; its
    knob is a config key at once (checked, listed, handed to the rule), and gone with the rule."""
    from dataclasses import dataclass

    from fedhpro.options import option
    from fedhpro.robust import RobustRule, rule_for

    @dataclass
    class ShrinkOptions:
        shrink_factor: float = option(0.5, gt=0.0, max=1.0, help="shrink: each update times this")

    class Shrink(RobustRule):
        needs = "each update"
        options_class = ShrinkOptions

        def __init__(self, options: ShrinkOptions) -> None:
            super().__init__(options)
            self.factor = options.shrink_factor

    REGISTRY.register("shrink-test", Shrink)
    try:
        config = load_config(None, ["aggregation=shrink-test", "aggregation.shrink_factor=0.2"])
        assert config.aggregation.shrink_factor == 0.2 and config.aggregation.trim == 0.2
        rule = rule_for(config.aggregation)
        assert isinstance(rule, Shrink) and rule.factor == 0.2
        # the chosen rule's knob after the knobs config.yaml always held; geometric-median's, at its default, left out
        assert list(config.to_dict()["aggregation"])[:7] == ["rule", "trim", "max_norm", "norm_multiple", "byzantine",
                                                             "shrink_factor", "max_share"]
        assert any(line.startswith("aggregation.shrink_factor: shrink") for line in key_lines("digits-offline"))
        with pytest.raises(ConfigError, match=r"aggregation.shrink_factor=2.0 is too large; it must be <= 1.0"):
            load_config(None, ["aggregation.shrink_factor=2"])

        @dataclass
        class Clash:
            trim: float = option(0.1)

        class Clashing(RobustRule):
            options_class = Clash

        with pytest.raises(ConfigError, match=r"the knob aggregation.trim of Clash is already trimmed-mean's"):
            REGISTRY.register("clash-test", Clashing)
    finally:
        REGISTRY.unregister("shrink-test")
    with pytest.raises(ConfigError, match=r"unknown config key 'aggregation.shrink_factor'"):
        load_config(None, ["aggregation.shrink_factor=0.2"])


# ----------------------------------------------------------------------------- the simulator


def test_simulator_geometric_median_of_the_replies_as_sent():
    initial, result, computed, bad, record = _hostile_round(AggregationOptions("geometric-median", iterations=30))
    w0 = float_weights(initial)
    names = [name for name, value in initial.items() if value.is_floating_point()]  # the replies' key order
    sent = []
    for k in range(5):  # the replies as sent: the hostile one is w0 + 100 * delta
        weights = {n: computed[k]["weights"][n].double() for n in w0}
        if k == bad:
            weights = {n: w0[n] + 100.0 * (weights[n] - w0[n]) for n in w0}
        sent.append(np.concatenate([weights[n].numpy().ravel() for n in names]))
    median = numpy_weiszfeld(np.array(sent), 30)
    start = 0
    for name in names:  # the method's n_k-weighted mean of five equal replies: the median
        size = initial[name].numel()
        np.testing.assert_allclose(result[name].double().numpy().ravel(), median[start:start + size],
                                   rtol=0, atol=1e-5)
        start += size
    # the hostile client moves it by far less than it moves the mean
    honest = np.mean([sent[k] for k in range(5) if k != bad], axis=0)
    mean = sum(sent[k] * (n / sum(SIZES)) for k, n in enumerate(SIZES))
    assert np.linalg.norm(median - honest) < 0.2 * np.linalg.norm(mean - honest)
    assert record.server["robust_updates"] == 5.0


# ----------------------------------------------------------------------------- both engines

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")


def test_flower_and_the_simulator_give_the_geometric_median_the_same_numbers(digits_data_dir, tmp_path,
                                                                             monkeypatch):
    """The real ServerApp (run_server) over a grid whose four nodes run the real ClientApp (partition mode), and
    fedhpro.run, FedProto (weights and class prototypes): metrics.jsonl and the model equal to the byte."""
    from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
    from flwr.app import Context, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    import fedhpro
    from fedhpro.flower.local_grid import LocalGrid, inside_a_run
    from fedhpro.flower.server import run_server

    for name in ("_run_id", "_node_id", "_task_id"):  # put back after the test
        monkeypatch.setattr(TaskIdentity, name, getattr(TaskIdentity, name, None))
    inside_a_run()
    clients = 4
    settings = {"rounds": 2, "clients": clients, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
                "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 16, "local_epochs": 1,
                "device": "cpu", "data_dir": str(digits_data_dir), "progress": False, "seed": 1,
                "method": "fedproto", "aggregation": "geometric-median", "aggregation.iterations": 5,
                "faults.scale": 0.25}
    grid = LocalGrid({}, tmp_path / "state")
    grid.contexts = {100 + k: Context(run_id=1, node_id=100 + k, state=RecordDict(), run_config={},
                                      node_config={"partition-id": k, "num-partitions": clients,
                                                   "state-dir": str(tmp_path / "state" / str(k))})
                     for k in range(clients)}
    flower_out, simulator_out = tmp_path / "flower", tmp_path / "simulator"
    run_server(grid, {}, {**settings, "out": str(flower_out)})
    fedhpro.run(settings, out=str(simulator_out))
    assert (flower_out / "metrics.jsonl").read_bytes() == (simulator_out / "metrics.jsonl").read_bytes()
    rows = [json.loads(line) for line in Path(flower_out / "metrics.jsonl").read_text().splitlines()]
    assert all(row["server"]["robust_updates"] == clients for row in rows)
    flower_model = torch.load(flower_out / "model.pt", weights_only=True)
    simulator_model = torch.load(simulator_out / "model.pt", weights_only=True)
    assert all(torch.equal(flower_model[key], simulator_model[key]) for key in simulator_model)
    saved = (simulator_out / "config.yaml").read_text()
    assert "rule: geometric-median" in saved and "iterations: 5" in saved
