"""Tests of the FedProx, MOON and FedRCL baselines against hand computations.

References: hand-written SGD steps (momentum, weight decay, proximal gradient),
closed-form values of the contrastive losses for known cosines, hand-picked
hardest positives / negatives on a batch of unit vectors at known angles, and
FedAvg's update where a method must reduce to it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import NUM_CLASSES, TinyBNNet, TinyNet, make_client, make_federation
from fedhpro.engines.simulator import Simulator
from fedhpro.methods.base import Client, MethodContext, clone_weights
from fedhpro.methods.training import TrainSettings, train_epochs
from fedhpro.methods.fedavg import FedAvgOptions
from fedhpro.methods import fedprox, fedrcl, moon
from fedhpro.methods.fedprox import FedProxClient, FedProxOptions, anchored_parameters, proximal_term
from fedhpro.methods.fedrcl import (FedRCLClient, FedRCLOptions, fedrcl_loss, pool_stage, relaxed_contrastive_terms,
                                    select_pairs, stage_modules)
from fedhpro.methods.moon import MoonClient, MoonOptions, moon_contrastive_loss, wrap_model
from fedhpro.models import build_model
from fedhpro.models.projection import ProjectionHeadNet

TRAIN = TrainSettings(epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-4)


def context(options, *, model=TinyNet, train=TRAIN) -> MethodContext:
    return MethodContext(model=model(), num_classes=NUM_CLASSES, options=options, train=train, seed=0)


def seeded(factory, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return factory().to(dtype)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fit(client_cls, options, model, data, *, train=TRAIN, state=None, payload=None, seed=5):
    payload = payload if payload is not None else {"weights": clone_weights(model)}
    client = client_cls(context(options, train=train))
    state = {} if state is None else state
    reply, metrics = client.fit(model, payload, data, state, gen(seed))
    return reply, metrics, state


def fedavg_weights(model, data, *, train=TRAIN, payload=None, seed=5):
    """The weights FedAvg's client returns from the same start, data and generator seed."""
    return fit(Client, FedAvgOptions(), model, data, train=train, payload=payload, seed=seed)[0]["weights"]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def distance(a, b) -> float:
    return math.sqrt(sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a if a[k].is_floating_point()))


# ----------------------------------------------------------------------------
# FedProx
# ----------------------------------------------------------------------------


def test_fedprox_mu_zero_equals_fedavg_bit_for_bit():
    data = make_client(20, [0, 1, 2, 3], seed=1)
    model_a, model_b = seeded(TinyBNNet, 3), seeded(TinyBNNet, 3)
    reply, metrics, _ = fit(FedProxClient, FedProxOptions(mu=0.0), model_a, data)
    assert_same_weights(reply["weights"], fedavg_weights(model_b, data))
    assert reply["num_examples"] == 20 and "prox" not in metrics


def test_proximal_term_hand_value_counts_only_received_trainable_parameters():
    module = nn.Module()
    module.a = nn.Parameter(torch.tensor([1.0, 2.0]))
    module.b = nn.Parameter(torch.tensor([[1.0]]))
    module.frozen = nn.Parameter(torch.tensor([5.0]), requires_grad=False)
    module.not_sent = nn.Parameter(torch.tensor([7.0]))
    module.register_buffer("stat", torch.tensor([9.0]))
    anchors = {"a": torch.zeros(2), "b": torch.tensor([[3.0]]), "frozen": torch.zeros(1), "stat": torch.zeros(1)}
    pairs = anchored_parameters(module, anchors)
    assert [p is module.a or p is module.b for p, _ in pairs] == [True, True]
    value = proximal_term(pairs, mu=0.5)
    # (0.5 / 2) * ((1^2 + 2^2) + (1 - 3)^2) = 0.25 * 9
    assert float(value.detach()) == pytest.approx(2.25)
    value.backward()
    assert torch.allclose(module.a.grad, 0.5 * torch.tensor([1.0, 2.0]))
    assert torch.allclose(module.b.grad, torch.tensor([[0.5 * -2.0]]))


def test_fedprox_full_batch_sgd_equals_hand_written_steps_float64():
    # full batch (n <= batch) over 3 epochs: step 1 starts at w^t (no prox gradient), steps 2-3 feel it
    data = make_client(6, [0, 1, 2], seed=2, dtype=torch.float64)
    train = TrainSettings(epochs=3, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-3)
    mu = 0.7
    model = seeded(TinyNet, 4, torch.float64)
    start = clone_weights(model)
    reply, metrics, _ = fit(FedProxClient, FedProxOptions(mu=mu), model, data, train=train, seed=11)

    ref = copy.deepcopy(model)
    ref.load_state_dict(start)
    params = dict(ref.named_parameters())
    buffers, proxes = {}, []
    g = gen(11)
    for _ in range(train.epochs):
        order = torch.randperm(6, generator=g)
        x, y = data.x[order], data.y[order]
        ce = F.cross_entropy(ref.classifier(ref.features(x)), y)
        grads = torch.autograd.grad(ce, list(params.values()))
        with torch.no_grad():
            proxes.append(mu / 2 * sum(float((p - start[n]).pow(2).sum()) for n, p in params.items()))
            for (name, p), grad in zip(params.items(), grads):
                step = grad + mu * (p - start[name]) + train.weight_decay * p
                buffers[name] = step.clone() if name not in buffers else train.momentum * buffers[name] + step
                p -= train.lr * buffers[name]
    for name, p in params.items():
        assert torch.allclose(reply["weights"][name], p, atol=1e-12, rtol=0), name
    assert proxes[0] == 0.0 and proxes[1] > 0
    assert metrics["prox"] == pytest.approx(sum(proxes) / 3, rel=1e-9)


def test_fedprox_larger_mu_stays_closer_to_the_global_weights():
    data = make_client(24, [0, 1, 2, 3], seed=3)
    train = TrainSettings(epochs=4, batch_size=8, lr=0.05, momentum=0.5, weight_decay=0.0)
    distances = []
    for mu in (0.0, 0.3, 1.0, 3.0):  # lr * mu / (1 - momentum) <= 0.3: no overshoot
        model = seeded(TinyNet, 0)
        start = clone_weights(model)
        reply, _, _ = fit(FedProxClient, FedProxOptions(mu=mu), model, data, train=train)
        distances.append(distance(reply["weights"], start))
    assert all(a > b for a, b in zip(distances, distances[1:])), distances


# ----------------------------------------------------------------------------
# MOON
# ----------------------------------------------------------------------------


def test_moon_wrapped_model_shapes():
    wrapped = wrap_model(TinyNet(), MoonOptions(projection_head="authors", projection_dim=6), NUM_CLASSES)
    assert isinstance(wrapped, ProjectionHeadNet)
    assert isinstance(wrapped.classifier, nn.Linear)
    assert (wrapped.classifier.in_features, wrapped.classifier.out_features) == (6, NUM_CLASSES)
    assert (wrapped.feature_dim, wrapped.num_classes, wrapped.base_feature_dim) == (6, NUM_CLASSES, 16)
    head = wrapped.features
    assert isinstance(head[1], nn.Linear) and (head[1].in_features, head[1].out_features) == (16, 16)
    assert isinstance(head[2], nn.ReLU)
    assert isinstance(head[3], nn.Linear) and (head[3].in_features, head[3].out_features) == (16, 6)
    x = torch.randn(3, 3, 8, 8)
    assert wrapped.features(x).shape == (3, 6)
    assert torch.equal(wrapped(x), wrapped.classifier(wrapped.features(x)))

    cnn = wrap_model(build_model("cnn", 10, (3, 32, 32), feature_dim=32), MoonOptions(projection_head="authors"), 10)
    assert cnn.features(torch.randn(2, 3, 32, 32)).shape == (2, 256)
    assert cnn(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert (cnn.classifier.in_features, cnn.feature_dim) == (256, 256)


def test_moon_contrastive_loss_for_known_cosines():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    z_glob = torch.tensor([[3.0, 0.0], [1.0, 0.0]])  # cos 1, cos 0
    z_prev = torch.tensor([[0.0, 5.0], [0.0, 1.0]])  # cos 0, cos 1
    first = -math.log(math.exp(2) / (math.exp(2) + 1))  # tau = 0.5: e^{1/0.5} vs e^{0}
    second = -math.log(1 / (1 + math.exp(2)))
    assert float(moon_contrastive_loss(z[:1], z_glob[:1], z_prev[:1], 0.5)) == pytest.approx(first, rel=1e-6)
    assert float(moon_contrastive_loss(z, z_glob, z_prev, 0.5)) == pytest.approx((first + second) / 2, rel=1e-6)


def wrapped_tiny(seed=0, base=TinyNet, projection_dim=8):
    torch.manual_seed(seed)
    return wrap_model(base(), MoonOptions(projection_head="authors", projection_dim=projection_dim), NUM_CLASSES)


def test_moon_first_participation_equals_fedavg_and_stores_previous_weights():
    data = make_client(20, [0, 1, 2, 3], seed=4)
    model, twin = wrapped_tiny(1, TinyBNNet), wrapped_tiny(1, TinyBNNet)
    reply, metrics, state = fit(MoonClient, MoonOptions(projection_dim=8), model, data)
    assert_same_weights(reply["weights"], fedavg_weights(twin, data))
    assert "moon" not in metrics
    previous = state["previous_weights"]
    assert_same_weights(previous, model.state_dict())
    model_state = model.state_dict()
    assert all(previous[k].data_ptr() != model_state[k].data_ptr() for k in previous)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert not torch.equal(previous["classifier.weight"], model.classifier.weight)
    assert not model.features._forward_pre_hooks


def test_moon_previous_equal_to_global_gives_log2_per_sample():
    data = make_client(20, [0, 1, 2, 3], seed=4)
    model = wrapped_tiny(2)
    payload = {"weights": clone_weights(model)}
    state = {"previous_weights": clone_weights(model)}
    _, metrics, _ = fit(MoonClient, MoonOptions(mu=2.5, projection_dim=8), model, data, state=state, payload=payload)
    assert metrics["moon"] == pytest.approx(2.5 * math.log(2), rel=1e-6)
    assert not model.features._forward_pre_hooks


def test_moon_term_uses_frozen_eval_mode_global_and_previous_models():
    # one full-batch step: the reported term is the loss at the received weights, with the current
    # model in train mode (batch statistics) and the global / previous models in eval mode (running stats)
    data = make_client(12, [0, 1, 2, 3], seed=6, dtype=torch.float64)
    train = TrainSettings(epochs=1, batch_size=16, lr=0.1, momentum=0.9, weight_decay=0.0)
    model = wrapped_tiny(3, TinyBNNet).double()
    with torch.no_grad():  # non-trivial running statistics, so train and eval mode differ
        model.features[0][1].running_mean.uniform_(-0.5, 0.5)
        model.features[0][1].running_var.uniform_(0.5, 2.0)
    previous_model = wrapped_tiny(4, TinyBNNet).double()
    payload = {"weights": clone_weights(model)}
    state = {"previous_weights": clone_weights(previous_model)}
    current = copy.deepcopy(model).train()
    global_model = copy.deepcopy(model).eval()
    previous_model.eval()
    with torch.no_grad():
        expected = moon_contrastive_loss(current.features(data.x), global_model.features(data.x),
                                         previous_model.features(data.x), 0.5)
    reply, metrics, state = fit(MoonClient, MoonOptions(mu=1.0, projection_dim=8), model, data, train=train,
                                state=state, payload=payload)
    assert metrics["moon"] == pytest.approx(float(expected), rel=1e-9)
    # the term changes the update of the feature extractor (it acts on z, not on the classifier)
    twin = wrapped_tiny(3, TinyBNNet).double()
    twin.load_state_dict(payload["weights"])
    plain = fedavg_weights(twin, data, train=train, payload=payload)
    assert not torch.allclose(reply["weights"]["features.3.weight"], plain["features.3.weight"])
    assert torch.allclose(reply["weights"]["classifier.weight"], plain["classifier.weight"], atol=1e-12, rtol=0)
    # and the stored previous weights are now this round's local model
    assert_same_weights(state["previous_weights"], model.state_dict())


# ----------------------------------------------------------------------------
# FedRCL
# ----------------------------------------------------------------------------


def test_fedrcl_stage_modules_fallback_and_provided_list():
    bn = TinyBNNet()
    modules, include_z = stage_modules(bn)
    assert modules == [bn.features[2]] and include_z  # the ReLU before Flatten, plus z

    cnn = build_model("cnn", 10, (3, 32, 32))
    modules, include_z = stage_modules(cnn)
    assert modules == [cnn.features[2], cnn.features[5]] and include_z  # the two max-pools, plus z
    captured = []
    handles = [m.register_forward_hook(lambda m, a, out: captured.append(pool_stage(out))) for m in modules]
    z = cnn.features(torch.randn(2, 3, 32, 32))
    for h in handles:
        h.remove()
    assert [tuple(c.shape) for c in captured] == [(2, 32), (2, 64)] and z.shape == (2, 512)

    assert stage_modules(TinyNet()) == ([], True)

    class Staged(TinyBNNet):
        def __init__(self):
            super().__init__()
            self.stage_modules = [self.features[0], self.features[5]]

    staged = Staged()
    assert stage_modules(staged) == ([staged.features[0], staged.features[5]], False)


ANGLES = [0.0, 20.0, 50.0, 90.0, 200.0, 300.0]  # degrees: unit vectors u_i = (cos, sin)
LABELS = [0, 0, 0, 1, 1, 2]


def angle_batch(scale=None):
    theta = torch.tensor(ANGLES, dtype=torch.float64) * math.pi / 180
    u = torch.stack([theta.cos(), theta.sin()], 1)
    if scale is not None:  # un-normalised inputs: the loss normalises them
        u = u * torch.tensor(scale, dtype=torch.float64)[:, None]
    return u, torch.tensor(LABELS)


def cos_deg(i, j):
    return math.cos(math.radians(ANGLES[i] - ANGLES[j]))


def test_fedrcl_picks_hardest_positive_and_negatives_on_a_hand_made_batch():
    u, labels = angle_batch()
    pairs = select_pairs(u, labels, 2)
    # least similar same-class batch-mate (hand-derived from the angles)
    assert pairs.has_positive.tolist() == [True, True, True, True, True, False]
    assert pairs.positive_index[:5].tolist() == [2, 2, 0, 4, 3]
    # the two most similar other-class samples, descending
    assert pairs.negative_index.tolist()[:5] == [[5, 3], [3, 5], [3, 5], [2, 1], [5, 2]]
    assert select_pairs(u, labels, 1).negative_index[:, 0].tolist()[:5] == [5, 3, 3, 2, 5]


def test_fedrcl_loss_values_against_hand_computation():
    tau, threshold = 0.5, 0.7
    positives = {0: 2, 1: 2, 2: 0, 3: 4, 4: 3}
    negatives = {0: [5, 3], 1: [3, 5], 2: [3, 5], 3: [2, 1], 4: [5, 2]}
    scl_terms = []
    for i, p in positives.items():
        top = math.exp(cos_deg(i, p) / tau)
        scl_terms.append(-math.log(top / (top + sum(math.exp(cos_deg(i, n) / tau) for n in negatives[i]))))
    hand_scl = sum(scl_terms) / 5  # sample 5 has no positive: no term, not counted
    # m' = hardest positive if >= 0.7 else -1: only sample 1 (cos 30 deg = 0.866) keeps it
    relaxed = [-1.0, cos_deg(1, 2), -1.0, -1.0, -1.0, -1.0]
    hand_div = sum(math.log1p(math.exp((m - 1) / tau)) for m in relaxed) / 6

    u, labels = angle_batch(scale=[1.0, 2.0, 0.5, 3.0, 1.5, 4.0])
    scl, div = relaxed_contrastive_terms(u, labels, tau, threshold, 2)
    assert float(scl) == pytest.approx(hand_scl, rel=1e-12)
    assert float(div) == pytest.approx(hand_div, rel=1e-12)

    # two stages averaged: the second stage is the same batch -> same values; beta scales the penalty
    options = FedRCLOptions(tau=tau, threshold=threshold, beta=0.3)
    terms = fedrcl_loss([u, u.flip(1)], labels, options)  # flipping the axes keeps every cosine
    assert float(terms["rcl"]) == pytest.approx(hand_scl, rel=1e-12)
    assert float(terms["div"]) == pytest.approx(0.3 * hand_div, rel=1e-12)
    assert "div" not in fedrcl_loss([u], labels, FedRCLOptions(tau=tau, beta=0.0))


def test_fedrcl_divergence_penalty_hand_value():
    # two same-class samples at cosine 0.8 >= 0.7: softplus((0.8 - 1) / 0.05) = log(1 + e^-4) each
    u = torch.tensor([[1.0, 0.0], [0.8, 0.6]], dtype=torch.float64)
    scl, div = relaxed_contrastive_terms(u, torch.tensor([1, 1]), 0.05, 0.7, 2)
    assert float(div) == pytest.approx(math.log1p(math.exp(-4.0)), rel=1e-12)
    assert float(scl) == 0.0  # no negatives: -log(e^{p/tau} / e^{p/tau}) = 0
    # below the threshold: m' = -1, a constant softplus(-2 / tau) with no gradient
    v = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=torch.float64, requires_grad=True)
    _, div = relaxed_contrastive_terms(v, torch.tensor([1, 1]), 0.05, 0.7, 2)
    assert float(div.detach()) == pytest.approx(math.log1p(math.exp(-40.0)), rel=1e-12)
    (grad,) = torch.autograd.grad(div, v, allow_unused=True, materialize_grads=True)
    assert torch.count_nonzero(grad) == 0


def test_fedrcl_batch_without_positives_gives_fedavg_update():
    # 4 samples, 4 classes, one full batch: no sample has a same-class batch-mate
    data = make_client(4, [0, 1, 2, 3], seed=7)
    train = TrainSettings(epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-4)
    model, twin = seeded(TinyBNNet, 5), seeded(TinyBNNet, 5)
    reply, metrics, _ = fit(FedRCLClient, FedRCLOptions(), model, data, train=train)
    assert metrics["rcl"] == 0.0
    assert metrics["div"] == pytest.approx(math.log1p(math.exp(-2 / 0.05)), rel=1e-6)
    assert_same_weights(reply["weights"], fedavg_weights(twin, data, train=train))


def test_fedrcl_fit_uses_hooked_stages_and_removes_hooks():
    data = make_client(12, [0, 1, 2], seed=8, dtype=torch.float64)
    train = TrainSettings(epochs=1, batch_size=16, lr=0.1, momentum=0.9, weight_decay=0.0)
    options = FedRCLOptions(tau=0.2, beta=0.5)
    model = seeded(TinyBNNet, 6, torch.float64)
    ref = copy.deepcopy(model).train()
    with torch.no_grad():
        stage = pool_stage(ref.features[:3](data.x))  # conv, BN (batch statistics), ReLU
        z = ref.features[3:](ref.features[:3](data.x))
        expected = fedrcl_loss([stage, z], data.y, options)
    _, metrics, _ = fit(FedRCLClient, options, model, data, train=train)
    assert metrics["rcl"] == pytest.approx(float(expected["rcl"]), rel=1e-9)
    assert metrics["div"] == pytest.approx(float(expected["div"]), rel=1e-9)
    assert all(not m._forward_hooks for m in model.modules())
    # beta = 0: no penalty at all
    _, metrics, _ = fit(FedRCLClient, FedRCLOptions(beta=0.0), seeded(TinyBNNet, 6, torch.float64), data, train=train)
    assert "div" not in metrics and "rcl" in metrics


# ----------------------------------------------------------------------------
# one simulator round per method
# ----------------------------------------------------------------------------


def run_rounds(spec, model_factory, rounds=1, **kwargs):
    federation = make_federation([10, 12, 9], classes=[[0, 1], [1, 2, 3], [0, 3]])
    federation.client_domains = ["a", "b", "a"]  # per-client evaluation (classifier-only exchange) needs test sets
    train = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-5)
    sim = Simulator(spec, spec.options(), federation, model_factory, train, rounds=rounds, **kwargs)
    # the clients' uploads, one list per round (captured at fit: the server folds each reply's weights into
    # its running sum as the reply arrives, so what reaches aggregate no longer holds them)
    captured = []
    fit = sim.client.fit

    def capture(model, payload, data, state, generator):
        reply, metrics = fit(model, payload, data, state, generator)
        captured[-1].append(reply)
        return reply, metrics

    sim.client.fit = capture
    records = []
    for r in range(rounds):
        captured.append([])
        records.append(sim.run_round(r))
    return sim, records, captured


def check_replies(replies, reference):
    for reply in replies:
        assert set(reply) == {"weights", "num_examples"}
        assert reply["weights"].keys() == reference.keys()
        for name, tensor in reply["weights"].items():
            assert tensor.shape == reference[name].shape


@pytest.mark.parametrize("spec,factory,term", [
    (fedprox.METHOD, TinyBNNet, "prox"),
    (fedrcl.METHOD, TinyBNNet, "rcl"),
    (moon.METHOD, lambda: moon.METHOD.model_wrapper(TinyBNNet(), MoonOptions(), NUM_CLASSES), None),
])
def test_one_simulator_round(spec, factory, term):
    sim, records, captured = run_rounds(spec, factory)
    check_replies(captured[0], sim.server.global_weights())
    assert records[0].accuracy is not None and "AVG" in records[0].accuracy
    if term is not None:
        assert term in records[0].train
    assert spec.name in ("fedprox", "fedrcl", "moon") and spec.options is not None


def test_moon_two_simulator_rounds_use_the_previous_local_models():
    spec = moon.METHOD
    factory = lambda: spec.model_wrapper(TinyBNNet(), MoonOptions(projection_head="authors"), NUM_CLASSES)  # noqa: E731
    sim, records, captured = run_rounds(spec, factory, rounds=2)
    assert "moon" not in records[0].train and "moon" in records[1].train
    assert all("previous_weights" in state for state in sim.client_states)
    check_replies(captured[1], sim.server.global_weights())
    assert sim.server.global_weights()["classifier.weight"].shape == (NUM_CLASSES, 256)


def test_fedprox_classifier_only_exchange_applies_prox_to_the_classifier():
    sim, records, captured = run_rounds(fedprox.METHOD, TinyBNNet, shared="classifier")
    assert set(sim.server.global_weights()) == {"classifier.weight", "classifier.bias"}
    check_replies(captured[0], sim.server.global_weights())
    assert "prox" in records[0].train


def test_train_epochs_clips_the_global_gradient_norm_before_the_step():
    # one full batch, plain SGD (lr 1, no momentum/decay): the step is -g * min(1, c / (||g|| + 1e-6)),
    # torch's clip_grad_norm_ (with its epsilon)
    data = make_client(8, [0, 1, 2, 3], seed=9, dtype=torch.float64)
    model = seeded(TinyBNNet, 7, torch.float64)
    start = clone_weights(model)
    ref = copy.deepcopy(model).train()
    loss = F.cross_entropy(ref(data.x), data.y)
    names = [name for name, _ in ref.named_parameters()]
    grads = torch.autograd.grad(loss, [p for _, p in ref.named_parameters()])
    norm = float(torch.sqrt(sum((g ** 2).sum() for g in grads)))
    limit = norm / 4  # clipping active: the step shrinks by about 4
    factor = limit / (norm + 1e-6)
    train = TrainSettings(epochs=1, batch_size=8, lr=1.0, momentum=0.0, weight_decay=0.0, max_grad_norm=limit)
    train_epochs(model, data, train, torch.Generator().manual_seed(0))
    after = dict(model.named_parameters())
    for name, grad in zip(names, grads):
        torch.testing.assert_close(after[name].detach(), start[name] - grad * factor, rtol=0, atol=1e-12, msg=name)
    # FedRCL's default is the authors' clipping at 10; 0 switches it off
    assert FedRCLOptions().max_grad_norm == 10.0
