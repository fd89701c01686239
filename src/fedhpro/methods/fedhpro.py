"""FedHPro: federated hyper-prototype learning via gradient matching (the paper, Algorithm 1).

Server: FedAvg on the weights, then ``match_steps`` steps of gradient
matching (Eq. 6-9) on the hyper-prototypes S (C x |I| x d), which persist
across rounds. Client: CE + HPCL (Eq. 11-12, with the margin of Eq. 10) +
HPAL (Eq. 13) against S, then the class-wise feature gradients of Eq. 5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedhpro import functional as HF
from fedhpro.errors import UpdateError
from fedhpro.methods.base import (
    Client,
    ClientData,
    MethodContext,
    MethodSpec,
    Payload,
    Server,
    clone_weights,
    extract_features,
    load_weights,
    train_epochs,
)
from fedhpro.options import option


@dataclass
class FedHProOptions:
    hpcl_weight: float = option(1.0, min=0.0, help="lambda of L_HPCL (Eq. 12); 0 turns HPCL off (Table 5)")
    hpal_weight: float = option(1.0, min=0.0, help="lambda of L_HPAL (Eq. 13); 0 turns HPAL off (Table 5)")
    margin: str = option("raw", choices=("raw", "normalized", "off"),
                         help="client margin d_k of Eq. 10: raw feature distances (the paper), "
                              "distances of L2-normalised prototypes, or off (Figure 7)")
    num_hyper: int = option(5, min=1, help="|I|, hyper-prototypes per class")
    match_steps: int = option(30, min=0, help="M, gradient-matching steps per round (0: frozen random S)")
    tau: float = option(0.05, gt=0.0, help="temperature of HPCL")
    hyper_lr: float = option(0.1, gt=0.0, help="step size of gradient matching")
    hyper_optimizer: str = option("sgd", choices=("sgd", "adam"), help="optimiser of gradient matching")
    hpal_form: str = option("normalized", choices=("normalized", "paper"),
                            help="HPAL on L2-normalised z and H, mean-reduced (the authors' code, default), "
                                 "or Eq. 13 as printed (sum over d)")
    gradient_timing: str = option("after", choices=("after", "before"),
                                  help="class gradients g_k^c after local training (Algorithm 1) "
                                       "or before it (the authors' code)")
    gradient_samples_per_class: int = option(0, min=0,
                                             help="use at most this many samples per class for g_k^c (0: all; "
                                                  "the authors' code uses 100)")


class FedHProServer(Server):
    def __init__(self, context: MethodContext):
        super().__init__(context)
        feature_dim = context.model.classifier.in_features
        generator = torch.Generator().manual_seed(context.seed)
        # S ~ N(0, 1), drawn once on the CPU (same values on every device)
        self.hyper = torch.randn(self.num_classes, self.options.num_hyper, feature_dim, generator=generator)
        self.hyper_initial = self.hyper.clone()
        self.scratch = context.model

    def broadcast(self, round: int) -> Payload:
        return {"weights": self.weights, "hyper_prototypes": self.hyper}

    def aggregate(self, round: int, replies: list[Payload]) -> dict[str, float]:
        # validate everything before changing any state: a rejected round leaves the server as it was
        gradients, present = _stack_class_gradients(replies, self.num_classes, self.hyper.shape[2])
        self.weights = self.average_weights(replies)
        g_real, held = HF.aggregate_class_gradients(gradients, present)
        load_weights(self.scratch, self.weights)
        classifier = self.scratch.classifier
        device = classifier.weight.device
        hyper, before, after = HF.match_hyper_prototypes(
            self.hyper.to(device), classifier, g_real.to(device), held.to(device),
            steps=self.options.match_steps, lr=self.options.hyper_lr, optimizer=self.options.hyper_optimizer)
        self.hyper = hyper.to(self.hyper.device)
        movement = float((self.hyper - self.hyper_initial).norm() / self.hyper_initial.norm())
        return {"gm_loss_before": before, "gm_loss_after": after, "hyper_movement": movement}

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, "hyper_prototypes": self.hyper, "hyper_initial": self.hyper_initial}

    def load_state_dict(self, state) -> None:
        self.weights = dict(state["weights"])
        self.hyper = state["hyper_prototypes"].clone()
        self.hyper_initial = state["hyper_initial"].clone()


def _stack_class_gradients(replies: list[Payload], num_classes: int, feature_dim: int):
    gradients, present = [], []
    for index, reply in enumerate(replies):
        g = reply.get("class_gradients")
        counts = reply.get("class_counts")
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != (num_classes, feature_dim):
            raise UpdateError(f"reply {index}: class_gradients must be a {num_classes} x {feature_dim} tensor, "
                              f"got {getattr(g, 'shape', type(g).__name__)}")
        if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != (num_classes,):
            raise UpdateError(f"reply {index}: class_counts must be a tensor of {num_classes} counts")
        holds = counts > 0
        if not bool(torch.isfinite(g[holds]).all()):
            raise UpdateError(f"reply {index}: class_gradients contain NaN/Inf")
        gradients.append(g.float())
        present.append(holds)
    return torch.stack(gradients), torch.stack(present)


class FedHProClient(Client):
    def fit(self, model, payload: Payload, data: ClientData, state: dict, generator: torch.Generator):
        options = self.options
        load_weights(model, payload["weights"])
        hyper = payload["hyper_prototypes"].to(data.x.device)
        margin = torch.zeros((), device=data.x.device)
        if options.margin != "off" and options.hpcl_weight > 0:
            # d_k: from the received model, before training, fixed for the round (Eq. 10)
            prototypes, present = HF.local_prototypes(extract_features(model, data.x), data.y, self.num_classes)
            margin = HF.client_margin(prototypes, present, normalized=options.margin == "normalized")
        if options.gradient_timing == "before":
            gradients, counts, prototypes = self._class_gradients(model, data)

        def regularizer(z, y, logits):
            terms = {}
            if options.hpcl_weight > 0:
                terms["hpcl"] = options.hpcl_weight * HF.hpcl_loss(z, y, hyper, margin, options.tau)
            if options.hpal_weight > 0:
                terms["hpal"] = options.hpal_weight * HF.hpal_loss(
                    z, y, hyper, normalized=options.hpal_form == "normalized")
            return terms

        losses = train_epochs(model, data, self.train, generator, regularizer)
        if options.gradient_timing == "after":
            gradients, counts, prototypes = self._class_gradients(model, data)
        losses["margin"] = float(margin)
        reply = {
            "weights": clone_weights(model, payload["weights"]),
            "num_examples": len(data),
            "class_counts": counts.cpu(),
            "class_gradients": gradients.cpu(),
            "prototypes": prototypes.cpu(),
        }
        return reply, losses

    def _class_gradients(self, model, data: ClientData):
        """g_k^c (Eq. 5) and p_k^c (Eq. 2) from one eval-mode pass over the client's data."""
        x, y = data.x, data.y
        limit = self.options.gradient_samples_per_class
        if limit > 0:
            # the first `limit` samples of each class, in stored order
            rank = torch.zeros_like(y)
            for c in torch.unique(y):
                where = (y == c).nonzero().squeeze(1)
                rank[where] = torch.arange(where.numel(), device=y.device)
            keep = rank < limit
            x, y = x[keep], y[keep]
        features = extract_features(model, x)
        was_training = model.training
        model.eval()
        gradients, counts = HF.class_gradients(features, y, model.classifier, self.num_classes)
        model.train(was_training)
        prototypes, _ = HF.local_prototypes(features, y, self.num_classes)
        if limit > 0:
            counts = torch.bincount(data.y, minlength=self.num_classes)[: self.num_classes]
        return gradients, counts, prototypes


METHOD = MethodSpec(
    name="fedhpro",
    options=FedHProOptions,
    server=FedHProServer,
    client=FedHProClient,
    description="FedHPro: hyper-prototypes by gradient matching, HPCL + HPAL",
)
