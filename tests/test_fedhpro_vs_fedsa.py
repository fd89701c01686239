"""Issue 27 (FedHPro vs FedSA under label skew): the ``fedhpro.hyper_init`` option and the geometry it promises.

The default (``gaussian``) must draw exactly what the paper's N(0, 1) initialisation drew before the option
existed (same generator calls: the same bytes); the two other geometries are checked against closed forms.
"""

import itertools

import pytest
import torch
from conftest import NUM_CLASSES, TinyNet

from fedhpro.errors import ConfigError
from fedhpro.methods import MethodContext, TrainSettings, get_method
from fedhpro.methods.fedhpro.hyper import HyperPrototypeBank, initial_hyper_prototypes

C, PER_CLASS, D = 5, 3, 40


def directions(hyper: torch.Tensor) -> torch.Tensor:
    """Eq. 11's class directions: the mean of each class's unit vectors, as a slow loop."""
    rows = []
    for c in range(hyper.shape[0]):
        total = torch.zeros(hyper.shape[2], dtype=torch.float64)
        for j in range(hyper.shape[1]):
            vector = hyper[c, j].double()
            total += vector / vector.norm()
        rows.append(total / hyper.shape[1])
    return torch.stack(rows)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def test_gaussian_is_the_papers_draw_unchanged():
    bank = HyperPrototypeBank(C, D, seed=7, num_hyper=PER_CLASS)
    expected = torch.randn(C, PER_CLASS, D, generator=torch.Generator().manual_seed(7))
    assert torch.equal(bank.hyper, expected)
    assert torch.equal(HyperPrototypeBank(C, D, seed=7, num_hyper=PER_CLASS, init="gaussian").hyper, expected)


def test_simplex_classes_are_equiangular():
    hyper = initial_hyper_prototypes(C, PER_CLASS, D, torch.Generator().manual_seed(0), "simplex")
    assert hyper.shape == (C, PER_CLASS, D) and hyper.dtype == torch.float32
    units = directions(hyper)
    for a, b in itertools.permutations(range(C), 2):
        # -1/(C-1) for the noiseless vertices; the N(0, 0.1^2) noise moves it by about 1e-3
        assert cosine(units[a], units[b]) == pytest.approx(-1.0 / (C - 1), abs=0.02)
    # the norm of each vector is about sqrt(d), as a Gaussian vector's
    assert float(hyper.norm(dim=2).mean()) == pytest.approx(D ** 0.5, rel=0.05)


def test_orthogonal_nonnegative_classes_are_orthogonal_and_reachable_by_relu_features():
    hyper = initial_hyper_prototypes(C, PER_CLASS, D, torch.Generator().manual_seed(0), "orthogonal-nonnegative")
    assert bool((hyper >= 0).all())
    units = directions(hyper)
    for a, b in itertools.permutations(range(C), 2):
        assert cosine(units[a], units[b]) == 0.0
    for c in range(C):  # class c lives on coordinates [c d/C, (c+1) d/C) only
        support = (hyper[c] != 0).any(0).nonzero().squeeze(1).tolist()
        assert support == list(range(c * D // C, (c + 1) * D // C))
        # a non-negative feature (a ReLU's output) reaches the class direction exactly
        z = torch.relu(units[c])
        assert cosine(z, units[c]) == pytest.approx(1.0, abs=1e-12)


def test_gaussian_classes_are_out_of_reach_of_nonnegative_features():
    # why the option exists: the best non-negative feature for a Gaussian class direction is its positive part,
    # whose cosine with it is ||u_+|| / ||u|| (about 0.71 in high dimension), far from 1
    hyper = initial_hyper_prototypes(C, PER_CLASS, 2000, torch.Generator().manual_seed(0), "gaussian")
    units = directions(hyper)
    for c in range(C):
        best = cosine(torch.relu(units[c]), units[c])
        assert best == pytest.approx(float(torch.relu(units[c]).norm() / units[c].norm()), abs=1e-12)
        assert 0.6 < best < 0.8


@pytest.mark.parametrize("init", ["simplex", "orthogonal-nonnegative"])
def test_geometries_need_as_many_dimensions_as_classes(init):
    with pytest.raises(ConfigError, match="feature_dim >= the number of classes"):
        initial_hyper_prototypes(10, PER_CLASS, 8, torch.Generator().manual_seed(0), init)


def test_unknown_init_is_one_clear_error():
    with pytest.raises(ConfigError, match="unknown hyper-prototype init 'cube'"):
        initial_hyper_prototypes(C, PER_CLASS, D, torch.Generator().manual_seed(0), "cube")


@pytest.mark.parametrize("init", ["gaussian", "simplex", "orthogonal-nonnegative"])
def test_the_option_reaches_the_servers_hyper_prototypes(init):
    spec = get_method("fedhpro")
    model = TinyNet()
    server = spec.server(MethodContext(model=model, num_classes=NUM_CLASSES, options=spec.options(hyper_init=init),
                                       train=TrainSettings(), seed=3))
    dim = server.hyper.shape[2]
    expected = initial_hyper_prototypes(NUM_CLASSES, 5, dim, torch.Generator().manual_seed(3), init)
    assert torch.equal(server.hyper, expected)
    assert torch.equal(server.broadcast(0)["hyper_prototypes"], expected)
