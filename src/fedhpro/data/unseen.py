"""Clients that never train (``unseen_clients=<share>``, ``unseen_domain=<name>``): how well the federation's
model serves a site that joins after training, the new-client protocol of personalised FL and, for domain
federations, leave-one-domain-out.

The unseen clients are taken out of the federation before the first round: they are never sampled, never
receive a round, and their data reach no one. What is kept of them is what testing them needs:

* ``unseen_clients=<share>``: ``max(1, round(share * K))`` clients (at most ``K - 1``), drawn by the run's seed;
  each is tested on its own test split where the federation arrives split, else on test samples of its
  domain's test set drawn to follow its training labels (:mod:`fedhpro.data.matched_tests`: under label
  skew the shared test set would give every client the headline's number);
* ``unseen_domain=<name>``: every client of that domain; the domain's test set leaves the headline (the
  accuracy per domain and AVG are then over the seen domains) and is the unseen clients' test.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from fedhpro.data.federation import Federation, UnseenClients
from fedhpro.data.matched_tests import matched_positions
from fedhpro.errors import ConfigError

#: the generator stream of the unseen clients' draw
UNSEEN_STREAM = 0x756E73


def unseen_indices(num_clients: int, share: float, seed: int) -> list[int]:
    """The clients ``unseen_clients=share`` holds out: ``max(1, round(share * K))`` (half up, at most K - 1) of
    ``range(K)``, drawn by ``numpy.random.default_rng([seed, UNSEEN_STREAM])``; sorted."""
    count = min(max(1, int(np.floor(share * num_clients + 0.5))), num_clients - 1)
    rng = np.random.default_rng([seed, UNSEEN_STREAM])
    return sorted(int(k) for k in rng.choice(num_clients, size=count, replace=False))


def hold_out_clients(federation: Federation, share: float, domain: str | None, seed: int) -> Federation:
    """``federation`` without its unseen clients, which go to ``unseen`` (:class:`UnseenClients`); the
    partition record gains ``unseen`` (their indices and names) and the notes say who was held out.
    Neither set: ``federation`` unchanged. One ConfigError where nothing or everything would be held out."""
    if share <= 0 and domain is None:
        return federation
    if share > 0 and domain is not None:
        raise ConfigError("unseen_clients and unseen_domain both set; hold out a share of the clients or one "
                          "domain, not both")
    k_total = federation.num_clients
    if k_total < 2:
        raise ConfigError("unseen clients need at least 2 clients: one to train, one held out")
    names = federation.client_names or [f"client {k}" for k in range(k_total)]
    domains = federation.client_domains or [""] * k_total
    if domain is not None:
        held = [k for k in range(k_total) if domains[k] == domain]
        known = sorted({d for d in domains if d})
        if not held:
            raise ConfigError(f"unseen_domain={domain}: no client belongs to it; the domains are "
                              f"{', '.join(known) or 'none (this federation has no domains)'}")
        if len(held) == k_total:
            raise ConfigError(f"unseen_domain={domain}: every client belongs to it, none would train; hold out "
                              f"another domain ({', '.join(known)})")
    else:
        held = unseen_indices(k_total, share, seed)
    kept = [k for k in range(k_total) if k not in held]
    tests: list[tuple[Tensor, Tensor]] = []
    groups: list[str] = []
    test_sets = dict(federation.test_sets)
    for k in held:
        group = federation.client_test_name(k)
        groups.append((domains[k] or "all") if federation.client_tests is not None or domain is not None else group)
        if federation.client_tests is not None:
            tests.append(federation.client_tests[k])
        elif domain is not None:
            tests.append(federation.test_sets[domain] if domain in federation.test_sets else _empty(federation))
        else:
            x, y = federation.test_sets.get(group) or _joined(federation)
            where = torch.from_numpy(matched_positions(federation.clients[k].y, y, federation.num_classes, seed, k))
            tests.append((x[where.to(y.device)], y[where.to(y.device)]))
    if domain is not None:
        test_sets.pop(domain, None)  # the held-out domain leaves the headline
    unseen = UnseenClients([federation.clients[k] for k in held], [names[k] for k in held], groups, tests)
    note = (f"unseen: {len(held)} of {k_total} clients never train ({', '.join(names[k] for k in held[:8])}"
            f"{', ...' if len(held) > 8 else ''}"
            + (f"; the whole domain {domain}, whose test set leaves the accuracy per domain and AVG" if domain else
               "; each tested on its own test data or on test samples that follow its training labels")
            + "); metrics.jsonl's unseen is the global model on them")
    notes = [*federation.notes, note, *_untrained_after(federation, kept, [*test_sets.values(), *tests])]
    partition = dict(federation.partition)
    records = partition.get("clients")
    held_records = []
    if isinstance(records, list) and len(records) == k_total:  # the record stays aligned with the clients
        partition["clients"] = [records[k] for k in kept]
        held_records = [records[k] for k in held]
    partition["unseen"] = {"clients": held, "names": [names[k] for k in held],
                           **({"domain": domain} if domain else {"share": share}), "records": held_records}
    return dataclasses.replace(
        federation, clients=[federation.clients[k] for k in kept],
        client_domains=[domains[k] for k in kept] if federation.client_domains else federation.client_domains,
        client_names=[names[k] for k in kept] if federation.client_names else None,
        client_tests=[federation.client_tests[k] for k in kept] if federation.client_tests is not None else None,
        test_sets=test_sets, partition=partition, notes=notes, unseen=unseen)


def _untrained_after(federation: Federation, kept: list[int], tests: list[tuple[Tensor, Tensor]]) -> list[str]:
    """A warning naming the classes tested (headline, the kept clients' and the unseen clients' tests) that no
    kept client trains: only held-out clients held them, so the model never learns them and their test
    samples count as errors. Held-out clients are meant to differ, so this is said, not refused."""
    trained = {int(c) for k in kept for c in torch.unique(federation.clients[k].y).tolist()}
    kept_tests = [federation.client_tests[k] for k in kept] if federation.client_tests is not None else []
    tested = {int(c) for _, y in [*tests, *kept_tests] if len(y) for c in torch.unique(y).tolist()}
    untrained = sorted(tested - trained)
    if not untrained:
        return []
    names = federation.partition.get("classes")
    shown = [repr(str(names[c])) if isinstance(names, list) and c < len(names) else str(c) for c in untrained]
    listed = ", ".join(shown[:10]) + (", ..." if len(shown) > 10 else "")
    return [f"warning: unseen: class{'es' if len(untrained) > 1 else ''} {listed}: no training client holds "
            f"{'them' if len(untrained) > 1 else 'it'} once the unseen clients are held out, so the model never "
            "learns it and its test samples count as errors; hold out other clients (another seed) or fewer"]


def _joined(federation: Federation) -> tuple[Tensor, Tensor]:
    return (torch.cat([x for x, _ in federation.test_sets.values()]),
            torch.cat([y for _, y in federation.test_sets.values()]))


def _empty(federation: Federation) -> tuple[Tensor, Tensor]:
    x, _ = next(iter(federation.test_sets.values()))
    return x[:0], torch.empty(0, dtype=torch.int64)


__all__ = ["hold_out_clients", "unseen_indices"]
