"""FedProto and FedTGP (both protocols, local or hyper prototypes) against hand-computed references.

References: Python loops over clients and classes for the prototype means, scalar ``math`` for the
MSE, the margin and the margin-CE, a hand-written SGD loop for one client step and for the TGP's
server training, and FedAvg's client for the ``lam = 0`` / round-0 equivalences.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import FEATURE_DIM, NUM_CLASSES, TinyNet, make_client, make_federation

from fedhpro.engines.simulator import Simulator
from fedhpro.errors import ConfigError, UpdateError
from fedhpro.methods.base import Client, MethodContext, clone_weights
from fedhpro.methods.fedavg import FedAvgOptions
from fedhpro.methods.fedhpro.hyper import HyperPrototypeBank
from fedhpro.methods.fedproto import METHOD as FEDPROTO
from fedhpro.methods.fedproto import FedProtoClient, FedProtoOptions, FedProtoServer
from fedhpro.methods.fedtgp import METHOD as FEDTGP
from fedhpro.methods.fedtgp import (
    FedTGPClient,
    FedTGPOptions,
    FedTGPServer,
    tgp_margin,
)
from fedhpro.methods.no_grad import extract_features
from fedhpro.methods.prototypes import margin_ce, prototype_mse, prototype_regularizer
from fedhpro.methods.training import TrainSettings
from fedhpro.seeds import derive_seed

TRAIN = TrainSettings(epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-4)
METHODS = {"fedproto": (FEDPROTO, FedProtoOptions), "fedtgp": (FEDTGP, FedTGPOptions)}


def context(options, *, seed=0, shared_keys=None, train=TRAIN) -> MethodContext:
    if getattr(options, "protocol", "dagger") == "proto-only" and shared_keys is None:
        shared_keys = []
    return MethodContext(model=TinyNet(), num_classes=NUM_CLASSES, options=options, train=train, seed=seed,
                         shared_keys=shared_keys)


def seeded_model(seed=0):
    torch.manual_seed(seed)
    return TinyNet()


def generator(seed):
    return torch.Generator().manual_seed(seed)


def make_reply(server, counts, rows, *, num_examples=10, seed=0, weights=True):
    """A hand-built client reply: ``rows`` is C x d (rows of absent classes are garbage to be ignored)."""
    g = generator(seed)
    reply = {"num_examples": num_examples, "class_counts": torch.tensor(counts),
             "prototypes": torch.as_tensor(rows, dtype=torch.float32)}
    reply["weights"] = ({k: v + 0.1 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
                         for k, v in server.weights.items()} if weights else {})
    return reply


COUNTS = [[5, 3, 0, 0], [0, 1, 9, 0], [0, 7, 0, 0]]  # class 3: nobody


def hand_replies(server, seed=0, weights=True):
    g = generator(100 + seed)
    replies = []
    for k, counts in enumerate(COUNTS):
        rows = torch.randn(NUM_CLASSES, FEATURE_DIM, generator=g)
        for c in range(NUM_CLASSES):
            if counts[c] == 0:
                rows[c] = 1e3 * (c + 1)  # not held: must be ignored
        replies.append(make_reply(server, counts, rows, num_examples=sum(counts), seed=k, weights=weights))
    return replies


def loop_unweighted_means(replies):
    """P^c = (1/|A^c|) sum_{k holds c} p_k^c, by loops; None for a class nobody holds."""
    out = []
    for c in range(NUM_CLASSES):
        holders = [r["prototypes"][c].double() for r in replies if int(r["class_counts"][c]) > 0]
        out.append(sum(holders) / len(holders) if holders else None)
    return out


# ----------------------------------------------------------------------------
# FedProto server
# ----------------------------------------------------------------------------


def test_fedproto_round0_broadcast_has_no_prototypes():
    server = FedProtoServer(context(FedProtoOptions()))
    payload = server.broadcast(0)
    assert payload["prototype_mask"].tolist() == [False] * NUM_CLASSES
    assert payload["prototypes"].shape == (NUM_CLASSES, FEATURE_DIM)
    assert set(payload["weights"]) == set(TinyNet().state_dict())


def test_fedproto_server_unweighted_mean_over_holders_and_absent_class():
    server = FedProtoServer(context(FedProtoOptions()))
    replies = hand_replies(server)
    server.aggregate(0, replies)
    expected = loop_unweighted_means(replies)
    payload = server.broadcast(1)
    assert payload["prototype_mask"].tolist() == [True, True, True, False]
    for c in range(3):
        torch.testing.assert_close(payload["prototypes"][c].double(), expected[c], rtol=0, atol=1e-6)
    # class 3 is held by nobody: not averaged as zeros, marked absent (its row is never a target)
    assert torch.isfinite(payload["prototypes"]).all()
    # NOT the count-weighted mean (class 1: counts 3, 1, 7)
    weighted = sum(r["prototypes"][1].double() * int(r["class_counts"][1]) for r in replies) / 11
    assert not torch.allclose(payload["prototypes"][1].double(), weighted, atol=1e-3)
    # dagger: the weights are FedAvg's
    total = sum(r["num_examples"] for r in replies)
    for name, value in server.weights.items():
        reference = sum(r["weights"][name].double() * r["num_examples"] / total for r in replies)
        torch.testing.assert_close(value.double(), reference, rtol=0, atol=1e-6)


def test_fedproto_class_held_by_nobody_this_round_keeps_its_previous_prototype():
    server = FedProtoServer(context(FedProtoOptions()))
    first = hand_replies(server)
    server.aggregate(0, first)
    before = server.broadcast(1)["prototypes"].clone()
    # round 1: only class 0 is held (by two clients)
    g = generator(7)
    second = [make_reply(server, [4, 0, 0, 0], torch.randn(NUM_CLASSES, FEATURE_DIM, generator=g), seed=k)
              for k in range(2)]
    server.aggregate(1, second)
    payload = server.broadcast(2)
    expected0 = (second[0]["prototypes"][0] + second[1]["prototypes"][0]) / 2
    torch.testing.assert_close(payload["prototypes"][0], expected0)
    assert torch.equal(payload["prototypes"][1:3], before[1:3])
    assert payload["prototype_mask"].tolist() == [True, True, True, False]


def test_malformed_prototype_reply_raises_and_leaves_the_server_unchanged():
    server = FedProtoServer(context(FedProtoOptions()))
    replies = hand_replies(server)
    server.aggregate(0, replies)
    state = copy.deepcopy(server.state_dict())
    bad = hand_replies(server, seed=1)
    bad[1]["prototypes"] = bad[1]["prototypes"].clone()
    bad[1]["prototypes"][2, 0] = float("nan")  # class 2 is held by client 1
    with pytest.raises(UpdateError, match="NaN"):
        server.aggregate(1, bad)
    bad[1]["prototypes"] = torch.zeros(NUM_CLASSES, FEATURE_DIM + 1)
    with pytest.raises(UpdateError, match="prototypes"):
        server.aggregate(1, bad)
    assert torch.equal(server.prototypes, state["prototypes"])
    for name in server.weights:
        assert torch.equal(server.weights[name], state["weights"][name])


def test_validate_reply_checks_the_prototype_fields():
    server = FedTGPServer(context(FedTGPOptions(server_epochs=1)))
    good = hand_replies(server)[0]
    server.validate_reply(good)
    broken = dict(good, prototypes=good["prototypes"][:, :3])
    with pytest.raises(UpdateError, match="client 7: prototypes must be"):
        server.validate_reply(broken, who="client 7")
    with pytest.raises(UpdateError, match="class_counts"):
        server.validate_reply({k: v for k, v in good.items() if k != "class_counts"})
    # proto-only: a reply without weights is well-formed
    only = FedProtoServer(context(FedProtoOptions(protocol="proto-only")))
    only.validate_reply(hand_replies(only, weights=False)[0])
    # hyper: the class gradients are required
    hyper = FedProtoServer(context(FedProtoOptions(prototypes="hyper")))
    with pytest.raises(UpdateError, match="client 2: class_gradients"):
        hyper.validate_reply(hand_replies(hyper)[0], who="client 2")


# ----------------------------------------------------------------------------
# the prototype regulariser and FedProto's client
# ----------------------------------------------------------------------------


def test_prototype_mse_on_known_tensors():
    z = torch.tensor([[1.0, 2.0], [0.0, -1.0], [3.0, 3.0]])
    y = torch.tensor([0, 2, 1])
    prototypes = torch.tensor([[0.0, 0.0], [1.0, 1.0], [5.0, 5.0]])
    mask = torch.tensor([True, True, False])  # class 2 has no global prototype: sample 1 not regularised
    # (authors' nn.MSELoss on the substituted batch): ((1^2 + 2^2) + (2^2 + 2^2)) / (3 * 2)
    expected = ((1 + 4) + (4 + 4)) / 6
    assert float(prototype_mse(z, y, prototypes, mask)) == pytest.approx(expected)
    reg = prototype_regularizer(prototypes, mask, 0.5)
    assert float(reg(z, y, None)["proto"]) == pytest.approx(0.5 * expected)
    assert prototype_regularizer(prototypes, mask, 0.0) is None
    assert prototype_regularizer(prototypes, torch.zeros(3, dtype=torch.bool), 1.0) is None


def fedavg_fit(data, model_seed=0, gen_seed=5, train=TRAIN):
    model = seeded_model(model_seed)
    payload = {"weights": clone_weights(model)}
    reply, metrics = Client(context(FedAvgOptions(), train=train)).fit(model, payload, data, {}, generator(gen_seed))
    return reply, metrics


def proto_payload(model, mask, seed=3):
    prototypes = torch.randn(NUM_CLASSES, FEATURE_DIM, generator=generator(seed))
    return {"weights": clone_weights(model), "prototypes": prototypes, "prototype_mask": torch.tensor(mask)}


@pytest.mark.parametrize("client_cls, options_cls", [(FedProtoClient, FedProtoOptions), (FedTGPClient, FedTGPOptions)])
def test_lam_zero_and_round0_train_exactly_like_fedavg(client_cls, options_cls):
    data = make_client(30, [0, 1, 2, 3], seed=4)
    reference, _ = fedavg_fit(data)
    # lam = 0 with every prototype present
    model = seeded_model(0)
    reply, metrics = client_cls(context(options_cls(lam=0.0))).fit(model, proto_payload(model, [True] * 4), data, {},
                                                                   generator(5))
    for name, value in reference["weights"].items():
        assert torch.equal(reply["weights"][name], value)
    assert "proto" not in metrics
    # round 0: lam = 1 but no prototype exists yet (the server's first broadcast)
    server = FedProtoServer(context(FedProtoOptions()))
    model = seeded_model(0)
    payload = server.broadcast(0)
    payload["weights"] = clone_weights(model)
    reply, metrics = client_cls(context(options_cls())).fit(model, payload, data, {}, generator(5))
    for name, value in reference["weights"].items():
        assert torch.equal(reply["weights"][name], value)
    assert "proto" not in metrics
    # with prototypes and lam > 0 the update differs
    model = seeded_model(0)
    reply, metrics = client_cls(context(options_cls())).fit(model, proto_payload(model, [True] * 4), data, {},
                                                            generator(5))
    assert not torch.equal(reply["weights"]["classifier.weight"], reference["weights"]["classifier.weight"])
    assert metrics["proto"] > 0


def test_fedproto_client_one_sgd_step_matches_hand_loss():
    data = make_client(12, [0, 1, 2], seed=6)
    train = TrainSettings(epochs=1, batch_size=12, lr=0.05, momentum=0.0, weight_decay=0.0)
    lam = 0.7
    model = seeded_model(1)
    payload = proto_payload(model, [True, False, True, True], seed=9)  # class 1 has no prototype
    start = copy.deepcopy(model)
    reply, metrics = FedProtoClient(context(FedProtoOptions(lam=lam), train=train)).fit(model, payload, data, {},
                                                                                     generator(2))
    # hand loss: CE + lam * sum_{i: y_i != 1} ||z_i - P_{y_i}||^2 / (B d), full batch (order irrelevant)
    z = start.features(data.x)
    ce = F.cross_entropy(start.classifier(z), data.y)
    mse = sum(((z[i] - payload["prototypes"][int(data.y[i])]) ** 2).sum()
              for i in range(12) if int(data.y[i]) != 1) / (12 * FEATURE_DIM)
    loss = ce + lam * mse
    params = dict(start.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    for (name, p), g in zip(params.items(), grads):
        torch.testing.assert_close(reply["weights"][name], (p - 0.05 * g).detach(), rtol=1e-5, atol=1e-6)
    assert metrics["proto"] == pytest.approx(float(lam * mse.detach()), rel=1e-5)
    assert metrics["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)


def test_client_uploads_eval_mode_class_means_of_the_trained_model():
    data = make_client(21, [0, 2], seed=8)
    model = seeded_model(2)
    reply, _ = FedProtoClient(context(FedProtoOptions())).fit(model, proto_payload(model, [True] * 4), data, {},
                                                              generator(1))
    trained = TinyNet()
    trained.load_state_dict(reply["weights"])
    trained.eval()
    assert reply["class_counts"].tolist() == [11, 0, 10, 0]
    assert reply["num_examples"] == 21
    assert "class_gradients" not in reply
    with torch.no_grad():
        for c in (0, 2):
            members = [trained.features(data.x[i:i + 1])[0] for i in range(21) if int(data.y[i]) == c]
            torch.testing.assert_close(reply["prototypes"][c], sum(members) / len(members), rtol=1e-5, atol=1e-6)
    assert torch.equal(reply["prototypes"][1], torch.zeros(FEATURE_DIM))


# ----------------------------------------------------------------------------
# proto-only protocol
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("server_cls, client_cls, options_cls", [
    (FedProtoServer, FedProtoClient, FedProtoOptions),
    (FedTGPServer, FedTGPClient, FedTGPOptions),
])
def test_proto_only_exchanges_no_weights(server_cls, client_cls, options_cls):
    extra = {"server_epochs": 2} if options_cls is FedTGPOptions else {}
    options = options_cls(protocol="proto-only", **extra)
    server = server_cls(context(options))
    payload = server.broadcast(0)
    assert payload["weights"] == {}
    model = seeded_model(0)
    before = copy.deepcopy(model.state_dict())
    reply, _ = client_cls(context(options)).fit(model, payload, make_client(16, [0, 1], seed=3), {}, generator(0))
    assert reply["weights"] == {}
    assert not torch.equal(model.state_dict()["classifier.weight"], before["classifier.weight"])  # trained in place
    replies = hand_replies(server, weights=False)
    server.aggregate(0, replies)
    assert server.weights == {} and server.global_weights() == {}
    assert server.broadcast(1)["weights"] == {}
    assert server.broadcast(1)["prototype_mask"].tolist() == [True, True, True, False]


def test_invalid_protocol_combinations_raise_config_error():
    with pytest.raises(ConfigError, match="shared='none'"):
        FedProtoServer(context(FedProtoOptions(protocol="proto-only"), shared_keys=["classifier.weight"]))
    ctx = MethodContext(model=TinyNet(), num_classes=NUM_CLASSES, options=FedProtoOptions(protocol="proto-only"),
                        train=TRAIN)  # shared_keys None: the whole model would travel
    with pytest.raises(ConfigError, match="proto-only"):
        FedProtoServer(ctx)
    for options in (FedProtoOptions(protocol="proto-only", prototypes="hyper"),
                    FedTGPOptions(protocol="proto-only", prototypes="hyper")):
        server_cls = FedProtoServer if isinstance(options, FedProtoOptions) else FedTGPServer
        with pytest.raises(ConfigError, match="hyper needs protocol=dagger"):
            server_cls(context(options))


# ----------------------------------------------------------------------------
# FedTGP
# ----------------------------------------------------------------------------


def test_tgp_margin_on_hand_made_prototypes():
    # classes 0, 1, 2 at (0, 0), (3, 0), (0, 4); class 3 absent (far away, must be ignored)
    p = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0], [50.0, 50.0]])
    held = torch.tensor([True, True, True, False])
    # nearest-other gaps: class 0 -> 3, class 1 -> 3, class 2 -> 4; delta = min(max, cap)
    assert tgp_margin(p, held, 100.0) == pytest.approx(4.0)
    assert tgp_margin(p, held, 2.5) == pytest.approx(2.5)
    assert tgp_margin(p, torch.tensor([True, True, False, False]), 100.0) == pytest.approx(3.0)
    assert tgp_margin(p, torch.tensor([False, True, False, False]), 100.0) == 0.0  # no other class: no gap


def test_tgp_server_margin_uses_unweighted_means_of_the_uploads():
    server = FedTGPServer(context(FedTGPOptions(server_epochs=1)))
    replies = hand_replies(server)
    metrics = server.aggregate(0, replies)
    means = loop_unweighted_means(replies)
    gaps = [min(float((means[c] - means[o]).norm()) for o in range(3) if o != c) for c in range(3)]
    assert metrics["tgp_margin"] == pytest.approx(min(max(gaps), 100.0), rel=1e-5)


def test_tgp_margin_ce_matches_hand_computation():
    p = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    y = torch.tensor([1, 0])
    centers = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    delta = 0.3
    total = 0.0
    for i in range(2):
        logits = []
        for c in range(3):
            d = math.sqrt(sum((float(p[i, j]) - float(centers[c, j])) ** 2 for j in range(2)))
            logits.append(-(d + (delta if c == int(y[i]) else 0.0)))
        total += -logits[int(y[i])] + math.log(sum(math.exp(v) for v in logits))
    assert float(margin_ce(p, y, centers, delta)) == pytest.approx(total / 2, rel=1e-6)


def test_margin_ce_is_finite_for_identical_prototypes():
    centers = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], requires_grad=True)
    p = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], requires_grad=True)  # exactly at their centres
    loss = margin_ce(p, torch.tensor([0, 1]), centers, 1.0)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(centers.grad).all() and torch.isfinite(p.grad).all()
    # without the clamp the gradient of sqrt at 0 is not finite
    raw = torch.zeros(3, requires_grad=True)
    (g,) = torch.autograd.grad(raw.pow(2).sum().sqrt(), raw)
    assert not torch.isfinite(g).all()


def hand_train_tgp(net, pairs, labels, delta, *, epochs, lr, batch_size, seed):
    """The TGP's server training by hand: plain SGD on each batch's margin-CE (hand-written distances)."""
    g = torch.Generator().manual_seed(seed)
    params = list(net.parameters())
    for _ in range(epochs):
        order = torch.randperm(pairs.shape[0], generator=g)
        for start in range(0, pairs.shape[0], batch_size):
            index = order[start:start + batch_size]
            emb = net.embedding.weight
            centers = net.out(torch.relu(net.hidden(emb)))
            p, y = pairs[index], labels[index]
            logits = torch.stack([torch.stack([
                -(((p[i] - centers[c]) ** 2).sum().clamp(min=1e-12).sqrt() + (delta if c == int(y[i]) else 0.0))
                for c in range(NUM_CLASSES)]) for i in range(p.shape[0])])
            loss = F.cross_entropy(logits, y)
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for q, gq in zip(params, grads):
                    q -= lr * gq


def test_tgp_persists_across_rounds_and_matches_a_hand_training():
    options = FedTGPOptions(server_epochs=3, server_batch_size=4)
    server = FedTGPServer(context(options, seed=11))
    replies0 = hand_replies(server, seed=0)
    server.aggregate(0, replies0)
    after_round0 = copy.deepcopy(server.tgp)
    replies1 = hand_replies(server, seed=1)
    metrics = server.aggregate(1, replies1)

    # hand reference for round 1, starting from the TGP as round 0 left it
    reference = copy.deepcopy(after_round0)
    pairs = torch.stack([r["prototypes"][c] for r in replies1 for c in range(NUM_CLASSES)
                         if int(r["class_counts"][c]) > 0])
    labels = torch.tensor([c for r in replies1 for c in range(NUM_CLASSES) if int(r["class_counts"][c]) > 0])
    hand_train_tgp(reference, pairs, labels, metrics["tgp_margin"], epochs=3, lr=0.01, batch_size=4,
                   seed=derive_seed(server.context.seed, 42, 1))
    for (name, mine), (_, ref) in zip(server.tgp.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6, msg=name)
    # the broadcast prototypes are the TGP's output; the never-held class 3 is absent
    payload = server.broadcast(2)
    with torch.no_grad():
        torch.testing.assert_close(payload["prototypes"], reference.out(torch.relu(reference.hidden(
            reference.embedding.weight))), rtol=1e-5, atol=1e-6)
    assert payload["prototype_mask"].tolist() == [True, True, True, False]
    assert math.isfinite(metrics["tgp_loss"])


def test_tgp_server_training_is_seeded():
    def trained(seed):
        server = FedTGPServer(context(FedTGPOptions(server_epochs=2), seed=seed))
        server.aggregate(0, hand_replies(server))
        return server.tgp.state_dict()

    a, b, c = trained(3), trained(3), trained(4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    # the shuffling alone depends on the seed: same initial weights, different round seeds
    s1 = FedTGPServer(context(FedTGPOptions(server_epochs=2, server_batch_size=2), seed=3))
    s2 = copy.deepcopy(s1)
    replies = hand_replies(s1)
    s1.aggregate(0, replies)
    s2.aggregate(1, replies)
    assert not torch.equal(s1.tgp.embedding.weight, s2.tgp.embedding.weight)


def test_tgp_leaves_the_global_rng_alone():
    ctx = context(FedTGPOptions(server_epochs=2))  # building the template model draws from the global RNG
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    server = FedTGPServer(ctx)
    server.aggregate(0, hand_replies(server))
    assert torch.equal(torch.rand(3), expected)


def test_tgp_state_dict_round_trip():
    server = FedTGPServer(context(FedTGPOptions(server_epochs=2), seed=1))
    server.aggregate(0, hand_replies(server))
    buffer = io.BytesIO()
    torch.save(server.state_dict(), buffer)  # checkpoints load with weights_only=True
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = FedTGPServer(context(FedTGPOptions(server_epochs=2), seed=2))
    fresh.load_state_dict(state)
    for k, v in server.tgp.state_dict().items():
        assert torch.equal(fresh.tgp.state_dict()[k], v)
    assert torch.equal(fresh.broadcast(1)["prototypes"], server.broadcast(1)["prototypes"])
    assert torch.equal(fresh.broadcast(1)["prototype_mask"], server.broadcast(1)["prototype_mask"])


# ----------------------------------------------------------------------------
# plug-and-play hyper-prototypes
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("server_cls, client_cls, options_cls", [
    (FedProtoServer, FedProtoClient, FedProtoOptions),
    (FedTGPServer, FedTGPClient, FedTGPOptions),
])
def test_hyper_broadcasts_bank_average_and_matches_against_the_averaged_classifier(server_cls, client_cls,
                                                                                   options_cls):
    options = options_cls(prototypes="hyper", match_steps=3)
    server = server_cls(context(options, seed=5))
    payload = server.broadcast(0)
    assert torch.equal(payload["prototypes"], server.bank.averaged)
    assert payload["prototype_mask"].all()  # H exists from round 0 (as in FedHPro)
    reference_bank = HyperPrototypeBank(NUM_CLASSES, FEATURE_DIM, 5, num_hyper=5, match_steps=3, lr=0.1)
    assert torch.equal(reference_bank.averaged, server.bank.averaged)

    client = client_cls(context(options))
    fed = make_federation([16, 20], classes=[[0, 1], [1, 2]])
    replies = []
    for k, data in enumerate(fed.clients):
        model = seeded_model(0)
        payload["weights"] = clone_weights(model)
        reply, metrics = client.fit(model, payload, data, {}, generator(k))
        assert reply["class_gradients"].shape == (NUM_CLASSES, FEATURE_DIM)
        assert metrics["proto"] > 0  # regularised towards H in round 0
        replies.append(reply)
    metrics = server.aggregate(0, replies)
    assert {"gm_loss_before", "gm_loss_after", "hyper_movement"} <= set(metrics)

    # reference: the same bank update against the FedAvg classifier
    gradients, present = reference_bank.validate(replies)
    head = TinyNet()
    head.load_state_dict(server.weights)
    expected = reference_bank.update(gradients, present, head.classifier)
    assert metrics["gm_loss_before"] == pytest.approx(expected["gm_loss_before"], rel=1e-5)
    torch.testing.assert_close(server.bank.hyper, reference_bank.hyper)
    assert torch.equal(server.broadcast(1)["prototypes"], server.bank.averaged)
    assert not torch.equal(server.bank.averaged, HyperPrototypeBank(NUM_CLASSES, FEATURE_DIM, 5).averaged)


def test_hyper_client_gradients_come_from_the_trained_model():
    options = FedProtoOptions(prototypes="hyper")
    server = FedProtoServer(context(options))
    data = make_client(18, [0, 3], seed=2)
    model = seeded_model(0)
    payload = server.broadcast(0)
    payload["weights"] = clone_weights(model)
    reply, _ = FedProtoClient(context(options)).fit(model, payload, data, {}, generator(0))
    trained = TinyNet()
    trained.load_state_dict(reply["weights"])
    trained.eval()
    z = extract_features(trained, data.x).detach().requires_grad_(True)
    loss = F.cross_entropy(trained.classifier(z), data.y, reduction="sum")
    (per_sample,) = torch.autograd.grad(loss, z)
    for c in (0, 3):
        torch.testing.assert_close(reply["class_gradients"][c], per_sample[data.y == c].mean(0), rtol=1e-5,
                                   atol=1e-7)
    assert "prototypes" not in reply  # FedHPro's server step replaces FedProto's: it reads no prototypes
    assert reply["class_counts"].tolist() == [9, 0, 0, 9]


# ----------------------------------------------------------------------------
# one simulator round for every method x protocol x prototypes
# ----------------------------------------------------------------------------


COMBINATIONS = [(m, p, s) for m in METHODS for p in ("dagger", "proto-only") for s in ("local", "hyper")
                if not (p == "proto-only" and s == "hyper")]


@pytest.mark.parametrize("method, protocol, source", COMBINATIONS)
def test_one_simulator_round_runs(method, protocol, source):
    spec, options_cls = METHODS[method]
    extra = {"server_epochs": 2} if method == "fedtgp" else {}
    options = options_cls(protocol=protocol, prototypes=source, match_steps=2, **extra)
    fed = make_federation([12, 14, 10], classes=[[0, 1], [1, 2], [0, 1, 2, 3]])
    fed.client_domains = ["a", "b", "a"]
    train = TrainSettings(epochs=1, batch_size=8, lr=0.05)
    sim = Simulator(spec, options, fed, TinyNet, train, rounds=2, seed=1,
                    shared="none" if protocol == "proto-only" else None)
    for r in range(2):
        record = sim.run_round(r)
        assert math.isfinite(record.accuracy["AVG"])
        assert math.isfinite(record.train["loss"])
    assert ("proto" in record.train)
    if protocol == "proto-only":
        assert record.bytes_down == sum(4 * NUM_CLASSES * FEATURE_DIM + NUM_CLASSES for _ in range(3))
    if source == "hyper":
        assert "gm_loss_after" in record.server
    elif method == "fedtgp":
        assert "tgp_margin" in record.server


def test_simulator_proto_only_with_hyper_is_a_config_error():
    fed = make_federation([12, 14])
    with pytest.raises(ConfigError, match="dagger"):
        Simulator(FEDPROTO, FedProtoOptions(protocol="proto-only", prototypes="hyper"), fed, TinyNet,
                  TrainSettings(), rounds=1, shared="none")


# ----------------------------------------------------------------------------
# nearest-prototype inference (inference=nearest-prototype)
# ----------------------------------------------------------------------------


def test_nearest_prototype_classifier_by_hand():
    from fedhpro.methods.prototypes import NearestPrototypeClassifier

    class Identity(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.features = torch.nn.Flatten()
            self.anchor = torch.nn.Parameter(torch.zeros(1))  # a device to read

    prototypes = torch.tensor([[0.0, 0.0], [3.0, 4.0], [10.0, 0.0]])
    mask = torch.tensor([True, True, False])  # class 2 has no prototype: never predicted
    classifier = NearestPrototypeClassifier(Identity(), prototypes, mask)
    x = torch.tensor([[1.0, 1.0], [3.0, 3.0], [9.0, 0.0]])
    logits = classifier(x)
    assert logits[0, :2].tolist() == pytest.approx([-math.sqrt(2), -math.sqrt(4 + 9)])
    assert logits[1, :2].tolist() == pytest.approx([-math.sqrt(18), -1.0])
    assert math.isinf(float(logits[0, 2])) and float(logits[0, 2]) < 0
    # (9, 0) is nearest to class 2's row, but class 2 is absent: class 1 (sqrt(52) = 7.2) beats class 0 (9)
    assert logits.argmax(1).tolist() == [0, 1, 1]


@pytest.mark.parametrize("method", ["fedproto", "fedtgp"])
def test_proto_only_nearest_prototype_accuracy_equals_a_hand_evaluation(method):
    spec, options_cls = METHODS[method]
    extra = {"server_epochs": 2} if method == "fedtgp" else {}
    fed = make_federation([12, 14, 10], classes=[[0, 1], [1, 2], [0, 1, 2, 3]])
    fed.client_domains = ["a", "b", "a"]
    train = TrainSettings(epochs=1, batch_size=8, lr=0.05)
    runs = {}
    for inference in ("head", "nearest-prototype"):
        options = options_cls(protocol="proto-only", inference=inference, **extra)
        sim = Simulator(spec, options, fed, TinyNet, train, rounds=2, seed=1, shared="none")
        records = [sim.run_round(r) for r in range(2)]
        runs[inference] = (sim, records)
    head_sim, head_records = runs["head"]
    nearest_sim, nearest_records = runs["nearest-prototype"]
    # the inference rule changes only the evaluation, not the training
    assert [r.train for r in head_records] == [r.train for r in nearest_records]
    # reference: each client's own model, argmin_c ||f(x) - P_c|| over the held prototypes, on its domain
    prototypes, mask = nearest_sim.server.broadcast_prototypes()
    per_domain: dict[str, list[float]] = {}
    for k in range(fed.num_clients):
        model = nearest_sim.models.model_for(k)
        name = fed.client_test_name(k)
        x, y = fed.test_sets[name]
        z = extract_features(model, x)
        correct = 0
        for i in range(len(y)):
            best = min((float((z[i] - prototypes[c]).norm()), c) for c in range(NUM_CLASSES) if mask[c])
            correct += int(best[1] == int(y[i]))
        per_domain.setdefault(name, []).append(100.0 * correct / len(y))
    expected = {name: sum(v) / len(v) for name, v in per_domain.items()}
    for name, value in expected.items():
        assert nearest_records[-1].accuracy[name] == pytest.approx(value, abs=1e-9)
