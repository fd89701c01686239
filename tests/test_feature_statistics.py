"""Federated feature statistics (fedhpro.data.feature_statistics) against independent references: scikit-learn's
StandardScaler fitted on every site's rows pooled, a hand-computed pooled mean and std, and the attacks a false
release could mount (a huge sum of squares, rows that cannot exist, a count other than the declared size)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_breast_cancer, load_wine
from sklearn.preprocessing import StandardScaler

from fedhpro.data.feature_statistics import (
    FeatureSums,
    feature_sums,
    influence,
    resolved_standardize,
    shared_scaling,
    sums_from_json,
    sums_problem,
)
from fedhpro.errors import ConfigError


def label_skewed_sites(x: np.ndarray, y: np.ndarray) -> dict[str, torch.Tensor]:
    """A real table split by label so that the first site holds one class only and the others the rest."""
    order = np.argsort(y, kind="stable")
    parts = np.array_split(order, 3)
    return {f"site-{k}": torch.from_numpy(x[part]).float() for k, part in enumerate(parts)}


@pytest.mark.parametrize("loader", [load_wine, load_breast_cancer])
def test_shared_scaling_is_standard_scaler_on_the_pooled_rows(loader):
    x, y = loader(return_X_y=True)
    sites = label_skewed_sites(x, y)
    scaling = shared_scaling({name: feature_sums(rows) for name, rows in sites.items()})
    pooled = np.concatenate([rows.double().numpy() for rows in sites.values()])
    reference = StandardScaler().fit(pooled)
    np.testing.assert_allclose(scaling.mean.numpy(), reference.mean_, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(scaling.std.numpy(), reference.scale_, rtol=1e-9)
    assert scaling.sites == list(sites) and not scaling.left_out


def test_hand_computed_and_constant_features():
    a = torch.tensor([[1.0, 5.0], [3.0, 5.0]])  # mean (2, 5)
    b = torch.tensor([[8.0, 5.0]])
    scaling = shared_scaling({"a": feature_sums(a), "b": feature_sums(b)})
    # pooled rows 1, 3, 8: mean 4, population variance (9 + 1 + 16) / 3
    assert scaling.mean.tolist() == pytest.approx([4.0, 5.0])
    assert scaling.std.tolist() == pytest.approx([(26 / 3) ** 0.5, 1.0])  # the constant feature: only centred
    # weights: b's one row counts as two (its sums doubled), as a bounded or boosted claim would
    weighted = shared_scaling({"a": feature_sums(a), "b": feature_sums(b)}, weights={"a": 2.0, "b": 2.0})
    assert weighted.mean.tolist()[0] == pytest.approx((1 + 3 + 16) / 4)


def test_a_site_whose_sum_of_squares_squashes_the_others_is_left_out():
    x, y = load_wine(return_X_y=True)
    sites = {name: feature_sums(rows) for name, rows in label_skewed_sites(x, y).items()}
    honest = shared_scaling(sites)
    liar = sites["site-2"]
    squares = liar.sum_squares.clone()
    squares[4] *= 1e8  # one feature's spread made 10^4 times larger: every site's values of it become ~0
    sites["site-2"] = FeatureSums(liar.count, liar.sum, squares)
    unguarded = shared_scaling(sites, limit=0)
    assert float(unguarded.std[4] / honest.std[4]) > 1000
    guarded = shared_scaling(sites, columns=[f"c{i}" for i in range(13)])
    assert list(guarded.left_out) == ["site-2"] and "'c4'" in guarded.left_out["site-2"]
    assert guarded.sites == ["site-0", "site-1"]
    # the honest, label-skewed sites (one of them a single class) move no feature's spread near the limit
    skewed = label_skewed_sites(x, y)
    factors = influence({k: feature_sums(v) for k, v in skewed.items()}, {k: float(len(v)) for k, v in skewed.items()})
    assert max(factor for factor, _ in factors.values()) < 3.0


def test_two_sites_are_not_judged_and_a_majority_is_never_left_out():
    torch.manual_seed(0)
    a, b = feature_sums(torch.randn(20, 3)), feature_sums(1e4 * torch.randn(20, 3))
    assert not shared_scaling({"a": a, "b": b}).left_out  # which one lies cannot be told
    odd = {name: feature_sums(scale * torch.randn(20, 2)) for name, scale in
           (("a", 1.0), ("b", 1e4), ("c", 1e8), ("d", 1e12))}
    assert len(shared_scaling(odd).left_out) < 2


def test_claims_that_cannot_be_rows_are_named():
    rows = torch.arange(40, dtype=torch.float32).reshape(10, 4) / 7 + 1  # every feature's mean away from 0
    honest = feature_sums(rows)
    assert sums_problem(honest, 10) is None
    assert "declares 12" in sums_problem(honest, 12)
    short = FeatureSums(10, honest.sum * 10, honest.sum_squares)  # sum^2 > n * sum of squares: no rows give it
    assert "not those of any rows" in sums_problem(short)
    bad = FeatureSums(10, honest.sum, torch.tensor([1.0, float("inf"), 1.0, 1.0], dtype=torch.float64))
    assert "non-finite" in sums_problem(bad)
    assert sums_from_json(honest.as_json(), 4).count == 10
    for value in ({"count": 0, "sum": [1.0], "sum_squares": [1.0]}, {"count": 1, "sum": [1.0], "sum_squares": []},
                  {"count": 1, "sum": ["1"], "sum_squares": [1.0]}, [1, 2], {"count": 1.5, "sum": [], "sum_squares": []}):
        with pytest.raises(ValueError):
            sums_from_json(value)
    with pytest.raises(ValueError):
        sums_from_json(honest.as_json(), 5)


def test_auto_is_federated_except_under_privacy_or_secure_aggregation():
    assert resolved_standardize("auto", private=False) == ("federated", None)
    mode, note = resolved_standardize("auto", private=True)
    assert mode == "client" and "privacy" in note
    assert resolved_standardize("auto", private=False, secure=True)[0] == "client"
    assert resolved_standardize("client", private=True) == ("client", None)
    with pytest.raises(ConfigError, match="data.standardize=client"):
        resolved_standardize("federated", private=True)


def test_packed_range_sums_add_up_to_the_pooled_scaling_of_the_clipped_features():
    """What SecAgg+ adds up: each site's [w, w mean(u), w mean(u^2)] in [0, clip]; their total unpacks to the
    pooled mean and std of the features clipped to the public ranges (StandardScaler on the clipped rows)."""
    from fedhpro.data.feature_statistics import feature_ranges, packed_sums, range_sums, unpacked_scaling

    x, y = load_wine(return_X_y=True)
    sites = label_skewed_sites(x, y)
    pooled = np.concatenate([rows.double().numpy() for rows in sites.values()])
    low, high = feature_ranges(list(np.percentile(pooled, 5, axis=0)), list(np.percentile(pooled, 95, axis=0)), 13)
    weights = {name: float(len(rows)) for name, rows in sites.items()}
    bound, clip = max(weights.values()), 64.0
    vectors = [packed_sums(range_sums(rows, low, high), weights[name], bound, clip) for name, rows in sites.items()]
    assert all(float(v.min()) >= 0 and float(v.max()) <= clip for v in vectors)
    mean, std, total = unpacked_scaling(sum(vectors), bound, clip, low, high, tolerance=1e-9)
    clipped = np.clip(pooled, low.numpy(), high.numpy())
    reference = StandardScaler().fit(clipped)
    assert total == pytest.approx(len(pooled))
    np.testing.assert_allclose(mean.numpy(), reference.mean_, rtol=1e-10)
    np.testing.assert_allclose(std.numpy(), reference.scale_, rtol=1e-8)
    with pytest.raises(ValueError, match="outside"):
        packed_sums(range_sums(sites["site-0"], low, high), bound * 2, bound, clip)
    with pytest.raises(ConfigError, match="not above"):
        feature_ranges([0.0, 1.0], [1.0, 1.0])
