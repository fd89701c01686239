"""The paper's partitioners (Section 5.1, Appendix C.1, Table A10) as pure numpy functions.

Every partitioner takes the training labels (or, for :func:`domains`, each
sample's domain) and a :class:`numpy.random.Generator`; it never touches the
global RNG, so the same generator seed always gives the same partition. Each
returns a :class:`Partition`: per client, the sorted ``int64`` indices it holds
in the training set, plus the scheme's name and parameters.

==============  ===========================================================
name            scheme
==============  ===========================================================
``iid``         random permutation cut into K near-equal parts
``dirichlet``   NID1_alpha: NIID-Bench Dirichlet label skew (min_size, retries)
``nid2``        NID2: single-class clients plus client(s) holding all classes
``longtail``    CIFAR-LT style subsample (ratio rho) then ``dirichlet(0.5)``
``domains``     domain skew: (domain, clients, fraction) layout
``ag-nid``      AG News text partitions: 2-class clients and 4-class clients
==============  ===========================================================

Invariants (checked by ``tests/test_partition.py``): a training index is held
by at most one client (for ``domains`` given per-domain index spaces: at most
one client of its domain); ``iid``, ``dirichlet``, ``nid2`` and ``ag-nid``
assign every training index. Errors are :class:`PartitionError`, a
``ValueError`` whose message says what is wrong and how to fix it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedhpro.bounded import read_json_file
from fedhpro.errors import ConfigError, FedHProError
from fedhpro.files import write_atomic
from fedhpro.options import option
from fedhpro.registry import LiveChoices, Registry, checked_spec

LabelsLike = np.ndarray | Mapping[str, np.ndarray]


class PartitionError(FedHProError, ValueError):
    """An impossible partition setting or a malformed partition file (a ``ValueError``)."""


# --------------------------------------------------------------------------- the result


@dataclass
class Partition:
    """Which training samples each client holds.

    ``client_indices[k]``: sorted ``int64`` indices into the training set of
    client k. ``client_domains[k]``: client k's domain (``domains`` only, else
    ``None``); when the partition was built from a per-domain mapping of index
    arrays, the indices are in the index space of those arrays.
    """

    client_indices: list[np.ndarray]
    scheme: str
    params: dict[str, Any] = field(default_factory=dict)
    client_domains: list[str] | None = None

    def __post_init__(self) -> None:
        self.client_indices = [np.sort(np.asarray(ix, dtype=np.int64).reshape(-1)) for ix in self.client_indices]
        if self.client_domains is not None:
            self.client_domains = [str(d) for d in self.client_domains]
            if len(self.client_domains) != len(self.client_indices):
                raise PartitionError(f"client_domains has {len(self.client_domains)} entries but there are "
                                     f"{len(self.client_indices)} clients")

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    @property
    def sizes(self) -> np.ndarray:
        """Samples per client (K,)."""
        return np.array([len(ix) for ix in self.client_indices], dtype=np.int64)

    def class_counts(self, labels: LabelsLike, num_classes: int) -> np.ndarray:
        """K x C ``int64`` matrix: samples of class c held by client k.

        ``labels`` is the training label array, or (for a partition with
        ``client_domains`` over per-domain index spaces) a mapping domain ->
        that domain's label array.
        """
        counts = np.zeros((self.num_clients, int(num_classes)), dtype=np.int64)
        if isinstance(labels, Mapping):
            domains = self.client_domains
            if domains is None:
                raise PartitionError("labels given per domain but this partition has no client_domains")
            per_domain = {str(d): _as_labels(v, f"labels[{d!r}]") for d, v in labels.items()}
            missing = sorted(set(domains) - set(per_domain))
            if missing:
                raise PartitionError(f"labels given per domain lack the domain(s) {missing}")
            label_of = [per_domain[d] for d in domains]
        else:
            label_of = [_as_labels(labels)] * self.num_clients
        for k, ix in enumerate(self.client_indices):
            y = label_of[k]
            if ix.size and ix[-1] >= y.shape[0]:
                raise PartitionError(f"client {k} holds index {int(ix[-1])} but the labels have only {y.shape[0]} "
                                     "entries; is this the partition of another data set?")
            held = y[ix]
            if held.size and held.max() >= num_classes:
                raise PartitionError(f"label {int(held.max())} >= num_classes={num_classes}")
            counts[k] = np.bincount(held, minlength=num_classes)
        return counts

    def to_json(self, labels: LabelsLike | None = None, num_classes: int | None = None,
                seed: int | None = None) -> dict[str, Any]:
        """A JSON-serialisable record: scheme, params, seed, and per client its indices and class counts.

        The client records have the same keys as the federations' ``partition``
        records (``client``, ``domain``, ``indices``, ``class_counts``).
        Class counts (and ``num_samples``, used by :meth:`from_json` to check
        the indices) are included when ``labels`` is given.
        """
        record: dict[str, Any] = {"scheme": self.scheme, "params": _jsonable(self.params),
                                  "seed": None if seed is None else int(seed), "num_clients": self.num_clients}
        counts = None
        if labels is not None:
            if num_classes is None:
                raise PartitionError("to_json: pass num_classes together with labels")
            counts = self.class_counts(labels, num_classes)
            record["num_classes"] = int(num_classes)
            if isinstance(labels, Mapping):
                record["num_samples"] = {str(d): int(np.asarray(y).shape[0]) for d, y in labels.items()}
            else:
                record["num_samples"] = int(np.asarray(labels).shape[0])
        clients = []
        for k, ix in enumerate(self.client_indices):
            entry: dict[str, Any] = {"client": k}
            if self.client_domains is not None:
                entry["domain"] = self.client_domains[k]
            entry["indices"] = ix.tolist()
            if counts is not None:
                entry["class_counts"] = counts[k].tolist()
            clients.append(entry)
        record["clients"] = clients
        return record

    @classmethod
    def from_json(cls, record: Mapping[str, Any], num_samples: int | Mapping[str, int] | None = None,
                  source: str = "partition record") -> Partition:
        """Inverse of :meth:`to_json`.

        Indices are checked against ``num_samples`` (argument, else the
        record's own ``num_samples``): an int, or domain -> int for per-domain
        index spaces. Raises :class:`PartitionError` naming ``source``.
        """
        def bad(why: str) -> PartitionError:
            return PartitionError(f"{source}: malformed partition: {why}")

        if not isinstance(record, Mapping):
            raise bad(f"expected a JSON object, got {type(record).__name__}")
        for key in ("scheme", "clients"):
            if key not in record:
                raise bad(f"missing key {key!r}")
        scheme, params, clients = record["scheme"], record.get("params", {}), record["clients"]
        if not isinstance(scheme, str):
            raise bad("'scheme' must be a string")
        if not isinstance(params, Mapping):
            raise bad("'params' must be an object")
        if not isinstance(clients, list) or not clients:
            raise bad("'clients' must be a non-empty list")
        if "num_clients" in record and record["num_clients"] != len(clients):
            raise bad(f"num_clients={record['num_clients']} but {len(clients)} client records")
        indices, client_domains = [], []
        for k, entry in enumerate(clients):
            if not isinstance(entry, Mapping) or "indices" not in entry:
                raise bad(f"client record {k} must be an object with 'indices'")
            raw = entry["indices"]
            if not isinstance(raw, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
                raise bad(f"client {k}: 'indices' must be a list of integers")
            ix = np.asarray(raw, dtype=np.int64)
            if ix.size and ix.min() < 0:
                raise bad(f"client {k}: negative index {int(ix.min())}")
            if np.unique(ix).size != ix.size:
                raise bad(f"client {k}: repeated indices")
            indices.append(ix)
            client_domains.append(entry.get("domain"))
        has_domain = [d is not None for d in client_domains]
        if any(has_domain) and not all(has_domain):
            raise bad("some client records have a 'domain' and others not")
        domains_ = [str(d) for d in client_domains] if all(has_domain) else None

        # each index held by at most one client (per domain when domains are recorded)
        groups: dict[str | None, list[np.ndarray]] = {}
        for k, ix in enumerate(indices):
            groups.setdefault(None if domains_ is None else domains_[k], []).append(ix)
        for group, arrays in groups.items():
            joined = np.concatenate(arrays)
            if np.unique(joined).size != joined.size:
                where = "" if group is None else f" of domain {group!r}"
                raise bad(f"an index is held by more than one client{where}")

        limit = num_samples if num_samples is not None else record.get("num_samples")
        if limit is not None:
            for k, ix in enumerate(indices):
                if isinstance(limit, Mapping):
                    if domains_ is None or domains_[k] not in limit:
                        raise bad(f"client {k}: no data set size for its domain")
                    n = int(limit[domains_[k]])
                else:
                    n = int(limit)
                if ix.size and ix.max() >= n:
                    raise bad(f"client {k} holds index {int(ix.max())} but the data set has only {n} samples")
        return cls(indices, scheme, dict(params), domains_)

    def save(self, path: str | os.PathLike, labels: LabelsLike | None = None, num_classes: int | None = None,
             seed: int | None = None) -> Path:
        """Write :meth:`to_json` to ``path`` atomically (:func:`fedhpro.files.write_atomic`)."""
        path = Path(path)
        write_atomic(path, json.dumps(self.to_json(labels, num_classes, seed)))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, num_samples: int | Mapping[str, int] | None = None) -> Partition:
        """Read a file written by :meth:`save`; a malformed file raises :class:`PartitionError` naming it."""
        path = Path(path)
        record = read_json_file(path, PartitionError, f"{path}: partition file")
        return cls.from_json(record, num_samples=num_samples, source=str(path))


# --------------------------------------------------------------------------- helpers


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def _as_labels(labels: Any, name: str = "labels") -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1:
        raise PartitionError(f"{name} must be a 1-D array, got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        raise PartitionError(f"{name} must be integers, got dtype {y.dtype}")
    y = y.astype(np.int64, copy=False)
    if y.size and y.min() < 0:
        raise PartitionError(f"{name} must be >= 0, found {int(y.min())}")
    return y


def _check_clients(num_clients: Any, n: int | None = None) -> int:
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise PartitionError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    if n is not None and num_clients > n:
        raise PartitionError(f"num_clients={num_clients} exceeds the {n} training samples; use fewer clients")
    return int(num_clients)


def _finite_at_least(value: Any, name: str, bound: float, strict: bool = False, what: str = "") -> float:
    """``value`` as a finite float ``> bound`` (``strict``) or ``>= bound``; else one PartitionError."""
    relation = ">" if strict else ">="
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise PartitionError(f"{name} must be a number {relation} {bound:g}, got {value!r}") from None
    if not (math.isfinite(number) and (number > bound if strict else number >= bound)):
        raise PartitionError(f"{name} must be a finite number {relation} {bound:g}{what}, got {value!r}")
    return number


def _check_rng(rng: Any) -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise PartitionError("rng must be a numpy.random.Generator (e.g. numpy.random.default_rng(seed)), "
                             f"got {type(rng).__name__}")
    return rng


def _split_equal(indices: np.ndarray, parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle ``indices`` and cut them into ``parts`` near-equal pieces (sizes differ by at most one)."""
    return np.array_split(rng.permutation(indices), parts)


# --------------------------------------------------------------------------- partitioners


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> Partition:
    """IID: a random permutation of the training set cut into K near-equal parts (sizes differ by <= 1)."""
    y = _as_labels(labels)
    k = _check_clients(num_clients, y.shape[0])
    rng = _check_rng(rng)
    parts = np.array_split(rng.permutation(y.shape[0]), k)
    return Partition(parts, "iid", {"num_clients": k})


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator,
              min_size: int = 10, max_retries: int = 1000) -> Partition:
    """NID1_alpha: Dirichlet label skew as in NIID-Bench (Li et al., 2022; Wang et al., 2020).

    One attempt: for each class c in order 0..C-1, shuffle its indices, draw
    proportions p ~ Dir(alpha * 1_K), zero the share of every client already
    holding >= N/K samples, renormalise, and cut the class at
    ``floor(cumsum(p) * n_c)``. The attempt is accepted when every client holds
    >= ``min_size`` samples; otherwise the whole draw is repeated, at most
    ``max_retries`` times, after which a :class:`PartitionError` says what
    failed and how to fix it (lower min_size, raise alpha, fewer clients).
    One difference from NIID-Bench, in a degenerate case only: if the drawn
    shares of all the clients still under N/K are exactly 0.0 (possible in
    floating point for tiny alpha), the attempt counts as failed instead of
    dividing by zero. ``params["attempts"]`` records the attempts used.
    """
    y = _as_labels(labels)
    n = int(y.shape[0])
    k = _check_clients(num_clients)
    rng = _check_rng(rng)
    alpha_f = _finite_at_least(alpha, "alpha", 0.0, strict=True)
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 0:
        raise PartitionError(f"min_size must be an integer >= 0, got {min_size!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, (int, np.integer)) or max_retries < 1:
        raise PartitionError(f"max_retries must be an integer >= 1, got {max_retries!r}")
    if min_size * k > n:
        raise PartitionError(f"min_size={min_size} x num_clients={k} = {min_size * k} exceeds the {n} training "
                             "samples; lower min_size or use fewer clients")

    classes = np.unique(y)
    by_class = [np.flatnonzero(y == c) for c in classes]
    cap = n / k
    best = -1
    for attempt in range(1, int(max_retries) + 1):
        batches: list[list[np.ndarray]] = [[] for _ in range(k)]
        sizes = np.zeros(k, dtype=np.int64)
        degenerate = False
        for idx_c in by_class:
            idx_c = rng.permutation(idx_c)
            p = rng.dirichlet(np.full(k, alpha_f))
            p = p * (sizes < cap)
            total = p.sum()
            if not total > 0:
                degenerate = True
                break
            p = p / total
            cuts = (np.cumsum(p) * len(idx_c)).astype(np.int64)[:-1]
            for j, piece in enumerate(np.split(idx_c, cuts)):
                batches[j].append(piece)
                sizes[j] += len(piece)
        if degenerate:
            continue
        smallest = int(sizes.min())
        best = max(best, smallest)
        if smallest >= min_size:
            parts = [np.concatenate(b) if b else np.empty(0, np.int64) for b in batches]
            return Partition(parts, "dirichlet",
                             {"alpha": alpha_f, "num_clients": k, "min_size": int(min_size), "attempts": attempt})
    best_txt = f"the best attempt's smallest client had {best} samples" if best >= 0 else "every attempt was degenerate"
    raise PartitionError(
        f"dirichlet partition failed: after {max_retries} attempts no draw gave every one of the {k} clients "
        f">= min_size={min_size} samples ({best_txt}; N={n}, alpha={alpha_f:g}). Lower min_size, raise alpha, "
        "use fewer clients, or raise max_retries.")


def nid2(labels: np.ndarray, num_clients: int, rng: np.random.Generator,
         single_class_clients: int | None = None, single_class_share: float | None = None) -> Partition:
    """NID2 (paper Section 5.1): S single-class clients and K - S clients holding all classes.

    The paper's setting is K = 7: 6 clients each hold one single class and 1
    client holds all classes. ``single_class_clients`` (S, default K - 1)
    generalises; it must satisfy 0 <= S <= K - 1 and S <= the number of
    classes present (the single-class clients' classes are distinct).

    Choices (the paper does not say how much of its class a single-class
    client gets):

    * clients 0..S-1 are the single-class clients; their classes are S
      distinct classes drawn at random (``rng``), recorded in
      ``params["single_classes"]``; clients S..K-1 are the full clients
      (``params["full_clients"]``).
    * default share: every class is split equally (after a shuffle) among
      the clients that hold it. A class picked by a single-class client is
      held by that client and by each full client, so with the paper's one
      full client the single-class client gets half of its class and the
      full client the other half; classes nobody picked go wholly to the
      full client(s). The full client thus holds every class, and "the rest
      of the data goes to the full client".
    * ``single_class_share`` in (0, 1) overrides that: the single-class
      client gets ``floor(share * n_c)`` of its class, and the rest of the
      class is split equally among the full clients.

    Every training sample is assigned exactly once. Raises
    :class:`PartitionError` when a class has too few samples for every full
    client to get one.
    """
    y = _as_labels(labels)
    k = _check_clients(num_clients)
    rng = _check_rng(rng)
    if k < 2:
        raise PartitionError("nid2 needs at least 2 clients (single-class clients plus one full client)")
    classes = np.unique(y)
    s = k - 1 if single_class_clients is None else single_class_clients
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s <= k - 1:
        raise PartitionError(f"single_class_clients must be an integer in [0, num_clients-1={k - 1}] (at least one "
                             f"client holds all classes), got {single_class_clients!r}")
    s = int(s)
    if s > classes.size:
        raise PartitionError(f"nid2: {s} single-class clients need {s} distinct classes but the labels have only "
                             f"{classes.size}; pass single_class_clients <= {classes.size} (the other clients then "
                             "hold all classes) or use fewer clients")
    if single_class_share is not None and not 0.0 < float(single_class_share) < 1.0:
        raise PartitionError(f"single_class_share must be in (0, 1) so the full client keeps every class, "
                             f"got {single_class_share!r}")
    full = list(range(s, k))
    chosen = rng.choice(classes, size=s, replace=False) if s else np.empty(0, np.int64)
    owner = {int(c): j for j, c in enumerate(chosen)}
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for c in classes:
        idx_c = rng.permutation(np.flatnonzero(y == c))
        holder = owner.get(int(c))
        if holder is not None and single_class_share is not None:
            take = int(math.floor(float(single_class_share) * len(idx_c)))
            parts[holder].append(idx_c[:take])
            rest, receivers = idx_c[take:], full
        else:
            rest, receivers = idx_c, ([holder] if holder is not None else []) + full
        if len(rest) < len(receivers):
            raise PartitionError(f"nid2: class {int(c)} has too few samples ({len(rest)} left) for each of its "
                                 f"{len(receivers)} holders to get one; use fewer clients or a smaller "
                                 "single_class_share")
        for j, piece in zip(receivers, np.array_split(rest, len(receivers))):
            parts[j].append(piece)
    params = {"num_clients": k, "single_class_clients": s, "single_classes": [int(c) for c in chosen],
              "full_clients": full, "single_class_share": single_class_share}
    return Partition([np.concatenate(p) for p in parts], "nid2", params)


def longtail(labels: np.ndarray, num_clients: int, rho: float, rng: np.random.Generator, alpha: float = 0.5,
             min_size: int = 10, max_retries: int = 1000, num_classes: int | None = None) -> Partition:
    """Quantity skew (CIFAR-LT style, Cao et al. 2019): long-tail subsample, then ``dirichlet(alpha)``.

    Keeps ``n_c = floor(n_max * rho ** (-c / (C - 1)))`` samples of class c,
    drawn at random (``rng``) from that class, where class 0 is the head,
    n_max the size of the largest class and C = ``num_classes`` (default:
    max label + 1). So rho = n_0 / n_{C-1} (e.g. CIFAR10-LT rho=100: 5000 ...
    50). A class with fewer than n_c samples raises :class:`PartitionError`
    (the source set is expected balanced). The kept samples are then split
    by :func:`dirichlet` with ``alpha`` (0.5 in the paper) and ``min_size``.

    Returned indices refer to the ORIGINAL training set; discarded samples
    belong to no client. ``params["kept_per_class"]`` lists n_c. The test set
    is not touched here: the caller keeps it balanced, as in the paper.
    """
    y = _as_labels(labels)
    rng = _check_rng(rng)
    rho_f = _finite_at_least(rho, "rho", 1.0, what=" (ratio of head to tail class size)")
    if y.size == 0:
        raise PartitionError("longtail needs a non-empty label array")
    c_total = int(y.max()) + 1 if num_classes is None else int(num_classes)
    if y.max() >= c_total:
        raise PartitionError(f"label {int(y.max())} >= num_classes={c_total}")
    counts = np.bincount(y, minlength=c_total)
    n_max = int(counts.max())
    keep = []
    for c in range(c_total):
        n_c = n_max if c_total == 1 else int(math.floor(n_max * rho_f ** (-c / (c_total - 1))))
        if n_c > counts[c]:
            raise PartitionError(f"longtail: class {c} needs {n_c} samples (n_max={n_max}, rho={rho_f:g}) but has "
                                 f"only {int(counts[c])}; the source training set should be class-balanced")
        keep.append(n_c)
    kept = np.concatenate([rng.choice(np.flatnonzero(y == c), size=n_c, replace=False) for c, n_c in enumerate(keep)])
    kept = np.sort(kept)
    sub = dirichlet(y[kept], num_clients, alpha, rng, min_size=min_size, max_retries=max_retries)
    params = {"rho": rho_f, "alpha": float(alpha), "num_clients": int(num_clients), "min_size": int(min_size),
              "n_max": n_max, "kept_per_class": keep, "attempts": sub.params["attempts"]}
    return Partition([kept[ix] for ix in sub.client_indices], "longtail", params)


def domains(domain_of_sample: np.ndarray | Sequence[str] | Mapping[str, np.ndarray],
            layout: Sequence[tuple[str, int, float]], rng: np.random.Generator) -> Partition:
    """Domain skew (paper Section 5.1): a ``layout`` of (domain, number of clients, fraction).

    ``domain_of_sample``: each training sample's domain name (indices are
    then into the whole training set), or a mapping domain -> index array
    (indices returned as given, e.g. into that domain's own training set, as
    the digits federations do). Each client of a domain gets
    ``int(fraction * n_domain)`` samples drawn at random without replacement
    from its domain, disjoint from the other clients of that domain; clients
    x fraction > 1 for a domain is an error (no overlapping samples), and so
    is a fraction that gives a client no sample. Clients are numbered in
    layout order (a domain's clients consecutive); ``client_domains`` records
    each client's domain. Paper: Digits M:3 U:7 SV:6 SY:4 at 1%,
    Office-Caltech C:3 W:1 A:2 D:4 at 20%.
    """
    rng = _check_rng(rng)
    if isinstance(domain_of_sample, Mapping):
        pools = {}
        for d, ix in domain_of_sample.items():
            arr = np.asarray(ix)
            if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
                raise PartitionError(f"domain {d!r}: the index array must be 1-D integers")
            arr = arr.astype(np.int64)
            if arr.size and arr.min() < 0:
                raise PartitionError(f"domain {d!r}: negative index {int(arr.min())}")
            if np.unique(arr).size != arr.size:
                raise PartitionError(f"domain {d!r}: repeated indices")
            pools[str(d)] = arr
    else:
        names = np.asarray(domain_of_sample).astype(str)
        if names.ndim != 1:
            raise PartitionError("domain_of_sample must be a 1-D array of domain names or a mapping")
        pools = {str(d): np.flatnonzero(names == d) for d in np.unique(names)}
    if not layout:
        raise PartitionError("domains: the layout is empty; give (domain, clients, fraction) entries")
    seen: set[str] = set()
    parts, owners, record = [], [], []
    for entry in layout:
        try:
            d, clients, fraction = entry
        except (TypeError, ValueError):
            raise PartitionError(f"domains: layout entry {entry!r} is not (domain, clients, fraction)") from None
        d = str(d)
        if d in seen:
            raise PartitionError(f"domains: domain {d!r} appears twice in the layout; give its client count once")
        seen.add(d)
        if d not in pools:
            raise PartitionError(f"domains: unknown domain {d!r}; the data has {sorted(pools)}")
        if isinstance(clients, bool) or not isinstance(clients, (int, np.integer)) or clients < 0:
            raise PartitionError(f"domains: domain {d!r} client count must be an integer >= 0, got {clients!r}")
        fraction = float(fraction)
        if not 0.0 < fraction <= 1.0:
            raise PartitionError(f"domains: domain {d!r} fraction must be in (0, 1], got {fraction}")
        pool = pools[d]
        size = int(fraction * len(pool))
        if clients and size < 1:
            raise PartitionError(f"domains: fraction {fraction} of domain {d!r} ({len(pool)} samples) gives its "
                                 "clients no sample; raise the fraction")
        if clients * fraction > 1.0 + 1e-9 or clients * size > len(pool):
            raise PartitionError(f"domains: {clients} clients x fraction {fraction} of domain {d!r} exceed its "
                                 f"{len(pool)} samples (clients x fraction must be <= 1 for disjoint clients); "
                                 "lower the fraction or the client count")
        order = rng.permutation(pool)
        for j in range(int(clients)):
            parts.append(order[j * size:(j + 1) * size])
            owners.append(d)
        record.append([d, int(clients), fraction])
    if not parts:
        raise PartitionError("domains: the layout gives no client")
    return Partition(parts, "domains", {"layout": record}, client_domains=owners)


def _round_robin_pairs(c: int) -> list[tuple[int, int]]:
    """All C(C,2) class pairs ordered as rounds of a round-robin tournament (circle method).

    Each round is a perfect matching (for even C), so any run of consecutive
    pairs uses every class about equally often.
    """
    players = list(range(c)) + ([-1] if c % 2 else [])
    m = len(players)
    pairs = []
    for _ in range(m - 1):
        for i in range(m // 2):
            a, b = players[i], players[m - 1 - i]
            if a >= 0 and b >= 0:
                pairs.append((min(a, b), max(a, b)))
        players = [players[0], players[-1]] + players[1:-1]
    return pairs


def ag_nid(labels: np.ndarray, num_clients: int, rng: np.random.Generator,
           two_class_fraction: float | None = None) -> Partition:
    """AG News text partitions (paper Table A10): 2-class clients and clients holding all classes.

    AG-NID_K10: K=10, 50% of the clients hold 2 classes, 50% all 4;
    AG-NID_K50: K=50, 80% / 20%. ``two_class_fraction`` defaults to 0.5 if
    K <= 10 else 0.8; the number of 2-class clients is round(fraction * K).

    Choices (the paper does not specify them):

    * clients 0..T-1 are the 2-class clients, T..K-1 the full clients.
    * the 2-class clients' pairs cycle through all class pairs in
      round-robin-tournament order ({0,1},{2,3}, {0,2},{1,3}, {0,3},{1,2} for
      4 classes), after a random relabelling of the classes (``rng``), so
      every class is held by about as many 2-class clients as any other;
      recorded in ``params["client_classes"]``.
    * each class's samples are shuffled and split equally among all the
      clients that hold it (its 2-class clients and every full client):
      every training sample is assigned exactly once.

    Raises :class:`PartitionError` if a class would have no holder (no full
    client and too few 2-class clients) or fewer samples than holders.
    """
    y = _as_labels(labels)
    k = _check_clients(num_clients)
    rng = _check_rng(rng)
    classes = np.unique(y)
    if classes.size < 2:
        raise PartitionError("ag_nid needs at least 2 classes")
    frac = (0.5 if k <= 10 else 0.8) if two_class_fraction is None else float(two_class_fraction)
    if not 0.0 <= frac <= 1.0:
        raise PartitionError(f"two_class_fraction must be in [0, 1], got {two_class_fraction!r}")
    t = int(math.floor(frac * k + 0.5))
    relabel = rng.permutation(classes)
    pairs = [(int(relabel[a]), int(relabel[b])) for a, b in _round_robin_pairs(classes.size)]
    client_classes: list[list[int]] = [sorted(pairs[j % len(pairs)]) for j in range(t)]
    client_classes += [[int(c) for c in classes] for _ in range(t, k)]
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for c in classes:
        holders = [j for j in range(k) if int(c) in client_classes[j]]
        idx_c = np.flatnonzero(y == c)
        if not holders:
            raise PartitionError(f"ag_nid: class {int(c)} has no holder ({t} 2-class clients, {k - t} full clients); "
                                 "lower two_class_fraction or use more clients")
        if len(idx_c) < len(holders):
            raise PartitionError(f"ag_nid: class {int(c)} has {len(idx_c)} samples for {len(holders)} clients; "
                                 "use fewer clients")
        for j, piece in zip(holders, _split_equal(idx_c, len(holders), rng)):
            parts[j].append(piece)
    params = {"num_clients": k, "two_class_fraction": frac, "two_class_clients": t, "client_classes": client_classes}
    return Partition([np.concatenate(p) for p in parts], "ag-nid", params)


# --------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class PartitionerSpec:
    """A registered partitioner: ``partition=<name>`` (``partition.scheme=<name>``).

    ``split(options, labels, num_clients, rng, num_classes)`` returns the :class:`Partition` of the label
    array ``labels`` among ``num_clients`` clients, its parameters read from ``options`` (the ``partition``
    section: :class:`PartitionOptions` plus the fields of every installed partitioner's ``options``).
    ``options``: an optional dataclass of the partitioner's own knobs, each a ``partition.<knob>`` key
    (defaults only; a name :class:`PartitionOptions` already has is refused). ``labels=True``: a label-skew
    scheme, which every label-skew data set accepts. ``function``: the plain partitioner, if any
    (:data:`PARTITIONERS` maps names to it).
    """

    name: str
    split: Callable[..., Partition] | None
    options: type | None = None
    description: str = ""
    labels: bool = True
    function: Callable[..., Partition] | None = None


def _label_spec(name: str, function: Callable[..., Partition], split: Callable[..., Partition]) -> PartitionerSpec:
    return PartitionerSpec(name, split, function=function, description=(function.__doc__ or "").split("\n")[0])


def _partitioner_checks(spec: PartitionerSpec, where: str) -> None:
    """A label-skew partitioner's ``split`` is callable; its own knobs do not take a :class:`PartitionOptions` name."""
    if spec.labels and not callable(spec.split):
        raise ConfigError(f"{where}: PartitionerSpec.split must be callable (options, labels, num_clients, rng, "
                          "num_classes) -> Partition")
    if spec.options is not None:
        taken = {f.name for f in dataclasses.fields(PartitionOptions)} & {f.name for f in
                                                                          dataclasses.fields(spec.options)}
        if taken:
            raise ConfigError(f"{where}: partition.{sorted(taken)[0]} is already a partition key; name the "
                              "partitioner's own knobs differently (it may read the existing ones)")


def _checked_partitioner(name: str, loaded: object, where: str) -> PartitionerSpec:
    return checked_spec(name, loaded, where, PartitionerSpec, path="fedhpro.data.partition.PartitionerSpec",
                        give="PartitionerSpec(name, split) with split(options, labels, num_clients, rng, "
                             "num_classes) -> Partition",
                        keys="partition.* keys", optional_options=True, check=_partitioner_checks)


#: the entry-point group through which installed packages add partitioners
ENTRY_POINT_GROUP = "fedhpro.partitioners"

#: name -> :class:`PartitionerSpec`, a live mapping: the built-ins (one line each), then those registered
#: (:func:`register`) or installed (entry points of ``fedhpro.partitioners``)
REGISTRY: Registry[PartitionerSpec] = Registry(
    "partitioner", ENTRY_POINT_GROUP, key="partition", check=_checked_partitioner,
    hint=f" (or add one with fedhpro.data.partition.register or a package's {ENTRY_POINT_GROUP!r} entry point)")
REGISTRY.builtin("iid", _label_spec("iid", iid, lambda o, y, k, rng, c: iid(y, k, rng)))
REGISTRY.builtin("dirichlet", _label_spec(
    "dirichlet", dirichlet,
    lambda o, y, k, rng, c: dirichlet(y, k, o.alpha, rng, min_size=o.min_size, max_retries=o.max_retries)))
REGISTRY.builtin("nid2", _label_spec(
    "nid2", nid2, lambda o, y, k, rng, c: nid2(y, k, rng, single_class_clients=o.single_class_clients)))
REGISTRY.builtin("longtail", _label_spec(
    "longtail", longtail,
    lambda o, y, k, rng, c: longtail(y, k, o.rho, rng, alpha=o.alpha, min_size=o.min_size,
                                     max_retries=o.max_retries, num_classes=c)))
REGISTRY.builtin("domains", PartitionerSpec("domains", None, labels=False, function=domains,
                                            description="domain skew: (domain, clients, fraction) layout"))
REGISTRY.builtin("ag-nid", _label_spec(
    "ag-nid", ag_nid, lambda o, y, k, rng, c: ag_nid(y, k, rng, two_class_fraction=o.two_class_fraction)))


def register(name: str, spec: PartitionerSpec, *, replace: bool = False) -> PartitionerSpec:
    """Add ``spec`` as ``partition=name`` for this process; returns the registered spec."""
    return REGISTRY.register(name, spec, replace=replace)


def partitioner_names() -> list[str]:
    """Every partitioner's name: the built-ins first, then those registered or installed."""
    return REGISTRY.names()


def label_schemes() -> list[str]:
    """Every label-skew scheme (what ``partition=`` may be for a label-skew data set), live."""
    return [name for name in REGISTRY.names() if REGISTRY.entries[name].labels]


def added_label_schemes() -> list[str]:
    """The label-skew schemes registered or installed (not built in): every label-skew data set accepts them."""
    return [name for name in label_schemes() if not REGISTRY.is_builtin(name)]


class _Functions(Mapping[str, Callable[..., Partition]]):
    """:data:`PARTITIONERS`: scheme name -> plain partitioner function (the registry's, live)."""

    def __getitem__(self, name: str) -> Callable[..., Partition]:
        spec = REGISTRY[name]
        function = spec.function or spec.split
        if function is None:
            raise KeyError(name)
        return function

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY.names())

    def __len__(self) -> int:
        return len(REGISTRY.names())


#: scheme name -> partitioner
PARTITIONERS: Mapping[str, Callable[..., Partition]] = _Functions()

#: the built-in label-skew schemes (every built-in partitioner but ``domains``, which needs a domain layout);
#: :func:`label_schemes` adds those registered or installed
LABEL_SCHEMES = tuple(name for name, spec in REGISTRY.builtins.items() if spec.labels)


@dataclass
class PartitionOptions:
    """The ``partition`` config section: which scheme splits the training set, and its parameters.

    ``partition=dirichlet`` on the command line (or ``partition: dirichlet``
    in YAML) is short for ``partition.scheme=dirichlet``. ``auto`` takes the
    benchmark's own scheme (the one its paper table uses).
    """

    scheme: str = option("auto", choices=LiveChoices(partitioner_names, first=("auto",)),
                         help="auto (the benchmark's scheme) or one of the partitioners")
    alpha: float = option(0.5, gt=0.0, help="dirichlet/longtail: Dirichlet concentration (NID1_alpha)")
    min_size: int = option(10, min=0, help="dirichlet/longtail: fewest samples any client may get")
    max_retries: int = option(1000, min=1, help="dirichlet/longtail: draws tried before giving up")
    rho: float = option(100.0, min=1.0, help="longtail: head-to-tail class size ratio (the paper: 10, 50, 100)")
    single_class_clients: int | None = option(None, min=0, help="nid2: single-class clients (default K - 1)")
    two_class_fraction: float | None = option(None, min=0.0, max=1.0,
                                              help="ag-nid: share of 2-class clients (default 0.5 if K <= 10 "
                                                   "else 0.8, Table A10)")
    seed: int | None = option(None, min=0, help="seed of the partition (default: the run seed)")
    load: str | None = option(None, help="reuse the partition saved in this partition.json instead of drawing one")


_merged: dict[tuple[tuple[str, type], ...], type] = {}


def partition_options_class() -> type:
    """The ``partition`` section's options class: :class:`PartitionOptions`, plus (in a subclass) the knobs
    of every registered or installed partitioner that declares ``options`` (each a ``partition.<knob>``)."""
    extra: tuple[tuple[str, type], ...] = tuple(
        (name, options) for name in REGISTRY.names() if (options := REGISTRY.entries[name].options) is not None)
    if not extra:
        return PartitionOptions
    if extra not in _merged:
        fields: list[tuple[str, Any, Any]] = []
        for _, cls in extra:
            hints = typing.get_type_hints(cls)
            for item in dataclasses.fields(cls):
                if any(item.name == known[0] for known in fields):
                    continue  # two partitioners sharing a knob: the first one's declaration
                default = (dataclasses.field(default=item.default, metadata=item.metadata)
                           if item.default is not dataclasses.MISSING else
                           dataclasses.field(default_factory=item.default_factory, metadata=item.metadata))
                fields.append((item.name, hints[item.name], default))
        _merged[extra] = dataclasses.make_dataclass("PartitionOptions", fields, bases=(PartitionOptions,),
                                                    namespace={"__module__": __name__})
    return _merged[extra]


def chosen_scheme(options: PartitionOptions, default: str, allowed: Sequence[str], name: str,
                  note: str = "") -> str:
    """The scheme ``partition=`` asks for (``auto``: the data set's ``default``), checked against the
    schemes data set ``name`` accepts; one-line ConfigError listing them (and ``note``) otherwise."""
    scheme = default if options.scheme == "auto" else options.scheme
    allowed = [*allowed, *(added for added in added_label_schemes() if added not in allowed)]
    if scheme not in allowed:
        raise ConfigError(f"partition={scheme} does not apply to {name}; choose one of: {', '.join(allowed)}{note}")
    return scheme


def label_partition(options: PartitionOptions, scheme: str, labels: np.ndarray, num_clients: int,
                    rng: np.random.Generator, num_classes: int | None = None) -> Partition:
    """Split ``labels`` with the label-skew ``scheme`` and the parameters of ``options``."""
    spec = REGISTRY.get(scheme) if isinstance(scheme, str) else None
    if spec is None or not spec.labels or spec.split is None:
        raise PartitionError(f"partition={scheme!r} does not split by label; choose one of: "
                             f"{', '.join(label_schemes())}")
    return spec.split(options, labels, num_clients, rng, num_classes)


def within_domains(labels: Mapping[str, np.ndarray], layout: Mapping[str, int], scheme: str,
                   options: PartitionOptions, rng: np.random.Generator,
                   num_classes: int | None = None) -> Partition:
    """A label-skew ``scheme`` applied separately to each domain's training set among that domain's clients.

    ``labels``: domain -> that domain's training labels; ``layout``: domain ->
    its number of clients (domains with 0 are left out; clients are numbered in
    ``layout`` order, a domain's clients consecutive). Indices are in each
    domain's own index space and ``client_domains`` records each client's
    domain, as :func:`domains` returns them. With one domain this is the plain
    label partition of that domain.
    """
    parts: list[np.ndarray] = []
    owners: list[str] = []
    params: dict[str, Any] = {"within_domains": {}}
    for domain, clients in layout.items():
        if not clients:
            continue
        if domain not in labels:
            raise PartitionError(f"unknown domain {domain!r}; the data has {sorted(labels)}")
        try:
            split = label_partition(options, scheme, np.asarray(labels[domain]), int(clients), rng, num_classes)
        except PartitionError as error:
            raise PartitionError(f"domain {domain!r} ({int(clients)} clients): {error}") from None
        parts += split.client_indices
        owners += [str(domain)] * split.num_clients
        params["within_domains"][str(domain)] = {"clients": int(clients), **split.params}
    if not parts:
        raise PartitionError("the layout gives no client; give at least one domain a client")
    return Partition(parts, scheme, params, client_domains=owners)


__all__ = ["ENTRY_POINT_GROUP", "LABEL_SCHEMES", "PARTITIONERS", "Partition", "PartitionError", "PartitionOptions",
           "PartitionerSpec", "REGISTRY", "ag_nid", "added_label_schemes", "label_schemes", "partition_options_class",
           "partitioner_names", "register",
           "chosen_scheme", "dirichlet", "domains", "iid", "label_partition", "longtail", "nid2", "within_domains"]
