"""FedTGP (Zhang et al., AAAI 2024): trainable global prototypes with an adaptive margin, per ``baselines.md``.

Client: the same as FedProto's, ``CE + lam * MSE(z, P^_y)`` with ``P^`` the TGP's prototypes (a sample
whose class has no prototype is not regularised; none in round 0), then it uploads its local
prototypes ``p_k^c`` (Eq. 2) and class counts.

Server, every round (after FedAvg on the weights in ``dagger``):

1. ``Pbar^c`` = unweighted mean of this round's uploaded ``p_k^c`` over the clients holding ``c``;
   ``gap_c = min_{c' != c} ||Pbar^c - Pbar^c'||_2`` over the classes uploaded this round;
   ``delta = min(max_c gap_c, margin_cap)``, and ``delta = 0`` when fewer than two classes were
   uploaded (no gap exists; the authors' code would fall back to ``margin_cap`` there).
2. The TGP net (class embedding ``C x d`` -> Linear(d, d) -> ReLU -> Linear(d, d); it persists
   across rounds, its optimiser does not: plain SGD without momentum, as the authors') is trained
   ``server_epochs`` epochs over the pairs ``(p_k^c, c)`` in shuffled batches of ``server_batch_size``
   (the last batch may be smaller) on the margin-CE of every batch::

       P^     = TGP(0..C-1)                                       (C x d, all classes, every batch)
       dist   = sqrt(max(||p - P^_c||_2^2, 1e-12))                (B x C; exact differences)
       loss   = CE(-(dist + delta * onehot(y)), y)                (mean over the batch)

   The shuffling comes from ``torch.Generator`` seeded with ``(server seed, tag, round)``, the initial
   TGP weights from ``(server seed, tag)`` (PyTorch's default init laws, drawn from that generator);
   the global RNG is never used. It runs on the CPU, so the numbers are the same on every device.
3. The broadcast prototypes are ``P^ = TGP(0..C-1)`` (eval mode); the mask marks the classes that
   some client has uploaded in some round so far (the TGP's output for a never-seen class is
   untrained and is not sent as a target).

``prototypes=hyper`` replaces steps 1-3 by FedHPro's server step (the TGP is not trained then, as
its output would not be used; the clients send their class gradients and counts, not their prototypes),
so FedTGP+hyper and FedProto+hyper are the same algorithm here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro import functional
from fedhpro.methods.base import MethodContext, MethodSpec
from fedhpro.methods.fedtgp_options import DECLARATION
from fedhpro.methods.fedtgp_options import FedTGPOptions as FedTGPOptions
from fedhpro.methods.layout import Payload
from fedhpro.methods.prototypes import (
    NEAREST_PROTOTYPE,
    PrototypeClient,
    PrototypeServer,
    Uploads,
    margin_ce,
    nearest_class_gaps,
)
from fedhpro.seeds import derive_seed

_TGP_INIT, _TGP_SHUFFLE = 41, 42


class TrainableGlobalPrototypes(nn.Module):
    """Class embedding (C x d) -> Linear(d, d) -> ReLU -> Linear(d, d); ``forward()`` gives all C prototypes."""

    def __init__(self, num_classes: int, feature_dim: int, generator: torch.Generator):
        super().__init__()
        # skip_init: no draw from the global RNG; the weights are drawn below from ``generator``
        self.embedding = nn.utils.skip_init(nn.Embedding, num_classes, feature_dim)
        self.hidden = nn.utils.skip_init(nn.Linear, feature_dim, feature_dim)
        self.out = nn.utils.skip_init(nn.Linear, feature_dim, feature_dim)
        with torch.no_grad():
            self.embedding.weight.normal_(0.0, 1.0, generator=generator)  # nn.Embedding's default
            bound = 1.0 / math.sqrt(feature_dim)  # nn.Linear's default (kaiming_uniform a=sqrt(5)), bias likewise
            for layer in (self.hidden, self.out):
                layer.weight.uniform_(-bound, bound, generator=generator)
                layer.bias.uniform_(-bound, bound, generator=generator)

    def forward(self) -> Tensor:
        return self.out(F.relu(self.hidden(self.embedding.weight)))


def tgp_margin(mean_prototypes: Tensor, held: Tensor, cap: float) -> float:
    """``delta = min(max_c min_{c' != c} ||Pbar^c - Pbar^c'||_2, cap)`` over the held classes; 0 with < 2."""
    if int(held.sum()) < 2:
        return 0.0
    gaps = nearest_class_gaps(mean_prototypes, held)
    return float(min(float(gaps[held].max()), cap))


def train_tgp(net: TrainableGlobalPrototypes, prototypes: Tensor, labels: Tensor, delta: float, *, epochs: int,
              lr: float, batch_size: int, generator: torch.Generator) -> float:
    """``epochs`` of SGD on :func:`~fedhpro.methods.prototypes.margin_ce` with margin ``delta``; returns the
    mean batch loss of the last epoch (nan if none)."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    net.train()
    n = prototypes.shape[0]
    last = float("nan")
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        total, steps = 0.0, 0
        for start in range(0, n, batch_size):
            index = order[start:start + batch_size]
            loss = margin_ce(prototypes[index], labels[index], net(), delta)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
            steps += 1
        last = total / max(steps, 1)
    return last


class FedTGPServer(PrototypeServer):
    def __init__(self, context: MethodContext):
        super().__init__(context)
        generator = torch.Generator().manual_seed(derive_seed(context.seed, _TGP_INIT))
        self.tgp = TrainableGlobalPrototypes(self.num_classes, self.feature_dim, generator)
        self.seed = context.seed

    def prototype_step(self, round: int, uploads: Uploads, replies: Sequence[Payload]) -> dict[str, float]:
        o = self.options
        mean, held = functional.mean_client_prototypes(uploads.prototypes, uploads.present)
        delta = tgp_margin(mean, held, o.margin_cap)
        index = uploads.present.nonzero()  # (k, c) pairs, client-major: the order of the uploads
        pairs = uploads.prototypes[index[:, 0], index[:, 1]]
        labels = index[:, 1]
        generator = torch.Generator().manual_seed(derive_seed(self.seed, _TGP_SHUFFLE, round))
        loss = train_tgp(self.tgp, pairs, labels, delta, epochs=o.server_epochs, lr=o.server_lr,
                         batch_size=o.server_batch_size, generator=generator)
        self.tgp.eval()
        with torch.no_grad():
            self.prototypes = self.tgp().detach().clone()
        self.prototype_mask = self.prototype_mask | held
        return {"tgp_loss": loss, "tgp_margin": delta}

    def method_state(self) -> dict[str, Any]:
        return {**super().method_state(),
                "tgp": {name: t.detach().clone() for name, t in self.tgp.state_dict().items()}}

    def load_method_state(self, state: Mapping[str, Any]) -> None:
        super().load_method_state(state)
        self.tgp.load_state_dict(state["tgp"])


class FedTGPClient(PrototypeClient):
    pass


METHOD = MethodSpec.from_declaration(
    DECLARATION,
    server=FedTGPServer,
    client=FedTGPClient,
    inference_rule=NEAREST_PROTOTYPE,
)
