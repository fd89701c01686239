"""A validation part of every client's training data (``validation=<share>``), held apart from the test set.

Model selection (the reported "best" round, a tuned hyperparameter) must not look at the test set. With
``validation > 0`` each client gives up ``share`` of its training samples, class by class (stratified: of
a class's ``n`` samples, ``round(share * n)`` are held out, never the class's last training sample), drawn
from a generator of its own (the run's seed and the client's index), so a client's split does not depend
on the others' and a Flower node that holds only its own data draws the same one. The held-out samples
never train; the run tests the global (or personal) model on them beside the test set, pooled per test
set and averaged as the test figures are (``metrics.jsonl``'s ``validation``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from fedhpro.data.federation import ClientData, Federation
from fedhpro.errors import ConfigError

#: the generator stream of the validation draw (any fixed number apart from the run's other streams)
VALIDATION_STREAM = 0x76616C

#: the largest share ``validation=`` takes: at least half of every class stays to train on
MAX_SHARE = 0.5


def held_out_positions(labels: Tensor, share: float, seed: int, client: int) -> np.ndarray:
    """The positions (sorted) of a client's ``labels`` its validation part takes: per class of ``n`` samples
    ``min(round(share * n), n - 1)`` of them (half up), drawn without replacement by
    ``numpy.random.default_rng([seed, VALIDATION_STREAM, client])``, class by class in label order."""
    y = labels.detach().cpu().numpy()
    rng = np.random.default_rng([seed, VALIDATION_STREAM, client])
    held = []
    for c in np.unique(y):
        where = np.flatnonzero(y == c)
        count = min(int(np.floor(share * len(where) + 0.5)), len(where) - 1)
        if count > 0:
            held.append(rng.choice(where, size=count, replace=False))
    return np.sort(np.concatenate(held)) if held else np.empty(0, dtype=np.int64)


def hold_out_validation(federation: Federation, share: float, seed: int) -> Federation:
    """``federation`` with each client's validation part (:func:`held_out_positions`) taken out of its
    training data into ``client_validation``; the partition record gains ``validation`` (the share, and per
    client the held-out positions within its training data and their class counts) and the notes say what
    was held out. ``share == 0``: ``federation`` unchanged."""
    if share <= 0:
        return federation
    if share >= MAX_SHARE:
        raise ConfigError(f"validation={share} holds out too much; give a share below {MAX_SHARE} (e.g. "
                          "validation=0.1: a tenth of each client's training data)")
    clients: list[ClientData] = []
    parts: list[tuple[Tensor, Tensor]] = []
    record = []
    for k, data in enumerate(federation.clients):
        held = held_out_positions(data.y, share, seed, k)
        keep = np.setdiff1d(np.arange(len(data)), held)
        held_t, keep_t = torch.from_numpy(held).to(data.y.device), torch.from_numpy(keep).to(data.y.device)
        clients.append(data.select(keep_t))
        parts.append((data.x[held_t], data.y[held_t]))
        record.append({"client": k, "positions": held.tolist(),
                       "class_counts": torch.bincount(data.y[held_t].cpu(), minlength=data.num_classes).tolist()})
    total = sum(int(y.shape[0]) for _, y in parts)
    without = [k for k, (_, y) in enumerate(parts) if not y.numel()]
    notes = [f"validation: {share:g} of each client's training data held out, class by class ({total} samples in "
             "all); they never train, and the best round is chosen on them, not on the test set"]
    if without:
        shown = ", ".join(str(k) for k in without[:10]) + (", ..." if len(without) > 10 else "")
        notes.append(f"validation: clients {shown} hold too few samples of every class to give any "
                     "(a class's last training sample stays); they have no validation part")
    partition = {**federation.partition, "validation": {"share": share, "seed": seed, "clients": record}}
    return dataclasses.replace(federation, clients=clients, client_validation=parts, partition=partition,
                               notes=[*federation.notes, *notes])


__all__ = ["MAX_SHARE", "hold_out_validation", "held_out_positions"]
