"""What a method's server and client exchange: payloads (:data:`Payload`: a ``dict`` of tensors, numbers and
nested dicts of tensors, a model's :data:`Weights` under ``"weights"``) and the declared layout of a reply.

The reply's layout is a contract. ``Server.reply_layout()`` (:meth:`fedhpro.methods.base.Server.reply_layout`)
declares, as plain data, every key a client's reply holds and its form: a dict ``{name: (shape,
dtype)}`` for a model's weights, ``(shape, dtype)`` for one tensor, or a
scalar type (``int``, ``float``, ``bool``, ``str``). The default declares
``weights`` (the keys, shapes and dtypes of ``self.weights``) and
``num_examples`` (``int``); a method whose client uploads more (prototypes,
counts, soft predictions) extends it. The Flower server compares every reply
with this declaration before it decodes a single array (no ``np.load`` of a
reply that does not fit), and drops a reply with an extra or missing key, a
wrong dtype or shape, or more bytes than its shape needs. A plug-in method
must therefore declare every key its client uploads: an undeclared key is
refused with a line naming it and this fix. A tensor whose rows are per class (prototypes, class
gradients, counts) is declared as :class:`ClassRows` (still a ``(shape, dtype)``): the engines act on
per-class tensors (injected hostility, the robust rules) by that declaration alone; its ``averaged``
says how the server combines the clients' rows of a class, which secure aggregation needs to sum them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fedhpro.errors import ConfigError

Payload = dict[str, Any]
Weights = dict[str, Tensor]
#: one tensor of a reply layout: ``(shape, dtype)``
TensorLayout = tuple[tuple[int, ...], torch.dtype]


#: how a method's server averages a class's rows over the clients (:attr:`ClassRows.averaged`): the mean over
#: the clients that hold the class, or the mean weighted by the clients' counts of the class
HOLDERS, COUNTS = "holders", "counts"


class _Rows(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


class ClassRows(_Rows):
    """A tensor of a reply layout whose rows are per class (``shape[0]`` is the number of classes:
    prototypes, class gradients, soft predictions, class counts). It is a ``(shape, dtype)`` like any
    :data:`TensorLayout`; the engines read the per-class keys from it (:func:`class_keys`: injected
    hostility and the robust rules act on such tensors row by row), never from a reply's shapes.

    ``averaged`` (a keyword beside the tuple, not one of its items) declares how the server's step
    combines the clients' rows of a class: :data:`HOLDERS` (their mean over the clients that hold the
    class), :data:`COUNTS` (their mean weighted by the clients' counts of the class), or None (not
    declared: neither, or not said). Secure aggregation sums only declared rows
    (:mod:`fedhpro.flower.secure_sum`)."""

    averaged: str | None = None

    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, averaged: str | None = None) -> ClassRows:
        if averaged not in (None, HOLDERS, COUNTS):
            raise ConfigError(f"ClassRows(averaged={averaged!r}): say {HOLDERS!r} (the mean over the clients "
                              f"holding the class), {COUNTS!r} (weighted by their class counts) or None")
        rows = super().__new__(cls, shape, dtype)
        rows.averaged = averaged
        return rows

    def __repr__(self) -> str:
        return f"ClassRows(shape={self.shape!r}, dtype={self.dtype!r}, averaged={self.averaged!r})"


#: a reply's declared layout (:meth:`~fedhpro.methods.base.Server.reply_layout`): per key, ``{name: (shape,
#: dtype)}`` (a model's weights), ``(shape, dtype)`` (one tensor) or a scalar type (``int``, ``float``, ``bool``,
#: ``str``)
ReplyLayout = dict[str, dict[str, TensorLayout] | TensorLayout | type]


def tensor_layout(tensor: Tensor) -> TensorLayout:
    """``(shape, dtype)`` of ``tensor``: its entry in a reply layout."""
    return tuple(tensor.shape), tensor.dtype


def class_keys(layout: Mapping[str, Any]) -> list[str]:
    """The keys a reply layout declares per class (:class:`ClassRows`), in the layout's order."""
    return [key for key, entry in layout.items() if isinstance(entry, ClassRows)]


def weights_layout(weights: Mapping[str, Tensor]) -> dict[str, TensorLayout]:
    """``{name: (shape, dtype)}`` of a model's weights, in their order: their entry in a reply layout."""
    return {name: tensor_layout(tensor) for name, tensor in weights.items()}


def layout_problem(reply: Mapping[str, Any], layout: Mapping[str, Any]) -> str | None:
    """Why ``reply`` does not fit the declared ``layout`` (one line naming the key and the fix), or None.

    Checked: the reply's keys are exactly the layout's (an undeclared key would leave the client without the
    server reading it; a missing one is read as absent), a dict of tensors holds exactly its declared names, and
    a declared tensor is a tensor of its declared shape. The values are not looked at (the method's own checks
    do), nor the dtypes (the in-process engines hand tensors over as the client made them); the Flower server
    checks the same before it decodes a reply (:func:`fedhpro.flower.records.check_layout`)."""
    extra = [key for key in reply if key not in layout]
    if extra:
        return (f"the reply holds '{extra[0]}', which the method's reply layout does not declare (a method whose "
                "client uploads it must declare it in Server.reply_layout(), and one whose server does not read it "
                "must not upload it)")
    missing = [key for key in layout if key not in reply]
    if missing:
        return f"the reply lacks '{missing[0]}', which the method's reply layout declares in Server.reply_layout()"
    for key, form in layout.items():
        value = reply[key]
        if isinstance(form, Mapping):
            if not isinstance(value, Mapping):
                return f"'{key}' must be a dict of tensors, the reply holds a {type(value).__name__}"
            if value.keys() != form.keys():
                names = [name for name in value if name not in form] or [name for name in form if name not in value]
                return (f"'{key}' holds '{names[0]}', which the method's reply layout does not declare"
                        if names[0] in value else
                        f"'{key}' lacks '{names[0]}', which the method's reply layout declares")
        elif isinstance(form, tuple):
            if not isinstance(value, Tensor):
                return f"'{key}' must be a tensor of shape {tuple(form[0])}, the reply holds a {type(value).__name__}"
            if tuple(value.shape) != tuple(form[0]):
                return f"'{key}' has shape {tuple(value.shape)}, the method's reply layout declares {tuple(form[0])}"
    return None
