"""FedHPro's server (Algorithm 1's server side): FedAvg on the weights, then ``match_steps`` steps of gradient
matching (Eq. 6-9) on the hyper-prototypes S, which persist across rounds; with Table 6's ablations also the
global prototypes P (Eq. 4), with ``classifier_step=synthetic`` the authors' synthetic classifier. Its modes
are chosen once, when it is built (:mod:`~fedhpro.methods.fedhpro.modes`)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from fedhpro.errors import ConfigError
from fedhpro.methods.base import MethodContext, Server, load_weights
from fedhpro.methods.fedhpro import equations
from fedhpro.methods.fedhpro.hyper import HyperPrototypeBank, SyntheticClassifier
from fedhpro.methods.fedhpro.modes import modes_of
from fedhpro.methods.layout import COUNTS, HOLDERS, ClassRows, Payload, ReplyLayout
from fedhpro.methods.parts import classifier_of
from fedhpro.methods.prototypes import feature_dim_of, merge_prototypes, stack_prototypes

#: the warning a run with ``fedhpro.authors_last_client=true`` starts with
LAST_CLIENT_WARNING = ("fedhpro.authors_last_client=true: each round's global model is the LAST client's trained "
                       "model (BatchNorm statistics included), not the average of the clients' models: the mistake "
                       "of the authors' published main_run.py (one Local object reused for every client, whose "
                       "state_dict() tensors alias the live model). Use it only to reproduce their published "
                       "numbers; it is not FedHPro")


class FedHProServer(Server):
    def __init__(self, context: MethodContext):
        super().__init__(context)
        o = self.options
        feature_dim = feature_dim_of(context.model)
        self.bank = HyperPrototypeBank(self.num_classes, feature_dim, context.seed,
                                       num_hyper=o.num_hyper, match_steps=o.match_steps, lr=o.hyper_lr,
                                       optimizer=o.hyper_optimizer, init=o.hyper_init,
                                       distance=o.matching_distance)
        if o.authors_last_client:
            warnings.warn(LAST_CLIENT_WARNING, UserWarning, stacklevel=2)
            self.folds_weights = False  # the replies keep their weights: the server reads the last one
        self.scratch = context.model
        modes = modes_of(o)
        self.uses_global = modes.uses_global
        # the round's global weights: the clients' average (the method), or the last reply's (the authors' bug)
        self.aggregate_weights = self.last_client_weights if o.authors_last_client else self.average_weights
        self.global_prototypes = torch.zeros(self.num_classes, feature_dim)
        self.global_mask = torch.zeros(self.num_classes, dtype=torch.bool)
        self.synthetic: SyntheticClassifier | None = None
        if modes.synthetic_classifier:
            self.synthetic = SyntheticClassifier(self.num_classes, feature_dim, context.seed, lr=o.hyper_lr)
            self.classifier_keys = classifier_keys(context.model, self.weights)

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
        """What the server reads of a reply: the base layout plus ``class_counts`` (C, int64) and
        ``class_gradients`` (C x d, the model's dtype) under every option; the clients' ``prototypes`` (C x d)
        only for Table 6's global prototypes (``prototypes != hyper``: the method itself never reads them, so
        its clients do not send them); with ``classifier_step=synthetic`` also the classifier gradients; all
        of them per class (:class:`ClassRows`). The server averages the gradients over the clients that hold
        a class (Eq. 6), the prototypes by the clients' class counts (Eq. 4)."""
        classes, dim = self.num_classes, self.global_prototypes.shape[1]
        dtype = classifier_of(self.scratch).weight.dtype
        layout: ReplyLayout = {**super().reply_layout(), "class_counts": ClassRows((classes,), torch.int64),
                               "class_gradients": ClassRows((classes, dim), dtype, HOLDERS)}
        if self.uses_global:
            layout["prototypes"] = ClassRows((classes, dim), dtype, COUNTS)
        if self.synthetic is not None:  # classifier_step=synthetic: C x C x d and C x C classifier gradients
            layout.update(classifier_weight_gradients=ClassRows((classes, classes, dim), dtype, HOLDERS),
                          classifier_bias_gradients=ClassRows((classes, classes), dtype, HOLDERS))
        return layout

    def validate_reply(self, reply: Payload, who: str = "reply") -> None:
        super().validate_reply(reply, who)
        self.bank.validate([reply])
        if self.synthetic is not None:
            self.synthetic.validate([reply])

    def aggregate(self, round: int, replies: Sequence[Payload]) -> dict[str, float]:
        # validate everything before changing any state: a rejected round leaves the server as it was
        gradients, present = self.bank.validate(replies)
        if self.uses_global:
            prototypes, held_by, counts = stack_prototypes(replies, self.num_classes, self.global_prototypes.shape[1])
        metrics: dict[str, float] = {}
        if self.synthetic is not None:
            weight_gradients, bias_gradients, held_by_client = self.synthetic.validate(replies)
            weight_key, bias_key = self.classifier_keys
            # the head the clients received (and computed their classifier gradients with)
            sent_weight, sent_bias = self.weights[weight_key], self.weights[bias_key]
        self.weights = self.aggregate_weights(replies)
        if self.synthetic is not None:
            weight, bias, metrics = self.synthetic.update(round, weight_gradients, bias_gradients, held_by_client,
                                                          sent_weight, sent_bias)
            self.weights[weight_key], self.weights[bias_key] = weight, bias
        load_weights(self.scratch, self.weights)
        metrics.update(self.bank.update(gradients, present, classifier_of(self.scratch)))
        if self.uses_global:
            new, held = equations.global_prototypes(prototypes, held_by, counts)
            self.global_prototypes, self.global_mask = merge_prototypes(self.global_prototypes, self.global_mask,
                                                                        new, held)
        return metrics

    def last_client_weights(self, replies: Sequence[Payload]) -> dict[str, torch.Tensor]:
        """``fedhpro.authors_last_client``: a copy of the weights of the round's last reply (the engine's order),
        every tensor, BatchNorm statistics included, as the authors' ``get_agg_params`` returns when all the
        dicts it averages are the last client's (``main_run.py`` lines 123-131, 427, 492-507)."""
        self.validate_replies(replies)
        return {key: value.detach().clone() for key, value in replies[-1]["weights"].items()}

    def state_dict(self) -> dict[str, Any]:
        state = {"weights": self.weights, **self.bank.state_dict()}
        if self.uses_global:
            state.update(global_prototypes=self.global_prototypes, global_mask=self.global_mask)
        if self.synthetic is not None:
            state.update(self.synthetic.state_dict())
        return state

    def load_state_dict(self, state) -> None:
        self.weights = dict(state["weights"])
        self.bank.load_state_dict(state)
        if self.uses_global:
            self.global_prototypes = state["global_prototypes"].clone()
            self.global_mask = state["global_mask"].clone().bool()
        if self.synthetic is not None:
            self.synthetic.load_state_dict(state)


def classifier_keys(model: torch.nn.Module, weights: Payload) -> tuple[str, str]:
    """The state keys of the model's classifier weight and bias among the shared ``weights``; ConfigError
    when the classifier has no bias or is not shared (the synthetic classifier step replaces both)."""
    head = classifier_of(model)
    prefix = next(name for name, module in model.named_modules() if module is head)
    keys = (f"{prefix}.weight", f"{prefix}.bias")
    if head.bias is None or any(key not in weights for key in keys):
        raise ConfigError("fedhpro.classifier_step=synthetic needs a shared classifier with a bias; "
                          "set fedhpro.classifier_step=none for this model")
    return keys
