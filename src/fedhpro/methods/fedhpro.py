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
from fedhpro.methods.hyper import HyperPrototypeBank, class_statistics
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
        o = self.options
        self.bank = HyperPrototypeBank(self.num_classes, context.model.classifier.in_features, context.seed,
                                       num_hyper=o.num_hyper, match_steps=o.match_steps, lr=o.hyper_lr,
                                       optimizer=o.hyper_optimizer)
        self.scratch = context.model

    @property
    def hyper(self) -> torch.Tensor:
        return self.bank.hyper

    def broadcast(self, round: int) -> Payload:
        return {"weights": self.weights, "hyper_prototypes": self.bank.hyper}

    def validate_reply(self, reply: Payload, who: str = "reply") -> None:
        super().validate_reply(reply, who)
        self.bank.validate([reply])

    def aggregate(self, round: int, replies: list[Payload]) -> dict[str, float]:
        # validate everything before changing any state: a rejected round leaves the server as it was
        gradients, present = self.bank.validate(replies)
        self.weights = self.average_weights(replies)
        load_weights(self.scratch, self.weights)
        return self.bank.update(gradients, present, self.scratch.classifier)

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights, **self.bank.state_dict()}

    def load_state_dict(self, state) -> None:
        self.weights = dict(state["weights"])
        self.bank.load_state_dict(state)


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
        return class_statistics(model, data, self.num_classes, self.options.gradient_samples_per_class)


METHOD = MethodSpec(
    name="fedhpro",
    options=FedHProOptions,
    server=FedHProServer,
    client=FedHProClient,
    description="FedHPro: hyper-prototypes by gradient matching, HPCL + HPAL",
)
