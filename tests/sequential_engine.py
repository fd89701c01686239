"""A second engine, for tests: the participants trained one after another through the shared round protocol,
no observers, no drop handling beyond the protocol's. It implements :class:`fedhpro.engines.interface.Engine`
and nothing else, with the driver's row and client-evaluation functions, so a run through
:func:`~fedhpro.engines.lifecycle.execute` gives the simulator's bytes (one global model, test sets shared
per domain: FedAvg, FedHPro)."""

from __future__ import annotations

from typing import Any

import torch

from fedhpro.config import Config
from fedhpro.engines.one_round import round_extra, test_client
from fedhpro.engines.evaluation import pool_accuracy
from fedhpro.engines.protocol import RoundProtocol, RoundRecord, client_step
from fedhpro.engines.simulator import ClientModels, build_method
from fedhpro.experiment import Experiment, protocol_settings


class SequentialEngine:
    def __init__(self, config: Config, parts: Experiment, device: torch.device):
        self.federation, self.device, self.history = parts.federation, device, []
        self.seed, n = config.run.seed, parts.federation.num_clients
        self.models = ClientModels(parts.model_factory, num_clients=n, seed=self.seed, device=device,
                                   client_architectures=parts.architectures,
                                   architecture_factory=parts.architecture_factory, shared=parts.shared)
        self.server, self.client = build_method(parts.method, config.method_options, self.models,
                                                parts.federation.num_classes, parts.train, self.seed, device)
        self.protocol = RoundProtocol(self.server, n, client_sizes=[len(data) for data in parts.federation.clients],
                                      **protocol_settings(config))
        self.states: list[dict[str, Any]] = [{} for _ in range(n)]

    shared = property(lambda self: self.models.shared)
    client_names = property(lambda self: self.federation.client_names)

    def pooled_test_sizes(self) -> list[tuple[str, int]]:
        return []  # one global model tested once per shared test set: no client's count is pooled

    def run_round(self, round: int) -> RoundRecord:
        current = self.protocol.open(round)
        for k in current.to_ask:
            model, data = self.models.model_for(k), self.federation.clients[k]
            reply, metrics = client_step(self.server, self.client, model, current.payload, data, self.states[k],
                                         self.seed, round, k, self.protocol.client_privacy)
            if current.receive(k, reply, metrics, len(data)):
                self.models.keep(k, model)
        server_metrics = current.close()
        accuracy, per_client = self.evaluate_clients() if self.protocol.evaluates(round) else (None, None)
        record = current.record(server_metrics, accuracy, {"clients": 0.0, "server": 0.0, "eval": 0.0},
                                round_extra(None, per_client))
        self.history.append(record)
        return record

    def evaluate_clients(self) -> tuple[dict[str, float], list[float]]:
        weights, model = self.server.global_weights(), self.models.eval_model
        counts = [test_client(self.server, model, name, test, weights)
                  for name, test in self.federation.test_sets.items()]
        accuracy = pool_accuracy(counts)
        return accuracy, [accuracy.get(self.federation.client_test_name(k), accuracy["AVG"])
                          for k in range(self.federation.num_clients)]

    def state_dict(self) -> dict[str, Any]:
        return {"server": self.server.state_dict(), "client_states": self.states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.server.load_state_dict(state["server"])
        self.states = [dict(s) for s in state["client_states"]]

    def end_run(self) -> None:
        pass
