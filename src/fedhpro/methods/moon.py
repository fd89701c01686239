"""MOON (Li, He and Song, CVPR 2021): model-contrastive learning on the model's representation.

Network (``moon.projection_head``, :func:`wrap_model` the ``model_wrapper``):

* ``none`` (the default): the common network every other method trains, unchanged;
  ``z`` is its feature ``features(x)`` and the classifier classifies ``z``, as in
  PFLlib. The paper states that all methods share one architecture, so this is
  the setting of a comparison on fedhpro's network.
* ``authors``: the head of the authors' ``ModelFedCon``
  (:func:`fedhpro.models.projection.with_projection_head`): ``features`` becomes
  ``Sequential(base.features, Linear(d, d), ReLU, Linear(d, P))`` and ``classifier``
  ``Linear(P, C)`` (``P = projection_dim``), so ``z`` is the projection and the
  classifier classifies it. The authors' ``init_nets`` gives that head to every
  method they run (FedAvg and FedProx too); to compare on their network give it
  to every method with the run key ``projection_head=true`` (MOON then has it
  whatever this option says, and equals ``moon.projection_head=authors``).

Client loss (per batch, ``z`` the current model's ``features(x)``, ``z_glob`` the
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
  participation there is none and **no contrastive term** is used, so that update
  equals FedAvg's on the same network. In round 0 the authors' code agrees: its
  previous-model pool starts empty (the ``load_first_net`` branch copies the
  initial nets but never adds them to the pool), so the logits hold only the
  positive column and the term is exactly 0. From round 1 on their pool holds
  every client's net, a client not yet sampled keeping its own untrained
  initialisation, so under partial participation a client's first participation
  after round 0 is contrasted there against its initial net and here against
  nothing; with full participation the two agree;
* the global model of the term is the working model right after loading the
  payload: the whole received model in a homogeneous federation (with
  classifier-only exchange it is the client's own extractor plus the received
  classifier);
* the frozen models run on the batch's inputs ``Batch.x`` (those the current
  model's feature extractor ran on), built in ``prepare`` before training.

Server: FedAvg.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro.errors import ConfigError
from fedhpro.methods.base import Client, MethodSpec, Server, clone_weights
from fedhpro.methods.layout import Payload
from fedhpro.methods.moon_options import DECLARATION
from fedhpro.methods.moon_options import MoonOptions as MoonOptions
from fedhpro.methods.parts import features_of
from fedhpro.methods.training import Batch, LocalRound, LossTerms
from fedhpro.models.projection import ProjectionHeadNet, with_projection_head


def wrap_model(model: nn.Module, options: MoonOptions, num_classes: int) -> nn.Module:
    """The ``model_wrapper``: ``model`` with the authors' head if ``moon.projection_head=authors``, else as it is.

    A model that already has the head (the run key ``projection_head=true`` gave it to
    every method) is kept as it is; a ``moon.projection_dim`` other than that head's
    width is refused, since one network cannot have both.
    """
    if isinstance(model, ProjectionHeadNet):
        if options.projection_dim != model.feature_dim:
            raise ConfigError(f"moon.projection_dim={options.projection_dim} but projection_head=true gives every "
                              f"method the authors' {model.feature_dim}-wide head; drop moon.projection_dim, or "
                              "use moon.projection_head=authors without projection_head=true")
        return model
    if options.projection_head == "authors":
        return with_projection_head(model, num_classes, int(options.projection_dim))
    return model


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
    def prepare(self, round: LocalRound) -> None:
        """Frozen copies of the received (global) model and of this client's previous model, when it has one."""
        previous = round.state.get("previous_weights")
        if previous is not None and self.options.mu > 0:
            round.scratch["global_model"] = frozen_copy(round.model)
            previous_model = round.scratch["previous_model"] = frozen_copy(round.model)
            previous_model.load_state_dict(previous)

    def loss_terms(self, round: LocalRound) -> LossTerms | None:
        if "global_model" not in round.scratch:
            return None  # first participation (or mu = 0): FedAvg's update
        global_features = features_of(round.scratch["global_model"])
        previous_features = features_of(round.scratch["previous_model"])
        mu, tau = float(self.options.mu), float(self.options.tau)

        def terms(batch: Batch) -> dict[str, Tensor]:
            with torch.no_grad():
                z_glob = global_features(batch.x)
                z_prev = previous_features(batch.x)
            return {"moon": mu * moon_contrastive_loss(batch.z, z_glob, z_prev, tau)}

        return terms

    def upload(self, round: LocalRound) -> Payload:
        """Nothing beyond the weights; keeps the trained model as the next round's previous model."""
        round.state["previous_weights"] = clone_weights(round.model)
        return {}


METHOD = MethodSpec.from_declaration(
    DECLARATION,
    server=Server,
    client=MoonClient,
    model_wrapper=wrap_model,
)
