"""MOON (Li, He and Song, CVPR 2021): model-contrastive learning on a projection head.

Network (:func:`wrap_model`, the ``model_wrapper``): the engine's model ``base``
becomes ``features = Sequential(base.features, Linear(d, d), ReLU, Linear(d, P))``
and ``classifier = Linear(P, C)`` (``P = projection_dim``), so the projection head
sits in the classification path as in the authors' ``ModelFedCon`` (the head
classifies the projection ``z``); ``base.classifier`` is dropped.

Client loss (per batch, ``z`` the current model's projection, ``z_glob`` the
received global model's, ``z_prev`` the client's own previous local model's)::

    CE(h(z), y) + mu * mean_i -log( e^{cos(z_i, z_glob_i)/tau}
                                    / (e^{cos(z_i, z_glob_i)/tau} + e^{cos(z_i, z_prev_i)/tau}) )

Decisions:

* the global and previous models are frozen copies run in **eval mode** under
  ``no_grad`` (the authors' ``main.py`` sets ``global_model.eval()`` and
  ``net.eval()`` for the previous-model pool, ``requires_grad = False``); only the
  current model trains (train mode, as every method);
* the previous model is the client's own model right after its last local
  training, kept in ``state["previous_weights"]`` (a full state_dict copy, on the
  model's device, no storage shared with the model); on a client's first
  participation there is none and **no contrastive term** is used (the spec; the
  authors' code instead uses the freshly initialised local nets in round 0), so
  that update equals FedAvg's on the wrapped model;
* the global model of the term is the working model right after loading the
  payload: the whole received model in a homogeneous federation (with
  classifier-only exchange it is the client's own extractor plus the received
  classifier);
* the batch's inputs reach the frozen models through a forward pre-hook on
  ``model.features`` (the shared ``train_epochs`` hands the regulariser only
  ``z, y, logits``), removed when ``fit`` ends.

Server: FedAvg.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro.methods.base import (
    Client,
    ClientData,
    MethodSpec,
    Payload,
    Server,
    classifier_of,
    clone_weights,
    features_of,
    load_weights,
    train_epochs,
)
from fedhpro.options import option


@dataclass
class MoonOptions:
    mu: float = option(1.0, min=0.0, help="weight mu of the model-contrastive loss (paper C.1: 1.0)")
    tau: float = option(0.5, gt=0.0, help="temperature tau of the model-contrastive loss (paper C.1: 0.5)")
    projection_dim: int = option(256, min=1, help="output size P of the projection head d -> d -> P")


class MoonNet(nn.Module):
    """``base.features`` followed by MOON's 2-layer projection head, classified by ``Linear(P, C)``."""

    def __init__(self, base: nn.Module, projection_dim: int, num_classes: int):
        super().__init__()
        width = int(getattr(base, "feature_dim", None) or classifier_of(base).in_features)
        self.features = nn.Sequential(features_of(base), nn.Linear(width, width), nn.ReLU(),
                                      nn.Linear(width, projection_dim))
        self.classifier = nn.Linear(projection_dim, num_classes)
        self.base_feature_dim = width
        self.feature_dim = projection_dim
        self.num_classes = num_classes
        self.input_kind = getattr(base, "input_kind", "image")

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


def wrap_model(model: nn.Module, options: MoonOptions, num_classes: int) -> MoonNet:
    """The ``model_wrapper``: add the projection head (see :class:`MoonNet`)."""
    return MoonNet(model, int(options.projection_dim), num_classes)


def moon_contrastive_loss(z: Tensor, z_glob: Tensor, z_prev: Tensor, tau: float) -> Tensor:
    """``mean_i -log(e^{cos(z_i, zg_i)/tau} / (e^{cos(z_i, zg_i)/tau} + e^{cos(z_i, zp_i)/tau}))`` (without mu)."""
    positive = F.cosine_similarity(z, z_glob, dim=1)
    negative = F.cosine_similarity(z, z_prev, dim=1)
    logits = torch.stack([positive, negative], dim=1) / tau
    return F.cross_entropy(logits, torch.zeros(z.shape[0], dtype=torch.long, device=z.device))


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy in eval mode with gradients off."""
    frozen = copy.deepcopy(model)
    frozen.eval()
    for parameter in frozen.parameters():
        parameter.requires_grad_(False)
    return frozen


class MoonClient(Client):
    def fit(self, model: nn.Module, payload: Payload, data: ClientData, state: dict, generator: torch.Generator):
        options = self.options
        load_weights(model, payload["weights"])
        previous = state.get("previous_weights")
        regularizer = None
        handle = None
        if previous is not None and options.mu > 0:
            global_model = frozen_copy(model)
            previous_model = frozen_copy(model)
            previous_model.load_state_dict(previous)
            batch: dict[str, Tensor] = {}
            handle = features_of(model).register_forward_pre_hook(lambda module, args: batch.__setitem__("x", args[0]))
            mu, tau = float(options.mu), float(options.tau)

            def regularizer(z, y, logits):
                x = batch.pop("x")
                with torch.no_grad():
                    z_glob = features_of(global_model)(x)
                    z_prev = features_of(previous_model)(x)
                return {"moon": mu * moon_contrastive_loss(z, z_glob, z_prev, tau)}

        try:
            losses = train_epochs(model, data, self.train, generator, regularizer)
        finally:
            if handle is not None:
                handle.remove()
        state["previous_weights"] = clone_weights(model)
        return {"weights": clone_weights(model, payload["weights"]), "num_examples": len(data)}, losses


METHOD = MethodSpec(
    name="moon",
    options=MoonOptions,
    server=Server,
    client=MoonClient,
    description="MOON: CE + mu * model-contrastive loss (global vs previous local model) on a projection head",
    model_wrapper=wrap_model,
)
