"""``digits-offline``: the paper's Digits domain-skew federation on data that needs no download.

Clients are assigned to domains as in the paper's Digits setup (Table A3:
MNIST 3, USPS 7, SVHN 6, SYN 4 clients); here the stand-ins are mnist 3,
optdigits 7, mnistm 6, syn 4. Each client takes a random ``fraction`` of its
domain's training set, disjoint from the other clients of that domain.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedhpro.data import DatasetSpec
from fedhpro.data.federation import ClientData, Federation, normalize_images
from fedhpro.errors import ConfigError, DataError
from fedhpro.options import option

PAPER_CLIENTS = {"mnist": 3, "optdigits": 7, "mnistm": 6, "syn": 4}


def _paper_clients() -> dict[str, int]:
    return dict(PAPER_CLIENTS)


@dataclass
class DigitsOfflineOptions:
    clients_per_domain: dict[str, int] = option(
        default_factory=_paper_clients,
        help="clients of each domain (the paper's Digits layout); `clients=K` spreads K evenly instead")
    fraction: float = option(0.1, gt=0.0, max=1.0, help="share of its domain's training set each client samples")
    test_fraction: float = option(0.2, gt=0.0, max=0.9, help="share of each domain held out for testing")
    syn_size: int = option(5000, min=100, help="number of rendered synthetic digits")
    build_seed: int = option(0, help="seed of the data set itself (images, train/test split); the run seed "
                                     "only changes which samples each client gets")


def build(options: DigitsOfflineOptions, clients: int | None, seed: int, data_dir=None,
          progress: bool = False, partition=None) -> Federation:
    from fedhpro.data.digits_offline import DOMAINS, build_digits_offline, default_data_dir

    if partition is not None and partition.scheme not in ("auto", "domains"):
        raise ConfigError(f"partition={partition.scheme} does not apply to digits-offline (a domain-skew "
                          "federation); use partition=domains (the default) or a label-skew benchmark such as "
                          "dataset=cifar10")

    try:
        domains = build_digits_offline(data_dir, seed=options.build_seed, test_fraction=options.test_fraction,
                                       syn_size=options.syn_size, progress=progress)
    except OSError as error:
        raise DataError(f"cannot build or cache digits-offline under {data_dir or default_data_dir()!s} "
                        f"({error.strerror or error}); set data_dir= to a writable folder") from None
    layout = dict(options.clients_per_domain)
    unknown = set(layout) - set(DOMAINS)
    if unknown:
        raise ConfigError(f"data.clients_per_domain names unknown domains {sorted(unknown)}; "
                          f"the domains are: {', '.join(DOMAINS)}")
    if clients is not None:
        # spread K clients over the domains in the paper's order, round robin
        order = [d for d in PAPER_CLIENTS if d in DOMAINS]
        layout = {d: 0 for d in order}
        for k in range(clients):
            layout[order[k % len(order)]] += 1
    layout = {d: n for d, n in layout.items() if n > 0}
    if not layout:
        raise ConfigError("digits-offline needs at least one client; set clients=K or data.clients_per_domain")

    if partition is not None and partition.load:
        return _loaded(partition.load, domains, options)
    rng = np.random.default_rng(seed if partition is None or partition.seed is None else partition.seed)
    client_data, client_domains, records = [], [], []
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
            index_t = torch.from_numpy(index)
            y = data.train_y[index_t]
            client_data.append(ClientData(normalize_images(data.train_x[index_t]), y.clone(), 10))
            client_domains.append(domain)
            records.append({"client": len(records), "domain": domain, "indices": index.tolist(),
                            "class_counts": torch.bincount(y, minlength=10).tolist()})
    test_sets = {d: (normalize_images(domains[d].test_x), domains[d].test_y.clone()) for d in layout}
    partition = {"dataset": "digits-offline", "seed": seed, "scheme": "domains",
                 "layout": layout, "fraction": options.fraction, "clients": records}
    return Federation("digits-offline", 10, (3, 32, 32), client_data, client_domains, test_sets, partition)


def _loaded(path: str, domains: dict, options: DigitsOfflineOptions) -> Federation:
    """The federation of a saved ``partition.json`` (``partition.load=PATH``): same clients, same samples."""
    from pathlib import Path

    from fedhpro.data.partition import Partition

    if not Path(path).expanduser().is_file():
        raise ConfigError(f"partition.load={path!r}: no such file; give the partition.json of an earlier run")
    sizes = {d: int(v.train_y.shape[0]) for d, v in domains.items()}
    split = Partition.load(Path(path).expanduser(), num_samples=sizes)
    if split.client_domains is None:
        raise ConfigError(f"partition.load={path!r} has no client domains; digits-offline needs a domains partition")
    client_data, records = [], []
    for k, (index, domain) in enumerate(zip(split.client_indices, split.client_domains)):
        index_t = torch.from_numpy(index)
        y = domains[domain].train_y[index_t]
        client_data.append(ClientData(normalize_images(domains[domain].train_x[index_t]), y.clone(), 10))
        records.append({"client": k, "domain": domain, "indices": index.tolist(),
                        "class_counts": torch.bincount(y, minlength=10).tolist()})
    used = [d for d in PAPER_CLIENTS if d in set(split.client_domains)]
    test_sets = {d: (normalize_images(domains[d].test_x), domains[d].test_y.clone()) for d in used}
    record = {"dataset": "digits-offline", "seed": None, "scheme": "domains", "loaded_from": str(path),
              "layout": {d: split.client_domains.count(d) for d in used}, "fraction": options.fraction,
              "clients": records}
    return Federation("digits-offline", 10, (3, 32, 32), client_data, list(split.client_domains), test_sets, record)


DATASET = DatasetSpec(
    name="digits-offline",
    options=DigitsOfflineOptions,
    build=build,
    description="four digit domains built offline: mnist, optdigits, syn, mnistm (stand-ins for MNIST, USPS, SYN, SVHN)",
)
