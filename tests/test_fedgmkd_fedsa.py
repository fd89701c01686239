"""Tests of FedGMKD and FedSA (``fedhpro.methods.fedgmkd`` / ``fedsa``) against hand-computed references.

References used: class means and per-element loops in float64 (prototypes,
soft predictions, gaps, EMA), ``math.log``/``math.exp`` loops for the KL, the
margin CE and the calibration CE, the DAT weights computed with Python floats,
a hand-written full-batch SGD step of each client loss, per-sample autograd for
the class gradients, and the Simulator for one round of every configuration.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import FEATURE_DIM, NUM_CLASSES, TinyNet, make_client, make_federation

from fedhpro.engines.simulator import Simulator
from fedhpro.errors import ConfigError, UpdateError
from fedhpro.methods import fedgmkd as G
from fedhpro.methods import fedsa as S
from fedhpro.methods.base import MethodContext, clone_weights
from fedhpro.methods.fedavg import METHOD as FEDAVG
from fedhpro.methods.fedavg import FedAvgOptions
from fedhpro.methods.fedhpro.hyper import HyperPrototypeBank, class_statistics
from fedhpro.methods.prototypes import clamped_distances
from fedhpro.methods.training import TrainSettings

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4)
STEP = TrainSettings(epochs=1, batch_size=64, lr=0.05, momentum=0.9, weight_decay=1e-3)  # one full-batch step


def context(options, *, seed=0, model=None) -> MethodContext:
    return MethodContext(model=model if model is not None else TinyNet(), num_classes=NUM_CLASSES,
                         options=options, train=TRAIN, seed=seed)


def seeded_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return TinyNet().to(dtype)


def model_with(weights, dtype=torch.float32):
    model = TinyNet().to(dtype)
    model.load_state_dict(weights)
    model.eval()
    return model


def gen(seed):
    return torch.Generator().manual_seed(seed)


def hand_class_means(z, y, num_classes):
    out = torch.zeros(num_classes, z.shape[1], dtype=torch.float64)
    for c in range(num_classes):
        rows = [z[i].double() for i in range(z.shape[0]) if int(y[i]) == c]
        if rows:
            out[c] = sum(rows) / len(rows)
    return out


def hand_kl(p, q):
    return sum(pi * (math.log(pi) - math.log(qi)) for pi, qi in zip(p, q) if pi > 0)


def hand_softmax(values):
    top = max(values)
    e = [math.exp(v - top) for v in values]
    return [v / sum(e) for v in e]


# ============================================================================
# FedGMKD: GMM prototypes
# ============================================================================


def test_gmm_prototype_of_one_tight_gaussian_is_the_raw_class_mean():
    g = gen(0)
    offset = torch.tensor([5.0, -3.0, 8.0])
    features = offset + 0.01 * torch.randn(60, 3, generator=g, dtype=torch.float64)
    labels = torch.zeros(60, dtype=torch.long)
    prototypes, present, components = G.gmm_prototypes(features, labels, 2, max_components=3, seed=3)
    assert present.tolist() == [True, False]
    assert components.tolist() == [1, 0]
    raw_mean = features.mean(0)
    torch.testing.assert_close(prototypes[0], raw_mean, rtol=0, atol=1e-10)
    # in the original space, not the standardised one (whose mean is ~0: the authors' bug)
    assert float(prototypes[0].norm()) > 9.0
    assert torch.equal(prototypes[1], torch.zeros(3, dtype=torch.float64))


def test_bic_picks_two_components_for_a_bimodal_class_and_the_prototype_stays_the_mixture_mean():
    g = gen(1)
    a = torch.tensor([6.0, 0.0]) + 0.3 * torch.randn(70, 2, generator=g, dtype=torch.float64)
    b = torch.tensor([-4.0, 2.0]) + 0.3 * torch.randn(30, 2, generator=g, dtype=torch.float64)
    features = torch.cat([a, b])
    labels = torch.ones(100, dtype=torch.long)
    prototypes, present, components = G.gmm_prototypes(features, labels, 2, max_components=6, seed=0)
    assert components.tolist() == [0, 2]
    gmm = G.select_gmm(features.numpy(), 6, "full", seed=(0 + 1) % (2 ** 31 - 1))
    assert gmm.n_components == 2
    # sum_m pi_m mu_m (original space) ...
    torch.testing.assert_close(prototypes[1], torch.from_numpy(gmm.weights_ @ gmm.means_), rtol=0, atol=1e-12)
    # ... which after EM is the class mean itself (0.7 * (6, 0) + 0.3 * (-4, 2) ~ (3, 0.6)), not a mode
    torch.testing.assert_close(prototypes[1], features.mean(0), rtol=0, atol=1e-9)
    assert abs(float(prototypes[1][0]) - 3.0) < 0.2


def test_gmm_single_sample_class_cap_and_determinism():
    g = gen(2)
    features = torch.randn(41, 4, generator=g)
    labels = torch.tensor([0] * 40 + [2])
    protos, present, components = G.gmm_prototypes(features, labels, 3, max_samples=0, seed=5)
    assert present.tolist() == [True, False, True]
    assert torch.equal(protos[2], features[40])
    assert components[2] == 1
    assert protos.dtype == torch.float32
    # a cap of 10 of 40: the mean of 10 distinct samples of the class, the same for the same seed
    capped, _, _ = G.gmm_prototypes(features, labels, 3, max_samples=10, seed=5)
    again, _, _ = G.gmm_prototypes(features, labels, 3, max_samples=10, seed=5)
    assert torch.equal(capped, again)
    rows = np.sort(np.random.default_rng(5).choice(np.arange(40), size=10, replace=False))
    torch.testing.assert_close(capped[0], features[torch.from_numpy(rows)].mean(0), rtol=0, atol=1e-6)
    assert float((capped[0] - protos[0]).abs().max()) > 1e-4


# ============================================================================
# FedGMKD: loss terms, DAT
# ============================================================================


def small_head():
    head = torch.nn.Linear(2, 3).double()
    head.requires_grad_(True)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, -0.5], [0.2, 0.3], [-1.0, 0.7]]))
        head.bias.copy_(torch.tensor([0.1, 0.0, -0.2]))
    return head


@pytest.mark.parametrize("reduction", ["mean", "batchmean"])
def test_knowledge_kl_by_hand(reduction):
    head = small_head()
    P = torch.tensor([[1.0, 2.0], [-0.5, 0.3], [0.8, -1.2]], dtype=torch.float64)
    soft = torch.tensor([[0.7, 0.2, 0.1], [0.3, 0.3, 0.4], [0.0, 0.25, 0.75]], dtype=torch.float64)
    held = torch.tensor([True, False, True])
    T = 0.6
    value = G.knowledge_kl(head, P, soft, held, T, reduction)
    expected = []
    for c in (0, 2):
        logits = [sum(float(head.weight.detach()[j, i]) * float(P[c, i]) for i in range(2))
                  + float(head.bias.detach()[j])
                  for j in range(3)]
        q = hand_softmax([v / T for v in logits])
        expected.append(hand_kl(soft[c].tolist(), q))  # KL(S^_c || softmax(h(P_c)/T)), 0 log 0 = 0
    # batchmean: the divergence (summed over the 3 outputs) averaged over the 2 held classes;
    # mean: also divided by the 3 outputs, as torch.nn.KLDivLoss() in the authors' code
    per_class = sum(expected) / 2
    assert float(value.detach()) == pytest.approx(per_class / 3 if reduction == "mean" else per_class, rel=1e-12)
    if reduction == "mean":
        # torch's reduction='mean': the summed pointwise KL over the number of entries (2 x 3)
        reference = torch.nn.functional.kl_div(torch.log_softmax(head(P[held]) / T, dim=1), soft[held],
                                               reduction="sum") / 6
        assert float(value.detach()) == pytest.approx(float(reference.detach()), rel=1e-12)
    # gradients reach the head only through this term, and are finite with a zero entry in S^
    value.backward()
    assert bool(torch.isfinite(head.weight.grad).all())


def test_prototype_mse_skips_classes_without_prototype_but_keeps_them_in_the_mean():
    z = torch.tensor([[1.0, 2.0], [0.5, -1.0], [3.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 1, 0])
    P = torch.tensor([[0.0, 1.0], [9.0, 9.0]], dtype=torch.float64)
    held = torch.tensor([True, False])
    expected = ((1 - 0) ** 2 + (2 - 1) ** 2 + (3 - 0) ** 2 + (0 - 1) ** 2) / (3 * 2)
    assert float(G.prototype_mse(z, y, P, held)) == pytest.approx(expected, rel=1e-12)


def hand_dat(counts, soft, a, b):
    """DAT with Python floats: w0, S0, KL(S_k || S0), ReLU(w0 - a d + b) normalised over holders."""
    K, C = len(counts), len(counts[0])
    weights = [[0.0] * C for _ in range(K)]
    discrepancy = [[0.0] * C for _ in range(K)]
    for c in range(C):
        holders = [k for k in range(K) if counts[k][c] > 0]
        if not holders:
            continue
        total = sum(counts[k][c] for k in holders)
        w0 = {k: counts[k][c] / total for k in holders}
        s0 = [sum(w0[k] * soft[k][c][j] for k in holders) for j in range(C)]
        raw = {}
        for k in holders:
            discrepancy[k][c] = hand_kl(soft[k][c], s0)
            raw[k] = max(0.0, w0[k] - a * discrepancy[k][c] + b)
        norm = sum(raw.values())
        for k in holders:
            weights[k][c] = raw[k] / norm if norm > 0 else w0[k]
    return weights, discrepancy


def dat_example():
    counts = [[2, 0, 5, 0], [6, 3, 0, 0], [0, 1, 5, 0]]  # class 3: nobody
    g = gen(7)
    soft = torch.softmax(2.0 * torch.randn(3, 4, 4, generator=g, dtype=torch.float64), dim=2)
    for k in range(3):
        for c in range(4):
            if counts[k][c] == 0:
                soft[k, c] = 0.0  # non-holders send zero rows
    return counts, soft


@pytest.mark.parametrize("a,b", [(0.4, 0.2), (3.0, 0.0), (0.0, 0.0)])
def test_dat_weights_by_hand(a, b):
    counts, soft = dat_example()
    weights, discrepancy = G.dat_weights(torch.tensor(counts), soft, a, b)
    exp_w, exp_d = hand_dat(counts, soft.tolist(), a, b)
    torch.testing.assert_close(weights, torch.tensor(exp_w, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(discrepancy, torch.tensor(exp_d, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert weights[:, :3].sum(0).tolist() == pytest.approx([1.0, 1.0, 1.0], rel=1e-12)
    assert weights[:, 3].tolist() == [0.0, 0.0, 0.0]  # nobody holds class 3
    assert weights[0, 1] == 0 and weights[2, 0] == 0  # non-holders get nothing
    if a == 0 and b == 0:  # no discrepancy term: plain n_k^c / n^c
        assert float(weights[0, 0]) == pytest.approx(2 / 8)


def test_dat_falls_back_to_sample_shares_when_relu_zeroes_a_class():
    counts = torch.tensor([[1, 4], [3, 4]])
    soft = torch.tensor([[[0.99, 0.01], [0.5, 0.5]], [[0.01, 0.99], [0.5, 0.5]]], dtype=torch.float64)
    weights, discrepancy = G.dat_weights(counts, soft, a=100.0, b=0.0)
    assert float(discrepancy[0, 0]) > 0.1 and float(discrepancy[1, 0]) > 0.01
    torch.testing.assert_close(weights[:, 0], torch.tensor([0.25, 0.75], dtype=torch.float64))
    torch.testing.assert_close(weights[:, 1], torch.tensor([0.5, 0.5], dtype=torch.float64))  # d = 0


def test_client_weights_from_dat_reduce_to_fedavg_and_by_hand():
    counts, soft = dat_example()
    counts_t = torch.tensor(counts)
    plain, _ = G.dat_weights(counts_t, soft, 0.0, 0.0)
    sizes = [sum(row) for row in counts]
    torch.testing.assert_close(G.client_weights_from_dat(counts_t, plain),
                               torch.tensor([n / sum(sizes) for n in sizes], dtype=torch.float64))
    weights, _ = G.dat_weights(counts_t, soft, 0.4, 0.2)
    class_totals = [sum(counts[k][c] for k in range(3)) for c in range(4)]
    N = sum(class_totals)
    expected = [sum(class_totals[c] / N * float(weights[k, c]) for c in range(4)) for k in range(3)]
    client = G.client_weights_from_dat(counts_t, weights)
    assert client.tolist() == pytest.approx(expected, rel=1e-12)
    assert float(client.sum()) == pytest.approx(1.0, rel=1e-12)


# ============================================================================
# FedGMKD: server
# ============================================================================


def gmkd_reply(server, counts, soft_rows, protos, seed):
    g = gen(seed)
    weights = {n: t + 0.1 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t.clone()
               for n, t in server.weights.items()}
    return {"weights": weights, "num_examples": int(sum(counts)), "class_counts": torch.tensor(counts),
            "prototypes": protos, "soft_predictions": soft_rows}


def gmkd_replies(server):
    counts, soft = dat_example()
    g = gen(11)
    replies = []
    for k in range(3):
        protos = torch.randn(NUM_CLASSES, FEATURE_DIM, generator=g)
        s = soft[k].float().clone()
        for c in range(NUM_CLASSES):
            if counts[k][c] == 0:
                protos[c] = 1e3 * (c + 1)  # garbage rows of classes not held: must be ignored
                s[c] = 7.0
        replies.append(gmkd_reply(server, counts[k], s, protos, seed=k))
    return replies, counts


def test_fedgmkd_server_aggregates_knowledge_and_weights_with_dat_and_masks_unheld_classes():
    server = G.FedGMKDServer(context(G.FedGMKDOptions()))
    first = server.broadcast(0)
    assert first["prototype_mask"].tolist() == [False] * 4 and first["soft_mask"].tolist() == [False] * 4
    replies, counts = gmkd_replies(server)
    metrics = server.aggregate(0, replies)
    soft = [[r["soft_predictions"][c].double().tolist() if counts[k][c] else [0.0] * 4 for c in range(4)]
            for k, r in enumerate(replies)]
    exp_w, _ = hand_dat(counts, soft, 0.4, 0.2)
    for c in range(3):
        proto = sum(exp_w[k][c] * replies[k]["prototypes"][c].double() for k in range(3) if counts[k][c])
        label = sum(exp_w[k][c] * torch.tensor(soft[k][c], dtype=torch.float64) for k in range(3) if counts[k][c])
        torch.testing.assert_close(server.prototypes[c].double(), proto, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(server.soft[c].double(), label, rtol=1e-5, atol=1e-6)
    payload = server.broadcast(1)
    assert payload["prototype_mask"].tolist() == [True, True, True, False]
    assert payload["soft_mask"].tolist() == [True, True, True, False]
    assert bool(torch.isfinite(payload["prototypes"]).all()) and float(payload["prototypes"].abs().max()) < 100
    assert metrics["classes_held"] == 3.0
    # weights: weighted by w_k = sum_c (n^c / N) p_k^c, computed by hand in float64
    totals = [sum(counts[k][c] for k in range(3)) for c in range(4)]
    w = [sum(totals[c] / sum(totals) * exp_w[k][c] for c in range(4)) for k in range(3)]
    for name, value in server.weights.items():
        expected = sum(w[k] * replies[k]["weights"][name].double() for k in range(3))
        torch.testing.assert_close(value.double(), expected, rtol=1e-5, atol=1e-6, msg=name)


def test_fedgmkd_server_rejects_malformed_knowledge_and_keeps_its_state():
    server = G.FedGMKDServer(context(G.FedGMKDOptions()))
    replies, _ = gmkd_replies(server)
    replies[1]["soft_predictions"][0, 0] = float("nan")  # class 0 is held by client 1
    before = copy.deepcopy(server.state_dict())
    with pytest.raises(UpdateError, match="reply 1.*soft_predictions"):
        server.aggregate(0, replies)
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(server.state_dict()[key], value)
    replies, _ = gmkd_replies(server)
    replies[0]["prototypes"] = torch.zeros(NUM_CLASSES, FEATURE_DIM + 1)
    with pytest.raises(UpdateError, match="prototypes"):
        server.validate_reply(replies[0])


def test_fedgmkd_server_keeps_the_knowledge_of_a_class_nobody_held_this_round():
    server = G.FedGMKDServer(context(G.FedGMKDOptions()))
    replies, _ = gmkd_replies(server)
    server.aggregate(0, replies)
    kept_p, kept_s = server.prototypes[0].clone(), server.soft[0].clone()
    later, _ = gmkd_replies(server)
    for reply in later:  # nobody holds class 0 in round 1
        reply["class_counts"][0] = 0
        reply["prototypes"][0] = float("nan")
        reply["num_examples"] = int(reply["class_counts"].sum())
    server.aggregate(1, later)
    assert torch.equal(server.prototypes[0], kept_p) and torch.equal(server.soft[0], kept_s)
    assert server.prototype_mask.tolist() == [True, True, True, False]
    assert server.soft_mask.tolist() == [True, True, True, False]


# ============================================================================
# FedGMKD: client
# ============================================================================

HELD = [0, 1, 3]


def gmkd_payload(model, *, knowledge: bool, dtype=torch.float32, seed=21):
    g = gen(seed)
    protos = torch.randn(NUM_CLASSES, FEATURE_DIM, generator=g).to(dtype)
    soft = torch.softmax(torch.randn(NUM_CLASSES, NUM_CLASSES, generator=g), 1).to(dtype)
    p_mask = torch.tensor([True, True, False, True]) if knowledge else torch.zeros(NUM_CLASSES, dtype=torch.bool)
    s_mask = torch.tensor([True, False, True, True]) if knowledge else torch.zeros(NUM_CLASSES, dtype=torch.bool)
    return {"weights": clone_weights(model), "prototypes": protos, "prototype_mask": p_mask,
            "soft_predictions": soft, "soft_mask": s_mask}


def test_fedgmkd_client_without_knowledge_trains_like_fedavg_and_uploads_its_knowledge():
    data = make_client(30, HELD, seed=4)
    options = G.FedGMKDOptions(temperature=0.5)
    model = seeded_model(2)
    reply, metrics = G.FedGMKDClient(context(options)).fit(model, gmkd_payload(model, knowledge=False), data, {},
                                                            gen(9))
    ref_model = seeded_model(2)
    ref, ref_metrics = FEDAVG.client(context(FedAvgOptions())).fit(ref_model, {"weights": clone_weights(ref_model)},
                                                                  data, {}, gen(9))
    for name in ref["weights"]:
        assert torch.equal(reply["weights"][name], ref["weights"][name]), name
    assert "proto_mse" not in metrics and "kd_kl" not in metrics
    assert set(reply) == {"weights", "num_examples", "class_counts", "prototypes", "soft_predictions"}
    assert reply["class_counts"].tolist() == [10, 10, 0, 10]
    trained = model_with(reply["weights"])
    with torch.no_grad():
        z = trained.features(data.x)
        probs = torch.softmax(trained.classifier(z) / 0.5, dim=1)
    # the GMM prototype (all 10 samples < max_samples) is the class mean of the trained features
    torch.testing.assert_close(reply["prototypes"].double(), hand_class_means(z, data.y, NUM_CLASSES),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reply["soft_predictions"].double(), hand_class_means(probs, data.y, NUM_CLASSES),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(reply["soft_predictions"][2], torch.zeros(NUM_CLASSES))
    assert 1.0 <= metrics["gmm_components"] <= 6.0


@pytest.mark.parametrize("reduction", ["mean", "batchmean"])
def test_fedgmkd_client_one_sgd_step_matches_hand_written_loss(reduction):
    data = make_client(12, HELD, seed=5, dtype=torch.float64)
    options = G.FedGMKDOptions(lam=0.7, gamma=0.4, temperature=0.8, kl_reduction=reduction)
    model = seeded_model(3, torch.float64)
    payload = gmkd_payload(model, knowledge=True, dtype=torch.float64)
    received = copy.deepcopy(payload["weights"])
    client = G.FedGMKDClient(MethodContext(model=TinyNet(), num_classes=NUM_CLASSES, options=options, train=STEP))
    reply, metrics = client.fit(model, payload, data, {}, gen(1))

    ref = model_with(copy.deepcopy(received), dtype=torch.float64)
    ref.train()
    z = ref.features(data.x)
    ce = F.cross_entropy(ref.classifier(z), data.y)
    P, S = payload["prototypes"], payload["soft_predictions"]
    mse = sum(((z[i] - P[int(data.y[i])]) ** 2).sum() for i in range(12) if int(data.y[i]) in (0, 1, 3))
    mse = mse / (12 * FEATURE_DIM)
    kl = 0.0
    for c in (0, 3):  # prototype AND soft prediction held
        log_q = torch.log_softmax(ref.classifier(P[c]) / 0.8, dim=0)
        kl = kl + sum(S[c, j] * (torch.log(S[c, j]) - log_q[j]) for j in range(NUM_CLASSES))
    kl = kl / 2 if reduction == "batchmean" else kl / (2 * NUM_CLASSES)
    loss = ce + 0.4 * mse + 0.7 * kl
    params = dict(ref.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    for (name, p), grad in zip(params.items(), grads):
        expected = p.detach() - STEP.lr * (grad + STEP.weight_decay * p.detach())
        torch.testing.assert_close(reply["weights"][name], expected, rtol=0, atol=1e-10, msg=name)
    assert metrics["proto_mse"] == pytest.approx(0.4 * float(mse.detach()), rel=1e-9)
    assert metrics["kd_kl"] == pytest.approx(0.7 * float(kl.detach()), rel=1e-9)


# ============================================================================
# FedSA: anchors
# ============================================================================


def test_anchors_are_seeded_and_the_server_starts_from_them():
    a = S.semantic_anchors(NUM_CLASSES, FEATURE_DIM, 3)
    assert a.shape == (NUM_CLASSES, FEATURE_DIM) and a.dtype == torch.float32
    assert torch.equal(a, S.semantic_anchors(NUM_CLASSES, FEATURE_DIM, 3))
    assert not torch.equal(a, S.semantic_anchors(NUM_CLASSES, FEATURE_DIM, 4))
    assert bool((a >= 0).all()) and S.class_gap(a) > 0  # ReLU output, distinct classes
    server = S.FedSAServer(context(S.FedSAOptions(), seed=3))
    assert torch.equal(server.broadcast(0)["anchors"], a)
    assert torch.equal(S.FedSAServer(context(S.FedSAOptions(), seed=3)).anchors, a)
    torch.manual_seed(0)
    first = torch.randn(5)
    torch.manual_seed(0)
    S.semantic_anchors(NUM_CLASSES, FEATURE_DIM, 3)
    assert torch.equal(torch.randn(5), first)  # the global RNG is not touched


def sa_reply(server, counts, protos, seed, gradients=None):
    g = gen(seed)
    weights = {n: t + 0.05 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t.clone()
               for n, t in server.weights.items()}
    reply = {"weights": weights, "num_examples": int(sum(counts)), "class_counts": torch.tensor(counts),
             "prototypes": protos}
    if gradients is not None:
        reply["class_gradients"] = gradients
    return reply


def sa_replies(server, seed=0, hyper=False):
    counts = [[4, 0, 2, 0], [3, 5, 0, 0], [0, 2, 6, 0]]
    g = gen(100 + seed)
    replies = []
    for k in range(3):
        protos = torch.randn(NUM_CLASSES, FEATURE_DIM, generator=g)
        for c in range(NUM_CLASSES):
            if counts[k][c] == 0:
                protos[c] = float("nan")  # rows of classes not held are never read
        gradients = torch.randn(NUM_CLASSES, FEATURE_DIM, generator=g) if hyper else None
        replies.append(sa_reply(server, counts[k], protos, seed=k + 10 * seed, gradients=gradients))
    return replies, counts


def test_anchor_ema_by_hand_over_two_rounds():
    server = S.FedSAServer(context(S.FedSAOptions(), seed=1))
    anchors = [server.anchors.clone()]
    for round_ in range(2):
        replies, counts = sa_replies(server, seed=round_)
        server.aggregate(round_, replies)
        expected = anchors[-1].double().clone()
        for c in range(NUM_CLASSES):
            holders = [k for k in range(3) if counts[k][c]]
            if holders:
                pbar = sum(replies[k]["prototypes"][c].double() for k in holders) / len(holders)
                expected[c] = 0.9999 * expected[c] + 0.0001 * pbar
        torch.testing.assert_close(server.anchors.double(), expected, rtol=0, atol=1e-6)
        assert torch.equal(server.anchors[3], anchors[0][3])  # nobody holds class 3: unchanged, not zeroed
        anchors.append(server.anchors.clone())
    assert float((anchors[2] - anchors[0]).abs().max()) < 1e-2  # only the slow EMA moves them
    # FedAvg on the weights (dagger)
    replies, _ = sa_replies(server, seed=5)
    server.aggregate(2, replies)
    n = [r["num_examples"] for r in replies]
    for name, value in server.weights.items():
        expected = sum(n[k] * replies[k]["weights"][name].double() for k in range(3)) / sum(n)
        torch.testing.assert_close(value.double(), expected, rtol=1e-5, atol=1e-6)


def test_anchor_momentum_option_is_used():
    server = S.FedSAServer(context(S.FedSAOptions(anchor_momentum=0.5), seed=1))
    start = server.anchors.clone()
    replies, counts = sa_replies(server)
    server.aggregate(0, replies)
    pbar = (replies[0]["prototypes"][0] + replies[1]["prototypes"][0]) / 2
    torch.testing.assert_close(server.anchors[0], 0.5 * start[0] + 0.5 * pbar)


# ============================================================================
# FedSA: loss terms
# ============================================================================


def test_margin_ce_by_hand():
    z = torch.tensor([[0.0, 1.0], [2.0, -1.0], [0.5, 0.5]], dtype=torch.float64)
    A = torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, -2.0]], dtype=torch.float64)
    y = torch.tensor([1, 2, 0])
    gap = 0.7
    total = 0.0
    for i in range(3):
        logits = []
        for c in range(3):
            dist = math.sqrt(sum((float(z[i, j]) - float(A[c, j])) ** 2 for j in range(2)))
            logits.append(-(dist + (gap if c == int(y[i]) else 0.0)))
        total += -math.log(hand_softmax(logits)[int(y[i])])
    assert float(S.margin_ce(z, y, A, gap)) == pytest.approx(total / 3, rel=1e-12)


def test_calibration_ce_by_hand():
    head = small_head()
    A = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    total = 0.0
    for c in range(3):
        logits = [sum(float(head.weight.detach()[j, i]) * float(A[c, i]) for i in range(2))
                  + float(head.bias.detach()[j])
                  for j in range(3)]
        total += -math.log(hand_softmax(logits)[c])
    assert float(S.calibration_ce(head, A).detach()) == pytest.approx(total / 3, rel=1e-12)


def test_sqrt_clamp_gives_finite_gradients_when_a_feature_sits_on_an_anchor():
    A = torch.tensor([[1.0, 2.0], [-1.0, 0.5]], dtype=torch.float64)
    z = A[[0, 1]].clone().requires_grad_(True)  # z_i == A_{y_i} exactly
    loss = S.margin_ce(z, torch.tensor([0, 1]), A, 0.3)
    (grad,) = torch.autograd.grad(loss, z)
    assert bool(torch.isfinite(loss)) and bool(torch.isfinite(grad).all())
    distances = clamped_distances(z.detach(), A)
    assert float(distances[0, 0]) == pytest.approx(1e-6)


def test_class_gap_by_hand():
    vectors = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0], [10.0, 10.0]])
    # nearest others: 0 -> 2 (1), 1 -> 2 (sqrt(18)), 2 -> 0 (1), 3 -> 1 (sqrt(85))
    assert S.class_gap(vectors) == pytest.approx((1 + math.sqrt(18) + 1 + math.sqrt(85)) / 4)
    present = torch.tensor([True, True, False, False])
    assert S.class_gap(vectors, present) == pytest.approx(5.0)
    assert S.class_gap(vectors, torch.tensor([False, True, False, False])) is None


# ============================================================================
# FedSA: client
# ============================================================================


def sa_payload(model, scale=1.0, dtype=torch.float32):
    anchors = scale * S.semantic_anchors(NUM_CLASSES, FEATURE_DIM, 8)
    return {"weights": clone_weights(model), "anchors": anchors.to(dtype)}


def test_fedsa_client_keeps_last_prototypes_and_uses_them_for_the_gap():
    data = make_client(24, HELD, seed=6)
    client = S.FedSAClient(context(S.FedSAOptions()))
    state: dict = {}
    model = seeded_model(1)
    payload = sa_payload(model, scale=1e-3)  # tiny anchors: tiny global gap, the local gap wins
    reply, metrics = client.fit(model, payload, data, state, gen(2))
    assert "local_gap" not in metrics  # first participation: the global gap only
    global_gap = S.class_gap(payload["anchors"])
    assert metrics["gap"] == pytest.approx(global_gap)
    assert set(state) == {"last_prototypes", "last_present"}
    trained = model_with(reply["weights"])
    with torch.no_grad():
        expected = hand_class_means(trained.features(data.x), data.y, NUM_CLASSES)
    torch.testing.assert_close(state["last_prototypes"].double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reply["prototypes"], state["last_prototypes"])
    assert state["last_present"].tolist() == [True, True, False, True]
    assert reply["class_counts"].tolist() == [8, 8, 0, 8]

    # second round: gap = max(global, local) with the local gap of the stored prototypes (held classes only)
    stored = state["last_prototypes"].clone()
    local = 0.0
    for c in HELD:
        local += min(float((stored[c].double() - stored[o].double()).norm()) for o in HELD if o != c)
    local /= len(HELD)
    assert local > global_gap
    _, metrics2 = client.fit(model, sa_payload(model, scale=1e-3), data, state, gen(3))
    assert metrics2["local_gap"] == pytest.approx(local, rel=1e-6)
    assert metrics2["gap"] == pytest.approx(local, rel=1e-6)
    # and big anchors: the global gap wins
    _, metrics3 = client.fit(model, sa_payload(model, scale=100.0), data, state, gen(4))
    assert metrics3["gap"] == pytest.approx(S.class_gap(100.0 * S.semantic_anchors(NUM_CLASSES, FEATURE_DIM, 8)),
                                            rel=1e-5)


def test_fedsa_client_one_sgd_step_matches_hand_written_loss():
    data = make_client(12, HELD, seed=7, dtype=torch.float64)
    options = S.FedSAOptions(lambda1=0.3, lambda2=0.6, lambda3=0.8)
    model = seeded_model(4, torch.float64)
    payload = sa_payload(model, scale=0.5, dtype=torch.float64)
    received = copy.deepcopy(payload["weights"])
    g = gen(12)
    state = {"last_prototypes": torch.randn(NUM_CLASSES, FEATURE_DIM, generator=g),
             "last_present": torch.tensor([True, True, True, False])}
    stored = state["last_prototypes"].clone()
    client = S.FedSAClient(MethodContext(model=TinyNet(), num_classes=NUM_CLASSES, options=options, train=STEP))
    reply, metrics = client.fit(model, payload, data, state, gen(1))

    A = payload["anchors"]
    local = sum(min(float((stored[c].double() - stored[o].double()).norm()) for o in (0, 1, 2) if o != c)
                for c in (0, 1, 2)) / 3
    glob = sum(min(float((A[c] - A[o]).norm()) for o in range(4) if o != c) for c in range(4)) / 4
    gap = max(local, glob)
    assert metrics["gap"] == pytest.approx(gap, rel=1e-9)
    ref = model_with(copy.deepcopy(received), dtype=torch.float64)
    ref.train()
    z = ref.features(data.x)
    ce = F.cross_entropy(ref.classifier(z), data.y)
    calib = F.cross_entropy(ref.classifier(A), torch.arange(4))
    mse = sum(((z[i] - A[int(data.y[i])]) ** 2).sum() for i in range(12)) / (12 * FEATURE_DIM)
    margin = 0.0
    for i in range(12):
        dists = torch.stack([((z[i] - A[c]) ** 2).sum().sqrt() for c in range(4)])
        logits = -(dists + gap * (torch.arange(4) == int(data.y[i])).double())
        margin = margin - torch.log_softmax(logits, 0)[int(data.y[i])]
    margin = margin / 12
    loss = ce + 0.3 * calib + 0.6 * mse + 0.8 * margin
    params = dict(ref.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()))
    for (name, p), grad in zip(params.items(), grads):
        expected = p.detach() - STEP.lr * (grad + STEP.weight_decay * p.detach())
        torch.testing.assert_close(reply["weights"][name], expected, rtol=0, atol=1e-10, msg=name)
    assert metrics["calibration"] == pytest.approx(0.3 * float(calib.detach()), rel=1e-9)
    assert metrics["anchor_mse"] == pytest.approx(0.6 * float(mse.detach()), rel=1e-9)
    assert metrics["margin_ce"] == pytest.approx(0.8 * float(margin.detach()), rel=1e-9)


# ============================================================================
# prototypes=hyper (plug-and-play) and protocol checks
# ============================================================================


@pytest.mark.parametrize("module", [G, S], ids=["fedgmkd", "fedsa"])
def test_hyper_broadcast_is_the_averaged_bank_and_replies_carry_class_gradients(module):
    options = (G.FedGMKDOptions if module is G else S.FedSAOptions)(prototypes="hyper", num_hyper=3, match_steps=2)
    server = (G.FedGMKDServer if module is G else S.FedSAServer)(context(options, seed=5))
    bank = HyperPrototypeBank(NUM_CLASSES, FEATURE_DIM, 5, num_hyper=3)
    payload = server.broadcast(0)
    key = "prototypes" if module is G else "anchors"
    assert torch.equal(payload[key], bank.averaged)
    if module is G:
        assert payload["prototype_mask"].tolist() == [True] * 4

    data = make_client(24, HELD, seed=8)
    model = seeded_model(0)
    client = (G.FedGMKDClient if module is G else S.FedSAClient)(context(options))
    reply, _ = client.fit(model, payload, data, {}, gen(3))
    trained = model_with(reply["weights"])
    gradients, counts, prototypes = class_statistics(trained, data, NUM_CLASSES)
    torch.testing.assert_close(reply["class_gradients"], gradients, rtol=1e-5, atol=1e-7)
    if module is G:  # FedGMKD's knowledge step reads the prototypes with hyper-prototypes too
        torch.testing.assert_close(reply["prototypes"], prototypes, rtol=1e-5, atol=1e-6)
    else:  # FedSA's server step is FedHPro's: no prototypes sent; the client keeps them for its local gap
        assert "prototypes" not in reply
        state: dict = {}
        client.fit(seeded_model(0), payload, data, state, gen(3))
        torch.testing.assert_close(state["last_prototypes"], prototypes, rtol=1e-5, atol=1e-6)
    assert torch.equal(reply["class_counts"], counts)

    # the server matches the bank against the NEW global head, and then broadcasts the new averaged H
    replies = [reply, client.fit(seeded_model(1), server.broadcast(0), make_client(20, [1, 2], seed=9), {},
                                 gen(4))[0]]
    metrics = server.aggregate(0, replies)
    assert metrics["hyper_movement"] > 0
    assert torch.equal(server.broadcast(1)[key], server.bank.averaged)
    assert not torch.equal(server.bank.averaged, bank.averaged)


@pytest.mark.parametrize("module", [G, S], ids=["fedgmkd", "fedsa"])
def test_protocol_configuration_errors(module):
    options_cls = G.FedGMKDOptions if module is G else S.FedSAOptions
    server_cls = G.FedGMKDServer if module is G else S.FedSAServer
    no_weights = MethodContext(model=TinyNet(), num_classes=NUM_CLASSES, options=None, train=TRAIN, shared_keys=[])
    with pytest.raises(ConfigError, match="dagger"):
        server_cls(MethodContext(**{**no_weights.__dict__, "options": options_cls(protocol="proto-only",
                                                                                  prototypes="hyper")}))
    with pytest.raises(ConfigError, match="shared='none'"):
        server_cls(context(options_cls(protocol="proto-only")))  # weights would travel
    server_cls(MethodContext(**{**no_weights.__dict__, "options": options_cls(protocol="proto-only")}))


# ============================================================================
# one Simulator round of every configuration
# ============================================================================

CONFIGS = [(m, p, s) for m in ("fedgmkd", "fedsa") for p in ("dagger", "proto-only") for s in ("local", "hyper")]


@pytest.mark.parametrize("method,protocol,source", CONFIGS, ids=["-".join(c) for c in CONFIGS])
def test_simulator_runs_every_configuration(method, protocol, source):
    module = G if method == "fedgmkd" else S
    extra = {"max_components": 3} if module is G else {}
    options = (G.FedGMKDOptions if module is G else S.FedSAOptions)(
        protocol=protocol, prototypes=source, num_hyper=2, match_steps=2, **extra)
    # class 3 is held by nobody: it must neither crash nor be averaged as zeros
    federation = make_federation([12, 10, 9], classes=[[0, 1], [1, 2], [0, 2]])
    # test sets named after the clients' domains: proto-only evaluates each client on its own domain's
    federation.test_sets = {"d0": federation.test_sets["a"], "d1": federation.test_sets["b"]}
    shared = "none" if protocol == "proto-only" else None

    def build():
        return Simulator(module.METHOD, options, federation, TinyNet, TRAIN, rounds=2, seed=0, shared=shared)

    if protocol == "proto-only" and source == "hyper":
        with pytest.raises(ConfigError, match="dagger"):
            build()
        return
    sim = build()
    records = [sim.run_round(r) for r in range(2)]
    for record in records:
        assert record.accuracy is not None and math.isfinite(record.accuracy["AVG"])
        assert math.isfinite(record.train["loss"]) and not record.dropped
    if protocol == "proto-only":
        assert sim.server.weights == {}
    else:
        assert all(bool(torch.isfinite(v).all()) for v in sim.server.weights.values() if v.is_floating_point())
    if method == "fedgmkd":
        assert sim.server.soft_mask.tolist() == [True, True, True, False]
        if source == "local":
            assert sim.server.prototype_mask.tolist() == [True, True, True, False]
        assert {"proto_mse", "kd_kl"} <= set(records[1].train)  # knowledge from round 0 is used in round 1
        assert bool(torch.isfinite(sim.server.prototypes).all())
    else:
        assert "margin_ce" in records[1].train
        if source == "local":
            initial = S.semantic_anchors(NUM_CLASSES, FEATURE_DIM, sim.server.context.seed)
            assert torch.equal(sim.server.anchors[3], initial[3])  # nobody holds class 3: never moved
        assert all("last_prototypes" in state for state in sim.client_states)
    # a checkpoint round-trip of the server keeps its state
    state = copy.deepcopy(sim.server.state_dict())
    fresh = build().server
    fresh.load_state_dict(state)
    for key, value in sim.server.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(fresh.state_dict()[key], value), key


def test_nearest_prototype_inference_uses_fedsa_anchors_and_fedgmkd_prototypes():
    from fedhpro.methods.prototypes import NearestPrototypeClassifier

    fed = make_federation([12, 14, 10], classes=[[0, 1], [1, 2], [0, 1, 2, 3]])
    fed.client_domains = ["a", "b", "a"]
    for spec, options in ((S.METHOD, S.FedSAOptions(protocol="proto-only", inference="nearest-prototype")),
                          (G.METHOD, G.FedGMKDOptions(protocol="proto-only", inference="nearest-prototype"))):
        sim = Simulator(spec, options, fed, TinyNet, TRAIN, rounds=1, seed=2, shared="none")
        record = sim.run_round(0)
        assert math.isfinite(record.accuracy["AVG"])
        model = sim.models.model_for(0)
        wrapped = sim.server.inference_model(model)
        assert isinstance(wrapped, NearestPrototypeClassifier) and wrapped.model is model
        if spec is S.METHOD:
            expected, mask = sim.server.anchors, torch.ones(NUM_CLASSES, dtype=torch.bool)
        else:
            expected, mask = sim.server.prototypes, sim.server.prototype_mask
        torch.testing.assert_close(wrapped.prototypes, expected.to(wrapped.prototypes.dtype))
        assert wrapped.mask.tolist() == mask.tolist()
        # inference=head (the default) evaluates the model itself
        sim.server.options = type(options)(protocol="proto-only")
        assert sim.server.inference_model(model) is model


@pytest.mark.slow
def test_fedsa_proto_only_runs_from_the_cli_with_personal_models(digits_data_dir, tmp_path):
    """FedSA's protocol=proto-only exchanges no weights: its MethodSpec declares so (weights_travel), so the run
    keeps each client's own model (it stopped with a one-line error when the declaration was missing)."""
    from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

    import fedhpro

    fedhpro.run(method="fedsa", rounds=1, clients=3, local_epochs=1, feature_dim=16, progress=False,
                data_dir=str(digits_data_dir), out=str(tmp_path / "run"),
                **{"fedsa.protocol": "proto-only", "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
                   "data.test_fraction": DIGITS_TEST_FRACTION})
    assert sorted(p.name for p in (tmp_path / "run" / "models").iterdir()) == [
        f"client_{k}.{kind}" for k in range(3) for kind in ("pt", "safetensors")]  # safetensors: fedhpro[export]
