"""FedHPro: federated hyper-prototype learning via gradient matching (the paper, Algorithm 1).

Server: FedAvg on the weights, then ``match_steps`` steps of gradient
matching (Eq. 6-9) on the hyper-prototypes S (C x |I| x d), which persist
across rounds. Client: CE + HPCL (Eq. 11-12, with the margin of Eq. 10) +
HPAL (Eq. 13) against S, then the class-wise feature gradients of Eq. 5.

Table 6's ablation, ``prototypes=global|global-hpcl|global-hpal``: the server
also aggregates the uploaded local prototypes into the global prototypes P of
Eq. 4 (as printed, so scaled by 1/|A^c|; both losses are scale-free in the
default normalised HPAL) and sends them; clients then use P (as ``C x 1 x d``)
in place of S in both losses, in HPCL only or in HPAL only. A class nobody has
held yet has no P: its samples get no term from the loss that uses P and it is
no negative in HPCL; before the first aggregation (round 0) that loss is off,
as FedProto's prototype term. Classes nobody holds in a later round keep their
previous P.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fedhpro import functional as HF
from fedhpro.methods.base import (
    Client,
    ClientData,
    MethodContext,
    MethodSpec,
    Payload,
    ReplyLayout,
    Server,
    classifier_of,
    clone_weights,
    extract_features,
    load_weights,
    train_epochs,
)
from fedhpro.methods.hyper import HyperPrototypeBank, class_statistics
from fedhpro.methods.prototypes import feature_dim_of, merge_prototypes, stack_prototypes
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
    prototypes: str = option("hyper", choices=("hyper", "global", "global-hpcl", "global-hpal"),
                             help="what HPCL and HPAL pull towards: the hyper-prototypes S (the method), or the "
                                  "global prototypes P of Eq. 4 in both losses, in HPCL only or in HPAL only "
                                  "(Table 6)")
    gradient_samples_per_class: int = option(0, min=0,
                                             help="use at most this many samples per class for g_k^c (0: all; "
                                                  "the authors' code uses 100)")


class FedHProServer(Server):
    def __init__(self, context: MethodContext):
        super().__init__(context)
        o = self.options
        feature_dim = feature_dim_of(context.model)
        self.bank = HyperPrototypeBank(self.num_classes, feature_dim, context.seed,
                                       num_hyper=o.num_hyper, match_steps=o.match_steps, lr=o.hyper_lr,
                                       optimizer=o.hyper_optimizer)
        self.scratch = context.model
        self.uses_global = o.prototypes != "hyper"
        self.global_prototypes = torch.zeros(self.num_classes, feature_dim)
        self.global_mask = torch.zeros(self.num_classes, dtype=torch.bool)

    @property
    def hyper(self) -> torch.Tensor:
        return self.bank.hyper

    def exposed_prototypes(self) -> tuple[torch.Tensor, torch.Tensor, str]:
        """The averaged hyper-prototypes H (C x d), every class present (also under the Table 6 ablations,
        whose global prototypes P only some losses use)."""
        return self.bank.averaged.detach(), torch.ones(self.num_classes, dtype=torch.bool), "hyper"

    def broadcast(self, round: int) -> Payload:
        payload = {"weights": self.weights, "hyper_prototypes": self.bank.hyper}
        if self.uses_global:
            payload["global_prototypes"] = self.global_prototypes.clone()
            payload["global_mask"] = self.global_mask.clone()
        return payload

    def reply_layout(self) -> ReplyLayout:
        """The base layout plus ``class_counts`` (C, int64), ``class_gradients`` and ``prototypes`` (C x d,
        the model's dtype), under every option."""
        rows = ((self.num_classes, self.global_prototypes.shape[1]), classifier_of(self.scratch).weight.dtype)
        return {**super().reply_layout(), "class_counts": ((self.num_classes,), torch.int64),
                "class_gradients": rows, "prototypes": rows}

    def validate_reply(self, reply: Payload, who: str = "reply") -> None:
        super().validate_reply(reply, who)
        self.bank.validate([reply])

    def aggregate(self, round: int, replies: Sequence[Payload]) -> dict[str, float]:
        # validate everything before changing any state: a rejected round leaves the server as it was
        gradients, present = self.bank.validate(replies)
        if self.uses_global:
            prototypes, held_by, counts = stack_prototypes(replies, self.num_classes, self.global_prototypes.shape[1])
        self.weights = self.average_weights(replies)
        load_weights(self.scratch, self.weights)
        metrics = self.bank.update(gradients, present, classifier_of(self.scratch))
        if self.uses_global:
            new, held = HF.global_prototypes(prototypes, held_by, counts)
            self.global_prototypes, self.global_mask = merge_prototypes(self.global_prototypes, self.global_mask,
                                                                        new, held)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        state = {"weights": self.weights, **self.bank.state_dict()}
        if self.uses_global:
            state.update(global_prototypes=self.global_prototypes, global_mask=self.global_mask)
        return state

    def load_state_dict(self, state) -> None:
        self.weights = dict(state["weights"])
        self.bank.load_state_dict(state)
        if self.uses_global:
            self.global_prototypes = state["global_prototypes"].clone()
            self.global_mask = state["global_mask"].clone().bool()


class PrototypeTargets(NamedTuple):
    """What a loss pulls towards: ``C x I x d`` targets and, for global prototypes, which classes have one."""

    targets: torch.Tensor
    mask: torch.Tensor | None  # None: every class has targets (the hyper-prototypes)

    @property
    def usable(self) -> bool:
        return self.mask is None or bool(self.mask.any())

    def restrict(self, z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(z, y, targets)`` over the samples and classes that have targets, labels renumbered to
        match; the inputs themselves when every class has targets; None when no sample of the batch has."""
        if self.mask is None or bool(self.mask.all()):
            return z, y, self.targets
        classes = self.mask.nonzero().squeeze(1)
        position = torch.full(self.mask.shape, -1, dtype=torch.long, device=self.mask.device)
        position[classes] = torch.arange(classes.numel(), device=classes.device)
        keep = self.mask[y]
        if not bool(keep.any()):
            return None
        return z[keep], position[y[keep]], self.targets[classes]


class FedHProClient(Client):
    def fit(self, model, payload: Payload, data: ClientData, state: dict, generator: torch.Generator):
        options = self.options
        load_weights(model, payload["weights"])
        hyper = payload["hyper_prototypes"].to(data.x.device)
        hpcl_targets = hpal_targets = PrototypeTargets(hyper, None)
        if options.prototypes != "hyper":
            # Table 6: P (C x 1 x d) with its mask in place of S in one or both losses
            global_targets = PrototypeTargets(payload["global_prototypes"].to(data.x.device).unsqueeze(1),
                                              payload["global_mask"].to(data.x.device).bool())
            if options.prototypes in ("global", "global-hpcl"):
                hpcl_targets = global_targets
            if options.prototypes in ("global", "global-hpal"):
                hpal_targets = global_targets
        if options.gradient_timing == "before":
            gradients, counts, prototypes = self._class_gradients(model, data)
        margin = torch.zeros((), device=data.x.device)
        if options.margin != "off" and options.hpcl_weight > 0:
            # d_k: from the received model, before training, fixed for the round (Eq. 10)
            if options.gradient_timing == "before" and options.gradient_samples_per_class == 0:
                # the class-statistics pass just made exactly these prototypes (same model in eval mode, same
                # data, same call): reuse them instead of a second pass over the data
                margin_prototypes, present = prototypes, counts > 0
            else:
                margin_prototypes, present = HF.local_prototypes(extract_features(model, data.x), data.y,
                                                                 self.num_classes)
            margin = HF.client_margin(margin_prototypes, present, normalized=options.margin == "normalized")

        normalized = options.hpal_form == "normalized"

        both_on_hyper = (options.prototypes == "hyper" and options.hpcl_weight > 0 and options.hpal_weight > 0)

        def regularizer(z, y, logits):
            if both_on_hyper:  # the method's default: both losses against S, sharing z/||z||
                hpcl, hpal = HF.hyper_prototype_losses(z, y, hyper, margin, options.tau, normalized=normalized)
                return {"hpcl": options.hpcl_weight * hpcl, "hpal": options.hpal_weight * hpal}
            terms = {}
            if options.hpcl_weight > 0 and hpcl_targets.usable:
                kept = hpcl_targets.restrict(z, y)
                if kept is not None:
                    terms["hpcl"] = options.hpcl_weight * HF.hpcl_loss(*kept[:2], kept[2], margin, options.tau)
            if options.hpal_weight > 0 and hpal_targets.usable:
                kept = hpal_targets.restrict(z, y)
                if kept is not None:
                    terms["hpal"] = options.hpal_weight * HF.hpal_loss(*kept, normalized=normalized)
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
        return class_statistics(model, data, self.num_classes, self.options.gradient_samples_per_class)


METHOD = MethodSpec(
    name="fedhpro",
    options=FedHProOptions,
    server=FedHProServer,
    client=FedHProClient,
    description="FedHPro: hyper-prototypes by gradient matching, HPCL + HPAL",
)
