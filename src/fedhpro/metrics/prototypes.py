"""Prototype quality (the paper's Figure 2): class means and their L2 distance to a reference.

The reference is the "centralized prototypes": the class means of ALL clients' training
features under the current global model (a simulator sees all the data; a real deployment
never computes this).
"""

from __future__ import annotations

import torch
from torch import Tensor


def class_means(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """``(means C x d, present C)``: the mean feature of each class (Eq. 2); zeros where absent."""
    features = features.double()
    sums = torch.zeros(num_classes, features.shape[1], dtype=torch.float64, device=features.device)
    sums.index_add_(0, labels, features)
    counts = torch.bincount(labels, minlength=num_classes)[:num_classes].to(features.device)
    present = counts > 0
    means = sums / counts.clamp(min=1).unsqueeze(1).double()
    return means.float(), present


def mean_client_prototypes(prototypes: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 4: the unweighted mean over the clients holding class c of their prototypes
    (``prototypes`` K x C x d, ``present`` K x C bool); returns ``(C x d, held C)``."""
    weights = present.to(prototypes.dtype).unsqueeze(2)
    holders = weights.sum(0)
    held = holders.squeeze(1) > 0
    return (prototypes * weights).sum(0) / holders.clamp(min=1), held


def prototype_distance(prototypes: Tensor, mask: Tensor, reference: Tensor, reference_mask: Tensor) -> dict[str, float]:
    """Mean over the classes present in both of ``||p_c - q_c||_2`` (``l2``) and of the same
    distance between the L2-normalised vectors (``l2_normalized``, scale-free, in [0, 2]).
    NaN when no class is present in both."""
    both = mask.bool().cpu() & reference_mask.bool().cpu()
    if not bool(both.any()):
        return {"l2": float("nan"), "l2_normalized": float("nan")}
    p = prototypes.detach().double().cpu()[both]
    q = reference.detach().double().cpu()[both]
    unit = lambda v: v / v.norm(dim=1, keepdim=True).clamp(min=1e-12)  # noqa: E731
    return {"l2": float((p - q).norm(dim=1).mean()), "l2_normalized": float((unit(p) - unit(q)).norm(dim=1).mean())}
