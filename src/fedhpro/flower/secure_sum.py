"""The vector a node hands to SecAgg+ for one method, and the method's replies rebuilt from the sum.

What a node sends (:class:`SecureLayout`, one flat float64 vector, the same layout on every node,
built from the method's :meth:`~fedhpro.methods.base.Server.reply_layout`), with ``n_k`` its
``num_examples`` and ``s`` the largest training-set size of the run (the header's ``secagg-scale``,
so every entry stays within ``[-1, 1]`` times the values themselves):

* ``weights/<key>``: ``(n_k / s) * (w_k - w_global)``, its update times its FedAvg weight;
* ``num_examples``: ``n_k / s``;
* with per-class uploads: ``held`` (1 for each class the client holds, else 0), ``class_counts``
  (``n_k^c / s``) and, per class tensor, its rows times ``held`` or times ``n_k^c / s``, as the layout
  declares the server averages them (:attr:`~fedhpro.methods.layout.ClassRows.averaged`: ``holders``, a
  mean over the clients that hold the class, or ``counts``, a count-weighted mean);
* ``metrics``: each training metric times ``n_k / (s M)`` (``M`` = :data:`METRIC_SCALE`: losses may exceed the
  clipping range, and need less precision than weights) in a slot of :data:`METRIC_SLOTS` chosen by a
  hash of its name (the names travel in clear: they say which losses exist, no values).

What the server rebuilds (:func:`rebuild_replies`): one reply per summed client, all carrying the same
aggregate (the FedAvg weights ``w_global + sum_k (n_k/s) Delta_k / sum_k (n_k/s)``, each class row's
mean), with class counts of 0 and 1 that give every class exactly as many holders as it had
(``round(sum held)``), so the method's own ``aggregate`` (a mean over the holders, a count-weighted
mean divided by the holders, or FedAvg) returns the aggregate: the method runs unchanged and its
numbers equal the plain run's up to the quantization. The replies go through
:meth:`~fedhpro.engines.protocol.OpenRound.receive` as any reply does (the protocol still bounds
``num_examples`` and ``class_counts`` and runs the method's checks, now on the aggregate).

A layout a sum cannot serve is refused in one line (:func:`summed_rows`): a class tensor whose averaging
the layout does not declare, a key that is no class tensor, a server that weights each client's weights
itself, integer weights (FedAvg keeps their maximum, a sum cannot give one).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor

from fedhpro.engines.replies import capped_reply
from fedhpro.errors import ConfigError, FedHProError, UpdateError
from fedhpro.methods.base import Server
from fedhpro.methods.layout import COUNTS, HOLDERS, ClassRows

#: slots of the training metrics in the summed vector (a metric's slot is a hash of its name)
METRIC_SLOTS = 4096
#: the training metrics are summed divided by this: a loss of up to METRIC_SCALE x clipping range fits, each
#: summed metric is then off by less than K x METRIC_SCALE x 2r/Q (about 4e-4 for 3 clients at the defaults)
METRIC_SCALE = 1024.0
#: tolerance, in units of one summed client's quantization error, of the aggregate's whole-number checks
WHOLE_TOLERANCE = 0.25
#: the keys every reply holds besides the class tensors: summed as the weights, the sizes and the class counts
PLAIN_KEYS = ("weights", "num_examples", "class_counts")


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def metric_slot(name: str) -> int:
    """The slot of the training metric ``name`` (a hash of the name, the same on every node)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") % METRIC_SLOTS


class SecureLayout:
    """The flat vector a node sends under SecAgg+ for one method (see the module doc): its entries, how
    each class tensor is weighted, and :meth:`pack` (node) / :meth:`unpack` (server)."""

    def __init__(self, server: Server, method: str):
        layout = server.reply_layout()
        weights = layout.get("weights", {})
        if not isinstance(weights, Mapping):
            raise ConfigError(f"method={method}: its reply's weights are not a dict of tensors; secure aggregation "
                              "cannot sum them")
        integer = [name for name, (_, dtype) in weights.items() if not torch.empty(0, dtype=dtype).is_floating_point()]
        if integer:
            raise ConfigError(f"flower.secure-aggregation=secagg+: the model's weight '{integer[0]}' is an integer "
                              "counter, which FedAvg aggregates by its maximum, and a secure sum cannot give a "
                              "maximum; use a model without BatchNorm counters or flower.secure-aggregation=none")
        self.weights = {name: tuple(shape) for name, (shape, _) in weights.items()}
        self.weight_dtypes = {name: dtype for name, (_, dtype) in weights.items()}
        #: how each class tensor is summed (HOLDERS or COUNTS), its shape and dtype
        self.weighting = summed_rows(server, method, layout)
        rows = {key: cast(ClassRows, layout[key]) for key in self.weighting}
        self.row_forms = {key: (tuple(entry.shape), entry.dtype) for key, entry in rows.items()}
        self.num_classes = int(server.num_classes)
        #: whether the replies hold class counts (with class tensors, or alone: the rebuilt replies hold them too)
        self.per_class = bool(self.weighting) or "class_counts" in layout
        entries = [Entry(f"weights/{name}", shape) for name, shape in self.weights.items()]
        entries.append(Entry("num_examples", (1,)))
        if self.per_class:
            entries += [Entry("held", (self.num_classes,)), Entry("class_counts", (self.num_classes,))]
            entries += [Entry(f"rows/{key}", shape) for key, (shape, _) in self.row_forms.items()]
        entries.append(Entry("metrics", (METRIC_SLOTS,)))
        self.entries = entries
        self.size = sum(entry.size for entry in entries)

    def pack(self, reply: Mapping[str, Any], global_weights: Mapping[str, Tensor], metrics: Mapping[str, float],
             num_samples: int, scale: float) -> np.ndarray:
        """The vector of one client's ``reply`` (checked by the caller), its training ``metrics`` and its
        training-set size ``num_samples`` (what the server weights its metrics by); ``scale``: the run's
        largest training-set size."""
        if float(reply["num_examples"]) > scale:  # above the cap the server sent (aggregation.max_share)
            reply = capped_reply(dict(reply), max(1, math.floor(scale)))
        count = float(reply["num_examples"])
        share = count / scale
        parts: list[Tensor] = []
        for name in self.weights:
            delta = reply["weights"][name].detach().cpu().double() - global_weights[name].detach().cpu().double()
            parts.append(share * delta)
        parts.append(torch.tensor([share], dtype=torch.float64))
        if self.per_class:
            counts = reply["class_counts"].detach().cpu().double()
            held = (counts > 0).double()
            parts += [held, counts / scale]
            for key, mode in self.weighting.items():
                row = reply[key].detach().cpu().double()
                factor = (held if mode == HOLDERS else counts / scale).reshape(-1, *([1] * (row.dim() - 1)))
                # rows of classes the client does not hold are ignored by every method: zeros (NaN there too)
                parts.append(torch.where(factor > 0, row * factor, torch.zeros((), dtype=torch.float64)))
        slots = torch.zeros(METRIC_SLOTS, dtype=torch.float64)
        for name, value in metrics.items():
            slots[metric_slot(name)] += float(value) * num_samples / (scale * METRIC_SCALE)
        parts.append(slots)
        return torch.cat([part.reshape(-1) for part in parts]).numpy()

    def unpack(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        """``{entry name: array of its shape}`` of a vector of this layout."""
        if vector.shape != (self.size,):
            raise UpdateError(f"the secure sum has shape {vector.shape}, the layout {self.size} values")
        out, start = {}, 0
        for entry in self.entries:
            out[entry.name] = vector[start:start + entry.size].reshape(entry.shape)
            start += entry.size
        return out


def summed_rows(server: Server, method: str, layout: Mapping[str, Any]) -> dict[str, str]:
    """``{class key: HOLDERS | COUNTS}`` of the floating class tensors of a reply, as the method's reply layout
    declares its server averages them (:attr:`~fedhpro.methods.layout.ClassRows.averaged`); ConfigError (one
    line, naming the key and the fix) for what a sum cannot give."""
    if not server.folds_weights:
        raise ConfigError(f"method={method} cannot run under flower.secure-aggregation=secagg+: its server weights "
                          "each client's own weights (Server.folds_weights=False), and the server learns only the "
                          "sum of the uploads; say why in its MethodSpec(needs_each_upload=...)")
    weighting: dict[str, str] = {}
    for key, entry in layout.items():
        if key in PLAIN_KEYS:
            continue
        if not isinstance(entry, ClassRows) or not entry.dtype.is_floating_point:
            raise ConfigError(f"method={method}: its reply holds '{key}', which secure aggregation does not know how "
                              "to sum (only weights, num_examples, class_counts and floating ClassRows); use "
                              "flower.secure-aggregation=none")
        if entry.averaged is None:
            raise ConfigError(f"method={method}: its reply's class rows '{key}' do not say how the server averages "
                              f"them; declare ClassRows(shape, dtype, averaged={HOLDERS!r}) (the mean over the "
                              f"clients holding the class) or averaged={COUNTS!r} (weighted by their class counts) "
                              "in its reply_layout, or MethodSpec(needs_each_upload=<why>) if the server needs "
                              "each client's own rows")
        weighting[key] = entry.averaged
    if weighting and "class_counts" not in layout:
        raise ConfigError(f"method={method}: its reply holds no class_counts, which secure aggregation needs to "
                          "sum its class rows; use flower.secure-aggregation=none")
    return weighting


# ---------------------------------------------------------------------------- the replies rebuilt from the sum


def _whole(values: np.ndarray, what: str, tolerance: float) -> np.ndarray:
    """``values`` rounded to whole numbers; UpdateError unless each is within ``tolerance`` of one."""
    rounded = np.rint(values)
    if values.size and float(np.abs(values - rounded).max()) > tolerance:
        raise UpdateError(f"the secure sum's {what} are not whole numbers (off by up to "
                          f"{float(np.abs(values - rounded).max()):.3g}): a node sent values it cannot hold")
    return rounded.astype(np.int64)


def holder_counts(holders: Sequence[int], capacity: Sequence[int]) -> np.ndarray:
    """A ``K x C`` matrix of 0 and 1 with exactly ``holders[c]`` ones in column ``c``, at least one and at
    most ``capacity[k]`` in row ``k``: the class counts of the rebuilt replies (each reply's num_examples is
    its row's sum). Classes go, most held first, to the rows with no class yet, then with the most room.
    UpdateError when none is found (the holders cannot come from these clients)."""
    rows, classes = len(capacity), len(holders)
    matrix = np.zeros((rows, classes), dtype=np.int64)
    degree = np.zeros(rows, dtype=np.int64)
    for c in sorted(range(classes), key=lambda c: (-holders[c], c)):
        room = [k for k in range(rows) if degree[k] < capacity[k]]
        room.sort(key=lambda k: (degree[k] > 0, -(capacity[k] - degree[k]), k))
        if len(room) < holders[c]:
            raise UpdateError(f"the secure sum says {holders[c]} clients hold class {c}, more than can")
        for k in room[:holders[c]]:
            matrix[k, c] = 1
            degree[k] += 1
    if rows and int(degree.min()) == 0:
        raise UpdateError("the secure sum leaves a summed client without any class")
    return matrix


def rebuild_replies(layout: SecureLayout, total: np.ndarray, global_weights: Mapping[str, Tensor],
                    num_samples: Sequence[int], scale: float, step: float, metric_names: Sequence[str]
                    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """``(one reply per summed client, the training metrics)`` from the secure sum ``total`` of the clients
    with ``num_samples`` training samples (in client order): every reply carries the aggregate (see the
    module doc), so the method's own aggregation returns it. UpdateError when the sum cannot come from
    honest clients of these sizes (the checks that hold on a sum: whole counts and holders, at most the
    clients' samples, counts adding up to num_examples)."""
    parts = layout.unpack(total)
    summed = len(num_samples)
    # each summed entry is off by less than `summed` quantization steps; whole numbers are checked in units of s
    tolerance = WHOLE_TOLERANCE + summed * step * scale
    examples = float(parts["num_examples"][0]) * scale
    total_examples = int(_whole(np.array([examples]), "num_examples", tolerance)[0])
    if not summed <= total_examples <= sum(num_samples):
        raise UpdateError(f"the secure sum's num_examples is {total_examples}, but the {summed} summed clients hold "
                          f"{sum(num_samples)} training samples together")
    share = examples / scale  # sum_k n_k / s, the FedAvg denominator
    weights = {}
    for name in layout.weights:
        delta = torch.from_numpy(np.ascontiguousarray(parts[f"weights/{name}"])) / share
        base = global_weights[name].detach().cpu()
        weights[name] = (base.double() + delta).to(layout.weight_dtypes[name])
    if not layout.per_class:
        replies = [{"weights": weights, "num_examples": int(n)} for n in num_samples]
    else:
        holders = _whole(parts["held"], "class holders", WHOLE_TOLERANCE + summed * step)
        counts = _whole(parts["class_counts"] * scale, "class counts", tolerance)
        if bool((holders < 0).any()) or bool((holders > summed).any()) or bool((counts < holders).any()):
            raise UpdateError("the secure sum's class holders and counts do not fit together")
        if int(counts.sum()) != total_examples:
            raise UpdateError(f"the secure sum's class counts add up to {int(counts.sum())}, its num_examples to "
                              f"{total_examples}")
        matrix = holder_counts(holders.tolist(), list(num_samples))
        rows: dict[str, Tensor] = {}
        for key, mode in layout.weighting.items():
            shape, dtype = layout.row_forms[key]
            # holder-mean: sum of held rows / holders; count-weighted: sum of (n_k^c/s) rows / sum of n_k^c/s (a
            # method dividing that by the holders, Eq. 4, gets it right: the rebuilt replies have as many holders)
            denominator = holders.astype(np.float64) if mode == HOLDERS else parts["class_counts"]
            denominator = np.where(holders > 0, denominator, 1.0).reshape(-1, *([1] * (len(shape) - 1)))
            means = np.where((holders > 0).reshape(denominator.shape), parts[f"rows/{key}"] / denominator, 0.0)
            rows[key] = torch.from_numpy(np.ascontiguousarray(means)).to(dtype)
        replies = []
        for k in range(summed):
            reply: dict[str, Any] = {"weights": dict(weights), "num_examples": int(matrix[k].sum()),
                                     "class_counts": torch.from_numpy(matrix[k].copy())}
            for key, mean in rows.items():
                held = torch.from_numpy(matrix[k] > 0).reshape(-1, *([1] * (mean.dim() - 1)))
                reply[key] = torch.where(held, mean, torch.zeros((), dtype=mean.dtype))
            replies.append(reply)
    slots: dict[int, str] = {}
    for name in sorted(set(metric_names)):
        slot = metric_slot(name)
        if slot in slots:
            raise FedHProError(f"the training metrics '{slots[slot]}' and '{name}' share a slot of the secure sum; "
                               "rename one of them")
        slots[slot] = name
    factor = scale * METRIC_SCALE / float(sum(num_samples))
    metrics = {name: float(parts["metrics"][slot]) * factor for slot, name in sorted(slots.items(), key=lambda i: i[1])}
    return replies, metrics

