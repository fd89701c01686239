"""Prototype quality (the paper's Figure 2): class means and their L2 distance to a reference.

The reference is the "centralized prototypes": the class means of ALL clients' training
features under the current global model (a simulator sees all the data; a real deployment
never computes this).
"""

from __future__ import annotations

from torch import Tensor

from fedhpro.functional import local_prototypes, mean_client_prototypes

__all__ = ["class_means", "mean_client_prototypes", "prototype_distance"]


def class_means(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """``(means C x d float32, present C)``: Eq. 2's class means (:func:`fedhpro.functional.local_prototypes`),
    summed in float64 so that the diagnostics carry no float32 rounding of the sums; zeros where absent."""
    means, present = local_prototypes(features.double(), labels, num_classes)
    return means.float(), present


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
