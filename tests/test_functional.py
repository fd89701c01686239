"""Tests of ``fedhpro.functional`` and FedHPro's equations (``fedhpro.methods.fedhpro.equations``) against
independent references.

Every expected value below comes from something other than the function under
test: slow per-sample Python loops, ``torch.autograd`` applied one sample at a
time, closed forms (for a linear head ``h(z) = Wz + b``,
``d CE(h(z), y) / dz = W^T (softmax(Wz + b) - e_y)``), finite differences, or
small cases whose numbers are written in the test.
"""

from __future__ import annotations

import copy
import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedhpro import functional
from fedhpro.functional import local_prototypes, weighted_average
from fedhpro.methods.fedhpro import authors_code, equations
from fedhpro.methods.fedhpro.equations import (
    class_gradients,
    client_margin,
    global_prototypes,
    gradient_matching_loss,
    hpal_loss,
    hpcl_loss,
    hyper_prototype_gradients,
    hyper_similarity,
    match_hyper_prototypes,
)

DT = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, dtype=DT, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed), dtype=dtype) * scale


def linear_head(d: int, c: int, seed: int, dtype=DT) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(d, c).to(dtype)
    with torch.no_grad():
        head.weight.copy_(randn(c, d, seed=seed + 1000, dtype=dtype))
        head.bias.copy_(randn(c, seed=seed + 2000, dtype=dtype))
    return head


# ----------------------------------------------------------------------------
# independent references
# ----------------------------------------------------------------------------


def py_softmax(logits: list[float]) -> list[float]:
    m = max(logits)
    e = [math.exp(v - m) for v in logits]
    s = sum(e)
    return [v / s for v in e]


def closed_form_ce_grad(W: torch.Tensor, b: torch.Tensor, z: torch.Tensor, y: int) -> torch.Tensor:
    """W^T (softmax(Wz + b) - e_y) for one sample, softmax in plain Python float64."""
    W64, b64, z64 = W.double(), b.double(), z.double()
    logits = [float(v) for v in (W64 @ z64 + b64)]
    p = py_softmax(logits)
    p[y] -= 1.0
    return W64.T @ torch.tensor(p, dtype=DT)


def autograd_ce_grad(head: nn.Module, z: torch.Tensor, y: int) -> torch.Tensor:
    """d CE(h(z), y) / dz for ONE sample, with autograd (no parameter gets .grad)."""
    leaf = z.detach().clone().unsqueeze(0).requires_grad_(True)
    loss = F.cross_entropy(head(leaf), torch.tensor([y]))
    (g,) = torch.autograd.grad(loss, leaf)
    return g[0]


def closed_form_g_hp(hyper: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Eq. 7 in closed form, differentiable w.r.t. hyper (torch ops, not the code under test)."""
    C = hyper.shape[0]
    logits = torch.einsum("cid,kd->cik", hyper, W) + b  # C x I x C
    probs = torch.softmax(logits, dim=-1)
    onehot = torch.eye(C, dtype=hyper.dtype).unsqueeze(1)  # C x 1 x C
    return torch.einsum("cik,kd->cid", probs - onehot, W).mean(1)


def ref_cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum() / (torch.sqrt((a * a).sum()) * torch.sqrt((b * b).sum()))


def ref_lgm(g_real: torch.Tensor, g_hp: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    total = g_hp.new_zeros(())
    for c in range(g_real.shape[0]):
        if bool(present[c]):
            total = total + (1.0 - ref_cosine(g_real[c], g_hp[c]))
    return total


def ref_match_sgd(hyper, W, b, g_real, present, steps, lr):
    s = hyper.detach().clone()
    mask = present.to(s.dtype).view(-1, 1, 1)
    losses = []
    for t in range(steps + 1):
        var = s.clone().requires_grad_(True)
        loss = ref_lgm(g_real, closed_form_g_hp(var, W, b), present)
        losses.append(float(loss.detach()))
        if t == steps:
            break
        (grad,) = torch.autograd.grad(loss, var)
        s = s - lr * grad * mask
    return s, losses[0], losses[-1]


def ref_similarity_loop(z: torch.Tensor, hyper: torch.Tensor) -> list[list[float]]:
    B, C, num_hyper = z.shape[0], hyper.shape[0], hyper.shape[1]
    out = []
    for i in range(B):
        zi = [float(v) for v in z[i]]
        nz = math.sqrt(sum(v * v for v in zi))
        row = []
        for c in range(C):
            acc = 0.0
            for j in range(num_hyper):
                s = [float(v) for v in hyper[c, j]]
                ns = math.sqrt(sum(v * v for v in s))
                acc += sum(a * bb for a, bb in zip(zi, s)) / (nz * ns)
            row.append(acc / num_hyper)
        out.append(row)
    return out


def ref_hpcl_direct(z, y, hyper, margin, tau) -> float:
    """Eq. 12 evaluated literally (moderate values only), batch mean."""
    sim = ref_similarity_loop(z, hyper)
    total = 0.0
    for i, row in enumerate(sim):
        yi = int(y[i])
        num = sum(math.exp((row[j] + margin) / tau) for j in range(len(row)) if j != yi)
        den = math.exp(row[yi] / tau)
        total += math.log(1.0 + num / den)
    return total / len(sim)


def ref_hpcl_stable(z, y, hyper, margin, tau) -> float:
    """Eq. 12 with my own log-sum-exp reasoning: loss = log(1 + sum_j exp(a_j - b))."""
    sim = ref_similarity_loop(z, hyper)
    total = 0.0
    for i, row in enumerate(sim):
        yi = int(y[i])
        b = row[yi] / tau
        terms = [(row[j] + margin) / tau - b for j in range(len(row)) if j != yi] + [0.0]  # 0 <-> the "1 +"
        m = max(terms)
        total += m + math.log(sum(math.exp(t - m) for t in terms))
    return total / len(sim)


def huber(x: float) -> float:
    return 0.5 * x * x if abs(x) <= 1.0 else abs(x) - 0.5


# ----------------------------------------------------------------------------
# Eq. 2: local prototypes
# ----------------------------------------------------------------------------


def test_local_prototypes_hand_case():
    features = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 0.0]], dtype=DT)
    labels = torch.tensor([0, 0, 1])
    protos, present = local_prototypes(features, labels, 3)
    assert protos.shape == (3, 2)
    assert torch.equal(present, torch.tensor([True, True, False]))
    assert torch.allclose(protos, torch.tensor([[2.0, 3.0], [5.0, 0.0], [0.0, 0.0]], dtype=DT), atol=0, rtol=0)


def test_local_prototypes_match_loop_with_absent_classes():
    B, d, C = 41, 6, 7
    features = randn(B, d, seed=1)
    labels = torch.randint(0, 5, (B,), generator=gen(2))  # classes 5, 6 absent
    labels[:5] = torch.arange(5)  # make 0..4 surely present
    protos, present = local_prototypes(features, labels, C)
    for c in range(C):
        rows = [features[i] for i in range(B) if int(labels[i]) == c]
        if rows:
            assert bool(present[c])
            ref = sum(rows) / len(rows)
            assert torch.allclose(protos[c], ref, atol=1e-12, rtol=0)
        else:
            assert not bool(present[c])
            assert torch.count_nonzero(protos[c]) == 0
    assert present.dtype == torch.bool


# ----------------------------------------------------------------------------
# Eq. 4: global prototypes
# ----------------------------------------------------------------------------


def test_global_prototypes_hand_case():
    # class 0: client 0 has p=(1,0) with n=1, client 1 has p=(0,1) with n=3
    #   -> 1/2 * (1/4 (1,0) + 3/4 (0,1)) = (0.125, 0.375)
    # class 1: only client 0, p=(2,2), n=5 -> 1/1 * (5/5) (2,2) = (2,2)
    # class 2: nobody -> zeros, not held
    protos = torch.tensor(
        [[[1.0, 0.0], [2.0, 2.0], [0.0, 0.0]], [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]], dtype=DT
    )
    present = torch.tensor([[True, True, False], [True, False, False]])
    counts = torch.tensor([[1, 5, 0], [3, 0, 0]])
    P, held = global_prototypes(protos, present, counts)
    assert torch.equal(held, torch.tensor([True, True, False]))
    expected = torch.tensor([[0.125, 0.375], [2.0, 2.0], [0.0, 0.0]], dtype=DT)
    assert torch.allclose(P, expected, atol=1e-15, rtol=0)


def test_global_prototypes_match_loop():
    K, C, d = 5, 6, 4
    protos = randn(K, C, d, seed=3)
    present = torch.rand(K, C, generator=gen(4)) < 0.6
    present[:, 5] = False  # class 5 held by nobody
    present[0, :5] = True
    counts = torch.randint(1, 20, (K, C), generator=gen(5)) * present.long()
    protos = protos * present.unsqueeze(-1).to(DT)  # absent prototypes are zero, as local_prototypes gives
    P, held = global_prototypes(protos, present, counts)
    for c in range(C):
        holders = [k for k in range(K) if bool(present[k, c])]
        if not holders:
            assert not bool(held[c])
            assert torch.count_nonzero(P[c]) == 0
            continue
        assert bool(held[c])
        n_c = sum(int(counts[k, c]) for k in holders)
        ref = sum((int(counts[k, c]) / n_c) * protos[k, c] for k in holders) / len(holders)
        assert torch.allclose(P[c], ref, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------
# Eq. 10: client margin
# ----------------------------------------------------------------------------


def test_client_margin_hand_case():
    protos = torch.tensor([[0.0, 0.0], [3.0, 4.0], [7.0, -1.0]], dtype=DT)
    present = torch.tensor([True, True, False])
    # ordered pairs (0,1), (1,0): 2 * 5, divided by (C-1)^2 = 4
    assert float(client_margin(protos, present)) == pytest.approx(2.5, abs=1e-14)


def test_client_margin_normalized_hand_case():
    protos = torch.tensor([[1.0, 0.0], [-2.0, 0.0], [0.0, 0.0]], dtype=DT)
    present = torch.tensor([True, True, False])
    # unit vectors (1,0) and (-1,0): distance 2, two ordered pairs, / 4
    assert float(client_margin(protos, present, normalized=True)) == pytest.approx(1.0, abs=1e-14)
    # raw: distance 3 -> 2 * 3 / 4
    assert float(client_margin(protos, present)) == pytest.approx(1.5, abs=1e-14)


@pytest.mark.parametrize("margin", [lambda p, m: client_margin(p, m), lambda p, m: client_margin(p, m, normalized=True),
                                    authors_code.dot_product_margin], ids=["raw", "normalized", "dot"])
def test_both_client_margins_are_a_zero_of_the_prototypes_dtype_below_two_classes(margin):
    protos = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=DT)
    for present in ([False, False], [True, False], [False, True]):
        zero = margin(protos, torch.tensor(present))
        assert zero.shape == () and zero.dtype == DT and float(zero) == 0.0
    single = margin(protos[:1], torch.tensor([True]))  # C = 1
    assert single.shape == () and float(single) == 0.0
    # two held classes of C = 2: the ordered pairs (0,1) and (1,0), over (C-1)^2 = 1
    held = float(margin(protos, torch.tensor([True, True])))
    assert held > 0.0 and held == pytest.approx(float(margin(protos.flip(0), torch.tensor([True, True]))), abs=1e-14)


@pytest.mark.parametrize("normalized", [False, True])
def test_client_margin_matches_loop(normalized):
    C, d = 6, 5
    protos = randn(C, d, seed=6, scale=3.0)
    for seed in range(4):
        present = torch.rand(C, generator=gen(100 + seed)) < 0.7
        present[:2] = True
        p = [F.normalize(protos[c], dim=0) if normalized else protos[c] for c in range(C)]
        total = 0.0
        for c1 in range(C):
            for c2 in range(C):
                if c1 != c2 and bool(present[c1]) and bool(present[c2]):
                    total += math.sqrt(sum(float(v) ** 2 for v in (p[c1] - p[c2])))
        ref = total / (C - 1) ** 2
        got = client_margin(protos, present, normalized=normalized)
        assert got.dim() == 0
        assert float(got) == pytest.approx(ref, rel=1e-12, abs=1e-14)


def test_client_margin_fewer_than_two_classes_is_zero():
    protos = randn(4, 3, seed=7)
    assert float(client_margin(protos, torch.tensor([False, False, False, False]))) == 0.0
    assert float(client_margin(protos, torch.tensor([False, True, False, False]))) == 0.0
    assert float(client_margin(protos, torch.tensor([False, True, False, False]), normalized=True)) == 0.0
    assert float(client_margin(protos[:1], torch.tensor([True]))) == 0.0


def test_client_margin_normalized_bounded_and_scale_invariant():
    C, d = 5, 8
    protos = randn(C, d, seed=8, scale=100.0)
    present = torch.ones(C, dtype=torch.bool)
    m = float(client_margin(protos, present, normalized=True))
    # every distance between unit vectors is <= 2; C(C-1) ordered pairs / (C-1)^2
    assert 0.0 < m <= 2.0 * C * (C - 1) / (C - 1) ** 2
    scales = torch.tensor([0.1, 2.0, 7.0, 1.0, 30.0], dtype=DT).unsqueeze(1)
    assert float(client_margin(protos * scales, present, normalized=True)) == pytest.approx(m, rel=1e-12)
    # the raw margin is NOT scale invariant: doubling every prototype doubles it
    raw = float(client_margin(protos, present))
    assert float(client_margin(2 * protos, present)) == pytest.approx(2 * raw, rel=1e-12)


# ----------------------------------------------------------------------------
# Eq. 5: class gradients
# ----------------------------------------------------------------------------


def _class_grad_fixture(dtype=DT, scale=1.0):
    B, d, C = 23, 5, 4
    head = linear_head(d, C, seed=9, dtype=dtype)
    features = randn(B, d, seed=10, dtype=dtype, scale=scale)
    labels = torch.randint(0, 3, (B,), generator=gen(11))  # class 3 absent
    labels[:3] = torch.arange(3)
    return head, features, labels, C


def test_class_gradients_match_per_sample_autograd():
    head, features, labels, C = _class_grad_fixture()
    g, counts = class_gradients(features, labels, head, C)
    assert g.shape == (C, features.shape[1])
    for c in range(C):
        idx = [i for i in range(len(labels)) if int(labels[i]) == c]
        assert int(counts[c]) == len(idx)
        if not idx:
            assert torch.count_nonzero(g[c]) == 0
            continue
        ref = sum(autograd_ce_grad(head, features[i], c) for i in idx) / len(idx)
        assert torch.allclose(g[c], ref, atol=1e-12, rtol=0)


def test_class_gradients_match_closed_form_and_counts():
    head, features, labels, C = _class_grad_fixture()
    g, counts = class_gradients(features, labels, head, C)
    W, b = head.weight.detach(), head.bias.detach()
    ref_counts = [sum(1 for v in labels.tolist() if v == c) for c in range(C)]
    assert counts.tolist() == ref_counts
    assert ref_counts[3] == 0
    for c in range(C):
        idx = [i for i in range(len(labels)) if int(labels[i]) == c]
        if idx:
            ref = sum(closed_form_ce_grad(W, b, features[i], c) for i in idx) / len(idx)
            assert torch.allclose(g[c], ref, atol=1e-12, rtol=0)
        else:
            assert torch.count_nonzero(g[c]) == 0


def test_class_gradients_leave_classifier_and_features_alone():
    head, features, labels, C = _class_grad_fixture(dtype=torch.float32)
    before = copy.deepcopy(head.state_dict())
    feats = features.clone().requires_grad_(True)
    g, _ = class_gradients(feats, labels, head, C)
    for name, p in head.named_parameters():
        assert p.grad is None, name
        assert torch.equal(p.detach(), before[name])
    assert feats.grad is None
    assert not g.requires_grad
    assert g.dtype == torch.float32
    # float32 result still agrees with the float64 closed form
    W, b = head.weight.detach(), head.bias.detach()
    idx = [i for i in range(len(labels)) if int(labels[i]) == 1]
    ref = sum(closed_form_ce_grad(W, b, features[i], 1) for i in idx) / len(idx)
    assert torch.allclose(g[1].double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_class_gradients_extreme_logits_are_finite(dtype):
    head, features, labels, C = _class_grad_fixture(dtype=dtype, scale=1e4)
    g, _ = class_gradients(features, labels, head, C)
    assert torch.isfinite(g).all()
    W, b = head.weight.detach(), head.bias.detach()
    for c in range(3):
        idx = [i for i in range(len(labels)) if int(labels[i]) == c]
        ref = sum(closed_form_ce_grad(W, b, features[i], c) for i in idx) / len(idx)
        tol = 1e-9 if dtype == torch.float64 else 1e-3
        assert torch.allclose(g[c].double(), ref, atol=tol, rtol=0)


# ----------------------------------------------------------------------------
# Eq. 7: hyper-prototype gradients
# ----------------------------------------------------------------------------


def test_hyper_prototype_gradients_match_per_vector_autograd():
    C, num_hyper, d = 4, 3, 6
    head = linear_head(d, C, seed=12)
    hyper = randn(C, num_hyper, d, seed=13)
    g = hyper_prototype_gradients(hyper, head)
    assert g.shape == (C, d)
    for c in range(C):
        ref = sum(autograd_ce_grad(head, hyper[c, i], c) for i in range(num_hyper)) / num_hyper
        assert torch.allclose(g[c], ref, atol=1e-12, rtol=0)
        # the gradient of a batch-mean loss would be 1/I of this: make sure it is not
        assert not torch.allclose(g[c], ref / num_hyper, atol=1e-6)
    assert not g.requires_grad
    for p in head.parameters():
        assert p.grad is None


def test_hyper_prototype_gradients_single_vector_is_closed_form():
    C, d = 5, 7
    head = linear_head(d, C, seed=14)
    hyper = randn(C, 1, d, seed=15)
    g = hyper_prototype_gradients(hyper, head)
    W, b = head.weight.detach(), head.bias.detach()
    for c in range(C):
        assert torch.allclose(g[c], closed_form_ce_grad(W, b, hyper[c, 0], c), atol=1e-12, rtol=0)


def test_hyper_prototype_gradients_second_order():
    C, num_hyper, d = 3, 2, 5
    head = linear_head(d, C, seed=16)
    W, b = head.weight.detach(), head.bias.detach()
    base = randn(C, num_hyper, d, seed=17)
    R = randn(C, d, seed=18)

    hyper = base.clone().requires_grad_(True)
    g = hyper_prototype_gradients(hyper, head)
    assert g.requires_grad
    (second,) = torch.autograd.grad((g * R).sum(), hyper)

    ref_var = base.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad((closed_form_g_hp(ref_var, W, b) * R).sum(), ref_var)
    assert torch.allclose(second, ref, atol=1e-12, rtol=0)

    # central finite differences of the closed form, element by element
    eps = 1e-6
    fd = torch.zeros_like(base)
    for idx in torch.cartesian_prod(torch.arange(C), torch.arange(num_hyper), torch.arange(d)).tolist():
        plus, minus = base.clone(), base.clone()
        plus[tuple(idx)] += eps
        minus[tuple(idx)] -= eps
        fd[tuple(idx)] = (
            (closed_form_g_hp(plus, W, b) * R).sum() - (closed_form_g_hp(minus, W, b) * R).sum()
        ) / (2 * eps)
    assert torch.allclose(second, fd, atol=1e-7, rtol=0)
    for p in head.parameters():
        assert p.grad is None


# ----------------------------------------------------------------------------
# Eq. 7 with a linear head: the closed form against the autograd path
# ----------------------------------------------------------------------------


class WrappedHead(nn.Module):
    """Calls an ``nn.Linear`` but is not one: forces the autograd (double-backward) path of Eq. 7."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def no_bias_head(d: int, c: int, seed: int, dtype=DT) -> nn.Linear:
    head = nn.Linear(d, c, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(randn(c, d, seed=seed + 1000, dtype=dtype))
    return head


def _forbid_autograd_path(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a plain nn.Linear head must take the closed form, not autograd")

    monkeypatch.setattr(functional, "per_sample_input_gradients", forbidden)


@pytest.mark.parametrize("C", [2, 7])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("num_hyper", [1, 3])
def test_hyper_prototype_gradients_closed_form_equals_per_sample_autograd(C, bias, num_hyper, monkeypatch):
    d = 6
    head = linear_head(d, C, seed=300 + C) if bias else no_bias_head(d, C, seed=300 + C)
    hyper = randn(C, num_hyper, d, seed=310 + C, scale=2.0)
    # the reference: the autograd path's per-sample input gradients, averaged over the |I| vectors
    labels = torch.arange(C).repeat_interleave(num_hyper)
    per_sample = functional.per_sample_input_gradients(hyper.reshape(C * num_hyper, d), labels, head,
                                                       create_graph=False)
    ref = per_sample.reshape(C, num_hyper, d).mean(1)
    assert not torch.allclose(ref, torch.zeros_like(ref), atol=1e-3)
    _forbid_autograd_path(monkeypatch)
    got = hyper_prototype_gradients(hyper, head)
    assert got.shape == (C, d) and got.dtype == DT
    assert torch.allclose(got, ref, atol=1e-10, rtol=0)
    assert not got.requires_grad
    for p in head.parameters():
        assert p.grad is None


@pytest.mark.parametrize("bias", [True, False])
def test_gradient_matching_grad_closed_form_equals_double_backward(bias, monkeypatch):
    C, num_hyper, d = 5, 3, 7
    head = linear_head(d, C, seed=320) if bias else no_bias_head(d, C, seed=320)
    base = randn(C, num_hyper, d, seed=321, scale=1.5)
    g_real = randn(C, d, seed=322)
    present = torch.tensor([True, False, True, True, True])
    g_real[1] = 0.0

    slow_var = base.clone().requires_grad_(True)  # autograd path: double backward through cross_entropy
    slow_loss = gradient_matching_loss(g_real, hyper_prototype_gradients(slow_var, WrappedHead(head)), present)
    (slow,) = torch.autograd.grad(slow_loss, slow_var)

    _forbid_autograd_path(monkeypatch)
    fast_var = base.clone().requires_grad_(True)
    fast_loss = gradient_matching_loss(g_real, hyper_prototype_gradients(fast_var, head), present)
    (fast,) = torch.autograd.grad(fast_loss, fast_var)

    assert float(fast_loss.detach()) == pytest.approx(float(slow_loss.detach()), rel=1e-12, abs=1e-12)
    assert slow.abs().max() > 1e-3
    assert torch.allclose(fast, slow, atol=1e-9, rtol=0)
    assert torch.count_nonzero(fast[1]) == 0  # an absent class gets no gradient
    for p in head.parameters():
        assert p.grad is None


def test_hyper_prototype_gradients_under_no_grad_stay_differentiable():
    C, num_hyper, d = 3, 2, 4
    head = linear_head(d, C, seed=330)
    hyper = randn(C, num_hyper, d, seed=331).requires_grad_(True)
    with torch.no_grad():
        g = hyper_prototype_gradients(hyper, head)
    assert g.requires_grad  # as the autograd path (it runs under enable_grad)


class ScaledLinear(nn.Linear):
    """An ``nn.Linear`` subclass whose forward is not ``W x + b``: must not take the closed form."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 3.0 * super().forward(x)


def test_hyper_prototype_gradients_other_heads_take_the_autograd_path():
    C, num_hyper, d = 4, 2, 5
    plain = linear_head(d, C, seed=340)
    hyper = randn(C, num_hyper, d, seed=341)
    scaled = ScaledLinear(d, C).to(DT)
    scaled.load_state_dict(plain.state_dict())
    hooked = copy.deepcopy(plain)
    hooked.register_forward_hook(lambda module, args, out: 3.0 * out)
    expected = torch.stack([
        sum(autograd_ce_grad(WrappedHead(scaled), hyper[c, i], c) for i in range(num_hyper)) / num_hyper
        for c in range(C)])
    closed = hyper_prototype_gradients(hyper, plain)
    assert not torch.allclose(expected, closed, atol=1e-3)
    for head in (scaled, hooked):
        assert torch.allclose(hyper_prototype_gradients(hyper, head), expected, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------
# Eq. 8: gradient-matching loss
# ----------------------------------------------------------------------------


def test_gradient_matching_loss_hand_case():
    g_real = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [5.0, 5.0]], dtype=DT)
    g_hyper = torch.tensor([[2.0, 0.0], [-3.0, 0.0], [0.0, 7.0], [1.0, 0.0]], dtype=DT)
    # parallel 0, opposite 2, orthogonal 1; class 3 absent -> ignored
    present = torch.tensor([True, True, True, False])
    assert float(gradient_matching_loss(g_real, g_hyper, present)) == pytest.approx(3.0, abs=1e-14)
    # with class 3: 1 - cos 45deg
    present_all = torch.ones(4, dtype=torch.bool)
    expected = 3.0 + 1.0 - 1.0 / math.sqrt(2.0)
    assert float(gradient_matching_loss(g_real, g_hyper, present_all)) == pytest.approx(expected, abs=1e-14)
    assert float(gradient_matching_loss(g_real, g_hyper, torch.zeros(4, dtype=torch.bool))) == 0.0


def test_gradient_matching_loss_matches_loop_and_ignores_absent():
    C, d = 6, 9
    g_real = randn(C, d, seed=19)
    g_hyper = randn(C, d, seed=20)
    present = torch.tensor([True, False, True, True, False, True])
    g_real[1] = 0.0  # absent classes typically have a zero g^c
    ref = ref_lgm(g_real, g_hyper, present)
    got = gradient_matching_loss(g_real, g_hyper, present)
    assert got.dim() == 0
    assert float(got) == pytest.approx(float(ref), rel=1e-12)
    # changing an absent class changes nothing
    g_hyper2 = g_hyper.clone()
    g_hyper2[4] = randn(d, seed=21) * 100
    assert float(gradient_matching_loss(g_real, g_hyper2, present)) == pytest.approx(float(ref), rel=1e-12)
    # its gradient is finite, zero on absent rows, and matches the reference's
    var = g_hyper.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(gradient_matching_loss(g_real, var, present), var)
    var2 = g_hyper.clone().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad(ref_lgm(g_real, var2, present), var2)
    assert torch.isfinite(grad).all()
    assert torch.count_nonzero(grad[~present]) == 0
    assert torch.allclose(grad, ref_grad, atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------
# Eq. 9: gradient matching of the hyper-prototypes
# ----------------------------------------------------------------------------


def _match_fixture(dtype=DT, seed=22):
    C, num_hyper, d = 5, 3, 8
    head = linear_head(d, C, seed=seed, dtype=dtype)
    hyper = randn(C, num_hyper, d, seed=seed + 1, dtype=dtype)
    g_real = randn(C, d, seed=seed + 2, dtype=dtype)
    present = torch.tensor([True, True, False, True, True])
    g_real[2] = 0.0
    return head, hyper, g_real, present


def test_match_sgd_matches_manual_reference():
    head, hyper, g_real, present = _match_fixture()
    W, b = head.weight.detach().clone(), head.bias.detach().clone()
    new, before, after = match_hyper_prototypes(hyper, head, g_real, present, steps=7, lr=0.1)
    ref, ref_before, ref_after = ref_match_sgd(hyper, W, b, g_real, present, steps=7, lr=0.1)
    assert new.shape == hyper.shape and new.dtype == hyper.dtype
    assert not new.requires_grad
    assert torch.allclose(new, ref, atol=1e-10, rtol=0)
    assert isinstance(before, float) and isinstance(after, float)
    assert before == pytest.approx(ref_before, rel=1e-10, abs=1e-12)
    assert after == pytest.approx(ref_after, rel=1e-10, abs=1e-12)
    assert not torch.equal(new[present], hyper[present])  # something moved


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_match_keeps_absent_classes_input_and_classifier(optimizer):
    head, hyper, g_real, present = _match_fixture()
    hyper_copy = hyper.clone()
    g_copy = g_real.clone()
    state = copy.deepcopy(head.state_dict())
    new, _, _ = match_hyper_prototypes(hyper, head, g_real, present, steps=5, lr=0.05, optimizer=optimizer)
    assert torch.equal(new[2], hyper_copy[2])  # bit-identical
    assert torch.equal(hyper, hyper_copy)  # input not modified
    assert torch.equal(g_real, g_copy)
    assert new.data_ptr() != hyper.data_ptr()
    for name, p in head.named_parameters():
        assert p.grad is None, name
        assert torch.equal(p.detach(), state[name])


def test_match_zero_steps_returns_equal_copy():
    head, hyper, g_real, present = _match_fixture()
    W, b = head.weight.detach(), head.bias.detach()
    new, before, after = match_hyper_prototypes(hyper, head, g_real, present, steps=0, lr=0.1)
    assert torch.equal(new, hyper)
    assert new.data_ptr() != hyper.data_ptr()
    assert before == after
    assert before == pytest.approx(float(ref_lgm(g_real, closed_form_g_hp(hyper, W, b), present)), rel=1e-12)
    new.add_(1.0)
    assert not torch.equal(new, hyper)


def test_match_no_present_class_is_a_no_op():
    head, hyper, g_real, _ = _match_fixture()
    none = torch.zeros(hyper.shape[0], dtype=torch.bool)
    new, before, after = match_hyper_prototypes(hyper, head, g_real, none, steps=5, lr=0.1)
    assert torch.equal(new, hyper)
    assert before == 0.0 and after == 0.0


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 0.05)])
def test_match_decreases_loss(optimizer, lr):
    head, hyper, _, present = _match_fixture(dtype=torch.float32, seed=40)
    W, b = head.weight.detach(), head.bias.detach()
    # an attainable target: the real gradients of one feature vector per class
    targets = randn(hyper.shape[0], hyper.shape[2], seed=45)
    g_real = torch.stack([closed_form_ce_grad(W, b, targets[c], c) for c in range(hyper.shape[0])]).float()
    g_real[~present] = 0.0
    new, before, after = match_hyper_prototypes(hyper, head, g_real, present, steps=200, lr=lr, optimizer=optimizer)
    assert after < 0.25 * before
    # the reported numbers are the true L_GM of the start and of the result
    W64, b64 = W.double(), b.double()
    ref_before = float(ref_lgm(g_real.double(), closed_form_g_hp(hyper.double(), W64, b64), present))
    ref_after = float(ref_lgm(g_real.double(), closed_form_g_hp(new.double(), W64, b64), present))
    assert before == pytest.approx(ref_before, rel=1e-4, abs=1e-5)
    assert after == pytest.approx(ref_after, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_match_decreases_loss_for_unattainable_target(optimizer):
    # random g^c generally leave W's row space, so L_GM cannot reach 0, but it must fall
    head, hyper, g_real, present = _match_fixture(dtype=torch.float32, seed=40)
    _, before, after = match_hyper_prototypes(hyper, head, g_real, present, steps=100, lr=0.1, optimizer=optimizer)
    assert after < before


def test_match_unknown_optimizer_raises():
    head, hyper, g_real, present = _match_fixture()
    with pytest.raises(ValueError):
        match_hyper_prototypes(hyper, head, g_real, present, steps=3, lr=0.1, optimizer="lbfgs")


def test_match_sgd_moves_only_within_row_space_of_W():
    head, hyper, g_real, present = _match_fixture(seed=50)
    W = head.weight.detach()  # C x d, C < d
    new, _, _ = match_hyper_prototypes(hyper, head, g_real, present, steps=50, lr=0.1)
    delta = new - hyper  # C x I x d
    assert delta.abs().max() > 1e-3
    # projector onto the orthogonal complement of W's row space
    proj_row = W.T @ torch.linalg.solve(W @ W.T, W)
    complement = delta - delta @ proj_row
    assert complement.abs().max() < 1e-10
    # the complement part of every vector is untouched
    assert torch.allclose(new - new @ proj_row, hyper - hyper @ proj_row, atol=1e-10, rtol=0)


@pytest.mark.parametrize("optimizer,lr", [("sgd", 0.1), ("adam", 0.05)])
@pytest.mark.parametrize("bias", [True, False])
def test_match_closed_form_equals_autograd_path_float32(optimizer, lr, bias):
    C, num_hyper, d = 6, 4, 16
    head = linear_head(d, C, seed=350, dtype=torch.float32) if bias else no_bias_head(d, C, 350, torch.float32)
    with torch.no_grad():
        head.weight.mul_(0.5)
    hyper = randn(C, num_hyper, d, seed=351, dtype=torch.float32)
    g_real = randn(C, d, seed=352, dtype=torch.float32)
    present = torch.tensor([True, True, False, True, True, True])
    g_real[2] = 0.0
    fast, fast_before, fast_after = match_hyper_prototypes(hyper, head, g_real, present, steps=6, lr=lr,
                                                           optimizer=optimizer)
    slow, slow_before, slow_after = match_hyper_prototypes(hyper, WrappedHead(head), g_real, present, steps=6,
                                                           lr=lr, optimizer=optimizer)
    assert (fast - hyper).abs().max() > 1e-3  # the step moved S: the comparison means something
    assert torch.allclose(fast, slow, atol=1e-5, rtol=0)
    assert torch.equal(fast[2], hyper[2]) and torch.equal(slow[2], hyper[2])
    assert fast_before == pytest.approx(slow_before, rel=1e-5, abs=1e-6)
    assert fast_after == pytest.approx(slow_after, rel=1e-5, abs=1e-6)
    assert fast_after < fast_before
    for p in head.parameters():
        assert p.grad is None


def test_match_loss_before_is_the_loss_of_the_start():
    head, hyper, g_real, present = _match_fixture(seed=360)
    W, b = head.weight.detach(), head.bias.detach()
    _, before, _ = match_hyper_prototypes(hyper, head, g_real, present, steps=3, lr=0.1)
    assert before == float(gradient_matching_loss(g_real, hyper_prototype_gradients(hyper, head), present))
    assert before == pytest.approx(float(ref_lgm(g_real, closed_form_g_hp(hyper, W, b), present)), rel=1e-12)


# ----------------------------------------------------------------------------
# Eq. 11: similarity
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_hyper", [1, 4])
def test_hyper_similarity_matches_loop(num_hyper):
    B, C, d = 7, 5, 6
    z = randn(B, d, seed=60, scale=3.0)
    hyper = randn(C, num_hyper, d, seed=61, scale=0.5)
    got = hyper_similarity(z, hyper)
    assert got.shape == (B, C)
    ref = torch.tensor(ref_similarity_loop(z, hyper), dtype=DT)
    assert torch.allclose(got, ref, atol=1e-13, rtol=0)


# ----------------------------------------------------------------------------
# Eq. 12: HPCL
# ----------------------------------------------------------------------------


def test_hpcl_hand_case():
    z = torch.tensor([[1.0, 0.0]], dtype=DT)
    hyper = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=DT)
    y = torch.tensor([0])
    # s_0 = 1, s_1 = 0, tau = 1, d = 0: log(1 + e^0 / e^1)
    assert float(hpcl_loss(z, y, hyper, 0.0, 1.0)) == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-14)
    # d = 0.5, tau = 0.5: log(1 + e^{(0+0.5)/0.5} / e^{1/0.5}) = log(1 + e^{-1})
    assert float(hpcl_loss(z, y, hyper, 0.5, 0.5)) == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-14)
    # y = 1: log(1 + e^{(1+0.2)/0.1} / e^{0}) = log(1 + e^{12})
    assert float(hpcl_loss(z, torch.tensor([1]), hyper, 0.2, 0.1)) == pytest.approx(
        math.log(1 + math.exp(12.0)), abs=1e-12
    )


@pytest.mark.parametrize("num_hyper,margin,tau", [(3, 0.0, 0.5), (3, 0.7, 0.2), (1, 0.3, 0.05), (1, 0.0, 1.0)])
def test_hpcl_matches_direct_reference(num_hyper, margin, tau):
    B, C, d = 9, 4, 5
    z = randn(B, d, seed=70)
    hyper = randn(C, num_hyper, d, seed=71)
    y = torch.randint(0, C, (B,), generator=gen(72))
    got = hpcl_loss(z, y, hyper, margin, tau)
    assert got.dim() == 0
    assert float(got) == pytest.approx(ref_hpcl_direct(z, y, hyper, margin, tau), rel=1e-12, abs=1e-13)
    # a 0-dim tensor margin gives the same value
    got_t = hpcl_loss(z, y, hyper, torch.tensor(margin, dtype=DT), tau)
    assert float(got_t) == pytest.approx(float(got), rel=1e-14, abs=1e-15)


def test_hpcl_larger_margin_larger_loss():
    B, C, num_hyper, d = 8, 5, 2, 6
    z = randn(B, d, seed=73)
    hyper = randn(C, num_hyper, d, seed=74)
    y = torch.randint(0, C, (B,), generator=gen(75))
    values = [float(hpcl_loss(z, y, hyper, m, 0.1)) for m in (0.0, 0.1, 0.5, 2.0)]
    assert all(a < b for a, b in zip(values, values[1:]))
    # and each matches the reference
    for m, v in zip((0.0, 0.1, 0.5, 2.0), values):
        assert v == pytest.approx(ref_hpcl_direct(z, y, hyper, m, 0.1), rel=1e-12)


def test_hpcl_float64_precision_for_large_logit_gap():
    # s_y = cos((1,0),(0,1)) = 0, s_neg = cos((1,0),(1,0)) = 1, d = 0.1, tau = 0.05:
    # log(1 + exp((1 + 0.1)/0.05) / exp(0)) = log(1 + e^22) = 22 + log1p(e^-22) = 22.00000000027895
    z = torch.tensor([[1.0, 0.0]], dtype=DT)
    hyper = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=DT)
    got = float(hpcl_loss(z, torch.tensor([1]), hyper, 0.1, 0.05))
    assert got == pytest.approx(22.00000000027895, abs=1e-12)


def test_hpcl_single_class_has_no_negatives():
    z = randn(4, 3, seed=76)
    hyper = randn(1, 2, 3, seed=77)
    y = torch.zeros(4, dtype=torch.long)
    # log(1 + 0) = 0
    assert float(hpcl_loss(z, y, hyper, 1.0, 0.05)) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hpcl_extreme_inputs_finite_and_correct(dtype):
    B, C, num_hyper, d = 6, 4, 2, 5
    tau, margin = 1e-3, 50.0
    z = (randn(B, d, seed=78) * 1e15).to(dtype).requires_grad_(True)
    hyper = randn(C, num_hyper, d, seed=79).to(dtype)
    y = torch.randint(0, C, (B,), generator=gen(80))
    loss = hpcl_loss(z, y, hyper, margin, tau)
    (grad,) = torch.autograd.grad(loss, z)
    assert torch.isfinite(loss)
    assert torch.isfinite(grad).all()
    ref = ref_hpcl_stable(z.detach().double(), y, hyper.double(), margin, tau)
    rel = 1e-12 if dtype == torch.float64 else 1e-5
    assert float(loss.detach()) == pytest.approx(ref, rel=rel)
    # with logits this large the loss is max_j((s_j + d)/tau) - s_y/tau up to < log(C)
    sim = ref_similarity_loop(z.detach().double(), hyper.double())
    approx = sum(
        max((row[j] + margin) / tau for j in range(C) if j != int(y[i])) - row[int(y[i])] / tau
        for i, row in enumerate(sim)
    ) / B
    assert approx > 1e4
    assert approx <= ref <= approx + math.log(C)
    # the loss is also finite for a small temperature when the positive dominates
    z_pos = hyper.mean(1)[y].clone().requires_grad_(True)
    loss_pos = hpcl_loss(z_pos, y, hyper, 0.0, 1e-3)
    (grad_pos,) = torch.autograd.grad(loss_pos, z_pos)
    assert torch.isfinite(loss_pos) and torch.isfinite(grad_pos).all()


def test_hyper_similarity_float32_huge_z():
    # z = 1e20 * (1, 0), s = (1, 0): cos = 1 exactly; z = 1e20 * (0, 1): cos = 0
    z = torch.tensor([[1e20, 0.0], [0.0, 1e20]], dtype=torch.float32)
    hyper = torch.tensor([[[1.0, 0.0]]], dtype=torch.float32)
    got = hyper_similarity(z, hyper)
    assert torch.allclose(got, torch.tensor([[1.0], [0.0]]), atol=1e-6, rtol=0)


def test_hpcl_gradient_matches_reference_autograd_and_finite_differences():
    B, C, num_hyper, d = 5, 4, 3, 6
    margin, tau = 0.4, 0.3
    z0 = randn(B, d, seed=81)
    hyper = randn(C, num_hyper, d, seed=82)
    y = torch.randint(0, C, (B,), generator=gen(83))

    z = z0.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(hpcl_loss(z, y, hyper, margin, tau), z)

    # per-sample autograd of a literal torch transcription of Eq. 11-12
    ref = torch.zeros_like(z0)
    for i in range(B):
        zi = z0[i].clone().requires_grad_(True)
        sims = []
        for c in range(C):
            acc = zi.new_zeros(())
            for j in range(num_hyper):
                acc = acc + (zi @ hyper[c, j]) / (torch.sqrt(zi @ zi) * torch.sqrt(hyper[c, j] @ hyper[c, j]))
            sims.append(acc / num_hyper)
        yi = int(y[i])
        num = sum(torch.exp((sims[j] + margin) / tau) for j in range(C) if j != yi)
        li = torch.log(1 + num / torch.exp(sims[yi] / tau)) / B
        (gi,) = torch.autograd.grad(li, zi)
        ref[i] = gi
    assert torch.allclose(grad, ref, atol=1e-12, rtol=0)

    # central finite differences of the plain-float reference
    eps = 1e-6
    for i, k in [(0, 0), (1, 3), (4, 5), (2, 2)]:
        plus, minus = z0.clone(), z0.clone()
        plus[i, k] += eps
        minus[i, k] -= eps
        fd = (ref_hpcl_direct(plus, y, hyper, margin, tau) - ref_hpcl_direct(minus, y, hyper, margin, tau)) / (2 * eps)
        assert float(grad[i, k]) == pytest.approx(fd, abs=1e-7)


# ----------------------------------------------------------------------------
# Eq. 13: HPAL
# ----------------------------------------------------------------------------


def test_hpal_hand_case():
    # H^0 = mean((0,0), (1,-2)) = (0.5, -1); H^1 = (2, 2)
    hyper = torch.tensor([[[0.0, 0.0], [1.0, -2.0]], [[2.0, 2.0], [2.0, 2.0]]], dtype=DT)
    z = torch.tensor([[1.0, 1.5], [2.0, -1.0]], dtype=DT)
    y = torch.tensor([0, 1])
    # sample 0: x = (0.5, 2.5) -> 0.125 + 2.0 = 2.125; sample 1: x = (0, -3) -> 0 + 2.5
    assert float(hpal_loss(z, y, hyper)) == pytest.approx((2.125 + 2.5) / 2, abs=1e-14)
    # boundary |x| = 1: both branches give 0.5
    z_b = torch.tensor([[1.5, 0.0]], dtype=DT)
    assert float(hpal_loss(z_b, torch.tensor([0]), hyper)) == pytest.approx(0.5 + 0.5, abs=1e-14)


def test_hpal_matches_loop():
    B, C, num_hyper, d = 10, 4, 3, 7
    z = randn(B, d, seed=90, scale=1.5)
    hyper = randn(C, num_hyper, d, seed=91, scale=1.5)
    y = torch.randint(0, C, (B,), generator=gen(92))
    total = 0.0
    n_small = n_large = 0
    for i in range(B):
        H = [sum(float(hyper[int(y[i]), j, q]) for j in range(num_hyper)) / num_hyper for q in range(d)]
        for q in range(d):
            x = float(z[i, q]) - H[q]
            n_small += abs(x) <= 1
            n_large += abs(x) > 1
            total += huber(x)
    assert n_small > 5 and n_large > 5  # both branches exercised
    got = hpal_loss(z, y, hyper)
    assert got.dim() == 0
    assert float(got) == pytest.approx(total / B, rel=1e-12)


def test_hpal_normalized_matches_loop():
    B, C, num_hyper, d = 6, 3, 2, 5
    z = randn(B, d, seed=93, scale=4.0)
    hyper = randn(C, num_hyper, d, seed=94)
    y = torch.randint(0, C, (B,), generator=gen(95))
    total = 0.0
    for i in range(B):
        zi = [float(v) for v in z[i]]
        nz = math.sqrt(sum(v * v for v in zi))
        H = [sum(float(hyper[int(y[i]), j, q]) for j in range(num_hyper)) / num_hyper for q in range(d)]
        nh = math.sqrt(sum(v * v for v in H))
        for q in range(d):
            total += huber(zi[q] / nz - H[q] / nh)
    got = hpal_loss(z, y, hyper, normalized=True)
    assert float(got) == pytest.approx(total / (B * d), rel=1e-12)
    # hand case: z = (3, 4) -> (0.6, 0.8); H = (1, 0): x = (-0.4, 0.8) -> (0.08 + 0.32) / 2
    z1 = torch.tensor([[3.0, 4.0]], dtype=DT)
    h1 = torch.tensor([[[2.0, 0.0], [4.0, 0.0]]], dtype=DT)
    assert float(hpal_loss(z1, torch.tensor([0]), h1, normalized=True)) == pytest.approx(0.2, abs=1e-14)


# ----------------------------------------------------------------------------
# Aggregation (Eq. 1 / Algorithm 1)
# ----------------------------------------------------------------------------


def test_weighted_average_hand_case():
    s1 = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3, dtype=torch.int64), "d": torch.tensor([[2.0]], dtype=DT)}
    s2 = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5, dtype=torch.int64), "d": torch.tensor([[10.0]], dtype=DT)}
    out = weighted_average([s1, s2], [1, 3])
    assert set(out) == {"w", "n", "d"}
    assert torch.allclose(out["w"], torch.tensor([2.5, 5.0]), atol=1e-6, rtol=0)
    assert out["w"].dtype == torch.float32
    assert out["d"].dtype == DT and float(out["d"]) == pytest.approx(0.25 * 2 + 0.75 * 10, abs=1e-14)
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 5
    # float weights, one of them zero
    out2 = weighted_average([s1, s2], [0.0, 2.5])
    assert torch.allclose(out2["w"], s2["w"], atol=1e-7, rtol=0)
    assert int(out2["n"]) == 5


def test_weighted_average_output_does_not_alias_inputs():
    s1 = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(7, dtype=torch.int64)}
    s2 = {"w": torch.tensor([3.0, 6.0]), "n": torch.tensor(5, dtype=torch.int64)}
    for states, weights in [([s1], [4]), ([s1, s2], [1, 1]), ([s1, s2], [1, 0])]:
        originals = [{k: v.clone() for k, v in s.items()} for s in states]
        out = weighted_average(states, weights)
        for key, value in out.items():
            for s in states:
                assert value.untyped_storage().data_ptr() != s[key].untyped_storage().data_ptr()
            value.add_(100)
        for s, o in zip(states, originals):
            for key in s:
                assert torch.equal(s[key], o[key])


def test_weighted_average_rejects_bad_weights():
    s = {"w": torch.ones(2)}
    with pytest.raises(ValueError):
        weighted_average([s, s], [0, 0])
    with pytest.raises(ValueError):
        weighted_average([s], [0.0])
    with pytest.raises(ValueError):
        weighted_average([], [])


def test_weighted_average_batchnorm_state_dicts():
    torch.manual_seed(0)
    modules = [nn.BatchNorm2d(3) for _ in range(3)]
    for k, m in enumerate(modules):
        with torch.no_grad():
            m.weight.copy_(randn(3, seed=200 + k, dtype=torch.float32))
            m.bias.copy_(randn(3, seed=300 + k, dtype=torch.float32))
        m.train()
        for step in range(k + 1):  # different num_batches_tracked: 1, 2, 3
            m(randn(4, 3, 2, 2, seed=400 + 10 * k + step, dtype=torch.float32) * (k + 1) + k)
    states = [m.state_dict() for m in modules]
    weights = [10, 20, 30]
    out = weighted_average(states, weights)
    assert set(out) == set(states[0])
    total = sum(weights)
    for key in states[0]:
        if key == "num_batches_tracked":
            assert out[key].dtype == torch.int64
            assert int(out[key]) == 3
            continue
        ref = torch.zeros_like(states[0][key], dtype=DT)
        for s, w in zip(states, weights):
            ref += (w / total) * s[key].double()
        assert out[key].dtype == states[0][key].dtype
        assert torch.allclose(out[key].double(), ref, atol=1e-6, rtol=0), key
    fresh = nn.BatchNorm2d(3)
    fresh.load_state_dict(out)
    assert int(fresh.num_batches_tracked) == 3


# --- the batched form FedHPro's local training uses ------------------------------------------------------------


@pytest.mark.parametrize("normalized", [True, False])
def test_hyper_prototype_losses_equal_the_two_losses_and_their_gradients(normalized):
    g = torch.Generator().manual_seed(11)
    hyper = torch.randn(6, 3, 16, generator=g)
    y = torch.randint(0, 6, (9,), generator=g)
    z0 = torch.relu(torch.randn(9, 16, generator=g))
    z_joint, z_apart = z0.clone().requires_grad_(True), z0.clone().requires_grad_(True)
    hpcl, hpal = equations.hyper_prototype_losses(z_joint, y, hyper, 0.3, 0.05, normalized=normalized)
    (hpcl + 2 * hpal).backward()
    hpcl_apart = equations.hpcl_loss(z_apart, y, hyper, 0.3, 0.05)
    hpal_apart = equations.hpal_loss(z_apart, y, hyper, normalized=normalized)
    (hpcl_apart + 2 * hpal_apart).backward()
    torch.testing.assert_close(hpcl, hpcl_apart, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hpal, hpal_apart, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z_joint.grad, z_apart.grad, rtol=1e-5, atol=1e-7)


def test_hyper_similarity_is_the_mean_cosine_per_sample_and_follows_in_place_changes():
    g = torch.Generator().manual_seed(12)
    hyper = torch.randn(4, 3, 8, generator=g, dtype=torch.float64)
    z = torch.randn(5, 8, generator=g, dtype=torch.float64)

    def by_hand():
        return torch.tensor([[sum(float(F.cosine_similarity(z[b], hyper[c, j], dim=0)) for j in range(3)) / 3
                              for c in range(4)] for b in range(5)], dtype=torch.float64)

    torch.testing.assert_close(equations.hyper_similarity(z, hyper), by_hand(), rtol=0, atol=1e-12)
    # the class directions are cached per tensor: an in-place change and a new tensor are both seen
    hyper.mul_(-1.0)
    torch.testing.assert_close(equations.hyper_similarity(z, hyper), by_hand(), rtol=0, atol=1e-12)
    hyper = torch.randn(4, 3, 8, generator=g, dtype=torch.float64)
    torch.testing.assert_close(equations.hyper_similarity(z, hyper), by_hand(), rtol=0, atol=1e-12)


def _hpcl_by_one_hot_mask(similarity, y, margin, tau):
    """HPCL of Eq. 12 on given similarities as it was written before the scatter: the positive masked out by a
    one-hot mask (the reference for bit-for-bit equality)."""
    positive = similarity.gather(1, y.view(-1, 1)).squeeze(1) / tau
    negatives = ((similarity + margin) / tau).masked_fill(F.one_hot(y, similarity.shape[1]).bool(), float("-inf"))
    gap = torch.logsumexp(negatives, dim=1) - positive
    return torch.logaddexp(torch.zeros_like(gap), gap).mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hpcl_positive_removed_by_scatter_is_the_one_hot_mask_bit_for_bit(dtype):
    """The scatter of -inf at the label gives the same loss and gradient bits as the one-hot masked_fill."""
    for seed in range(40):
        batch, classes = 2 + seed * 3, 2 + seed % 11
        similarity = (torch.rand(batch, classes, generator=gen(seed), dtype=dtype) * 2 - 1)
        y = torch.randint(0, classes, (batch,), generator=gen(seed + 100))
        margin = torch.tensor(0.37 * (seed % 4), dtype=dtype) if seed % 2 else 0.5
        tau = (0.05, 0.1, 1.0)[seed % 3]
        got_input = similarity.clone().requires_grad_(True)
        ref_input = similarity.clone().requires_grad_(True)
        got = equations._hpcl_of_similarity(got_input, y, margin, tau)
        ref = _hpcl_by_one_hot_mask(ref_input, y, margin, tau)
        got.backward()
        ref.backward()
        assert torch.equal(got, ref)
        assert torch.equal(got_input.grad, ref_input.grad)


# --- the closed-form node of the default path (Eq. 11-13, normalised HPAL) --------------------------------------


def _closed_form(hpcl: torch.Tensor) -> bool:
    """Whether a loss came out of the closed-form node (not the composite autograd ops)."""
    return type(hpcl.grad_fn).__name__ == "_HyperPrototypeLossesBackward"


def _random_case(seed: int, dtype=torch.float32):
    """A batch of random shape: rows of widely different norms, some ReLU'd, labels that may miss classes."""
    g = gen(seed)
    batch = 1 + int(torch.randint(0, 70, (), generator=g))
    classes = 2 + int(torch.randint(0, 11, (), generator=g))
    per_class = 1 + int(torch.randint(0, 5, (), generator=g))
    dim = 1 + int(torch.randint(0, 600, (), generator=g))
    hyper = torch.randn(classes, per_class, dim, generator=g, dtype=dtype)
    y = torch.randint(0, classes, (batch,), generator=g)
    z = torch.randn(batch, dim, generator=g, dtype=dtype) * torch.exp(3 * torch.randn(batch, 1, generator=g,
                                                                                       dtype=dtype))
    if seed % 2:
        z = torch.relu(z)  # exact zeros, as after a final ReLU
    margin = torch.tensor(2 * float(torch.rand((), generator=g)), dtype=dtype) if seed % 3 else 0.3
    tau = (0.05, 0.1, 0.5, 1.0)[seed % 4]
    return z, y, hyper, margin, tau


def _both_paths(z, y, hyper, margin, tau, hpcl_weight=1.0, hpal_weight=1.0):
    """Values and z-gradients of the closed-form node and of the composite autograd path (the reference)."""
    out = []
    def composite(*args):
        return hpcl_loss(*args), hpal_loss(*args[:3], normalized=True)

    for losses in (partial(equations.hyper_prototype_losses, normalized=True), composite):
        leaf = z.clone().requires_grad_(True)
        hpcl, hpal = losses(leaf, y, hyper, margin, tau)
        (hpcl_weight * hpcl + hpal_weight * hpal).backward()
        out.append((hpcl.detach(), hpal.detach(), leaf.grad, _closed_form(hpcl)))
    assert out[0][3] and not out[1][3]
    return out[0][:3], out[1][:3]


def _assert_rows_close(got, expected, rtol):
    """Gradients equal row by row to ``rtol`` of the row's largest entry (rows' scales differ by 1e10)."""
    scale = expected.abs().amax(1, keepdim=True).clamp_min(torch.finfo(expected.dtype).tiny)
    assert torch.all((got - expected).abs() <= rtol * scale), ((got - expected).abs() / scale).max()


def test_closed_form_losses_equal_the_composite_path_bit_for_bit_in_value_and_to_rounding_in_gradient():
    for seed in range(120):
        z, y, hyper, margin, tau = _random_case(seed)
        weights = (1.0, 1.0) if seed % 4 == 0 else (0.5 + seed % 3, 2.0 / (1 + seed % 5))
        (hpcl, hpal, grad), (hpcl_ref, hpal_ref, grad_ref) = _both_paths(z, y, hyper, margin, tau, *weights)
        # the forward is the composite path's ops, one for one
        assert torch.equal(hpcl, hpcl_ref) and torch.equal(hpal, hpal_ref), seed
        _assert_rows_close(grad, grad_ref, 1e-5)


def test_closed_form_gradient_at_a_zero_row_is_the_composite_paths_bounded_one():
    g = gen(21)
    hyper = torch.randn(4, 3, 16, generator=g)
    y = torch.tensor([0, 1, 2, 3, 1])
    z = torch.relu(torch.randn(5, 16, generator=g))
    z[1] = 0.0  # an exact zero row
    z[2] = 0.0
    z[2, 7] = 3.5  # one non-zero entry: norm == largest entry, _unit's clamp edge
    z[3] *= 1e30
    z[4] *= 1e-30
    (hpcl, hpal, grad), (hpcl_ref, hpal_ref, grad_ref) = _both_paths(z, y, hyper, 0.4, 0.05)
    assert torch.equal(hpcl, hpcl_ref) and torch.equal(hpal, hpal_ref)
    assert torch.isfinite(grad).all()
    assert grad[1].abs().max() > 0 and grad[1].abs().max() < 1e3  # bounded (was ~1e12 with eps 1e-12)
    _assert_rows_close(grad, grad_ref, 1e-5)


def test_closed_form_gradient_scales_exactly_with_a_power_of_two_row_scale():
    """The losses only see z/||z||: scaling a row by 2^k leaves the values and divides that row's gradient by 2^k,
    exactly (the max-abs scaling makes every intermediate the same bits), for huge and tiny rows alike."""
    z, y, hyper, margin, tau = _random_case(5, dtype=DT)
    factors = torch.tensor([2.0 ** k for k in (-900, -40, 0, 60, 1000)], dtype=DT)
    rows = torch.arange(z.shape[0]) % len(factors)
    results = []
    for scaled in (z, z * factors[rows].unsqueeze(1)):
        leaf = scaled.clone().requires_grad_(True)
        hpcl, hpal = equations.hyper_prototype_losses(leaf, y, hyper, margin, tau, normalized=True)
        assert _closed_form(hpcl)
        (hpcl + hpal).backward()
        results.append((hpcl.detach(), hpal.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[1][2] * factors[rows].unsqueeze(1), results[0][2])


@pytest.mark.parametrize("case", ["margin", "norms", "absent-class", "one-sample", "two-classes", "no-margin"])
def test_closed_form_losses_pass_gradcheck(case):
    g = gen(31)
    batch, classes, per_class, dim = {"one-sample": (1, 5, 3, 6), "two-classes": (7, 2, 2, 5)}.get(case, (9, 5, 3, 7))
    hyper = torch.randn(classes, per_class, dim, generator=g, dtype=DT)
    y = torch.randint(0, classes, (batch,), generator=g)
    if case == "absent-class":
        y = torch.tensor([0, 1, 3, 0, 1, 3, 3, 4, 0])  # class 2 absent
    z = torch.randn(batch, dim, generator=g, dtype=DT)
    if case == "norms":
        z = z * torch.tensor([1e-2, 1e3, 1.0, 40.0, 3e-2, 1e2, 0.5, 7.0, 1e-1], dtype=DT).unsqueeze(1)
    margin = 0.0 if case == "no-margin" else torch.tensor(0.8, dtype=DT)
    tau = 0.1 if case == "two-classes" else 0.5

    def losses(leaf):
        hpcl, hpal = equations.hyper_prototype_losses(leaf, y, hyper, margin, tau, normalized=True)
        assert _closed_form(hpcl)
        return hpcl, hpal

    leaf = z.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(losses, (leaf,), eps=1e-6, atol=1e-7, rtol=1e-4)


def test_closed_form_node_only_where_z_alone_needs_a_gradient():
    """Everything else takes the composite path: a gradient w.r.t. the hyper-prototypes (the server, Eq. 9 style
    tests) or the margin, no gradient at all, one class, the paper's unnormalised HPAL."""
    z, y, hyper, margin, tau = _random_case(2, dtype=DT)
    leaf = z.clone().requires_grad_(True)
    assert _closed_form(equations.hyper_prototype_losses(leaf, y, hyper, margin, tau, normalized=True)[0])
    assert not _closed_form(equations.hyper_prototype_losses(leaf, y, hyper, margin, tau, normalized=False)[0])
    # hyper requires grad: its gradient flows, equal to the separate losses'
    hyper_leaf = hyper.clone().requires_grad_(True)
    hpcl, hpal = equations.hyper_prototype_losses(leaf, y, hyper_leaf, margin, tau, normalized=True)
    assert not _closed_form(hpcl)
    (hyper_grad,) = torch.autograd.grad(hpcl + hpal, hyper_leaf)
    ref_leaf = hyper.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(hpcl_loss(z, y, ref_leaf, margin, tau) + hpal_loss(z, y, ref_leaf, normalized=True),
                                 ref_leaf)
    torch.testing.assert_close(hyper_grad, ref, rtol=1e-10, atol=1e-12)
    # margin requires grad
    margin_leaf = torch.tensor(0.3, dtype=DT, requires_grad=True)
    hpcl, _ = equations.hyper_prototype_losses(leaf, y, hyper, margin_leaf, tau, normalized=True)
    assert not _closed_form(hpcl)
    (margin_grad,) = torch.autograd.grad(hpcl, margin_leaf)
    assert margin_grad > 0  # a larger margin makes the negatives' terms larger
    # no gradient needed: the same values
    with torch.no_grad():
        values = equations.hyper_prototype_losses(leaf, y, hyper, margin, tau, normalized=True)
    graded = equations.hyper_prototype_losses(leaf, y, hyper, margin, tau, normalized=True)
    assert values[0].grad_fn is None and all(torch.equal(a, b.detach()) for a, b in zip(values, graded))
    # one class: HPCL is 0 (no negative)
    one = equations.hyper_prototype_losses(leaf, torch.zeros_like(y), hyper[:1], margin, tau, normalized=True)
    assert not _closed_form(one[0]) and one[0].item() == 0.0
    # under autocast (the package computes its losses outside it; a caller may not)
    leaf32 = z.float().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hpcl, hpal = equations.hyper_prototype_losses(leaf32, y, hyper.float(), 0.3, tau, normalized=True)
    assert not _closed_form(hpcl)
    (hpcl + hpal).backward()
    assert leaf32.grad.dtype == torch.float32 and torch.isfinite(leaf32.grad).all()


def test_closed_form_node_second_derivative_is_the_composite_paths():
    """A backward with create_graph=True (a gradient penalty, say) returns a differentiable gradient: the second
    derivative through it is the composite path's, not a silent zero."""
    z, y, hyper, margin, tau = _random_case(4, dtype=DT)
    results = []
    for closed_form in (True, False):
        leaf = z.clone().requires_grad_(True)
        if closed_form:
            hpcl, hpal = equations.hyper_prototype_losses(leaf, y, hyper, margin, tau, normalized=True)
            assert _closed_form(hpcl)
        else:
            hpcl, hpal = hpcl_loss(leaf, y, hyper, margin, tau), hpal_loss(leaf, y, hyper, normalized=True)
        (grad,) = torch.autograd.grad(hpcl + 3 * hpal, leaf, create_graph=True)
        (second,) = torch.autograd.grad(grad.pow(2).sum() + hpcl, leaf)
        results.append((grad.detach(), second))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-12, atol=1e-14)
    assert results[0][1].abs().max() > 0
