"""The round protocol, written once for every engine.

Which clients take part in a round (a seeded draw), which injected faults
they suffer, which replies count (the method's validation), whether the round
counts (``min_clients``), what is measured (bytes and parameters sent, n_k-
weighted training metrics) and how evaluation results pool into per-domain
accuracy and AVG. An engine only moves messages: the in-process simulator
calls the method's ``fit`` directly, the Flower ServerApp sends a message to a
node and hands the reply back here. Both therefore compute the same numbers.

One round, as an engine drives it::

    current = protocol.open(round)          # participants, payload, fault draws
    for k in current.to_ask:                # clients the fault model lets answer
        ... run or ask client k ...
        current.receive(k, reply, metrics, n_k)   # or current.fail(k, reason)
    server_metrics = current.close()        # drops reported, aggregate or skip
    record = current.record(accuracy, seconds, extra)

Every random draw comes from a generator derived from ``(seed, stream, round,
client)`` (:func:`derive_seed`), so the same seed and config give the same
numbers whatever ran before and on whichever engine.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedhpro.errors import FedHProError, UpdateError
from fedhpro.metrics import payload_bytes, payload_parameters
from fedhpro.seeds import derive_seed

# stream tags: each kind of randomness gets its own stream
INIT, SAMPLE, TRAIN, SERVER, FAULT = 1, 2, 3, 4, 5


def train_generator(seed: int, round: int, client: int) -> torch.Generator:
    """Client ``client``'s batch-order generator in ``round`` (the same on every engine)."""
    return torch.Generator().manual_seed(derive_seed(seed, TRAIN, round, client))


@dataclass(frozen=True)
class Faults:
    """Injected client faults, for tests and robustness studies (seeded per round and client)."""

    dropout: float = 0.0  # probability that a sampled client does not answer
    corrupt: float = 0.0  # probability that an answering client sends NaN weights


@dataclass
class RoundRecord:
    """Everything measured in one round (one line of ``metrics.jsonl``)."""

    round: int
    participants: list[int]
    train: dict[str, float]
    server: dict[str, float]
    accuracy: dict[str, float] | None
    bytes_up: int
    bytes_down: int
    seconds: dict[str, float]
    dropped: list[dict[str, Any]] = field(default_factory=list)
    skipped: bool = False
    #: further deterministic measurements (parameters sent, per-client accuracy and fairness,
    #: FLOPs, prototype distances), written as top-level keys of the ``metrics.jsonl`` row
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The deterministic part (same seed, same numbers): a line of ``metrics.jsonl``."""
        out = {"round": self.round, "participants": self.participants, "train": self.train,
               "server": self.server, "bytes_up": self.bytes_up, "bytes_down": self.bytes_down}
        out.update(self.extra)
        if self.dropped:
            out["dropped"] = self.dropped
        if self.skipped:
            out["skipped"] = True
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        return out


class Reception(enum.Enum):
    """What became of a reply: accepted, or refused because the client's own update was invalid, or
    because a transmission fault (``faults.corrupt``) spoiled a good one. True only when accepted."""

    ACCEPTED = "accepted"
    INVALID = "invalid"
    CORRUPTED = "corrupted"

    def __bool__(self) -> bool:
        return self is Reception.ACCEPTED


def round_half_up(value: float) -> int:
    return int(np.floor(value + 0.5))


def corrupted(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply with every floating-point weight replaced by NaN (``faults.corrupt``: a transmission fault)."""
    weights = {key: torch.full_like(v, float("nan")) if v.is_floating_point() else v
               for key, v in reply.get("weights", {}).items()}
    return {**reply, "weights": weights}


def weighted_mean(metrics: Sequence[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Mean of each client metric, weighted by the clients' sample counts."""
    total = sum(n for n, _ in metrics) or 1
    names = sorted({name for _, m in metrics for name in m})
    return {name: sum(n * m.get(name, 0.0) for n, m in metrics) / total for name in names}


@dataclass(frozen=True)
class TestCount:
    """One evaluation: ``correct`` of ``total`` test samples of test set ``name`` (a domain, or ``"all"``)."""

    name: str
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return 100.0 * self.correct / max(self.total, 1)


def pool_accuracy(counts: Sequence[TestCount], order: Sequence[str] | None = None) -> dict[str, float]:
    """Accuracy in percent per test set, pooling the counts of every client tested on it
    (``100 * sum correct / sum total``, i.e. weighted by test samples), plus ``AVG``: the
    unweighted mean over test sets (the paper's AVG over domains).

    ``order``: the test sets' order in the result (default: first appearance);
    test sets without any counted sample are left out.
    """
    correct: dict[str, int] = {}
    total: dict[str, int] = {}
    for count in counts:
        correct[count.name] = correct.get(count.name, 0) + int(count.correct)
        total[count.name] = total.get(count.name, 0) + int(count.total)
    names = [name for name in (order if order is not None else correct) if total.get(name, 0) > 0]
    accuracy = {name: 100.0 * correct[name] / total[name] for name in names}
    accuracy["AVG"] = float(np.mean([accuracy[name] for name in names])) if names else float("nan")
    return accuracy


class RoundProtocol:
    """Sampling, fault draws, reply validation, drops, skipped rounds and metrics of every round.

    ``server`` is the method's server part; the protocol calls its
    ``broadcast``, ``new_replies``, ``validate_reply`` and ``aggregate``.
    ``on_drop`` receives one line per dropped client or skipped round.
    """

    def __init__(self, server: Any, num_clients: int, *, rounds: int, participation: float = 1.0, seed: int = 0,
                 eval_every: int = 1, faults: Faults | None = None, min_clients: int = 1,
                 on_drop: Callable[[str], None] | None = None):
        self.server = server
        self.num_clients = num_clients
        self.rounds = rounds
        self.participation = participation
        self.seed = seed
        self.eval_every = eval_every
        self.faults = faults or Faults()
        self.min_clients = min_clients
        self.on_drop = on_drop

    def sample_clients(self, round: int) -> list[int]:
        """The participants of ``round``: a seeded draw without replacement, sorted."""
        total = self.num_clients
        count = max(1, int(round_half_up(self.participation * total)))
        if count >= total:
            return list(range(total))
        rng = np.random.default_rng(derive_seed(self.seed, SAMPLE, round))
        return sorted(int(k) for k in rng.choice(total, size=count, replace=False))

    def evaluates(self, round: int) -> bool:
        """Whether ``round`` ends with an evaluation (every ``eval_every`` rounds and the last)."""
        return (round + 1) % self.eval_every == 0 or round + 1 == self.rounds

    def open(self, round: int) -> OpenRound:
        return OpenRound(self, round)


class OpenRound:
    """One round in progress: what to send to whom, and the replies gathered so far."""

    def __init__(self, protocol: RoundProtocol, round: int):
        self.protocol = protocol
        self.round = round
        self.started = time.perf_counter()
        self.participants = protocol.sample_clients(round)
        self.payload = protocol.server.broadcast(round)
        self.bytes_down = payload_bytes(self.payload) * len(self.participants)
        self.params_down = payload_parameters(self.payload) * len(self.participants)
        self.dropped: list[dict[str, Any]] = []
        self._corrupt: dict[int, bool] = {}
        for k in self.participants:
            draw_dropout, draw_corrupt = np.random.default_rng(derive_seed(protocol.seed, FAULT, round, k)).random(2)
            if draw_dropout < protocol.faults.dropout:
                self.dropped.append({"client": k, "reason": "did not answer (faults.dropout)"})
            else:
                self._corrupt[k] = bool(draw_corrupt < protocol.faults.corrupt)
        #: the clients to run or ask, in client order
        self.to_ask = list(self._corrupt)
        # the server's container folds each reply's weights into a running sum as it arrives (one model's
        # memory, not one per client), so uploads are measured as replies arrive
        self.replies = protocol.server.new_replies()
        self.train_metrics: list[tuple[int, dict[str, float]]] = []
        self.failures: list[Exception | str] = []
        self.bytes_up = 0
        self.params_up = 0
        self.skipped = False

    def fail(self, client: int, reason: str, error: Exception | None = None) -> None:
        """Client ``client`` gave no usable reply (it raised, or none came in time): it is dropped."""
        self.dropped.append({"client": client, "reason": reason})
        self.failures.append(error if error is not None else f"client {client}: {reason}")

    def receive(self, client: int, reply: dict[str, Any], metrics: dict[str, float], num_samples: int) -> Reception:
        """Hand in client ``client``'s reply: injected corruption, the method's validation, then the
        fold into the round's replies. Returns whether it counts (a :class:`Reception`, true only when
        accepted) and, when not, whose fault it was: the client's own update (``INVALID``: an engine
        rolls the client's state back) or a transmission fault (``CORRUPTED``: the client computed a
        good update, so its state stands)."""
        reception = Reception.ACCEPTED
        if self._corrupt[client]:
            try:  # the client's own update, before transit: its faults are the client's
                self.protocol.server.validate_reply(reply)
            except UpdateError as error:
                self.dropped.append({"client": client, "reason": f"invalid update: {error}"})
                return Reception.INVALID
            reply, reception = corrupted(reply), Reception.CORRUPTED
        try:
            self.protocol.server.validate_reply(reply)
        except UpdateError as error:
            self.dropped.append({"client": client, "reason": f"invalid update: {error}"})
            return Reception.INVALID if reception is Reception.ACCEPTED else reception
        self.bytes_up += payload_bytes(reply)
        self.params_up += payload_parameters(reply)
        self.replies.append(reply)
        self.train_metrics.append((int(num_samples), metrics))
        return Reception.ACCEPTED

    def close(self, observe: contextlib.AbstractContextManager | None = None) -> dict[str, float]:
        """After the last reply: report the drops, then aggregate, or skip a round with fewer than
        ``min_clients`` valid replies (the global model is kept). ``observe`` wraps the server step
        (a FLOP counter). Raises when every participant failed: that is a bug or a setting, not a fault."""
        protocol = self.protocol
        position = {k: i for i, k in enumerate(self.participants)}
        self.dropped.sort(key=lambda item: position[item["client"]])
        if self.failures and len(self.failures) == len(self.participants):
            first = self.failures[0]
            if isinstance(first, Exception):
                raise first
            raise FedHProError(f"round {self.round}: every client failed; {first}")
        if protocol.on_drop is not None:
            for item in self.dropped:
                protocol.on_drop(f"round {self.round}: client {item['client']} dropped: {item['reason']}")
        self.skipped = len(self.replies) < protocol.min_clients
        if self.skipped:
            if protocol.on_drop is not None:
                protocol.on_drop(f"round {self.round}: only {len(self.replies)} valid updates "
                                 f"(min_clients={protocol.min_clients}); the round is skipped and the global "
                                 "model kept")
            return {}
        with observe if observe is not None else contextlib.nullcontext():
            return protocol.server.aggregate(self.round, self.replies)

    def record(self, server_metrics: dict[str, float], accuracy: dict[str, float] | None,
               seconds: dict[str, float], extra: dict[str, Any] | None = None) -> RoundRecord:
        """The round's row: what the protocol measured plus the engine's accuracy, times and extras."""
        return RoundRecord(round=self.round, participants=self.participants, train=weighted_mean(self.train_metrics),
                           server=server_metrics, accuracy=accuracy, bytes_up=self.bytes_up,
                           bytes_down=self.bytes_down, seconds=seconds, dropped=self.dropped, skipped=self.skipped,
                           extra={"params_up": self.params_up, "params_down": self.params_down, **(extra or {})})
