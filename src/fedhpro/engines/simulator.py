"""The in-process simulator: all clients in one process, data resident as tensors.

One round: sample the participants (seeded), broadcast the server's payload,
run each participant's ``fit`` on a reused working model, aggregate the
replies, evaluate the global model every ``eval_every`` rounds. Every random
draw comes from a generator derived from ``(seed, round, client)``, so the
same seed and config give the same numbers on the CPU, whatever ran before.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from fedhpro.data.federation import Federation
from fedhpro.errors import ConfigError, UpdateError
from fedhpro.methods.base import (MethodContext, MethodSpec, TrainSettings, eval_batch_size, eval_forward,
                                  extract_features, load_weights)
from fedhpro.metrics import (FlopCounter, class_means, fairness_statistics, mean_client_prototypes, payload_bytes,
                             payload_parameters, prototype_distance)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts (independent streams for rounds and clients)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


# stream tags: each kind of randomness gets its own stream
_INIT, _SAMPLE, _TRAIN, _SERVER, _FAULT = 1, 2, 3, 4, 5


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


@torch.no_grad()
def evaluate(model: nn.Module, test_sets: dict[str, tuple[Tensor, Tensor]],
             batch_size: int | None = None) -> dict[str, float]:
    """Accuracy in percent on each test set, plus ``AVG``, their unweighted mean (the paper's AVG)."""
    model.eval()
    accuracy = {}
    for name, (x, y) in test_sets.items():
        batch_size = batch_size or eval_batch_size(x.device)
        correct = 0
        for start in range(0, x.shape[0], batch_size):
            logits = eval_forward(model, x[start:start + batch_size])
            correct += int((logits.argmax(1) == y[start:start + batch_size]).sum())
        accuracy[name] = 100.0 * correct / max(int(y.shape[0]), 1)
    accuracy["AVG"] = float(np.mean([accuracy[name] for name in test_sets]))
    return accuracy


class Simulator:
    """Runs one method on one federation for a number of rounds."""

    def __init__(self, method: MethodSpec, options: Any, federation: Federation,
                 model_factory: Callable[[], nn.Module], train: TrainSettings, *, rounds: int,
                 participation: float = 1.0, seed: int = 0, eval_every: int = 1,
                 device: torch.device | str = "cpu", client_architectures: Sequence[str] | None = None,
                 architecture_factory: Callable[[str], nn.Module] | None = None, shared: str | None = None,
                 faults: Faults | None = None, min_clients: int = 1, on_drop: Callable[[str], None] | None = None,
                 count_flops: bool = False, prototype_distance: bool = False):
        """``client_architectures`` (one name per client, built by ``architecture_factory``) switches on
        heterogeneous feature extractors: each client keeps its own model across rounds and only the
        classifier (``classifier.*``) is exchanged and aggregated; evaluation then averages each
        client's model (its feature extractor with the global classifier) on its own test data.

        ``shared`` says which weights travel: ``"all"`` (default for one architecture), ``"classifier"``
        (default with ``client_architectures``) or ``"none"`` (prototype-only protocols: every client
        keeps its whole model, evaluated on its own test data).

        Opt-in measurements (each costs compute, none changes the training): ``count_flops`` counts
        the FLOPs of every client's ``fit`` and of the server step with ``torch.utils.flop_counter``
        (Table 4); ``prototype_distance`` computes, at each evaluated round, the L2 distance of the
        server's prototypes and of the mean of the clients' class means to the centralized
        prototypes, the class means of all training data under the global model (Figure 2)."""
        if shared is None:
            shared = "all" if client_architectures is None else "classifier"
        if shared not in ("all", "classifier", "none"):
            raise ValueError(f"shared must be all, classifier or none, got {shared!r}")
        if shared == "all" and client_architectures is not None:
            raise ConfigError("different client architectures cannot share all their weights")
        if shared != "all" and client_architectures is None:
            client_architectures = ["model"] * federation.num_clients
            architecture_factory = lambda name: model_factory()  # noqa: E731
        if prototype_distance and shared != "all":
            raise ConfigError("prototype_distance=true needs one shared global model; it is undefined with "
                              "heterogeneous models or protocol=proto-only (set prototype_distance=false)")
        self.count_flops = count_flops
        self.prototype_distance = prototype_distance
        self.shared = shared
        self.faults = faults or Faults()
        self.min_clients = min_clients
        self.on_drop = on_drop
        self.method = method
        self.federation = federation
        self.rounds = rounds
        self.participation = participation
        self.seed = seed
        self.eval_every = eval_every
        self.device = torch.device(device)
        self.client_architectures = list(client_architectures) if client_architectures is not None else None
        shared_keys = None
        if self.client_architectures is None:
            global_model = self._seeded(model_factory, derive_seed(seed, _INIT))
            self.working_model = copy.deepcopy(global_model)  # reused by every client: no per-client allocation
            self.eval_model = copy.deepcopy(global_model)
        else:
            if len(self.client_architectures) != federation.num_clients:
                raise ValueError(f"{len(self.client_architectures)} architectures for {federation.num_clients} clients")
            if architecture_factory is None:
                raise ValueError("client_architectures needs an architecture_factory")
            self.working_models: dict[str, nn.Module] = {}
            self.client_weights: list[dict[str, Tensor]] = []
            for k, name in enumerate(self.client_architectures):
                model = self._seeded(lambda: architecture_factory(name), derive_seed(seed, _INIT, k))
                self.working_models.setdefault(name, model)
                self.client_weights.append({key: v.detach().clone() for key, v in model.state_dict().items()})
            global_model = copy.deepcopy(self.working_models[self.client_architectures[0]])
            shared_keys = ([key for key in global_model.state_dict() if key.startswith("classifier.")]
                           if shared == "classifier" else [])
            shapes = {name: [tuple(m.state_dict()[key].shape) for key in shared_keys]
                      for name, m in self.working_models.items()}
            if len({tuple(v) for v in shapes.values()}) != 1:
                raise ConfigError(f"the client models' classifiers differ in shape {shapes}; "
                                  "every architecture must produce the same feature_dim")
        context = MethodContext(model=global_model, num_classes=federation.num_classes, options=options,
                                train=train, seed=derive_seed(seed, _SERVER), device=self.device,
                                shared_keys=shared_keys)
        self.server = method.server(context)
        self.client = method.client(context)
        self.client_states: list[dict[str, Any]] = [{} for _ in range(federation.num_clients)]
        self.history: list[RoundRecord] = []

    def _seeded(self, factory: Callable[[], nn.Module], seed: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):  # seed the initial weights without touching the caller's RNG
            torch.manual_seed(seed)
            return factory().to(self.device)

    @property
    def heterogeneous(self) -> bool:
        return self.client_architectures is not None

    def _client_model(self, k: int) -> nn.Module:
        """The model client ``k`` trains: the shared working model, or its own persistent one."""
        if not self.heterogeneous:
            return self.working_model
        model = self.working_models[self.client_architectures[k]]
        model.load_state_dict(self.client_weights[k])
        return model

    def evaluate_global(self) -> dict[str, float]:
        """Test accuracy (%) per test set and AVG: the global model, or (heterogeneous) each client's
        model with the global classifier on its own test data, averaged per domain and over domains."""
        return self.evaluate_clients()[0]

    def evaluate_clients(self) -> tuple[dict[str, float], list[float]]:
        """``(accuracy per test set and AVG, accuracy of each client on its own test distribution)``.

        With one global model a client's accuracy is the global model's on its test set
        (``client_test_name``: its domain's), so clients of one domain share it; with personal
        models (heterogeneous, proto-only) it is the client's own model's."""
        if not self.heterogeneous:
            self.eval_model.load_state_dict(self.server.global_weights())
            accuracy = evaluate(self.server.inference_model(self.eval_model), self.federation.test_sets)
            # a client whose distribution has no test set of its own is scored by the AVG
            return accuracy, [accuracy.get(self.federation.client_test_name(k), accuracy["AVG"])
                              for k in range(self.federation.num_clients)]
        per_client = []
        for k in range(self.federation.num_clients):
            model = self._client_model(k)
            load_weights(model, self.server.global_weights())
            name = self.federation.client_test_name(k)
            per_client.append((name, evaluate(self.server.inference_model(model),
                                              {name: self.federation.test_sets[name]})[name]))
        names = [name for name in self.federation.test_sets if any(n == name for n, _ in per_client)]
        accuracy = {name: float(np.mean([a for n, a in per_client if n == name])) for name in names}
        accuracy["AVG"] = float(np.mean([accuracy[name] for name in names]))
        return accuracy, [a for _, a in per_client]

    def server_prototypes(self) -> tuple[Tensor, Tensor, str] | None:
        """The server's global prototypes ``(C x d, mask C, kind)``: ``kind`` is ``"hyper"`` for the
        averaged hyper-prototypes H (FedHPro, ``prototypes=hyper``) and ``"global"`` for a method's own
        (FedProto's P, FedSA's anchors); None for a method without any (FedAvg)."""
        server = self.server
        if hasattr(server, "broadcast_prototypes"):
            prototypes, mask = server.broadcast_prototypes()
            kind = "hyper" if getattr(server, "bank", None) is not None else "global"
            return prototypes.detach(), mask.bool(), kind
        bank = getattr(server, "bank", None)
        if bank is not None and hasattr(bank, "averaged"):
            return bank.averaged.detach(), torch.ones(self.federation.num_classes, dtype=torch.bool), "hyper"
        return None

    def centralized_prototypes(self) -> tuple[Tensor, Tensor]:
        """Class means of all clients' training features under the global model (Figure 2's reference)."""
        self.eval_model.load_state_dict(self.server.global_weights())
        num_classes = self.federation.num_classes
        sums, counts = None, torch.zeros(num_classes, dtype=torch.float64)
        for data in self.federation.clients:
            means, _ = class_means(extract_features(self.eval_model, data.x), data.y, num_classes)
            n = torch.bincount(data.y.cpu(), minlength=num_classes)[:num_classes].double()
            part = means.double().cpu() * n.unsqueeze(1)
            sums = part if sums is None else sums + part
            counts += n
        return (sums / counts.clamp(min=1).unsqueeze(1)).float(), counts > 0

    @torch.no_grad()
    def test_features(self, per_test_set: int = 300) -> tuple[Tensor, Tensor, list[str]]:
        """``(features N x d, labels N, test-set name of each row)``: the global model's features of
        the first ``per_test_set`` samples of every test set (t-SNE of Figures 3 and 6)."""
        if self.shared != "all":
            raise ConfigError("test features need one shared global model; not available with heterogeneous "
                              "models or protocol=proto-only")
        self.eval_model.load_state_dict(self.server.global_weights())
        features, labels, names = [], [], []
        for name, (x, y) in self.federation.test_sets.items():
            features.append(extract_features(self.eval_model, x[:per_test_set]).cpu())
            labels.append(y[:per_test_set].cpu())
            names += [name] * int(labels[-1].shape[0])
        return torch.cat(features), torch.cat(labels), names

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
        evaluating = (round + 1) % self.eval_every == 0 or round + 1 == self.rounds
        # valid replies, appended in client order; the server's container folds each reply's weights into a
        # running sum as it arrives (one model's memory, not one per client), so the uploads are measured here
        replies = self.server.new_replies()
        train_metrics, dropped, errors = [], [], []
        flops_train, local_prototypes = 0, []
        up, params_up = 0, 0
        for k in participants:
            fault_rng = np.random.default_rng(derive_seed(self.seed, _FAULT, round, k))
            draw_dropout, draw_corrupt = fault_rng.random(2)
            if draw_dropout < self.faults.dropout:
                dropped.append({"client": k, "reason": "did not answer (faults.dropout)"})
                continue
            generator = torch.Generator().manual_seed(derive_seed(self.seed, _TRAIN, round, k))
            model = self._client_model(k)
            state_before = copy.deepcopy(self.client_states[k]) if self.client_states[k] else {}
            counter = FlopCounter() if self.count_flops else contextlib.nullcontext()
            try:
                with counter:  # counting FLOPs only observes the operations
                    reply, metrics = self.client.fit(model, payload, self.federation.clients[k],
                                                     self.client_states[k], generator)
            except (KeyboardInterrupt, SystemExit, MemoryError):
                raise
            except Exception as error:  # a crashing client is a dropped client
                self.client_states[k] = state_before
                dropped.append({"client": k, "reason": f"raised {type(error).__name__}: {error}"})
                errors.append(error)
                continue
            if draw_corrupt < self.faults.corrupt:
                reply = _corrupted(reply)
            try:
                self.server.validate_reply(reply)
            except UpdateError as error:
                dropped.append({"client": k, "reason": f"invalid update: {error}"})
                continue
            if self.heterogeneous:  # the client's own feature extractor persists to its next round
                self.client_weights[k] = {key: v.detach().clone() for key, v in model.state_dict().items()}
            up += payload_bytes(reply)
            params_up += payload_parameters(reply)
            replies.append(reply)
            train_metrics.append((len(self.federation.clients[k]), metrics))
            if self.count_flops:
                flops_train += counter.total
            if self.prototype_distance and evaluating:  # the client's class means under its trained model
                data = self.federation.clients[k]
                local_prototypes.append(class_means(extract_features(model, data.x), data.y,
                                                    self.federation.num_classes))
        if errors and len(errors) == len(participants):
            raise errors[0]  # every client failed: a bug or a setting, not a fault; show it
        for item in dropped:
            if self.on_drop is not None:
                self.on_drop(f"round {round}: client {item['client']} dropped: {item['reason']}")
        client_seconds = time.perf_counter() - timer

        timer = time.perf_counter()
        skipped = len(replies) < self.min_clients
        if skipped:
            server_metrics = {}
            if self.on_drop is not None:
                self.on_drop(f"round {round}: only {len(replies)} valid updates (min_clients={self.min_clients}); "
                             "the round is skipped and the global model kept")
        else:
            counter = FlopCounter() if self.count_flops else contextlib.nullcontext()
            with counter:
                server_metrics = self.server.aggregate(round, replies)
        server_seconds = time.perf_counter() - timer

        timer = time.perf_counter()
        accuracy = None
        extra: dict[str, Any] = {"params_up": params_up,
                                 "params_down": payload_parameters(payload) * len(participants)}
        if self.count_flops:
            extra["flops_train"] = flops_train
            extra["flops_server"] = counter.total if not skipped else 0
        if evaluating:
            accuracy, per_client = self.evaluate_clients()
            extra["client_accuracy"] = per_client
            extra["fairness"] = fairness_statistics(per_client)
            if self.prototype_distance:
                extra["prototype_distance"] = self._prototype_distances(local_prototypes)
        eval_seconds = time.perf_counter() - timer

        record = RoundRecord(
            round=round, participants=participants, train=_weighted_mean(train_metrics),
            server=server_metrics, accuracy=accuracy, bytes_up=up, bytes_down=down * len(participants),
            seconds={"clients": client_seconds, "server": server_seconds, "eval": eval_seconds},
            dropped=dropped, skipped=skipped, extra=extra)
        self.history.append(record)
        return record

    def _prototype_distances(self, local_prototypes: list[tuple[Tensor, Tensor]]) -> dict[str, Any]:
        """Figure 2: distances to the centralized prototypes of the server's prototypes (if any) and
        of the unweighted mean (Eq. 4) of this round's clients' class means."""
        reference, reference_mask = self.centralized_prototypes()
        out: dict[str, Any] = {"centralized_norm": float(reference[reference_mask].norm(dim=1).mean())}
        held = self.server_prototypes()
        if held is not None:
            prototypes, mask, kind = held
            out["server"] = {"kind": kind, **prototype_distance(prototypes, mask, reference, reference_mask)}
        if local_prototypes:
            stacked = torch.stack([p.cpu() for p, _ in local_prototypes])
            present = torch.stack([m.cpu() for _, m in local_prototypes])
            mean, mask = mean_client_prototypes(stacked, present)
            out["clients_mean"] = prototype_distance(mean, mask, reference, reference_mask)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything a later round depends on (all randomness is derived from seed, round and client)."""
        state = {"server": self.server.state_dict(), "client_states": self.client_states}
        if self.heterogeneous:
            state["client_weights"] = self.client_weights
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server.load_state_dict(state["server"])
        self.client_states = [dict(s) for s in state["client_states"]]
        if self.heterogeneous:
            self.client_weights = [dict(w) for w in state["client_weights"]]


def _corrupted(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply with every floating-point weight replaced by NaN (fault injection)."""
    weights = {key: torch.full_like(v, float("nan")) if v.is_floating_point() else v
               for key, v in reply.get("weights", {}).items()}
    return {**reply, "weights": weights}


def round_half_up(value: float) -> int:
    return int(np.floor(value + 0.5))


def _weighted_mean(metrics: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Mean of each client metric, weighted by the clients' sample counts."""
    total = sum(n for n, _ in metrics) or 1
    names = sorted({name for _, m in metrics for name in m})
    return {name: sum(n * m.get(name, 0.0) for n, m in metrics) / total for name in names}
