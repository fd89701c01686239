"""FedProx (Li et al., MLSys 2020): local CE plus a proximal term towards the received global model.

Client loss: ``CE + (mu / 2) * sum_k ||w_k - w^t_k||^2`` where ``k`` runs over the
model's trainable parameters (``requires_grad``, buffers such as BatchNorm's
running statistics excluded) **that the server sent** in ``payload["weights"]``:
the whole model in a homogeneous federation, only the classifier when
heterogeneous feature extractors exchange just the classifier (a client's own
feature extractor has no global anchor to be pulled towards). ``w^t`` is the
received tensor, fixed for the whole local training. Server: FedAvg.

With ``mu = 0`` the term is not built at all, so the update equals FedAvg's bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from fedhpro.methods.base import Client, MethodSpec, Server
from fedhpro.methods.fedprox_options import DECLARATION
from fedhpro.methods.fedprox_options import FedProxOptions as FedProxOptions
from fedhpro.methods.training import LocalRound, LossTerms


def anchored_parameters(model: nn.Module, anchors: Mapping[str, Tensor]) -> list[tuple[Tensor, Tensor]]:
    """``(parameter, received tensor)`` for every trainable parameter of ``model`` named in ``anchors``.

    The received tensor is detached and moved to the parameter's device/dtype (no copy when they match;
    it is only read).
    """
    pairs: list[tuple[Tensor, Tensor]] = []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad and name in anchors:
            pairs.append((parameter, anchors[name].detach().to(device=parameter.device, dtype=parameter.dtype)))
    return pairs


def proximal_term(pairs: list[tuple[Tensor, Tensor]], mu: float) -> Tensor:
    """``(mu / 2) * sum over pairs of ||w - w_global||_2^2`` (a scalar tensor with a graph to the ``w``)."""
    total = sum((parameter - anchor).pow(2).sum() for parameter, anchor in pairs)
    if not isinstance(total, Tensor):  # no anchored parameter
        return torch.zeros(())
    return 0.5 * mu * total


class FedProxClient(Client):
    #: the proximal term depends on the parameters and the received weights only: under privacy=sample its
    #: gradient is added after DP-SGD's clipping and noise
    public_loss_terms = frozenset({"prox"})

    def loss_terms(self, round: LocalRound) -> LossTerms | None:
        mu = float(self.options.mu)
        if mu == 0:
            return None
        pairs = anchored_parameters(round.model, round.payload["weights"])
        return lambda batch: {"prox": proximal_term(pairs, mu)}


METHOD = MethodSpec.from_declaration(
    DECLARATION,
    server=Server,
    client=FedProxClient,
)
