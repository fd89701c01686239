"""``digits-offline``: the paper's Digits domain-skew federation on data that needs no download.

Clients are assigned to domains as in the paper's Digits setup (Table A3:
MNIST 3, USPS 7, SVHN 6, SYN 4 clients); here the stand-ins are mnist 3,
optdigits 7, mnistm 6, syn 4. ``data.domains`` keeps any subset of them.

Two ways to split a domain among its clients:

* ``partition=domains`` (the default, domain skew): each client takes a
  random ``data.fraction`` of its domain's training set, disjoint from the
  other clients of that domain (per domain in the paper's order:
  ``rng.permutation`` of the domain, the first ``size`` indices to its first
  client, the next ``size`` to the second, ...).
* ``partition=dirichlet|nid2|iid|longtail`` (label or quantity skew on top
  of the domains): the scheme splits each domain's WHOLE training set among
  that domain's clients (:func:`fedhpro.data.partition.within_domains`);
  ``data.fraction`` is not used. With one domain
  (``data.domains=[mnist]``) this is the plain label partition of that
  domain. ``longtail`` first trims a domain whose classes differ in size to
  its smallest class (optdigits: 139-146 per class), so the head-to-tail
  rule ``n_c = floor(n_max * rho ** (-c / 9))`` applies to every class.

Evaluation stays per domain: one test set per domain that has clients, and
AVG over those domains.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedhpro.bounded import read_json_file
from fedhpro.data.digits_federation_options import DECLARATION, PAPER_CLIENTS, DigitsOfflineOptions
from fedhpro.data.federation import (
    Augment,
    ClientData,
    CompactClientData,
    Federation,
    domains_without_clients_note,
    normalize_images,
)
from fedhpro.data.partition import (
    Partition,
    PartitionError,
    PartitionOptions,
    added_label_schemes,
    within_domains,
)
from fedhpro.data.pixels import CompactImages
from fedhpro.data.spec import DatasetSpec, half_range_image
from fedhpro.errors import ConfigError, DataError

#: ``partition=`` schemes this data set accepts (``auto`` means ``domains``)
SCHEMES = ("domains", "dirichlet", "nid2", "iid", "longtail")

#: what to change when a label scheme cannot split a domain (appended to the partitioner's message)
_FIXES = {
    "dirichlet": "set partition.min_size lower or partition.alpha higher, give the domain fewer clients "
                 "(clients=K or data.clients_per_domain), or leave it out with data.domains",
    "longtail": "set partition.rho or partition.min_size lower or partition.alpha higher, give the domain fewer "
                "clients (clients=K or data.clients_per_domain), or leave it out with data.domains",
    "nid2": "give every domain at least 2 clients and more than partition.single_class_clients "
            "(clients=K or data.clients_per_domain), or leave the domain out with data.domains",
    "iid": "give the domain fewer clients (clients=K or data.clients_per_domain)",
}


def chosen_domains(names: list[str]) -> list[str]:
    """``data.domains`` checked and put in the paper's order (mnist, optdigits, mnistm, syn)."""
    unknown = [d for d in names if d not in PAPER_CLIENTS]
    if unknown:
        raise ConfigError(f"data.domains names unknown domain(s) {unknown}; the domains are: "
                          f"{', '.join(PAPER_CLIENTS)} (e.g. data.domains=[mnist,syn])")
    if not names:
        raise ConfigError(f"data.domains is empty; list at least one of: {', '.join(PAPER_CLIENTS)}")
    return [d for d in PAPER_CLIENTS if d in names]


def client_layout(clients_per_domain: dict[str, int], domains: list[str], clients: int | None) -> dict[str, int]:
    """Domain -> number of clients, domains without a client left out.

    ``clients=K`` spreads K clients round robin over ``domains`` (in the
    paper's order); otherwise ``clients_per_domain`` restricted to ``domains``
    (in its own order, as before ``data.domains`` existed).
    """
    layout = dict(clients_per_domain)
    unknown = set(layout) - set(PAPER_CLIENTS)
    if unknown:
        raise ConfigError(f"data.clients_per_domain names unknown domains {sorted(unknown)}; "
                          f"the domains are: {', '.join(PAPER_CLIENTS)}")
    if clients is not None:
        layout = {d: 0 for d in domains}
        for k in range(clients):
            layout[domains[k % len(domains)]] += 1
    return {d: n for d, n in layout.items() if n > 0 and d in domains}


def build(options: DigitsOfflineOptions, clients: int | None, seed: int, data_dir=None,
          progress: bool = False, partition=None) -> Federation:
    from fedhpro.data.digits_offline import build_digits_offline, default_data_dir

    scheme = "domains" if partition is None or partition.scheme == "auto" else partition.scheme
    allowed = (*SCHEMES, *added_label_schemes())  # and every registered or installed label-skew partitioner
    if scheme not in allowed:
        raise ConfigError(f"partition={scheme} does not apply to digits-offline; choose one of: domains (the "
                          f"default, domain skew), {', '.join(allowed[1:])} (label skew within each domain)")
    chosen = chosen_domains(options.domains)
    layout = client_layout(options.clients_per_domain, chosen, clients)
    loading = partition is not None and partition.load
    if not layout and not loading:
        raise ConfigError(f"digits-offline needs at least one client and data.clients_per_domain gives none to "
                          f"data.domains={chosen}; set clients=K or data.clients_per_domain")

    try:
        domains = build_digits_offline(data_dir, seed=options.build_seed, test_fraction=options.test_fraction,
                                       syn_size=options.syn_size, progress=progress)
    except OSError as error:
        raise DataError(f"cannot build or cache digits-offline under {data_dir or default_data_dir()!s} "
                        f"({error.strerror or error}); set data_dir= to a writable folder") from None

    if loading:
        return _loaded(partition.load, domains, options, chosen)
    rng = np.random.default_rng(seed if partition is None or partition.seed is None else partition.seed)
    if scheme == "domains":
        federation = _domain_skew(domains, layout, options, rng, seed)
    else:
        federation = _label_skew(domains, layout, scheme, partition, rng,
                                 seed if partition.seed is None else partition.seed)
    # a domain of data.domains without a client is neither trained on nor tested: said, never silent
    zero = [d for d, n in options.clients_per_domain.items() if n == 0] if clients is None else []
    kept = ",".join(d for d in chosen if d in layout)
    dropped = domains_without_clients_note("digits-offline", chosen, layout, clients, zero,
                                           f"choose the domains with data.domains=[{kept}]")
    if dropped:
        federation.notes.append(dropped)
    return federation


class DomainRows(CompactClientData):
    """A client's ``rows`` of its domain's uint8 training ``images``, gathered at each access instead of
    copied: a domain's clients share its one tensor (mapped from the cache file, so only the rows that train
    become resident). The pixels, and so the floats, are those of a copy, to the bit."""

    def __init__(self, images: Tensor, rows: Tensor, y: Tensor, num_classes: int,
                 decode: Callable[[Tensor], Tensor], augment: Augment | None = None):
        if images.dtype != torch.uint8:
            raise DataError(f"a client's domain rows are uint8 pixels, got {images.dtype}")
        self.images, self.rows, self.decode = images, rows, decode
        self.y, self.num_classes, self.augment = y, num_classes, augment

    @property
    def pixels(self) -> Tensor:
        return self.images[self.rows]

    @pixels.setter
    def pixels(self, value: Tensor) -> None:
        raise AttributeError("a client's domain rows are read-only: build a CompactClientData of its pixels")

    def to(self, device: torch.device | str) -> ClientData:
        if self.images.device == torch.device(device):
            return self
        # another device holds this client's rows only, as a copy (a domain's tensor is not moved per client)
        return CompactClientData(self.pixels.to(device), self.y.to(device), self.num_classes, self.decode,
                                 self.augment)

    def select(self, index: Tensor) -> ClientData:
        return DomainRows(self.images, self.rows[index], self.y[index], self.num_classes, self.decode, self.augment)

    def with_augment(self, augment: Augment | None) -> ClientData:
        return DomainRows(self.images, self.rows, self.y, self.num_classes, self.decode, augment)


def _client(data: Any, index: np.ndarray) -> tuple[ClientData, list[int]]:
    """Client data of the training ``index`` rows of a domain, and its class counts."""
    index_t = torch.from_numpy(index)
    y = data.train_y[index_t]
    return (DomainRows(data.train_x, index_t, y.clone(), 10, normalize_images),
            torch.bincount(y, minlength=10).tolist())


def _test_sets(domains: dict, names) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    # held as uint8 and decoded a batch at a time: float32 test sets were 4x the memory
    return {d: (CompactImages(domains[d].test_x, normalize_images), domains[d].test_y.clone()) for d in names}


def _domain_skew(domains: dict, layout: dict[str, int], options: DigitsOfflineOptions, rng: np.random.Generator,
                 seed: int) -> Federation:
    """``partition=domains``: per domain (paper order) a permutation; client j takes its j-th block of ``size``."""
    client_data: list[ClientData] = []
    client_domains: list[str] = []
    records: list[dict[str, Any]] = []
    for domain in [d for d in PAPER_CLIENTS if d in layout]:
        data = domains[domain]
        available = int(data.train_y.shape[0])
        size = int(options.fraction * available)
        needed = size * layout[domain]
        if size < 2:
            raise ConfigError(f"data.fraction={options.fraction} gives clients of domain {domain} fewer than 2 "
                              f"samples (it has {available}); raise data.fraction")
        if needed > available:
            raise ConfigError(f"{layout[domain]} clients x data.fraction={options.fraction} of domain {domain} need "
                              f"{needed} samples but it has {available}; lower data.fraction or the client count")
        order = rng.permutation(available)
        for j in range(layout[domain]):
            index = np.sort(order[j * size:(j + 1) * size])
            client, counts = _client(data, index)
            client_data.append(client)
            client_domains.append(domain)
            records.append({"client": len(records), "domain": domain, "indices": index.tolist(),
                            "class_counts": counts})
    partition = {"dataset": "digits-offline", "seed": seed, "scheme": "domains",
                 "layout": layout, "fraction": options.fraction, "clients": records}
    return Federation("digits-offline", 10, (3, 32, 32), client_data, client_domains, _test_sets(domains, layout),
                      partition)


def balanced_subset(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices keeping ``min_c count_c`` random samples of every class (all of them if already equal).

    ``longtail`` keeps ``floor(n_max * rho ** (-c / 9))`` of class c with
    ``n_max`` the largest class, so class 0 must be a largest class: on a
    domain whose classes differ a little (optdigits) the rule is applied to
    this balanced subset. A balanced domain (mnist) draws nothing from ``rng``.
    """
    counts = np.bincount(labels, minlength=10)
    if counts.min() == counts.max():
        return np.arange(labels.shape[0], dtype=np.int64)
    keep = [rng.choice(np.flatnonzero(labels == c), size=int(counts.min()), replace=False) for c in range(10)]
    return np.sort(np.concatenate(keep)).astype(np.int64)


def _label_skew(domains: dict, layout: dict[str, int], scheme: str, options: PartitionOptions,
                rng: np.random.Generator, seed: int) -> Federation:
    """``partition=dirichlet|nid2|iid|longtail``: the scheme within each domain, over its whole training set."""
    layout = {d: layout[d] for d in PAPER_CLIENTS if d in layout}
    labels = {d: domains[d].train_y.numpy().astype(np.int64) for d in layout}
    pools = {d: (balanced_subset(y, rng) if scheme == "longtail" else np.arange(y.shape[0], dtype=np.int64))
             for d, y in labels.items()}
    try:
        inner = within_domains({d: labels[d][pools[d]] for d in layout}, layout, scheme, options, rng,
                               num_classes=10)
    except PartitionError as error:
        raise ConfigError(f"digits-offline partition={scheme}: {str(error).rstrip('.')}; "
                          f"to fix: {_FIXES[scheme]}") from None
    owners = inner.client_domains
    assert owners is not None, "within_domains records every client's domain"
    # back from each domain's pool to its whole training set
    split = Partition([pools[d][ix] for ix, d in zip(inner.client_indices, owners)], scheme,
                      inner.params, client_domains=owners)
    client_data = [_client(domains[d], ix)[0] for ix, d in zip(split.client_indices, owners)]
    record = {"dataset": "digits-offline", "layout": layout, **split.to_json(labels, 10, seed)}
    notes = [f"digits-offline: {scheme} partition within each domain: "
             + ", ".join(f"{d} {n} clients" for d, n in layout.items())]
    trimmed = {d: int(len(pools[d]) // 10) for d in layout if len(pools[d]) < len(labels[d])}
    if trimmed:
        record["balanced_per_class"] = trimmed
        notes.append("longtail: classes first trimmed to the smallest class of their domain ("
                     + ", ".join(f"{d} {n}" for d, n in trimmed.items()) + " per class)")
    return Federation("digits-offline", 10, (3, 32, 32), client_data, list(owners),
                      _test_sets(domains, layout), record, notes)


def _loaded(path: str, domains: dict, options: DigitsOfflineOptions, chosen: list[str]) -> Federation:
    """The federation of a saved ``partition.json`` (``partition.load=PATH``): same clients, same samples."""
    from pathlib import Path

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"partition.load={path!r}: no such file; give the partition.json of an earlier run")
    sizes = {d: int(v.train_y.shape[0]) for d, v in domains.items()}
    split = Partition.load(file, num_samples=sizes)
    if split.client_domains is None:
        raise ConfigError(f"partition.load={path!r} has no client domains; digits-offline needs a partition with "
                          "a domain per client (one saved by a digits-offline run)")
    left_out = sorted(set(split.client_domains) - set(chosen))
    if left_out:
        raise ConfigError(f"partition.load={path!r} has clients of domain(s) {left_out}, which "
                          f"data.domains={chosen} leaves out; add them to data.domains or load another partition")
    client_data, records = [], []
    for k, (index, domain) in enumerate(zip(split.client_indices, split.client_domains)):
        client, counts = _client(domains[domain], index)
        client_data.append(client)
        records.append({"client": k, "domain": domain, "indices": index.tolist(), "class_counts": counts})
    used = [d for d in PAPER_CLIENTS if d in set(split.client_domains)]
    saved = read_json_file(file, DataError)  # read and checked once already: its seed, bounded all the same
    seed = saved.get("seed") if isinstance(saved, dict) else None
    record: dict[str, Any] = {"dataset": "digits-offline", "seed": seed,
                              "scheme": split.scheme, "loaded_from": str(path),
                              "layout": {d: split.client_domains.count(d) for d in used}}
    if split.scheme == "domains":
        record["fraction"] = options.fraction
    else:
        record["params"] = split.params
    record["clients"] = records
    return Federation("digits-offline", 10, (3, 32, 32), client_data, list(split.client_domains),
                      _test_sets(domains, used), record)


def image_input(options: DigitsOfflineOptions, partition: Mapping[str, Any], size: int) -> dict[str, Any]:
    """A new image as this data set's input: scaled to [-1, 1], never resized (only 32 x 32 images fit)."""
    return half_range_image("digits-offline", size, resize=False)


DATASET = DatasetSpec.of(DECLARATION, build, image_input)
