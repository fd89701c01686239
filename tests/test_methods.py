"""Tests of the methods' server and client parts (``fedhpro.methods``) against independent references.

References used: per-sample autograd loops (one sample at a time), per-class
Python loops for prototypes and Eq. 10, the closed form of a linear head's
input gradient ``W^T (softmax(Wz + b) - e_y)``, a hand-written SGD loop with
momentum and weight decay, and hand-built replies.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FEATURE_DIM, NUM_CLASSES, TinyBNNet, TinyNet, make_client

from fedhpro.errors import UpdateError
from fedhpro.methods import METHODS, MethodContext, TrainSettings
from fedhpro.methods.base import clone_weights
from fedhpro.methods.fedavg import FedAvgOptions
from fedhpro.methods.fedhpro import FedHProOptions
from fedhpro.methods.fedhpro.client import FedHProClient
from fedhpro.methods.fedhpro.server import FedHProServer

TRAIN = TrainSettings(epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-4)


def context(options, *, model=TinyNet, train=TRAIN, seed=0, num_classes=NUM_CLASSES) -> MethodContext:
    return MethodContext(model=model(), num_classes=num_classes, options=options, train=train, seed=seed)


def seeded_model(model=TinyNet, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return model().to(dtype)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def fedhpro_payload(model, seed=0, num_hyper=5, dtype=torch.float32) -> dict:
    hyper = torch.randn(NUM_CLASSES, num_hyper, FEATURE_DIM, generator=generator(seed + 77)).to(dtype)
    return {"weights": clone_weights(model), "hyper_prototypes": hyper}


def fit_fedhpro(options, data, *, model_cls=TinyNet, model_seed=0, train=TRAIN, gen_seed=5, dtype=torch.float32):
    """Run FedHProClient.fit once; returns (received weights, payload, reply, metrics). With Table 6's global
    prototypes (``options.prototypes != "hyper"``) the payload's P holds no class yet (round 0)."""
    model = seeded_model(model_cls, model_seed, dtype)
    payload = fedhpro_payload(model, num_hyper=options.num_hyper, dtype=dtype)
    if options.prototypes != "hyper":
        payload.update(global_prototypes=torch.zeros(NUM_CLASSES, FEATURE_DIM, dtype=dtype),
                       global_mask=torch.zeros(NUM_CLASSES, dtype=torch.bool))
    received = copy.deepcopy(payload["weights"])
    client = FedHProClient(context(options, model=model_cls, train=train))
    reply, metrics = client.fit(model, payload, data, {}, generator(gen_seed))
    return received, payload, reply, metrics


def model_with(weights, model_cls=TinyNet, dtype=torch.float32):
    model = model_cls().to(dtype)
    model.load_state_dict(weights)
    model.eval()
    return model


# ----------------------------------------------------------------------------
# independent references
# ----------------------------------------------------------------------------


def loop_class_gradients(model, x, y, num_classes):
    """mean over the samples of each class of d CE(h(z_i), y_i) / d z_i, one sample at a time (eval mode)."""
    sums = torch.zeros(num_classes, FEATURE_DIM, dtype=torch.float64)
    counts = [0] * num_classes
    for i in range(x.shape[0]):
        with torch.no_grad():
            z = model.features(x[i:i + 1])
        z = z.detach().requires_grad_(True)
        loss = F.cross_entropy(model.classifier(z), y[i:i + 1])
        (g,) = torch.autograd.grad(loss, z)
        sums[int(y[i])] += g[0].double()
        counts[int(y[i])] += 1
    return torch.stack([sums[c] / counts[c] if counts[c] else sums[c] for c in range(num_classes)]), counts


def loop_prototypes(model, x, y, num_classes):
    with torch.no_grad():
        z = [model.features(x[i:i + 1])[0].double() for i in range(x.shape[0])]
    out = torch.zeros(num_classes, FEATURE_DIM, dtype=torch.float64)
    for c in range(num_classes):
        members = [z[i] for i in range(len(z)) if int(y[i]) == c]
        if members:
            out[c] = sum(members) / len(members)
    return out


def loop_margin(prototypes, held: list[int], num_classes: int, normalized: bool = False) -> float:
    """Eq. 10: sum over ordered pairs c1 != c2 of held classes of ||p1 - p2||_2, divided by (C-1)^2."""
    total = 0.0
    for c1 in held:
        for c2 in held:
            if c1 == c2:
                continue
            p1, p2 = prototypes[c1].double(), prototypes[c2].double()
            if normalized:
                p1, p2 = p1 / p1.norm(), p2 / p2.norm()
            total += math.sqrt(sum(float(v) ** 2 for v in (p1 - p2)))
    return total / (num_classes - 1) ** 2


def closed_form_head_gradient(W, b, z, c):
    """d CE(Wz + b, c) / dz = W^T (softmax(Wz + b) - e_c)."""
    p = torch.softmax(W.double() @ z.double() + b.double(), 0)
    p[c] -= 1.0
    return W.double().T @ p


# ----------------------------------------------------------------------------
# FedAvg client: a hand-written SGD loop
# ----------------------------------------------------------------------------


def test_fedavg_client_equals_hand_written_sgd_with_momentum_and_weight_decay():
    # n = 2 * batch + 1: the trailing batch of one sample is skipped, as documented
    data = make_client(17, [0, 1, 2, 3], seed=3, dtype=torch.float64)
    train = TrainSettings(epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-3)
    model = seeded_model(TinyNet, 1, torch.float64)
    start = clone_weights(model)
    client = METHODS["fedavg"].client(context(FedAvgOptions(), train=train))
    reply, metrics = client.fit(model, {"weights": start}, data, {}, generator(9))
    assert reply["num_examples"] == 17

    # reference: the same batch order (one randperm per epoch from the generator), manual SGD updates
    ref = model_with(copy.deepcopy(start), dtype=torch.float64)
    ref.train()
    params = dict(ref.named_parameters())
    buffers = {name: None for name in params}
    g = generator(9)
    losses = []
    for _ in range(train.epochs):
        order = torch.randperm(17, generator=g)
        for start_index in range(0, 17, 8):
            index = order[start_index:start_index + 8]
            if index.numel() < 2:
                continue
            loss = F.cross_entropy(ref(data.x[index]), data.y[index])
            grads = torch.autograd.grad(loss, list(params.values()))
            with torch.no_grad():
                for (name, p), grad in zip(params.items(), grads):
                    step = grad + train.weight_decay * p
                    buffers[name] = step.clone() if buffers[name] is None else train.momentum * buffers[name] + step
                    p -= train.lr * buffers[name]
            losses.append(float(loss.detach()))
    assert len(losses) == 4  # 2 epochs x 2 full batches
    for name, p in params.items():
        torch.testing.assert_close(reply["weights"][name], p.detach(), rtol=0, atol=1e-12, msg=name)
    assert metrics["ce"] == pytest.approx(sum(losses) / len(losses), rel=1e-12)
    assert metrics["loss"] == pytest.approx(metrics["ce"], rel=1e-12)


# ----------------------------------------------------------------------------
# FedHPro server
# ----------------------------------------------------------------------------


def test_initial_hyper_prototypes_shape_distribution_and_seeding():
    options = FedHProOptions(num_hyper=7)
    a = FedHProServer(context(options, seed=3)).hyper
    b = FedHProServer(context(options, seed=3)).hyper
    c = FedHProServer(context(options, seed=4)).hyper
    assert a.shape == (NUM_CLASSES, 7, FEATURE_DIM)
    assert a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # N(0, 1): 448 draws, mean within ~5 standard errors of 0, std near 1
    assert abs(float(a.mean())) < 5 / math.sqrt(a.numel())
    assert 0.85 < float(a.std()) < 1.15
    # the broadcast carries the weights and these hyper-prototypes
    payload = FedHProServer(context(options, seed=3)).broadcast(0)
    assert set(payload) == {"weights", "hyper_prototypes"}
    assert torch.equal(payload["hyper_prototypes"], a)


def make_reply(server, *, scale, num_examples, counts, gradients, seed):
    """A well-formed FedHPro reply: the server's weights plus noise, the given counts and gradients."""
    g = generator(seed)
    weights = {name: (t + scale * torch.randn(t.shape, generator=g)) if t.is_floating_point() else t.clone()
               for name, t in server.weights.items()}
    return {
        "weights": weights,
        "num_examples": num_examples,
        "class_counts": torch.tensor(counts, dtype=torch.long),
        "class_gradients": gradients,
        "prototypes": torch.zeros(NUM_CLASSES, FEATURE_DIM),
    }


def hand_replies(server):
    """Three replies; class 3 is held by nobody (its rows are garbage), class 0 by one client only."""
    g = generator(100)
    rows = [torch.randn(NUM_CLASSES, FEATURE_DIM, generator=g) for _ in range(3)]
    counts = [[5, 4, 0, 0], [0, 6, 2, 0], [0, 3, 9, 0]]
    for k in range(3):
        for c in range(NUM_CLASSES):
            if counts[k][c] == 0:
                rows[k][c] = 1e3 * (c + 1)  # not held: must be ignored
    sizes = [9, 8, 12]
    return [make_reply(server, scale=0.1, num_examples=n, counts=cnt, gradients=r, seed=k)
            for k, (n, cnt, r) in enumerate(zip(sizes, counts, rows))], counts


def test_aggregate_class_gradients_are_unweighted_means_over_holders(monkeypatch):
    server = FedHProServer(context(FedHProOptions(match_steps=4), seed=1))
    replies, counts = hand_replies(server)
    captured = {}
    from fedhpro.methods.fedhpro import equations

    original = equations.match_hyper_prototypes

    def spy(hyper, classifier, g_real, present, **kwargs):
        captured["g_real"], captured["present"] = g_real.clone(), present.clone()
        captured["W"], captured["b"] = classifier.weight.detach().clone(), classifier.bias.detach().clone()
        return original(hyper, classifier, g_real, present, **kwargs)

    monkeypatch.setattr(equations, "match_hyper_prototypes", spy)
    hyper_before = server.hyper.clone()
    metrics = server.aggregate(0, replies)

    expected = torch.zeros(NUM_CLASSES, FEATURE_DIM, dtype=torch.float64)
    for c in range(NUM_CLASSES):
        holders = [k for k in range(3) if counts[k][c] > 0]
        if holders:
            expected[c] = sum(replies[k]["class_gradients"][c].double() for k in holders) / len(holders)
    torch.testing.assert_close(captured["g_real"].double(), expected, rtol=0, atol=1e-6)
    assert captured["present"].tolist() == [True, True, True, False]
    # the head used for matching is the NEWLY aggregated one
    torch.testing.assert_close(captured["W"], server.weights["classifier.weight"])
    torch.testing.assert_close(captured["b"], server.weights["classifier.bias"])

    # L_GM before matching, by hand: sum over held classes of 1 - cos(g^c, mean_i W^T(softmax(W s_i + b) - e_c))
    W, b = server.weights["classifier.weight"], server.weights["classifier.bias"]
    hand_loss = 0.0
    for c in range(3):
        g_hp = sum(closed_form_head_gradient(W, b, hyper_before[c, i], c)
                   for i in range(hyper_before.shape[1])) / hyper_before.shape[1]
        hand_loss += 1.0 - float(torch.dot(expected[c], g_hp) / (expected[c].norm() * g_hp.norm()))
    assert metrics["gm_loss_before"] == pytest.approx(hand_loss, rel=1e-5)

    # class 3 (no holder) keeps its hyper-prototypes bit for bit; held classes moved
    assert torch.equal(server.hyper[3], hyper_before[3])
    for c in range(3):
        assert not torch.equal(server.hyper[c], hyper_before[c])
    assert metrics["gm_loss_after"] <= metrics["gm_loss_before"]
    movement = float((server.hyper - server.bank.initial).norm() / server.bank.initial.norm())
    assert metrics["hyper_movement"] == pytest.approx(movement, rel=1e-6)
    assert metrics["hyper_movement"] > 0
    # the next broadcast carries the matched hyper-prototypes
    assert torch.equal(server.broadcast(1)["hyper_prototypes"], server.hyper)


def test_aggregate_weights_are_n_k_weighted():
    server = FedHProServer(context(FedHProOptions(match_steps=1), seed=1))
    replies, _ = hand_replies(server)
    server.aggregate(0, replies)
    total = sum(r["num_examples"] for r in replies)
    for name, value in server.weights.items():
        expected = sum(r["weights"][name].double() * r["num_examples"] / total for r in replies)
        torch.testing.assert_close(value.double(), expected, rtol=0, atol=1e-6)


def test_zero_match_steps_leave_hyper_prototypes_unchanged():
    server = FedHProServer(context(FedHProOptions(match_steps=0), seed=2))
    before = server.hyper.clone()
    replies, _ = hand_replies(server)
    for r in range(2):
        metrics = server.aggregate(r, replies)
        assert torch.equal(server.hyper, before)
        assert metrics["gm_loss_after"] == metrics["gm_loss_before"]
        assert metrics["hyper_movement"] == 0.0


def test_hyper_movement_is_measured_from_the_initial_draw_across_rounds():
    server = FedHProServer(context(FedHProOptions(match_steps=5, hyper_lr=0.5), seed=2))
    initial = server.hyper.clone()
    replies, _ = hand_replies(server)
    server.aggregate(0, replies)
    after_first = server.hyper.clone()
    metrics = server.aggregate(1, replies)
    assert not torch.equal(server.hyper, after_first)  # round 1 starts from round 0's matched S
    expected = float((server.hyper.double() - initial.double()).norm() / initial.double().norm())
    assert metrics["hyper_movement"] == pytest.approx(expected, rel=1e-5)


def test_server_state_dict_round_trip():
    server = FedHProServer(context(FedHProOptions(match_steps=2), seed=2))
    replies, _ = hand_replies(server)
    server.aggregate(0, replies)
    state = copy.deepcopy(server.state_dict())
    fresh = FedHProServer(context(FedHProOptions(match_steps=2), seed=99))
    fresh.load_state_dict(state)
    assert torch.equal(fresh.hyper, server.hyper)
    assert torch.equal(fresh.bank.initial, server.bank.initial)
    for name in server.weights:
        assert torch.equal(fresh.weights[name], server.weights[name])


def test_typical_round_decreases_the_matching_loss(tiny_federation):
    from fedhpro.engines.simulator import Simulator

    federation = tiny_federation([20, 24, 28], classes=[[0, 1, 2], [1, 2, 3], [0, 1, 2, 3]], seed=3)
    sim = Simulator(METHODS["fedhpro"], FedHProOptions(match_steps=10), federation, TinyNet, TRAIN, rounds=2,
                    seed=0)
    for r in range(2):
        record = sim.run_round(r)
        assert set(record.server) == {"gm_loss_before", "gm_loss_after", "hyper_movement"}
        assert record.server["gm_loss_after"] < record.server["gm_loss_before"]
        assert record.server["hyper_movement"] > 0


# ----------------------------------------------------------------------------
# FedHPro client
# ----------------------------------------------------------------------------

HELD = [0, 1, 3]  # class 2 absent on this client


@pytest.fixture(scope="module")
def fitted():
    data = make_client(30, HELD, seed=4)
    options = FedHProOptions(num_hyper=3, tau=0.2)
    received, payload, reply, metrics = fit_fedhpro(options, data)
    return data, received, payload, reply, metrics


def test_client_reply_fields_and_counts(fitted):
    data, received, payload, reply, metrics = fitted
    # prototypes=hyper: the server reads no prototypes, so none are sent
    assert set(reply) == {"weights", "num_examples", "class_counts", "class_gradients"}
    assert reply["num_examples"] == 30
    assert reply["class_counts"].tolist() == [10, 10, 0, 10]
    assert reply["class_counts"].tolist() == torch.bincount(data.y, minlength=NUM_CLASSES).tolist()
    assert reply["class_gradients"].shape == (NUM_CLASSES, FEATURE_DIM)
    assert set(reply["weights"]) == set(received)
    assert any(not torch.equal(reply["weights"][n], received[n]) for n in received)  # it trained
    assert {"ce", "hpcl", "hpal", "loss", "margin"} <= set(metrics)
    assert metrics["loss"] == pytest.approx(metrics["ce"] + metrics["hpcl"] + metrics["hpal"], rel=1e-5)


def test_client_class_gradients_match_per_sample_autograd_with_the_trained_model(fitted):
    data, received, payload, reply, metrics = fitted
    trained = model_with(reply["weights"])
    expected, counts = loop_class_gradients(trained, data.x, data.y, NUM_CLASSES)
    assert counts == [10, 10, 0, 10]
    torch.testing.assert_close(reply["class_gradients"].double(), expected, rtol=1e-4, atol=1e-6)
    assert torch.equal(reply["class_gradients"][2], torch.zeros(FEATURE_DIM))
    # and NOT those of the received model (the gradients are taken after local training)
    before, _ = loop_class_gradients(model_with(received), data.x, data.y, NUM_CLASSES)
    assert float((reply["class_gradients"].double() - before).abs().max()) > 1e-3


def test_client_prototypes_are_class_means_of_the_trained_features():
    data = make_client(30, HELD, seed=4)
    _, _, reply, _ = fit_fedhpro(FedHProOptions(num_hyper=3, tau=0.2, prototypes="global"), data)
    assert set(reply) == {"weights", "num_examples", "class_counts", "class_gradients", "prototypes"}
    expected = loop_prototypes(model_with(reply["weights"]), data.x, data.y, NUM_CLASSES)
    torch.testing.assert_close(reply["prototypes"].double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(reply["prototypes"][2], torch.zeros(FEATURE_DIM))


def test_client_margin_is_eq10_on_the_received_model(fitted):
    data, received, payload, reply, metrics = fitted
    before = loop_prototypes(model_with(received), data.x, data.y, NUM_CLASSES)
    expected = loop_margin(before, HELD, NUM_CLASSES)
    assert expected > 0
    assert metrics["margin"] == pytest.approx(expected, rel=1e-5)
    # the trained model would give a different margin: the test tells the two apart
    after = loop_prototypes(model_with(reply["weights"]), data.x, data.y, NUM_CLASSES)
    assert abs(loop_margin(after, HELD, NUM_CLASSES) - expected) > 1e-3 * expected


def test_client_margin_normalized_and_off():
    data = make_client(24, HELD, seed=6)
    received, _, _, normalized = fit_fedhpro(FedHProOptions(num_hyper=2, margin="normalized"), data)
    before = loop_prototypes(model_with(received), data.x, data.y, NUM_CLASSES)
    assert normalized["margin"] == pytest.approx(loop_margin(before, HELD, NUM_CLASSES, normalized=True), rel=1e-5)
    assert normalized["margin"] <= 2 * 6 / 9 + 1e-9  # 6 ordered pairs, each <= 2, over (C-1)^2
    _, _, _, off = fit_fedhpro(FedHProOptions(num_hyper=2, margin="off"), data)
    assert off["margin"] == 0.0
    _, _, _, no_hpcl = fit_fedhpro(FedHProOptions(num_hyper=2, hpcl_weight=0.0), data)
    assert no_hpcl["margin"] == 0.0


def test_client_single_class_has_zero_margin():
    data = make_client(12, [1], seed=7)
    _, _, reply, metrics = fit_fedhpro(FedHProOptions(num_hyper=2), data)
    assert metrics["margin"] == 0.0
    assert reply["class_counts"].tolist() == [0, 12, 0, 0]


@pytest.mark.parametrize("model_cls", [TinyNet, TinyBNNet], ids=["linear", "batchnorm"])
@pytest.mark.parametrize("timing", ["after", "before"])
def test_client_without_hpcl_and_hpal_trains_exactly_like_fedavg(model_cls, timing):
    data = make_client(27, [0, 1, 2, 3], seed=8)
    options = FedHProOptions(hpcl_weight=0.0, hpal_weight=0.0, gradient_timing=timing, num_hyper=2)
    _, _, reply, metrics = fit_fedhpro(options, data, model_cls=model_cls, model_seed=3, gen_seed=11)

    model = seeded_model(model_cls, 3)
    client = METHODS["fedavg"].client(context(FedAvgOptions(), model=model_cls))
    fedavg_reply, fedavg_metrics = client.fit(model, {"weights": clone_weights(model)}, data, {}, generator(11))
    assert reply["weights"].keys() == fedavg_reply["weights"].keys()
    for name in reply["weights"]:
        assert torch.equal(reply["weights"][name], fedavg_reply["weights"][name]), name
    assert metrics["ce"] == fedavg_metrics["ce"]
    assert "hpcl" not in metrics and "hpal" not in metrics


@pytest.mark.parametrize("weights", [(1.0, 0.0), (0.0, 1.0)], ids=["hpcl-only", "hpal-only"])
def test_each_regularizer_changes_the_update(weights):
    """Counterpart of the FedAvg-equality test: with one term on, the update differs from FedAvg's."""
    data = make_client(27, [0, 1, 2, 3], seed=8)
    options = FedHProOptions(hpcl_weight=weights[0], hpal_weight=weights[1], num_hyper=2)
    _, _, reply, _ = fit_fedhpro(options, data, model_seed=3, gen_seed=11)
    model = seeded_model(TinyNet, 3)
    client = METHODS["fedavg"].client(context(FedAvgOptions()))
    fedavg_reply, _ = client.fit(model, {"weights": clone_weights(model)}, data, {}, generator(11))
    gap = max(float((reply["weights"][n] - fedavg_reply["weights"][n]).abs().max()) for n in reply["weights"])
    assert gap > 1e-4


def hand_hpcl(z, y, hyper, margin, tau):
    """Eq. 11-12 one sample at a time, in float64."""
    total = 0.0
    for i in range(z.shape[0]):
        sims = []
        for c in range(hyper.shape[0]):
            sims.append(sum(F.cosine_similarity(z[i], hyper[c, j], dim=0) for j in range(hyper.shape[1]))
                        / hyper.shape[1])
        positive = torch.exp(sims[int(y[i])] / tau)
        negatives = sum(torch.exp((sims[c] + margin) / tau) for c in range(hyper.shape[0]) if c != int(y[i]))
        total = total + torch.log(1 + negatives / positive)
    return total / z.shape[0]


def hand_hpal(z, y, hyper, normalized):
    """Eq. 13: Huber (beta 1) of z - H^y summed over d (paper) or of the unit vectors averaged (normalized)."""
    H = hyper.mean(1)
    total = 0.0
    for i in range(z.shape[0]):
        a, b = z[i], H[int(y[i])]
        if normalized:
            a, b = a / a.norm(), b / b.norm()
        diff = (a - b).abs()
        huber = torch.where(diff < 1, 0.5 * diff ** 2, diff - 0.5)
        total = total + (huber.mean() if normalized else huber.sum())
    return total / z.shape[0]


@pytest.mark.parametrize("hpal_form", ["paper", "normalized"])
def test_client_one_sgd_step_matches_hand_written_fedhpro_loss(hpal_form):
    """One full-batch step: w1 = w0 - lr (grad(CE + l1 HPCL + l2 HPAL) + wd w0), in float64."""
    data = make_client(12, HELD, seed=9, dtype=torch.float64)
    train = TrainSettings(epochs=1, batch_size=64, lr=0.05, momentum=0.9, weight_decay=1e-3)
    options = FedHProOptions(hpcl_weight=0.7, hpal_weight=0.3, tau=0.5, num_hyper=2, hpal_form=hpal_form)
    received, payload, reply, metrics = fit_fedhpro(options, data, train=train, model_seed=4, dtype=torch.float64)

    model = model_with(copy.deepcopy(received), dtype=torch.float64)
    margin = loop_margin(loop_prototypes(model, data.x, data.y, NUM_CLASSES), HELD, NUM_CLASSES)
    model.train()
    z = model.features(data.x)
    ce = F.cross_entropy(model.classifier(z), data.y)
    hyper = payload["hyper_prototypes"]
    hpcl = hand_hpcl(z, data.y, hyper, margin, options.tau)
    hpal = hand_hpal(z, data.y, hyper, normalized=hpal_form == "normalized")
    loss = ce + 0.7 * hpcl + 0.3 * hpal
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    for (name, p), grad in zip(params.items(), grads):
        expected = p.detach() - train.lr * (grad + train.weight_decay * p.detach())
        torch.testing.assert_close(reply["weights"][name], expected, rtol=0, atol=1e-10, msg=name)
    assert metrics["ce"] == pytest.approx(float(ce.detach()), rel=1e-9)
    assert metrics["hpcl"] == pytest.approx(0.7 * float(hpcl.detach()), rel=1e-9)
    assert metrics["hpal"] == pytest.approx(0.3 * float(hpal.detach()), rel=1e-9)
    assert metrics["margin"] == pytest.approx(margin, rel=1e-9)


def test_gradient_timing_before_uses_the_received_model():
    data = make_client(24, HELD, seed=10)
    received, _, reply, _ = fit_fedhpro(FedHProOptions(num_hyper=2, gradient_timing="before"), data)
    expected, _ = loop_class_gradients(model_with(received), data.x, data.y, NUM_CLASSES)
    torch.testing.assert_close(reply["class_gradients"].double(), expected, rtol=1e-4, atol=1e-6)
    assert "prototypes" not in reply  # prototypes=hyper: not read, not sent
    received, _, reply, _ = fit_fedhpro(FedHProOptions(num_hyper=2, gradient_timing="before", prototypes="global"),
                                        data)
    protos = loop_prototypes(model_with(received), data.x, data.y, NUM_CLASSES)
    torch.testing.assert_close(reply["prototypes"].double(), protos, rtol=1e-5, atol=1e-6)


def test_gradient_samples_per_class_uses_the_first_k_samples_of_each_class():
    data = make_client(30, HELD, seed=11)
    k = 4
    _, _, reply, _ = fit_fedhpro(FedHProOptions(num_hyper=2, gradient_samples_per_class=k), data)
    keep = []
    seen = {c: 0 for c in range(NUM_CLASSES)}
    for i in range(len(data)):  # first k of each class, in stored order
        c = int(data.y[i])
        if seen[c] < k:
            keep.append(i)
            seen[c] += 1
    keep = torch.tensor(keep)
    assert len(keep) == 3 * k
    trained = model_with(reply["weights"])
    expected, _ = loop_class_gradients(trained, data.x[keep], data.y[keep], NUM_CLASSES)
    torch.testing.assert_close(reply["class_gradients"].double(), expected, rtol=1e-4, atol=1e-6)
    everything, _ = loop_class_gradients(trained, data.x, data.y, NUM_CLASSES)
    assert float((reply["class_gradients"].double() - everything).abs().max()) > 1e-5
    # the reported counts are still the client's full class counts (the server needs n_k^c > 0 only)
    assert reply["class_counts"].tolist() == torch.bincount(data.y, minlength=NUM_CLASSES).tolist()


# ----------------------------------------------------------------------------
# malformed replies
# ----------------------------------------------------------------------------


def good_reply(server):
    return make_reply(server, scale=0.01, num_examples=10, counts=[3, 3, 4, 0],
                      gradients=torch.randn(NUM_CLASSES, FEATURE_DIM, generator=generator(1)), seed=0)


def _nan_weight(r):
    r["weights"]["features.1.weight"][0, 0] = float("nan")


def _inf_weight(r):
    r["weights"]["classifier.bias"][1] = float("inf")


def _missing_key(r):
    del r["weights"]["classifier.bias"]


def _extra_key(r):
    r["weights"]["extra.weight"] = torch.zeros(2)


def _wrong_shape(r):
    r["weights"]["classifier.weight"] = torch.zeros(NUM_CLASSES + 1, FEATURE_DIM)


def _no_weights(r):
    del r["weights"]


def _zero_examples(r):
    r["num_examples"] = 0


def _negative_examples(r):
    r["num_examples"] = -3


def _missing_examples(r):
    del r["num_examples"]


def _gradients_shape(r):
    r["class_gradients"] = torch.zeros(NUM_CLASSES, FEATURE_DIM + 1)


def _gradients_missing(r):
    del r["class_gradients"]


def _gradients_nan(r):
    r["class_gradients"][1, 3] = float("nan")


def _counts_shape(r):
    r["class_counts"] = torch.tensor([1, 2])


MALFORMED = [
    (_nan_weight, ["non-finite", "features.1.weight"]),
    (_inf_weight, ["non-finite", "classifier.bias"]),
    (_missing_key, ["missing", "classifier.bias"]),
    (_extra_key, ["unexpected", "extra.weight"]),
    (_wrong_shape, ["classifier.weight", "shape", f"({NUM_CLASSES}, {FEATURE_DIM})"]),
    (_no_weights, ["weights"]),
    (_zero_examples, ["num_examples=0"]),
    (_negative_examples, ["num_examples=-3"]),
    (_missing_examples, ["num_examples"]),
]
MALFORMED_FEDHPRO = [
    (_gradients_shape, ["class_gradients", f"{NUM_CLASSES} x {FEATURE_DIM}"]),
    (_gradients_missing, ["class_gradients"]),
    (_gradients_nan, ["class_gradients", "NaN"]),
    (_counts_shape, ["class_counts"]),
]


@pytest.mark.parametrize("method", ["fedavg", "fedhpro"])
@pytest.mark.parametrize("break_it,words", MALFORMED, ids=[f.__name__.strip("_") for f, _ in MALFORMED])
def test_malformed_weights_or_sizes_raise_update_error(method, break_it, words):
    options = FedAvgOptions() if method == "fedavg" else FedHProOptions(match_steps=2)
    server = METHODS[method].server(context(options, seed=1))
    replies = [good_reply(server), good_reply(server)]
    before = {n: t.clone() for n, t in server.weights.items()}
    break_it(replies[1])
    with pytest.raises(UpdateError) as error:
        server.aggregate(0, replies)
    message = str(error.value)
    assert "reply 1" in message
    for word in words:
        assert word in message
    # a rejected round leaves the global weights as they were
    for name in before:
        assert torch.equal(server.weights[name], before[name])


@pytest.mark.parametrize("break_it,words", MALFORMED_FEDHPRO,
                         ids=[f.__name__.strip("_") for f, _ in MALFORMED_FEDHPRO])
def test_malformed_fedhpro_fields_raise_update_error(break_it, words):
    server = FedHProServer(context(FedHProOptions(match_steps=2), seed=1))
    replies = [good_reply(server), good_reply(server)]
    break_it(replies[0])
    with pytest.raises(UpdateError) as error:
        server.aggregate(0, replies)
    message = str(error.value)
    assert "reply 0" in message
    for word in words:
        assert word in message


def test_rejected_fedhpro_reply_leaves_the_server_unchanged():
    server = FedHProServer(context(FedHProOptions(match_steps=2), seed=1))
    replies = [good_reply(server), good_reply(server)]
    _gradients_shape(replies[1])
    before = {n: t.clone() for n, t in server.weights.items()}
    hyper = server.hyper.clone()
    with pytest.raises(UpdateError):
        server.aggregate(0, replies)
    assert torch.equal(server.hyper, hyper)
    for name in before:
        assert torch.equal(server.weights[name], before[name]), name


@pytest.mark.parametrize("value", [None, "10"], ids=["none", "string"])
def test_non_numeric_num_examples_raise_update_error(value):
    server = METHODS["fedavg"].server(context(FedAvgOptions(), seed=1))
    replies = [good_reply(server), good_reply(server)]
    replies[0]["num_examples"] = value
    with pytest.raises(UpdateError, match="num_examples"):
        server.aggregate(0, replies)


def test_infinite_num_examples_raise_update_error():
    server = METHODS["fedavg"].server(context(FedAvgOptions(), seed=1))
    replies = [good_reply(server), good_reply(server)]
    replies[0]["num_examples"] = float("inf")
    try:
        server.aggregate(0, replies)
    except UpdateError:
        return
    assert all(bool(torch.isfinite(t).all()) for t in server.weights.values() if t.is_floating_point()), \
        "global weights became non-finite"
    pytest.fail("num_examples=inf was accepted")


# ----------------------------------------------------------------------------
# Table 6: global prototypes P (Eq. 4) in place of the hyper-prototypes
# ----------------------------------------------------------------------------


def hand_hpcl_masked(z, y, prototypes, mask, margin, tau):
    """Eq. 12 with one target per class, over the samples whose class has a prototype; classes without
    one are no negatives; the mean is over those samples."""
    classes = [c for c in range(prototypes.shape[0]) if mask[c]]
    total, count = 0.0, 0
    for i in range(z.shape[0]):
        if int(y[i]) not in classes:
            continue
        sims = {c: F.cosine_similarity(z[i], prototypes[c], dim=0) for c in classes}
        positive = torch.exp(sims[int(y[i])] / tau)
        negatives = sum(torch.exp((sims[c] + margin) / tau) for c in classes if c != int(y[i]))
        total, count = total + torch.log(1 + negatives / positive), count + 1
    return total / count


@pytest.mark.parametrize("variant", ["global", "global-hpcl", "global-hpal"])
def test_client_step_with_global_prototypes_matches_hand_loss(variant):
    data = make_client(12, HELD, seed=9, dtype=torch.float64)
    train = TrainSettings(epochs=1, batch_size=64, lr=0.05, momentum=0.9, weight_decay=1e-3)
    options = FedHProOptions(hpcl_weight=0.7, hpal_weight=0.3, tau=0.5, num_hyper=2, prototypes=variant)
    model = seeded_model(TinyNet, 4, torch.float64)
    payload = fedhpro_payload(model, num_hyper=2, dtype=torch.float64)
    global_prototypes = torch.randn(NUM_CLASSES, FEATURE_DIM, generator=generator(3), dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])  # class 3 (held by this client) has no P yet
    payload.update(global_prototypes=global_prototypes, global_mask=mask)
    received = copy.deepcopy(payload["weights"])
    client = FedHProClient(context(options, train=train))
    reply, metrics = client.fit(model, payload, data, {}, generator(5))

    ref = model_with(copy.deepcopy(received), dtype=torch.float64)
    margin = loop_margin(loop_prototypes(ref, data.x, data.y, NUM_CLASSES), HELD, NUM_CLASSES)
    ref.train()
    z = ref.features(data.x)
    ce = F.cross_entropy(ref.classifier(z), data.y)
    hyper = payload["hyper_prototypes"]
    if variant in ("global", "global-hpcl"):
        hpcl = hand_hpcl_masked(z, data.y, global_prototypes, mask, margin, options.tau)
    else:
        hpcl = hand_hpcl(z, data.y, hyper, margin, options.tau)
    if variant in ("global", "global-hpal"):
        keep = mask[data.y]
        hpal = hand_hpal(z[keep], data.y[keep], global_prototypes.unsqueeze(1), normalized=True)
    else:
        hpal = hand_hpal(z, data.y, hyper, normalized=True)
    loss = ce + 0.7 * hpcl + 0.3 * hpal
    params = dict(ref.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    for (name, p), grad in zip(params.items(), grads):
        expected = p.detach() - train.lr * (grad + train.weight_decay * p.detach())
        torch.testing.assert_close(reply["weights"][name], expected, rtol=0, atol=1e-10, msg=name)
    assert metrics["hpcl"] == pytest.approx(0.7 * float(hpcl.detach()), rel=1e-9)
    assert metrics["hpal"] == pytest.approx(0.3 * float(hpal.detach()), rel=1e-9)


def test_server_global_prototypes_are_eq4_as_printed_and_persist():
    options = FedHProOptions(prototypes="global", match_steps=0)
    server = FedHProServer(context(options))
    round0 = server.broadcast(0)
    assert not round0["global_mask"].any()  # nothing aggregated yet: the client's P-loss is off
    rows = [torch.randn(NUM_CLASSES, FEATURE_DIM, generator=generator(s)) for s in (1, 2)]
    counts = [torch.tensor([3, 0, 5, 0]), torch.tensor([1, 4, 0, 0])]
    replies = []
    for s, (p, n) in enumerate(zip(rows, counts)):
        replies.append({"weights": clone_weights(server.scratch), "num_examples": int(n.sum()),
                        "class_counts": n, "prototypes": p,
                        "class_gradients": torch.randn(NUM_CLASSES, FEATURE_DIM, generator=generator(10 + s))})
    server.aggregate(0, replies)
    out = server.broadcast(1)
    # Eq. 4 by hand: p^c = 1/|A^c| sum_k (n_k^c / n^c) p_k^c over the holders A^c
    for c in range(NUM_CLASSES):
        holders = [k for k in range(2) if counts[k][c] > 0]
        if not holders:
            assert not out["global_mask"][c]
            continue
        n_c = sum(int(counts[k][c]) for k in holders)
        expected = sum(int(counts[k][c]) / n_c * rows[k][c] for k in holders) / len(holders)
        torch.testing.assert_close(out["global_prototypes"][c], expected)
        assert out["global_mask"][c]
    # a class nobody holds in the next round keeps its P
    before = out["global_prototypes"].clone()
    replies[0]["class_counts"] = torch.tensor([0, 2, 0, 0])
    replies[1]["class_counts"] = torch.tensor([0, 3, 0, 0])
    server.aggregate(1, replies)
    after = server.broadcast(2)["global_prototypes"]
    torch.testing.assert_close(after[0], before[0])
    torch.testing.assert_close(after[2], before[2])
    expected_1 = (2 / 5 * rows[0][1] + 3 / 5 * rows[1][1]) / 2
    torch.testing.assert_close(after[1], expected_1)
    # checkpoints keep P
    twin = FedHProServer(context(options))
    twin.load_state_dict(server.state_dict())
    torch.testing.assert_close(twin.broadcast(3)["global_prototypes"], after)
    # the method itself sends no P
    assert "global_prototypes" not in FedHProServer(context(FedHProOptions())).broadcast(0)
