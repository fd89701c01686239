"""What the prototype methods (FedProto, FedTGP, FedGMKD, FedSA) share, written once.

What lives here:

* the code of their common options, :class:`PrototypeOptions` (the protocol, the prototype source, the
  inference rule, the hyper-prototype knobs, which each method's options dataclass extends), declared without torch
  in :mod:`fedhpro.methods.prototype_options` with the other facts their declarations share,
* validating and stacking the prototypes the clients upload (:func:`stack_prototypes`) and
  keeping the previous prototype of a class nobody held this round (:func:`merge_prototypes`);
  the unweighted mean over the clients that hold a class is
  :func:`fedhpro.functional.mean_client_prototypes`,
* the client loss term ``lam * MSE(z, P_y)`` that skips samples whose class has no
  global prototype (:func:`prototype_mse`, :func:`prototype_regularizer`),
* the two protocols of ``baselines.md`` (``dagger``: weights + prototypes; ``proto-only``:
  prototypes only) and the plug-and-play ``prototypes=hyper`` (paper Table 3), as a
  :class:`PrototypeServer` / :class:`PrototypeClient` pair that the four methods subclass. A
  method writes its prototype step (server), its loss terms and its upload (client hooks); the
  protocols, the hyper-prototypes, the reply checks, the nearest-prototype inference, what the
  server exposes to diagnostics and the server state are the same code for all four.

Payload keys. Server -> client: ``weights`` (``{}`` in proto-only), ``prototypes`` (C x d,
always present; zeros where absent) and ``prototype_mask`` (C bool: which rows are real
prototypes; all False before the first aggregation). Client -> server: ``weights``,
``num_examples``, ``prototypes`` (C x d, Eq. 2 under the trained model, zeros for classes
the client does not hold), ``class_counts`` (C); with ``prototypes=hyper`` ``class_gradients``
(C x d, Eq. 5) in place of the prototypes, which FedHPro's server step does not read (FedGMKD,
whose knowledge step reads them, sends both). FedGMKD adds soft predictions both ways; FedSA broadcasts its
``anchors`` in place of ``prototypes`` and ``prototype_mask``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro import functional
from fedhpro.errors import ConfigError, UpdateError
from fedhpro.methods.base import Client, InferenceRule, MethodContext, Server, load_weights
from fedhpro.methods.fedhpro.hyper import HyperPrototypeBank, feature_statistics
from fedhpro.methods.layout import ClassRows, Payload, ReplyLayout, Weights
from fedhpro.methods.no_grad import extract_features
from fedhpro.methods.parts import classifier_of, features_of

# the options and declared facts live in the torch-free prototype_options; imported here under their old path
from fedhpro.methods.prototype_options import INFERENCE as INFERENCE
from fedhpro.methods.prototype_options import PROTOCOLS, PROTOTYPE_SOURCES
from fedhpro.methods.prototype_options import RAW_PROTOTYPES_CLIPPING as RAW_PROTOTYPES_CLIPPING
from fedhpro.methods.prototype_options import PrototypeOptions as PrototypeOptions
from fedhpro.methods.prototype_options import weights_travel as weights_travel
from fedhpro.methods.training import LocalRound, LossTerms, Regularizer, regularizer_terms

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


def check_class_counts(reply: Payload, num_classes: int, who: str = "reply") -> Tensor:
    """UpdateError unless ``reply`` has ``class_counts`` (C); returns the ``C`` bool mask of the classes the
    client holds (count > 0): :func:`check_prototype_reply` for a reply without prototypes."""
    n = reply.get("class_counts")
    if not isinstance(n, Tensor) or tuple(n.shape) != (num_classes,):
        raise UpdateError(f"{who}: class_counts must be a tensor of {num_classes} counts")
    return n.detach().cpu() > 0


def check_class_tensor(reply: Payload, key: str, shape: tuple[int, ...], who: str,
                       held: Tensor | None = None) -> Tensor:
    """``reply[key]`` as a tensor of ``shape``, finite on the rows of ``held`` (all rows if None);
    UpdateError naming ``who`` and ``key`` otherwise."""
    value = reply.get(key)
    if not isinstance(value, Tensor) or tuple(value.shape) != tuple(shape):
        raise UpdateError(f"{who}: {key} must be a tensor of shape {tuple(shape)}, "
                          f"got {tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__}")
    rows = value if held is None else value[held]
    if value.is_floating_point() and not bool(torch.isfinite(rows).all()):
        raise UpdateError(f"{who}: {key} contains NaN/Inf")
    return value


class Uploads(NamedTuple):
    """One round's uploaded prototypes, stacked over the ``K`` replies in their order."""

    prototypes: Tensor  # K x C x d float32, zeros where the client does not hold the class
    present: Tensor  # K x C bool: class_counts > 0
    counts: Tensor  # K x C class counts n_k^c


def stack_prototypes(replies: Sequence[Payload], num_classes: int, feature_dim: int) -> Uploads:
    """The replies' ``prototypes``, presence and ``class_counts`` (:class:`Uploads`); UpdateError if malformed.

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
    return Uploads(torch.stack(prototypes), torch.stack(present), torch.stack(counts))


def stack_presence(replies: Sequence[Payload], num_classes: int) -> Tensor:
    """``K x C`` bool: which classes each reply's client holds (``class_counts > 0``), for a server that reads
    the counts but not the prototypes (the prototype methods with ``prototypes=hyper``); UpdateError if
    malformed. The same mask as :func:`stack_prototypes`' ``present``."""
    if not replies:
        raise UpdateError("no replies to aggregate")
    return torch.stack([check_class_counts(reply, num_classes, who=f"reply {index}")
                        for index, reply in enumerate(replies)])


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


#: clamp of a squared distance before its square root (finite gradients where a vector equals its centre)
SQUARED_DISTANCE_FLOOR = 1e-12


def clamped_distances(x: Tensor, centers: Tensor) -> Tensor:
    """``sqrt(max(||x_i - c_j||_2^2, 1e-12))`` (B x C), from exact differences."""
    squared = (x.unsqueeze(1) - centers.unsqueeze(0)).pow(2).sum(-1)
    return squared.clamp(min=SQUARED_DISTANCE_FLOOR).sqrt()


def margin_ce(x: Tensor, labels: Tensor, centers: Tensor, margin: float) -> Tensor:
    """``CE(-(d(x_i, c_j) + margin * [j = y_i]), y_i)``, mean over the batch, ``d`` the
    :func:`clamped_distances`: FedTGP's server loss (uploaded prototypes against the TGP's) and
    FedSA's margin-enhanced contrastive term (features against the anchors).

    Args:
        x: ``B x d`` vectors.
        labels: ``B`` their classes.
        centers: ``C x d`` one centre per class.
        margin: added to the distance of each vector to its own class's centre.
    """
    distances = clamped_distances(x, centers)
    logits = -(distances + margin * F.one_hot(labels, centers.shape[0]).to(distances.dtype))
    return F.cross_entropy(logits, labels)


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


def class_uploads(classifier: nn.Module, features: Tensor, labels: Tensor, num_classes: int,
                  with_gradients: bool) -> Payload:
    """A client's class statistics from the features of one eval-mode pass of its trained model:
    ``prototypes`` (``p_k^c``, Eq. 2), ``class_counts`` (``n_k^c``) and, ``with_gradients``
    (``prototypes=hyper``), ``class_gradients`` (``g_k^c``, Eq. 5, through ``classifier``); on the CPU."""
    counts = torch.bincount(labels, minlength=num_classes)[:num_classes]
    upload: Payload = {}
    if with_gradients:
        gradients, prototypes = feature_statistics(classifier, features, labels, num_classes)
        upload["class_gradients"] = gradients.cpu()
    else:
        prototypes, _ = functional.local_prototypes(features, labels, num_classes)
    upload["prototypes"] = prototypes.detach().cpu()
    upload["class_counts"] = counts.cpu()
    return upload


def private_class_uploads(client: Client, round: LocalRound, classifier: nn.Module, features: Tensor,
                          labels: Tensor, with_gradients: bool, temperature: float | None = None) -> Payload:
    """``privacy=sample``: what :func:`class_uploads` sends, from the round's one release
    (:meth:`~fedhpro.methods.base.Client.release_statistics`): ``prototypes`` (noisy means of the per-sample
    features), ``class_counts`` (noisy, rounded), with ``with_gradients`` ``class_gradients`` (noisy means of the
    per-sample ``d CE(h(z_i), y_i) / d z_i``) and with a ``temperature`` ``soft_predictions`` (noisy means of
    ``softmax(h(z_i) / T)``); every row of a class the release does not count is zero. On the CPU."""
    features = features.reshape(features.shape[0], -1).detach()
    parts: dict[str, Tensor] = {"prototypes": features}
    was_training = classifier.training
    classifier.eval()
    try:
        if with_gradients:
            with torch.enable_grad():  # the per-sample terms of Eq. 5's class means
                parts["class_gradients"] = functional.per_sample_input_gradients(features, labels, classifier,
                                                                          create_graph=False).detach()
        if temperature is not None:
            with torch.no_grad():
                parts["soft_predictions"] = torch.softmax(classifier(features) / temperature, dim=1)
    finally:
        classifier.train(was_training)
    released = client.release_statistics(round, labels, parts)
    upload: Payload = {**released.means, "class_counts": released.counts}
    if temperature is not None:  # post-processing: each held class's noisy mean back onto the simplex
        soft = upload["soft_predictions"].clamp(min=0)
        total = soft.sum(1, keepdim=True)
        uniform = torch.full_like(soft, 1.0 / soft.shape[1])
        soft = torch.where(total > 0, soft / total.clamp(min=torch.finfo(soft.dtype).tiny), uniform)
        upload["soft_predictions"] = torch.where(released.counts.unsqueeze(1) > 0, soft, torch.zeros_like(soft))
    return upload


class NearestPrototypeClassifier(nn.Module):
    """Classify by the nearest global prototype: logits ``-||f(x) - P_c||_2`` (``-inf`` for a class
    without a prototype), so ``argmax`` is FedProto's ``argmin_c ||f(x) - P_c||_2``."""

    #: buffers (registered in ``__init__``): the ``C x d`` prototypes and the ``C`` bool mask of classes with one
    prototypes: Tensor
    mask: Tensor

    def __init__(self, model: nn.Module, prototypes: Tensor, mask: Tensor):
        super().__init__()
        self.model = model
        self.register_buffer("prototypes", prototypes.detach().clone())
        self.register_buffer("mask", mask.detach().clone().bool())

    def forward(self, x: Tensor) -> Tensor:
        z = features_of(self.model)(x).reshape(x.shape[0], -1)
        prototypes = self.prototypes.to(device=z.device, dtype=z.dtype)
        # exact differences, not |a|^2 - 2ab + |b|^2: ties and near-ties stay ordered correctly
        distances = (z.unsqueeze(1) - prototypes.unsqueeze(0)).pow(2).sum(-1).sqrt()
        return (-distances).masked_fill(~self.mask.to(z.device), float("-inf"))


def empty_nearest_prototype(network: nn.Module, num_classes: int) -> NearestPrototypeClassifier:
    """A :class:`NearestPrototypeClassifier` over ``network`` without prototypes yet (zeros, no class marked):
    what a saved one's state dict is loaded into."""
    dim = classifier_of(network).in_features
    return NearestPrototypeClassifier(network, torch.zeros(num_classes, dim),
                                      torch.zeros(num_classes, dtype=torch.bool))


#: the prototype methods' ``inference=nearest-prototype`` as their MethodSpec declares it (kept on export)
NEAREST_PROTOTYPE = InferenceRule("nearest-prototype", empty_nearest_prototype)


def prototype_inference(inference: str, model: nn.Module, prototypes: Tensor, mask: Tensor) -> nn.Module:
    """``model`` itself (``inference=head``), or a :class:`NearestPrototypeClassifier` over ``prototypes``.

    Before any class has a prototype (nothing aggregated yet) the model's own head is used."""
    if inference != "nearest-prototype" or not bool(mask.any()):
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
    protocol, source = options.protocol, options.prototypes
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

    The method's global prototypes are ``self.prototypes`` (C x d) with ``self.prototype_mask`` (C
    bool), none before the first aggregation. A round (:meth:`aggregate`) validates every reply,
    stacks the uploads, runs the method's :meth:`prototype_step`, then averages the weights
    (:meth:`aggregate_weights`, ``dagger`` only).

    With ``prototypes=hyper`` the prototype step is replaced (unless :attr:`steps_with_hyper`) by
    FedHPro's server step, a :class:`HyperPrototypeBank` matched against the new global
    classifier, and the broadcast prototypes are ``H = bank.averaged`` with every class present,
    from round 0 on (as in FedHPro, whose clients use S from the first round).

    Subclasses implement :meth:`prototype_step` and may extend :meth:`method_state` /
    :meth:`load_method_state` (what else they keep), :meth:`broadcast` and :meth:`validate_reply`.
    """

    #: whether :meth:`prototype_step` also runs with ``prototypes=hyper``: FedGMKD's knowledge step sends
    #: soft predictions and weights the clients either way; FedProto's and FedTGP's prototypes would go unused
    steps_with_hyper = False
    #: how the server combines the clients' prototypes (and class gradients) of a class, declared in
    #: :meth:`reply_layout` (:attr:`ClassRows.averaged`); None: not by a mean (FedTGP trains on them)
    rows_averaged: str | None = None

    def __init__(self, context: MethodContext):
        check_protocol(context)
        super().__init__(context)
        o = self.options
        self.feature_dim = feature_dim_of(context.model)
        self.prototypes = torch.zeros(self.num_classes, self.feature_dim)
        self.prototype_mask = torch.zeros(self.num_classes, dtype=torch.bool)
        self.scratch = context.model
        self.bank = (HyperPrototypeBank(self.num_classes, self.feature_dim, context.seed, num_hyper=o.num_hyper,
                                        match_steps=o.match_steps, lr=o.hyper_lr)
                     if o.prototypes == "hyper" else None)

    @property
    def exchanges_weights(self) -> bool:
        return self.options.protocol == "dagger"

    @property
    def reads_prototypes(self) -> bool:
        """Whether the server reads the clients' prototypes: in its own prototype step, which
        ``prototypes=hyper`` replaces by FedHPro's unless :attr:`steps_with_hyper`. Only then does
        :meth:`reply_layout` declare them (and the clients send them: :attr:`PrototypeClient.sends_prototypes`)."""
        return self.bank is None or self.steps_with_hyper

    def broadcast_weights(self) -> Weights:
        """The global weights in ``dagger``; ``{}`` in ``proto-only`` (every client keeps its own model)."""
        return self.weights if self.exchanges_weights else {}

    def broadcast_prototypes(self) -> tuple[Tensor, Tensor]:
        """``(P C x d, mask C)``: what the clients receive (the hyper-prototypes with ``prototypes=hyper``)."""
        if self.bank is not None:
            return self.bank.averaged, torch.ones(self.num_classes, dtype=torch.bool)
        return self.prototypes, self.prototype_mask

    def broadcast(self, round: int) -> Payload:
        prototypes, mask = self.broadcast_prototypes()
        return {"weights": self.broadcast_weights(), "prototypes": prototypes.clone(), "prototype_mask": mask.clone()}

    def exposed_prototypes(self) -> tuple[Tensor, Tensor, str]:
        """The broadcast prototypes: the hyper-prototypes H (``"hyper"``) with ``prototypes=hyper``, the
        method's own (``"global"``) otherwise."""
        prototypes, mask = self.broadcast_prototypes()
        return prototypes.detach(), mask.bool(), "hyper" if self.bank is not None else "global"

    def inference_model(self, model: nn.Module) -> nn.Module:
        return prototype_inference(self.options.inference, model, *self.broadcast_prototypes())

    def reply_layout(self) -> ReplyLayout:
        """What the server reads of a reply: the base layout (weights, ``{}`` in proto-only; num_examples),
        ``class_counts`` (C, int64), ``prototypes`` (C x d, the model's dtype) when it reads them
        (:attr:`reads_prototypes`) and, with ``prototypes=hyper``, ``class_gradients`` (C x d); all but the
        weights per class (:class:`ClassRows`, averaged as :attr:`rows_averaged` says)."""
        rows = ClassRows((self.num_classes, self.feature_dim), classifier_of(self.scratch).weight.dtype,
                         self.rows_averaged)
        layout: ReplyLayout = super().reply_layout()
        if self.reads_prototypes:
            layout["prototypes"] = rows
        layout["class_counts"] = ClassRows((self.num_classes,), torch.int64)
        if self.bank is not None:
            layout["class_gradients"] = rows
        return layout

    def validate_reply(self, reply: Payload, who: str = "reply") -> None:
        """The base checks (weights, ``{}`` in proto-only; num_examples), the class counts, the prototypes
        when the server reads them and, with ``prototypes=hyper``, the class gradients."""
        super().validate_reply(reply, who)
        held = (check_prototype_reply(reply, self.num_classes, self.feature_dim, who) if self.reads_prototypes
                else check_class_counts(reply, self.num_classes, who))
        if self.bank is not None:
            check_class_tensor(reply, "class_gradients", (self.num_classes, self.feature_dim), who, held)

    def aggregate(self, round: int, replies: Sequence[Payload]) -> dict[str, float]:
        # validate everything before changing any state: a rejected round leaves the server as it was
        self.validate_replies(replies)
        uploads = stack_prototypes(replies, self.num_classes, self.feature_dim) if self.reads_prototypes else None
        present = uploads.present if uploads is not None else stack_presence(replies, self.num_classes)
        gradients = self.bank.validate(replies)[0] if self.bank is not None else None
        metrics: dict[str, float] = {"classes_held": float(present.any(0).sum())}
        if uploads is not None:
            metrics.update(self.prototype_step(round, uploads, replies))
        if self.exchanges_weights:
            self.weights = self.aggregate_weights(replies)
        if self.bank is not None:
            assert gradients is not None  # stacked and validated above, with the bank
            load_weights(self.scratch, self.weights)
            metrics.update(self.bank.update(gradients, present, classifier_of(self.scratch)))
        return metrics

    @abstractmethod
    def prototype_step(self, round: int, uploads: Uploads, replies: Sequence[Payload]) -> dict[str, float]:
        """Update the method's global prototypes from this round's validated uploads; return metrics."""

    def aggregate_weights(self, replies: Sequence[Payload]) -> Weights:
        """The new global weights (``dagger``), after :meth:`prototype_step`: FedAvg by ``num_examples``."""
        return self.average_weights(replies)

    def method_state(self) -> dict[str, Any]:
        """The method's own server state by ``state_dict`` key: its global prototypes and their mask."""
        return {"prototypes": self.prototypes, "prototype_mask": self.prototype_mask}

    def load_method_state(self, state: Mapping[str, Any]) -> None:
        self.prototypes = state["prototypes"].clone()
        self.prototype_mask = state["prototype_mask"].clone().bool()

    def state_dict(self) -> dict[str, Any]:
        state = {"weights": self.weights, **self.method_state()}
        if self.bank is not None:
            state.update(self.bank.state_dict())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.weights = dict(state["weights"])
        self.load_method_state(state)
        if self.bank is not None:
            self.bank.load_state_dict(state)


class PrototypeClient(Client):
    """Load the received weights (may be ``{}``), train on CE plus the method's :meth:`loss_terms`,
    then reply the trained weights and the method's :meth:`upload` (the hooks of :class:`Client`).

    The defaults are FedProto's: ``lam * MSE(z, P_y)`` (classes without a global prototype
    skipped), and the local prototypes (Eq. 2) and class counts, with ``prototypes=hyper`` also the
    class gradients (Eq. 5), all from one eval-mode pass of the trained model.
    """

    def loss_terms(self, round: LocalRound) -> LossTerms | None:
        prototypes, mask = received_prototypes(round.payload, self.num_classes, feature_dim_of(round.model),
                                               round.device)
        regularizer = prototype_regularizer(prototypes, mask, float(self.options.lam))
        return None if regularizer is None else regularizer_terms(regularizer)

    @property
    def sends_prototypes(self) -> bool:
        """Whether the reply carries the local prototypes: not with ``prototypes=hyper``, whose server step
        replaces the method's own and reads only the counts and class gradients
        (:attr:`PrototypeServer.reads_prototypes`; FedGMKD, whose knowledge step reads them either way, uploads
        by its own :meth:`upload`)."""
        return self.options.prototypes != "hyper"

    def class_statistics(self, round: LocalRound) -> Payload:
        """The client's class statistics of its trained model (one eval-mode pass): prototypes, counts and, with
        ``prototypes=hyper``, class gradients (:func:`class_uploads`; under ``privacy=sample`` the round's one
        release of them, :func:`private_class_uploads`), whether or not the reply carries the prototypes."""
        features = extract_features(round.model, round.data.x)
        if self.sample_private:
            return private_class_uploads(self, round, classifier_of(round.model), features, round.data.y,
                                         with_gradients=self.options.prototypes == "hyper")
        return class_uploads(classifier_of(round.model), features, round.data.y, self.num_classes,
                             with_gradients=self.options.prototypes == "hyper")

    def sent(self, statistics: Payload) -> Payload:
        """What of :meth:`class_statistics` the reply carries: all of it, less the prototypes unless
        :attr:`sends_prototypes`."""
        if self.sends_prototypes:
            return statistics
        return {key: value for key, value in statistics.items() if key != "prototypes"}

    def upload(self, round: LocalRound) -> Payload:
        return self.sent(self.class_statistics(round))
