"""The losses of hyper-prototypes under ``torch.inference_mode()``, the normalized margin's true bound, a
bounded ``_unit`` gradient at a zero row, and ``fedhpro.run`` leaving the caller's flush-denormal state as it
found it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import FEATURE_DIM, TinyNet, make_federation

import fedhpro
from fedhpro.methods.fedhpro import equations


def tiny_settings(out: Path, **extra) -> dict:
    return {"rounds": 2, "local_epochs": 1, "batch_size": 8, "progress": False, "device": "cpu", "out": str(out),
            "feature_dim": FEATURE_DIM, **extra}


# ---------------------------------------------------------------------------- 1. the losses under inference_mode


def loss_values(z, y, hyper):
    """Every public loss of hyper-prototypes on one batch, as plain floats."""
    hpcl, hpal = equations.hyper_prototype_losses(z, y, hyper, 0.2, 0.5, normalized=True)
    hpcl_raw, hpal_raw = equations.hyper_prototype_losses(z, y, hyper, 0.2, 0.5, normalized=False)
    return [equations.hyper_similarity(z, hyper).sum().item(), equations.hpcl_loss(z, y, hyper, 0.2, 0.5).item(),
            equations.hpal_loss(z, y, hyper).item(), equations.hpal_loss(z, y, hyper, normalized=True).item(),
            hpcl.item(), hpal.item(), hpcl_raw.item(), hpal_raw.item()]


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 5, generator=g), torch.tensor([0, 1, 2, 0, 1, 2]), torch.randn(3, 2, 5, generator=g)


def test_the_losses_under_inference_mode_equal_those_outside_it():
    z, y, hyper = batch(0)
    expected = loss_values(z, y, hyper.clone())
    with torch.inference_mode():  # tensors made here are inference tensors (no version counter)
        z_inference, y_inference, hyper_inference = batch(0)
        assert hyper_inference.is_inference()
        assert loss_values(z_inference, y_inference, hyper_inference) == expected
        assert loss_values(z, y, hyper) == expected  # normal tensors inside inference_mode


def test_a_value_computed_under_inference_mode_is_not_reused_by_training():
    z, y, hyper = batch(1)
    with torch.inference_mode():
        validation = equations.hpcl_loss(z, y, hyper, 0.2, 0.5).item()
    trained = z.clone().requires_grad_(True)
    loss = equations.hpcl_loss(trained, y, hyper, 0.2, 0.5)  # would use an inference tensor if one had been cached
    loss.backward()
    assert loss.item() == validation and torch.isfinite(trained.grad).all()


# ---------------------------------------------------------------------------- 2. the normalized margin's bound


def margin_bound(num_classes: int) -> float:
    """sqrt(2) (C/(C-1))^1.5: Cauchy-Schwarz on sum ||u_i - u_j||^2 = 2C sum|u_i|^2 - 2|sum u_i|^2 <= 2C^2."""
    return math.sqrt(2.0) * (num_classes / (num_classes - 1)) ** 1.5


def test_the_normalized_margin_reaches_its_bound_which_exceeds_2():
    angles = torch.tensor([0.0, 2 * math.pi / 3, 4 * math.pi / 3], dtype=torch.float64)
    triangle = torch.stack([angles.cos(), angles.sin()], dim=1) * 7.0  # any length: normalised inside
    three = equations.client_margin(triangle, torch.ones(3, dtype=torch.bool), normalized=True).item()
    assert three == pytest.approx(6 * math.sqrt(3) / 4)  # 6 ordered pairs at distance sqrt(3), over (C-1)^2 = 4
    assert three == pytest.approx(margin_bound(3)) and three > 2
    opposite = torch.tensor([[3.0, 0.0], [-0.5, 0.0]], dtype=torch.float64)
    two = equations.client_margin(opposite, torch.ones(2, dtype=torch.bool), normalized=True).item()
    assert two == pytest.approx(4.0) == pytest.approx(margin_bound(2))
    # random prototypes (some classes absent) stay below the bound
    g = torch.Generator().manual_seed(0)
    for num_classes in (2, 3, 5, 10):
        for _ in range(20):
            prototypes = torch.randn(num_classes, 4, generator=g, dtype=torch.float64)
            present = torch.rand(num_classes, generator=g) < 0.8
            margin = equations.client_margin(prototypes, present, normalized=True).item()
            assert margin <= margin_bound(num_classes) + 1e-9


def test_the_docs_state_the_true_bound_not_2():
    doc = equations.client_margin.__doc__
    assert "<= 2)" not in doc and "d_k <= 2" not in doc
    assert "sqrt(2) * (C/(C-1))^1.5" in doc and "at most 4" in doc


# ---------------------------------------------------------------------------- 3b. _unit at a zero row


def test_unit_has_a_bounded_gradient_at_an_exactly_zero_row():
    x = torch.zeros(3, 4)
    x[1] = torch.tensor([1.0, -2.0, 0.5, 3.0])
    x.requires_grad_(True)
    upstream = torch.tensor([[1.0, -2.0, 3.0, 0.5]] * 3)
    unit = equations._unit(x, dim=1)
    (unit * upstream).sum().backward()
    assert torch.equal(unit[0].detach(), torch.zeros(4))  # a zero row stays zero
    assert x.grad[0].abs().max() <= 2 * upstream[0].abs().max()  # was ~3e12 (1 / F.normalize's eps 1e-12)
    assert x.grad[2].abs().max() <= 2 * upstream[2].abs().max()


def previous_unit(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``_unit`` as it was before the zero-row fix (F.normalize's eps of 1e-12)."""
    scale = x.detach().abs().amax(dim=dim, keepdim=True)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return F.normalize(x / scale, dim=dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unit_of_nonzero_rows_is_bit_identical_to_before(dtype):
    g = torch.Generator().manual_seed(3)
    rows = torch.relu(torch.randn(64, 16, generator=g, dtype=dtype))  # ReLU features: many exact zeros
    rows[0] = 0.0
    rows[0, 5] = 2.5  # one non-zero entry: norm == largest entry, the clamp's edge
    rows[1] = torch.tensor(1e-30, dtype=dtype)  # tiny and huge rows: the scaling keeps them exact
    rows[2] = torch.tensor(1e30, dtype=dtype)
    upstream = torch.randn(64, 16, generator=g, dtype=dtype)
    gradients = []
    for unit in (equations._unit, previous_unit):
        x = rows.clone().requires_grad_(True)
        value = unit(x, 1)
        (value * upstream).sum().backward()
        gradients.append((value.detach(), x.grad))
    assert torch.equal(gradients[0][0], gradients[1][0])
    assert torch.equal(gradients[0][1], gradients[1][1])
    # and they are x / ||x|| with its gradient (I - u u^T) g / ||x|| (rows of norm 1: no rescaling issue)
    unit = rows[3:] / rows[3:].norm(dim=1, keepdim=True)
    assert torch.allclose(gradients[0][0][3:], unit)


# ---------------------------------------------------------------------------- 3. the caller's flush-denormal state


def denormals_flushed() -> bool:
    return (torch.tensor(1e-40) * 1).item() == 0.0


@pytest.mark.slow
def test_run_leaves_the_flush_denormal_state_as_it_found_it(tmp_path):
    before = denormals_flushed()
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    federation = make_federation([8, 8])
    try:
        assert not denormals_flushed()
        fedhpro.run(method="fedavg", federation=federation, model=TinyNet, **tiny_settings(tmp_path / "a"))
        assert not denormals_flushed()
        torch.set_flush_denormal(True)  # a caller who flushes keeps flushing
        fedhpro.run(method="fedavg", federation=federation, model=TinyNet, **tiny_settings(tmp_path / "b"))
        assert denormals_flushed()
    finally:
        torch.set_flush_denormal(before)
