"""Shared parts of the prototype methods (FedProto, FedTGP; readable by FedGMKD and FedSA).

What lives here:

* validating and stacking the prototypes the clients upload (:func:`stack_prototypes`),
* the unweighted mean over the clients that hold a class (:func:`mean_prototypes`), and
  keeping the previous prototype of a class nobody held this round (:func:`merge_prototypes`),
* the client regulariser ``lam * MSE(z, P_y)`` that skips samples whose class has no
  global prototype (:func:`prototype_mse`, :func:`prototype_regularizer`),
* the two protocols of ``baselines.md`` (``dagger``: weights + prototypes; ``proto-only``:
  prototypes only) and the plug-and-play ``prototypes=hyper`` (paper Table 3), as a
  :class:`PrototypeServer` / :class:`PrototypeClient` pair that FedProto and FedTGP subclass.

Payload keys. Server -> client: ``weights`` (``{}`` in proto-only), ``prototypes`` (C x d,
always present; zeros where absent) and ``prototype_mask`` (C bool: which rows are real
prototypes; all False before the first aggregation). Client -> server: ``weights``,
``num_examples``, ``prototypes`` (C x d, Eq. 2 under the trained model, zeros for classes
the client does not hold), ``class_counts`` (C), plus ``class_gradients`` (C x d, Eq. 5)
with ``prototypes=hyper``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedhpro import functional as HF
from fedhpro.data.federation import ClientData
from fedhpro.errors import ConfigError, UpdateError
from fedhpro.methods.base import (
    Client,
    MethodContext,
    Payload,
    Regularizer,
    Server,
    clone_weights,
    extract_features,
    load_weights,
    train_epochs,
)
from fedhpro.methods.hyper import HyperPrototypeBank, class_statistics
from fedhpro.options import option

PROTOCOLS = ("dagger", "proto-only")
PROTOTYPE_SOURCES = ("local", "hyper")
INFERENCE = ("head", "nearest-prototype")


# ----------------------------------------------------------------------------
# option fields shared by the prototype methods (each method declares them in its own dataclass)
# ----------------------------------------------------------------------------


def protocol_option() -> Any:
    return option("dagger", choices=PROTOCOLS,
                  help="dagger: exchange model weights (FedAvg) and prototypes (the paper's default); "
                       "proto-only: exchange prototypes only, every client keeps its own model (Table A7)")


def prototypes_option() -> Any:
    return option("local", choices=PROTOTYPE_SOURCES,
                  help="local: the method's own global prototypes; hyper: the averaged hyper-prototypes H "
                       "learned by FedHPro's gradient matching (plug-and-play, Table 3; needs protocol=dagger)")


def inference_option() -> Any:
    return option("head", choices=INFERENCE,
                  help="how the evaluated models classify: head (the model's own classifier) or "
                       "nearest-prototype (argmin_c ||f(x) - P_c||_2 over the server's global prototypes, "
                       "FedProto's inference; useful with protocol=proto-only)")


def num_hyper_option() -> Any:
    return option(5, min=1, help="|I|, hyper-prototypes per class (prototypes=hyper only)")


def match_steps_option() -> Any:
    return option(30, min=0, help="M, gradient-matching steps per round (prototypes=hyper only)")


def hyper_lr_option() -> Any:
    return option(0.1, gt=0.0, help="step size of gradient matching (prototypes=hyper only)")


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integer parts (the same construction as the simulator's)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


# ----------------------------------------------------------------------------
# pure tensor helpers
# ----------------------------------------------------------------------------


def check_prototype_reply(reply: Payload, num_classes: int, feature_dim: int, who: str = "reply") -> Tensor:
    """UpdateError unless ``reply`` has ``prototypes`` (C x d, finite where held) and ``class_counts`` (C);
    returns the ``C`` bool mask of the classes the client holds (count > 0)."""
    p = reply.get("prototypes")
    n = reply.get("class_counts")
    if not isinstance(p, Tensor) or tuple(p.shape) != (num_classes, feature_dim):
        raise UpdateError(f"{who}: prototypes must be a {num_classes} x {feature_dim} tensor, "
                          f"got {getattr(p, 'shape', type(p).__name__)}")
    if not isinstance(n, Tensor) or tuple(n.shape) != (num_classes,):
        raise UpdateError(f"{who}: class_counts must be a tensor of {num_classes} counts")
    holds = n.detach().cpu() > 0
    if not bool(torch.isfinite(p.detach().cpu()[holds]).all()):
        raise UpdateError(f"{who}: prototypes contain NaN/Inf; the local training diverged (lower lr?)")
    return holds


def stack_prototypes(replies: list[Payload], num_classes: int, feature_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(prototypes K x C x d, present K x C bool, counts K x C)`` from the replies; UpdateError if malformed.

    A class is present for a client when its ``class_counts`` entry is > 0; the
    prototype rows of absent classes are ignored (replaced by zeros), those of
    present classes must be finite.
    """
    if not replies:
        raise UpdateError("no replies to aggregate")
    prototypes, present, counts = [], [], []
    for index, reply in enumerate(replies):
        holds = check_prototype_reply(reply, num_classes, feature_dim, who=f"reply {index}")
        p = reply["prototypes"].detach().cpu().float()
        prototypes.append(torch.where(holds.unsqueeze(1), p, torch.zeros(())))
        present.append(holds)
        counts.append(reply["class_counts"].detach().cpu().clamp(min=0))
    return torch.stack(prototypes), torch.stack(present), torch.stack(counts)


def mean_prototypes(prototypes: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
    """FedProto's aggregation: ``P^c = 1/|A^c| sum_{k in A^c} p_k^c`` (unweighted), ``A^c`` the holders of c.

    Args:
        prototypes: ``K x C x d``.
        present: ``K x C`` bool.

    Returns:
        ``(P, held)``: ``C x d`` (zeros for a class nobody holds) and the ``C`` bool mask of held classes.
    """
    holders = present.sum(0)
    summed = torch.where(present.unsqueeze(2), prototypes, torch.zeros((), dtype=prototypes.dtype)).sum(0)
    return summed / holders.clamp(min=1).unsqueeze(1).to(prototypes.dtype), holders > 0


def merge_prototypes(previous: Tensor, previous_mask: Tensor, new: Tensor, held: Tensor) -> tuple[Tensor, Tensor]:
    """Classes held this round take ``new``; the others keep their previous prototype (and mask)."""
    merged = torch.where(held.unsqueeze(1), new.to(previous.dtype), previous)
    return merged, previous_mask | held


def nearest_class_gaps(prototypes: Tensor, present: Tensor) -> Tensor:
    """``gap_c = min_{c' != c, both present} ||P^c - P^c'||_2`` for each present class (``inf`` otherwise).

    Exact differences (no ``|a|^2 - 2ab + |b|^2`` cancellation).
    """
    num_classes = prototypes.shape[0]
    gaps = torch.full((num_classes,), float("inf"), dtype=prototypes.dtype)
    held = present.nonzero().squeeze(1)
    if held.numel() < 2:
        return gaps
    p = prototypes[held]
    distances = (p.unsqueeze(1) - p.unsqueeze(0)).pow(2).sum(-1).sqrt()
    distances.fill_diagonal_(float("inf"))
    gaps[held] = distances.min(1).values
    return gaps


def prototype_mse(z: Tensor, y: Tensor, prototypes: Tensor, mask: Tensor) -> Tensor:
    """FedProto's regulariser (authors' code): ``MSE(z', z)`` over the whole ``B x d`` batch, with
    ``z'_i = P_{y_i}`` where class ``y_i`` has a global prototype and ``z'_i = z_i`` (no term) otherwise.

    That is ``sum_{i: mask[y_i]} ||z_i - P_{y_i}||^2 / (B * d)``: unregularised samples count in the
    denominator, as in the authors' ``nn.MSELoss()`` on the substituted batch.
    """
    z = z.reshape(z.shape[0], -1)
    targets = prototypes.to(device=z.device, dtype=z.dtype)[y]
    keep = mask.to(z.device)[y].to(z.dtype).unsqueeze(1)
    return ((z - targets).pow(2) * keep).sum() / max(z.numel(), 1)


def prototype_regularizer(prototypes: Tensor, mask: Tensor, weight: float, name: str = "proto") -> Regularizer | None:
    """``(z, y, logits) -> {name: weight * prototype_mse(...)}``, or None when there is nothing to regularise
    (``weight == 0`` or no class has a prototype, e.g. FedProto's round 0)."""
    if weight == 0 or not bool(mask.any()):
        return None

    def regularizer(z: Tensor, y: Tensor, logits: Tensor) -> dict[str, Tensor]:
        return {name: weight * prototype_mse(z, y, prototypes, mask)}

    return regularizer


def received_prototypes(payload: Payload, num_classes: int, feature_dim: int,
                        device: torch.device) -> tuple[Tensor, Tensor]:
    """``(P C x d, mask C bool)`` from a broadcast; all-absent if the payload has none."""
    p = payload.get("prototypes")
    mask = payload.get("prototype_mask")
    if p is None:
        return torch.zeros(num_classes, feature_dim, device=device), torch.zeros(num_classes, dtype=torch.bool,
                                                                               device=device)
    if not isinstance(p, Tensor) or tuple(p.shape) != (num_classes, feature_dim):
        raise UpdateError(f"the server sent prototypes of shape {getattr(p, 'shape', None)}, "
                          f"expected {num_classes} x {feature_dim}")
    if mask is None:
        mask = torch.ones(num_classes, dtype=torch.bool)
    if not isinstance(mask, Tensor) or tuple(mask.shape) != (num_classes,):
        raise UpdateError(f"the server sent a prototype_mask of shape {getattr(mask, 'shape', None)}")
    return p.to(device), mask.to(device=device, dtype=torch.bool)


def local_class_prototypes(model: nn.Module, data: ClientData, num_classes: int) -> tuple[Tensor, Tensor]:
    """``(p_k^c C x d (Eq. 2), n_k^c C)`` from one eval-mode pass of the (trained) model over the data."""
    prototypes, _ = HF.local_prototypes(extract_features(model, data.x), data.y, num_classes)
    counts = torch.bincount(data.y, minlength=num_classes)[:num_classes]
    return prototypes, counts


class NearestPrototypeClassifier(nn.Module):
    """Classify by the nearest global prototype: logits ``-||f(x) - P_c||_2`` (``-inf`` for a class
    without a prototype), so ``argmax`` is FedProto's ``argmin_c ||f(x) - P_c||_2``."""

    def __init__(self, model: nn.Module, prototypes: Tensor, mask: Tensor):
        super().__init__()
        self.model = model
        self.register_buffer("prototypes", prototypes.detach().clone())
        self.register_buffer("mask", mask.detach().clone().bool())

    def forward(self, x: Tensor) -> Tensor:
        z = self.model.features(x).reshape(x.shape[0], -1)
        prototypes = self.prototypes.to(device=z.device, dtype=z.dtype)
        # exact differences, not |a|^2 - 2ab + |b|^2: ties and near-ties stay ordered correctly
        distances = (z.unsqueeze(1) - prototypes.unsqueeze(0)).pow(2).sum(-1).sqrt()
        return (-distances).masked_fill(~self.mask.to(z.device), float("-inf"))


def prototype_inference(options: Any, model: nn.Module, prototypes: Tensor, mask: Tensor) -> nn.Module:
    """``model`` itself (``inference=head``), or a :class:`NearestPrototypeClassifier` over ``prototypes``.

    Before any class has a prototype (nothing aggregated yet) the model's own head is used."""
    if getattr(options, "inference", "head") != "nearest-prototype" or not bool(mask.any()):
        return model
    device = next(model.parameters()).device
    return NearestPrototypeClassifier(model, prototypes.to(device), mask.to(device))


def feature_dim_of(model: nn.Module) -> int:
    classifier = getattr(model, "classifier", None)
    dim = getattr(classifier, "in_features", None)
    if not isinstance(dim, int):
        raise ConfigError("prototype methods need a model whose `classifier` is an nn.Linear "
                          "(feature_dim = in_features)")
    return dim


# ----------------------------------------------------------------------------
# the two protocols and the plug-and-play hyper-prototypes
# ----------------------------------------------------------------------------


def check_protocol(context: MethodContext) -> None:
    """ConfigError for combinations that cannot work (see the messages)."""
    options = context.options
    protocol = getattr(options, "protocol", "dagger")
    source = getattr(options, "prototypes", "local")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"protocol={protocol!r} is not valid; choose one of: {', '.join(PROTOCOLS)}")
    if source not in PROTOTYPE_SOURCES:
        raise ConfigError(f"prototypes={source!r} is not valid; choose one of: {', '.join(PROTOTYPE_SOURCES)}")
    if protocol == "proto-only" and context.shared_keys != []:
        raise ConfigError("protocol=proto-only exchanges no weights: the engine must keep every client's own "
                          "model (Simulator(..., shared='none'), which fedhpro.api does for this protocol)")
    if protocol == "proto-only" and source == "hyper":
        raise ConfigError("prototypes=hyper needs protocol=dagger: gradient matching (Eq. 7-9) needs the global "
                          "classifier, and proto-only exchanges no weights (paper Table 3 uses the dagger variants)")


class PrototypeServer(Server, ABC):
    """FedAvg on the weights (``dagger``) or none (``proto-only``), plus a prototype step.

    Subclasses implement :meth:`prototype_step` (the method's own global prototypes, from the
    validated uploads) and may extend :meth:`extra_state` / :meth:`load_extra_state`. With
    ``prototypes=hyper`` the prototype step is replaced by FedHPro's server step (a
    :class:`HyperPrototypeBank` matched against the new global classifier) and the broadcast
    prototypes are ``H = bank.averaged`` with every class present, from round 0 on (as in FedHPro,
    whose clients use S from the first round).
    """

    def __init__(self, context: MethodContext):
        check_protocol(context)
        super().__init__(context)
        self.feature_dim = feature_dim_of(context.model)
        self.prototypes = torch.zeros(self.num_classes, self.feature_dim)
        self.prototype_mask = torch.zeros(self.num_classes, dtype=torch.bool)
        self.scratch = context.model
        self.bank: HyperPrototypeBank | None = None
        if self.options.prototypes == "hyper":
            o = self.options
            self.bank = HyperPrototypeBank(self.num_classes, self.feature_dim, context.seed, num_hyper=o.num_hyper,
                                           match_steps=o.match_steps, lr=o.hyper_lr)

    @property
    def exchanges_weights(self) -> bool:
        return self.options.protocol == "dagger"

    def broadcast(self, round: int) -> Payload:
        prototypes, mask = self.broadcast_prototypes()
        return {"weights": self.weights if self.exchanges_weights else {},
                "prototypes": prototypes.clone(), "prototype_mask": mask.clone()}

    def validate_reply(self, reply: Payload, who: str = "reply") -> None:
        """The base checks (weights, ``{}`` in proto-only; num_examples) plus the prototype fields."""
        super().validate_reply(reply, who)
        check_prototype_reply(reply, self.num_classes, self.feature_dim, who)
        if self.bank is not None:
            try:
                self.bank.validate([reply])
            except UpdateError as error:  # its messages name the reply "reply 0"
                raise UpdateError(str(error).replace("reply 0", who, 1)) from None

    def aggregate(self, round: int, replies: Sequence[Payload]) -> dict[str, float]:
        # validate everything before changing any state: a rejected round leaves the server as it was
        self.validate_replies(replies)
        prototypes, present, counts = stack_prototypes(replies, self.num_classes, self.feature_dim)
        gradients = None
        if self.bank is not None:
            gradients, _ = self.bank.validate(replies)
        weights = self.average_weights(replies) if self.exchanges_weights else None
        if weights is not None:
            self.weights = weights
        metrics: dict[str, float] = {"classes_held": float(present.any(0).sum())}
        if self.bank is not None:
            load_weights(self.scratch, self.weights)
            metrics.update(self.bank.update(gradients, present, self.scratch.classifier))
        else:
            metrics.update(self.prototype_step(round, prototypes, present, counts))
        return metrics

    def inference_model(self, model: nn.Module) -> nn.Module:
        prototypes = self.broadcast_prototypes()
        return prototype_inference(self.options, model, *prototypes)

    def broadcast_prototypes(self) -> tuple[Tensor, Tensor]:
        """``(P C x d, mask C)``: what the clients receive (the hyper-prototypes with ``prototypes=hyper``)."""
        if self.bank is not None:
            return self.bank.averaged, torch.ones(self.num_classes, dtype=torch.bool)
        return self.prototypes, self.prototype_mask

    @abstractmethod
    def prototype_step(self, round: int, prototypes: Tensor, present: Tensor, counts: Tensor) -> dict[str, float]:
        """Update ``self.prototypes`` / ``self.prototype_mask`` from this round's uploads; return metrics."""

    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: Mapping[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        state = {"weights": self.weights, "prototypes": self.prototypes, "prototype_mask": self.prototype_mask}
        if self.bank is not None:
            state.update(self.bank.state_dict())
        state.update(self.extra_state())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.weights = dict(state["weights"])
        self.prototypes = state["prototypes"].clone()
        self.prototype_mask = state["prototype_mask"].clone().bool()
        if self.bank is not None:
            self.bank.load_state_dict(state)
        self.load_extra_state(state)


class PrototypeClient(Client):
    """Load the received weights (may be ``{}``), train on ``CE + lam * MSE(z, P_y)`` (absent classes
    skipped), then upload the local prototypes (Eq. 2) and counts; with ``prototypes=hyper`` also the
    class gradients (Eq. 5), all from one eval-mode pass of the trained model."""

    def regularizer(self, payload: Payload, data: ClientData, feature_dim: int) -> Regularizer | None:
        prototypes, mask = received_prototypes(payload, self.num_classes, feature_dim, data.x.device)
        return prototype_regularizer(prototypes, mask, float(self.options.lam))

    def fit(self, model: nn.Module, payload: Payload, data: ClientData, state: dict[str, Any],
            generator: torch.Generator) -> tuple[Payload, dict[str, float]]:
        load_weights(model, payload["weights"])
        regularizer = self.regularizer(payload, data, feature_dim_of(model))
        losses = train_epochs(model, data, self.train, generator, regularizer)
        reply: Payload = {"weights": clone_weights(model, payload["weights"]), "num_examples": len(data)}
        if self.options.prototypes == "hyper":
            gradients, counts, prototypes = class_statistics(model, data, self.num_classes)
            reply["class_gradients"] = gradients.cpu()
        else:
            prototypes, counts = local_class_prototypes(model, data, self.num_classes)
        reply["prototypes"] = prototypes.detach().cpu()
        reply["class_counts"] = counts.cpu()
        return reply, losses
