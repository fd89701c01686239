"""A reply's class tensors: the floating-point tensors whose rows are per class (prototypes, class gradients,
soft predictions), which hostile faults scale, ``aggregation.max_row_norm`` bounds and the robust rules combine
class by class over the replies that hold each class."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fedhpro.methods.layout import ClassRows


def class_tensor_keys(reply: Mapping[str, Any], num_classes: int | None,
                      declared: Sequence[str] | None = None) -> list[str]:
    """The reply's class tensors: floating-point tensors whose rows are per class (prototypes, class
    gradients, soft predictions). ``declared``: the keys the method's reply layout declares per class
    (:func:`declared_class_keys`), the engines' source; without it (a direct call on bare replies) the
    floating-point tensors other than the weights whose first dimension is ``num_classes`` (none when
    ``num_classes`` is unknown)."""
    if declared is not None:
        return [key for key in declared if isinstance(reply.get(key), Tensor) and reply[key].is_floating_point()
                and reply[key].dim() >= 1]
    if num_classes is None:
        return []
    return [key for key, value in reply.items()
            if key != "weights" and isinstance(value, Tensor) and value.is_floating_point() and value.dim() >= 1
            and value.shape[0] == num_classes]


def declared_class_keys(server: Any) -> list[str]:
    """The per-class keys of ``server.reply_layout()`` (:class:`~fedhpro.methods.base.ClassRows` entries,
    floating point: the integer class counts are never scaled or averaged), in the layout's order; none
    for a server without a layout."""
    layout = getattr(server, "reply_layout", None)
    if layout is None:
        return []
    return [key for key, entry in layout().items() if isinstance(entry, ClassRows) and entry.dtype.is_floating_point]


def holders(replies: Sequence[Mapping[str, Any]], num_classes: int) -> Tensor:
    """``K x C`` bool: which classes each reply holds (``class_counts > 0``; every class without counts)."""
    rows = []
    for reply in replies:
        counts = reply.get("class_counts")
        if isinstance(counts, Tensor) and tuple(counts.shape) == (num_classes,):
            rows.append(counts.detach().cpu() > 0)
        else:
            rows.append(torch.ones(num_classes, dtype=torch.bool))
    return torch.stack(rows)


__all__ = ["class_tensor_keys", "declared_class_keys", "holders"]
