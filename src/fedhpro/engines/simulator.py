"""The in-process simulator: all clients in one process, data resident as tensors.

One round: sample the participants (seeded), broadcast the server's payload,
run each participant's ``fit`` on a reused working model, aggregate the
replies, evaluate the global model every ``eval_every`` rounds. Every random
draw comes from a generator derived from ``(seed, round, client)``, so the
same seed and config give the same numbers on the CPU, whatever ran before.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor, nn

from fedhpro.data.federation import Federation
from fedhpro.methods.base import MethodContext, MethodSpec, TrainSettings, payload_bytes


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts (independent streams for rounds and clients)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


# stream tags: each kind of randomness gets its own stream
_INIT, _SAMPLE, _TRAIN, _SERVER = 1, 2, 3, 4


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

    def to_json(self) -> dict[str, Any]:
        """The deterministic part (same seed, same numbers): a line of ``metrics.jsonl``."""
        out = {"round": self.round, "participants": self.participants, "train": self.train,
               "server": self.server, "bytes_up": self.bytes_up, "bytes_down": self.bytes_down}
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        return out


@torch.no_grad()
def evaluate(model: nn.Module, test_sets: dict[str, tuple[Tensor, Tensor]], batch_size: int = 1024) -> dict[str, float]:
    """Accuracy in percent on each test set, plus ``AVG``, their unweighted mean (the paper's AVG)."""
    model.eval()
    accuracy = {}
    for name, (x, y) in test_sets.items():
        correct = 0
        for start in range(0, x.shape[0], batch_size):
            correct += int((model(x[start:start + batch_size]).argmax(1) == y[start:start + batch_size]).sum())
        accuracy[name] = 100.0 * correct / max(int(y.shape[0]), 1)
    accuracy["AVG"] = float(np.mean([accuracy[name] for name in test_sets]))
    return accuracy


class Simulator:
    """Runs one method on one federation for a number of rounds."""

    def __init__(self, method: MethodSpec, options: Any, federation: Federation,
                 model_factory: Callable[[], nn.Module], train: TrainSettings, *, rounds: int,
                 participation: float = 1.0, seed: int = 0, eval_every: int = 1,
                 device: torch.device | str = "cpu"):
        self.method = method
        self.federation = federation
        self.rounds = rounds
        self.participation = participation
        self.seed = seed
        self.eval_every = eval_every
        self.device = torch.device(device)
        with torch.random.fork_rng(devices=[]):  # seed the initial weights without touching the caller's RNG
            torch.manual_seed(derive_seed(seed, _INIT))
            global_model = model_factory().to(self.device)
        self.working_model = copy.deepcopy(global_model)  # reused by every client: no per-client allocation
        self.eval_model = copy.deepcopy(global_model)
        context = MethodContext(model=global_model, num_classes=federation.num_classes, options=options,
                                train=train, seed=derive_seed(seed, _SERVER), device=self.device)
        self.server = method.server(context)
        self.client = method.client(context)
        self.client_states: list[dict[str, Any]] = [{} for _ in range(federation.num_clients)]
        self.history: list[RoundRecord] = []

    def sample_clients(self, round: int) -> list[int]:
        """The participants of ``round``: a seeded draw without replacement, sorted."""
        total = self.federation.num_clients
        count = max(1, int(round_half_up(self.participation * total)))
        if count >= total:
            return list(range(total))
        rng = np.random.default_rng(derive_seed(self.seed, _SAMPLE, round))
        return sorted(int(k) for k in rng.choice(total, size=count, replace=False))

    def run_round(self, round: int) -> RoundRecord:
        timer = time.perf_counter()
        participants = self.sample_clients(round)
        payload = self.server.broadcast(round)
        down = payload_bytes(payload)
        replies, train_metrics = [], []
        for k in participants:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, _TRAIN, round, k))
            reply, metrics = self.client.fit(self.working_model, payload, self.federation.clients[k],
                                             self.client_states[k], generator)
            replies.append(reply)
            train_metrics.append((len(self.federation.clients[k]), metrics))
        client_seconds = time.perf_counter() - timer
        up = sum(payload_bytes(reply) for reply in replies)

        timer = time.perf_counter()
        server_metrics = self.server.aggregate(round, replies)
        server_seconds = time.perf_counter() - timer

        timer = time.perf_counter()
        accuracy = None
        if (round + 1) % self.eval_every == 0 or round + 1 == self.rounds:
            self.eval_model.load_state_dict(self.server.global_weights())
            accuracy = evaluate(self.eval_model, self.federation.test_sets)
        eval_seconds = time.perf_counter() - timer

        record = RoundRecord(
            round=round, participants=participants, train=_weighted_mean(train_metrics),
            server=server_metrics, accuracy=accuracy, bytes_up=up, bytes_down=down * len(participants),
            seconds={"clients": client_seconds, "server": server_seconds, "eval": eval_seconds})
        self.history.append(record)
        return record


def round_half_up(value: float) -> int:
    return int(np.floor(value + 0.5))


def _weighted_mean(metrics: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Mean of each client metric, weighted by the clients' sample counts."""
    total = sum(n for n, _ in metrics) or 1
    names = sorted({name for _, m in metrics for name in m})
    return {name: sum(n * m.get(name, 0.0) for n, m in metrics) / total for name in names}
