"""FedAvgM (Hsu et al., 2019): FedAvg with server momentum, a fedhpro method defined outside the package.

Clients train as in FedAvg. The server treats the change the clients
propose, ``delta = w - average(client weights)``, as a gradient and steps
with heavy-ball momentum::

    v <- server_momentum * v + delta
    w <- w - server_lr * v

With ``server_momentum=0`` and ``server_lr=1`` this is FedAvg. Buffers that
are not floating point (BatchNorm's batch counter) take the plain average.
Installed with ``pip install ./examples/own_method``, the entry point in
``pyproject.toml`` makes ``fedhpro run method=fedavgm`` work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedhpro.methods import Client, MethodSpec, Server
from fedhpro.options import option


@dataclass
class FedAvgMOptions:
    server_lr: float = option(1.0, gt=0.0, help="server step size on the momentum buffer")
    server_momentum: float = option(0.9, min=0.0, max=1.0, help="heavy-ball momentum of the server update")


class FedAvgMServer(Server):
    def __init__(self, context):
        super().__init__(context)
        self.velocity = {name: torch.zeros_like(w) for name, w in self.weights.items() if w.is_floating_point()}

    def aggregate(self, round, replies):
        average = self.average_weights(replies)
        beta, lr = float(self.options.server_momentum), float(self.options.server_lr)
        for name, w in self.weights.items():
            if name in self.velocity:
                self.velocity[name] = beta * self.velocity[name] + (w - average[name])
                average[name] = w - lr * self.velocity[name]
        self.weights = average
        squares = sum((v.pow(2).sum() for v in self.velocity.values()), torch.zeros(()))
        return {"velocity_norm": float(squares.sqrt())}

    def state_dict(self):
        return {"weights": self.weights, "velocity": self.velocity}

    def load_state_dict(self, state):
        self.weights, self.velocity = dict(state["weights"]), dict(state["velocity"])


METHOD = MethodSpec(name="fedavgm", options=FedAvgMOptions, server=FedAvgMServer, client=Client,
                    description="FedAvgM: FedAvg with server momentum (Hsu et al., 2019)")
