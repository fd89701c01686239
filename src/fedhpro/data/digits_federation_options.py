"""The declaration of ``dataset=digits-offline`` (its ``data.*`` options), without torch: a config reads it before
torch loads (the data set's code: :mod:`fedhpro.data.digits_federation`)."""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.data.spec import DatasetDeclaration
from fedhpro.options import option

#: the paper's Digits layout: clients of each domain, in the paper's order of the domains
PAPER_CLIENTS = {"mnist": 3, "optdigits": 7, "mnistm": 6, "syn": 4}


def _paper_clients() -> dict[str, int]:
    return dict(PAPER_CLIENTS)


def _paper_domains() -> list[str]:
    return list(PAPER_CLIENTS)


@dataclass
class DigitsOfflineOptions:
    domains: list[str] = option(
        default_factory=_paper_domains,
        help="the domains of the federation (any of mnist, optdigits, mnistm, syn); clients, test sets and AVG "
             "cover only these")
    clients_per_domain: dict[str, int] = option(
        default_factory=_paper_clients,
        help="clients of each domain (the paper's Digits layout); `clients=K` spreads K evenly instead")
    fraction: float = option(0.1, gt=0.0, max=1.0,
                             help="share of its domain's training set each client samples (partition=domains; "
                                  "label partitions split the whole domain)")
    test_fraction: float = option(0.2, gt=0.0, max=0.9, help="share of each domain held out for testing")
    syn_size: int = option(5000, min=100, help="number of rendered synthetic digits")
    build_seed: int = option(0, help="seed of the data set itself (images, train/test split); the run seed "
                                     "only changes which samples each client gets")


DECLARATION = DatasetDeclaration(
    name="digits-offline",
    options=DigitsOfflineOptions,
    description="four digit domains built offline: mnist, optdigits, syn, mnistm (stand-ins for MNIST, USPS, SYN, "
                "SVHN); partition=domains (default) or dirichlet/nid2/iid/longtail within each domain",
)

__all__ = ["DECLARATION", "DigitsOfflineOptions", "PAPER_CLIENTS"]
