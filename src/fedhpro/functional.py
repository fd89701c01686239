"""The equations shared by the prototype methods, as small, pure, batched functions.

Every function here is stateless and works on tensors only, like
``torch.nn.functional``. Equation numbers refer to the FedHPro paper
(*Federated Hyper-Prototype Learning via Gradient Matching*, ICML), whose
Eq. 1-3 the prototype baselines share; FedHPro's own equations (Eq. 4-13)
are in :mod:`fedhpro.methods.fedhpro.equations`.

Shapes: ``B`` samples, ``C`` classes, ``d`` feature dimension.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro.averaging import WeightedSum

__all__ = [
    "local_prototypes",
    "mean_client_prototypes",
    "per_sample_input_gradients",
    "weighted_average",
]


def local_prototypes(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Class-wise prototypes of one client, Eq. 2 (stacked as in Eq. 3).

    Args:
        features: ``B x d`` feature vectors ``z = f(x)``.
        labels: ``B`` integer class labels in ``[0, num_classes)``.
        num_classes: ``C``.

    Returns:
        ``(prototypes, present)``: ``C x d`` means of the features of each
        class (zeros for a class with no sample) and a ``C`` bool mask of the
        classes that have at least one sample.
    """
    features = features.reshape(features.shape[0], -1)
    counts = torch.bincount(labels, minlength=num_classes)[:num_classes]
    sums = features.new_zeros(num_classes, features.shape[1]).index_add_(0, labels, features)
    present = counts > 0
    prototypes = sums / counts.clamp(min=1).unsqueeze(1).to(features.dtype)
    return prototypes, present


def mean_client_prototypes(prototypes: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
    """The unweighted mean over the clients holding each class, ``P^c = 1/|A^c| sum_{k in A^c} p_k^c``.

    Eq. 4 without the ``n_k^c / n^c`` weights: FedProto's aggregation (the
    authors' ``proto_aggregation``), the centre FedTGP's margin and FedSA's
    anchor update use, and the "mean of the clients' class means" of the
    prototype diagnostics. Rows of absent classes are never read (a client's
    zeros or NaN there change nothing).

    Args:
        prototypes: ``K x C x d`` local prototypes of ``K`` clients.
        present: ``K x C`` bool, which client holds which class.

    Returns:
        ``(P, held)``: ``C x d`` (zeros for a class no client holds) and the
        ``C`` bool mask of classes held by some client.
    """
    holders = present.sum(0)
    summed = torch.where(present.unsqueeze(2), prototypes, torch.zeros((), dtype=prototypes.dtype)).sum(0)
    return summed / holders.clamp(min=1).unsqueeze(1).to(prototypes.dtype), holders > 0


def per_sample_input_gradients(inputs: Tensor, labels: Tensor, classifier: nn.Module, create_graph: bool) -> Tensor:
    """``d CE(h(z_i), y_i) / d z_i`` for every row ``z_i`` of ``inputs``.

    Each row's loss depends on that row only (the head is applied row-wise,
    in eval mode), so the gradient of the summed loss is exactly the stack of
    the per-sample gradients.
    """
    if not create_graph:
        inputs = inputs.detach().requires_grad_(True)
    logits = classifier(inputs)
    loss = F.cross_entropy(logits, labels, reduction="sum")
    (gradients,) = torch.autograd.grad(loss, inputs, create_graph=create_graph)
    return gradients


def weighted_average(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """Global aggregation of Algorithm 1 (and Eq. 1): ``w* = sum_k (n_k/N) w_k``.

    Floating-point entries (parameters and BatchNorm running statistics) are
    averaged with weights ``n_k / N`` (summed as ``sum_k n_k w_k`` in the order
    given, then divided by ``N``); integer entries (``num_batches_tracked``)
    are counters, not parameters: the largest one is kept. Returns new tensors
    (no aliasing of any input). The states are folded one by one with
    :class:`~fedhpro.averaging.WeightedSum`, exactly as an engine streams them,
    so both give bit-identical results.

    Args:
        states: state dicts with the same keys and shapes.
        weights: one non-negative weight per state (``n_k``), not all zero.
    """
    if len(states) != len(weights):
        raise ValueError(f"weighted_average got {len(states)} states but {len(weights)} weights")
    folded = WeightedSum()
    for state, weight in zip(states, weights):
        folded.add(state, weight)
    return folded.result()
