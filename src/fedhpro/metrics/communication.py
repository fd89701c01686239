"""What travels: bytes and parameters of a payload (the paper's Table 4, Upload and Comm.).

A payload is a ``dict`` of tensors, numbers and nested dicts or lists of tensors. Its bytes are
the ``nbytes`` of every tensor (``numel * element_size``) plus 8 bytes for each plain number;
its parameters are the number of elements of every floating-point tensor (what Table 4 counts
as "Upload"; integer buffers such as BatchNorm's ``num_batches_tracked`` and the class counts
are bytes but not parameters).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor


def payload_bytes(payload: Any) -> int:
    """Bytes of all tensors in a payload (numbers count 8 bytes each)."""
    if isinstance(payload, Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, Mapping):
        return sum(payload_bytes(value) for value in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(payload_bytes(value) for value in payload)
    if isinstance(payload, (int, float, bool)):
        return 8
    return 0


def payload_parameters(payload: Any) -> int:
    """Number of floating-point tensor elements in a payload."""
    if isinstance(payload, Tensor):
        return payload.numel() if payload.is_floating_point() else 0
    if isinstance(payload, Mapping):
        return sum(payload_parameters(value) for value in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(payload_parameters(value) for value in payload)
    return 0
