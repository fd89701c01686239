"""What every method is made of: a server part and a client part exchanging plain payloads.

A payload is a ``dict`` of tensors, numbers and nested dicts of tensors (a
model's weights under ``"weights"``). Neither part knows which engine runs it:
the in-process simulator and the Flower apps call the same four hooks.

Server hooks: ``broadcast(round) -> payload``, ``aggregate(round, replies) ->
metrics``, ``global_weights()``, ``state_dict()`` / ``load_state_dict()``, and
for diagnostics ``exposed_prototypes()`` (None unless the method has prototypes).
The engines collect a round's replies in ``new_replies()`` (a :class:`Replies`
that folds each reply's weights into a running weighted sum as it arrives)
and hand that to ``aggregate``; methods also accept a plain list.
Client: ``fit(model, payload, data, state, generator) -> (reply, metrics)``, one fixed sequence for
every method (load the payload's weights, :meth:`Client.prepare`, the shared training loop
:func:`train_epochs` on CE plus :meth:`Client.loss_terms`, the reply of the trained weights plus
:meth:`Client.upload`). A method fills in those hooks (and :meth:`Client.activation_modules`,
:meth:`Client.train_settings`), never a loop of its own; they share one :class:`LocalRound`.

The reply's layout is a contract. ``Server.reply_layout()`` declares, as plain
data, every key a client's reply holds and its form: a dict ``{name: (shape,
dtype)}`` for a model's weights, ``(shape, dtype)`` for one tensor, or a
scalar type (``int``, ``float``, ``bool``, ``str``). The default declares
``weights`` (the keys, shapes and dtypes of ``self.weights``) and
``num_examples`` (``int``); a method whose client uploads more (prototypes,
counts, soft predictions) extends it. The Flower server compares every reply
with this declaration before it decodes a single array (no ``np.load`` of a
reply that does not fit), and drops a reply with an extra or missing key, a
wrong dtype or shape, or more bytes than its shape needs. A plug-in method
must therefore declare every key its client uploads: an undeclared key is
refused with a line naming it and this fix. A tensor whose rows are per class (prototypes, class
gradients, counts) is declared as :class:`ClassRows` (still a ``(shape, dtype)``): the engines act on
per-class tensors (injected hostility, the robust rules) by that declaration alone; its ``averaged``
says how the server combines the clients' rows of a class, which secure aggregation needs to sum them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast, final, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro import runtime
from fedhpro.averaging import WeightedSum
from fedhpro.data.federation import ClientData
from fedhpro.errors import ConfigError, UpdateError
from fedhpro.functional import weighted_average
from fedhpro.methods import sample_dp

Payload = dict[str, Any]
Weights = dict[str, Tensor]
#: one tensor of a reply layout: ``(shape, dtype)``
TensorLayout = tuple[tuple[int, ...], torch.dtype]


#: how a method's server averages a class's rows over the clients (:attr:`ClassRows.averaged`): the mean over
#: the clients that hold the class, or the mean weighted by the clients' counts of the class
HOLDERS, COUNTS = "holders", "counts"


class _Rows(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


class ClassRows(_Rows):
    """A tensor of a reply layout whose rows are per class (``shape[0]`` is the number of classes:
    prototypes, class gradients, soft predictions, class counts). It is a ``(shape, dtype)`` like any
    :data:`TensorLayout`; the engines read the per-class keys from it (:func:`class_keys`: injected
    hostility and the robust rules act on such tensors row by row), never from a reply's shapes.

    ``averaged`` (a keyword beside the tuple, not one of its items) declares how the server's step
    combines the clients' rows of a class: :data:`HOLDERS` (their mean over the clients that hold the
    class), :data:`COUNTS` (their mean weighted by the clients' counts of the class), or None (not
    declared: neither, or not said). Secure aggregation sums only declared rows
    (:mod:`fedhpro.flower.secure_sum`)."""

    averaged: str | None = None

    def __new__(cls, shape: tuple[int, ...], dtype: torch.dtype, averaged: str | None = None) -> ClassRows:
        if averaged not in (None, HOLDERS, COUNTS):
            raise ConfigError(f"ClassRows(averaged={averaged!r}): say {HOLDERS!r} (the mean over the clients "
                              f"holding the class), {COUNTS!r} (weighted by their class counts) or None")
        rows = super().__new__(cls, shape, dtype)
        rows.averaged = averaged
        return rows

    def __repr__(self) -> str:
        return f"ClassRows(shape={self.shape!r}, dtype={self.dtype!r}, averaged={self.averaged!r})"


#: a reply's declared layout (:meth:`Server.reply_layout`): per key, ``{name: (shape, dtype)}`` (a model's
#: weights), ``(shape, dtype)`` (one tensor) or a scalar type (``int``, ``float``, ``bool``, ``str``)
ReplyLayout = dict[str, dict[str, TensorLayout] | TensorLayout | type]


def tensor_layout(tensor: Tensor) -> TensorLayout:
    """``(shape, dtype)`` of ``tensor``: its entry in a reply layout."""
    return tuple(tensor.shape), tensor.dtype


def class_keys(layout: Mapping[str, Any]) -> list[str]:
    """The keys a reply layout declares per class (:class:`ClassRows`), in the layout's order."""
    return [key for key, entry in layout.items() if isinstance(entry, ClassRows)]


def weights_layout(weights: Mapping[str, Tensor]) -> dict[str, TensorLayout]:
    """``{name: (shape, dtype)}`` of a model's weights, in their order: their entry in a reply layout."""
    return {name: tensor_layout(tensor) for name, tensor in weights.items()}


@dataclass(frozen=True)
class TrainSettings:
    """Local optimisation settings shared by all methods (SGD, as the paper)."""

    epochs: int = 1
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-5
    #: clip the gradient's global L2 norm to this before each step (None: no clipping); a method's
    #: recipe may set it (FedRCL's authors clip at 10)
    max_grad_norm: float | None = None
    #: mixed precision of the training forward pass: "off" (float32, the default) or "bf16" (the model's
    #: forward under ``torch.autocast(bfloat16)``; the losses and the weights stay float32, no loss scaling; on a
    #: GPU without native bfloat16, float16 autocast with a gradient scaler: :func:`fedhpro.runtime.amp_precision`)
    amp: str = "off"
    #: convert the model and every image batch to ``torch.channels_last``: True, False, or None (auto: exactly
    #: when ``amp`` is on and the model has a Conv2d, :func:`fedhpro.runtime.trains_channels_last`)
    channels_last: bool | None = None
    #: ``torch.compile`` the feature extractor once per working model (the compiled graph is reused by every
    #: client, as the working model is)
    compile: bool = False
    #: ``privacy=sample`` (DP-SGD): each sample's gradient (and feature, for what a method uploads) is
    #: clipped to this L2 norm; None: no sample-level DP. Set from ``privacy.*`` by :mod:`fedhpro.privacy`.
    dp_clip: float | None = None
    #: ``privacy=sample``: the Gaussian noise's std is ``dp_noise_multiplier x dp_clip`` (calibrated by the
    #: privacy ledger when ``privacy.target_epsilon`` is set)
    dp_noise_multiplier: float = 0.0
    #: ``privacy=sample`` with ``privacy.secure_noise=true``: DP-SGD's noise and Poisson batches and the statistics
    #: release's noise come from the operating system's randomness, not the round's seeded generator (anyone who
    #: knows the seed could redraw seeded noise); False (unset or false): seeded, the run repeats
    dp_secure_noise: bool = False

    def __post_init__(self) -> None:
        if self.amp not in AMP_CHOICES:
            raise ValueError(f"amp must be one of {AMP_CHOICES}, got {self.amp!r}")

    @property
    def fast_path(self) -> bool:
        """Whether any of the opt-in speed settings (amp, channels_last, compile) is on."""
        return self.amp != "off" or self.channels_last or self.compile


#: the values of ``TrainSettings.amp``
AMP_CHOICES = ("off", "bf16")

#: ``LocalRound.scratch`` key of the round's released statistics (``privacy=sample``)
RELEASED = "released_statistics"


@dataclass
class MethodContext:
    """What the engine tells a method when it builds it."""

    model: nn.Module  # a template of the global model (the server may use it as scratch)
    num_classes: int
    options: Any  # the method's options dataclass
    train: TrainSettings
    seed: int = 0
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    #: the state keys exchanged and aggregated (None: the whole model; heterogeneous models: the classifier)
    shared_keys: list[str] | None = None


def features_of(model: nn.Module) -> nn.Module:
    """``model.features``, the feature extractor every fedhpro model has (:mod:`fedhpro.models`), typed:
    ``nn.Module``'s attribute access is typed ``Tensor | Module`` by torch."""
    return cast(nn.Module, model.features)


def classifier_of(model: nn.Module) -> nn.Linear:
    """``model.classifier``, the linear head ``nn.Linear(d, C)`` every fedhpro model has (:mod:`fedhpro.models`),
    typed: ``nn.Module``'s attribute access is typed ``Tensor | Module`` by torch."""
    return cast(nn.Linear, model.classifier)


def model_weights(model: nn.Module, keys: Iterable[str] | None = None) -> Weights:
    """The model's own state tensors (only ``keys`` if given), detached and not copied: they change when the
    model trains or is loaded again, so whoever keeps them past that copies them (:func:`clone_weights`)."""
    state = model.state_dict()
    names = state.keys() if keys is None else keys
    return {name: state[name] for name in names}


def clone_weights(model: nn.Module, keys: Iterable[str] | None = None) -> Weights:
    """A copy of the model's state (only ``keys`` if given), sharing no storage with the model."""
    return {name: tensor.detach().clone() for name, tensor in model_weights(model, keys).items()}


def load_weights(model: nn.Module, weights: Mapping[str, Tensor]) -> None:
    """Load the shared part of a model: every key in ``weights`` must exist in the model.

    With a homogeneous federation ``weights`` is the whole state; with
    heterogeneous feature extractors it is the shared classifier only, and the
    client's own feature extractor stays as it is.
    """
    state = model.state_dict()
    unknown = [name for name in weights if name not in state]
    if unknown:
        raise UpdateError(f"the server sent weights {unknown[:3]} that this client's model does not have")
    with torch.no_grad():
        for name, tensor in weights.items():
            if state[name].shape != tensor.shape:
                raise UpdateError(f"the server sent '{name}' with shape {tuple(tensor.shape)}, "
                                  f"the client's model has {tuple(state[name].shape)}")
            state[name].copy_(tensor)


def all_finite(tensor: Tensor) -> bool:
    """Whether a floating tensor holds no NaN or infinity: its minimum and maximum are finite (a NaN
    propagates into both). One reduction and no tensor-sized temporary, so checking every reply stays cheap
    with thousands of clients (``torch.isfinite(t).all()`` allocates a mask as large as ``t``)."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def check_weights(weights: Any, reference: Mapping[str, Tensor], who: str = "client") -> None:
    """Raise UpdateError unless ``weights`` has the reference's keys, shapes and only finite values."""
    if not isinstance(weights, Mapping):
        raise UpdateError(f"{who} sent weights of type {type(weights).__name__}, expected a dict of tensors")
    missing = set(reference) - set(weights)
    extra = set(weights) - set(reference)
    if missing or extra:
        raise UpdateError(f"{who} sent weights with missing keys {sorted(missing)[:3]} / "
                          f"unexpected keys {sorted(extra)[:3]}")
    for name, tensor in weights.items():
        if not isinstance(tensor, Tensor) or tensor.shape != reference[name].shape:
            raise UpdateError(f"{who} sent '{name}' with shape {getattr(tensor, 'shape', None)}, "
                              f"expected {tuple(reference[name].shape)}")
        if tensor.is_floating_point() and not all_finite(tensor):
            raise UpdateError(f"{who} sent non-finite values in '{name}'; the local training diverged (lower lr?)")


class Replies(Sequence[Payload]):
    """One round's valid replies, in the order an engine appends them (client order).

    With ``fold_weights`` (what :meth:`Server.new_replies` gives unless the
    method says otherwise) each reply's ``"weights"`` are folded, as the reply
    is appended, into a running ``n_k``-weighted sum (:class:`WeightedSum`, by
    ``num_examples``), and the stored reply keeps every other key (counts,
    prototypes, class gradients: small) but not the weights. The round then
    holds one model's worth of summed weights, not one copy per client, and
    :meth:`Server.average_weights` returns the same numbers as for the list of
    the full replies in the same order (bit for bit). Without ``fold_weights``
    it is a plain list of the replies as appended.

    Append only replies that passed :meth:`Server.validate_reply`: the weights
    are gone afterwards, so the server cannot check them again.
    """

    def __init__(self, fold_weights: bool = True):
        self.folds_weights = fold_weights
        self._replies: list[Payload] = []
        self._sum = WeightedSum() if fold_weights else None

    def append(self, reply: Payload) -> None:
        """Add a validated reply; with ``fold_weights`` its weights go into the running sum, not into the store."""
        if self._sum is not None:
            self._sum.add(reply["weights"], reply["num_examples"])
            reply = {key: value for key, value in reply.items() if key != "weights"}
        self._replies.append(reply)

    def average_weights(self) -> Weights:
        """FedAvg of the folded weights by ``num_examples``: new tensors; ValueError if nothing was folded."""
        if self._sum is None:
            raise ValueError("these replies keep their weights (fold_weights=False); average the replies instead")
        return self._sum.result()

    def __len__(self) -> int:
        return len(self._replies)

    @overload
    def __getitem__(self, index: int) -> Payload: ...

    @overload
    def __getitem__(self, index: slice) -> list[Payload]: ...

    def __getitem__(self, index):
        return self._replies[index]

    def __iter__(self) -> Iterator[Payload]:
        return iter(self._replies)

    def __repr__(self) -> str:
        return f"Replies({len(self)} replies, fold_weights={self.folds_weights})"


class Server:
    """Server part. The default is FedAvg: broadcast the global weights, average the replies by n_k."""

    #: the engines collect a round's replies in :meth:`new_replies`; with True each reply's weights are folded
    #: into the ``num_examples``-weighted sum as it arrives (one model's memory per round, not one per client).
    #: A method that weights the clients by another rule, or reads the clients' weights, sets False.
    folds_weights = True

    def __init__(self, context: MethodContext):
        self.context = context
        self.options = context.options
        self.num_classes = context.num_classes
        self.weights: Weights = clone_weights(context.model, context.shared_keys)

    def broadcast(self, round: int) -> Payload:
        return {"weights": self.weights}

    def aggregate(self, round: int, replies: Sequence[Payload]) -> dict[str, float]:
        self.weights = self.average_weights(replies)
        return {}

    def new_replies(self) -> Replies:
        """The container an engine appends this round's valid replies to (then hands to :meth:`aggregate`)."""
        return Replies(fold_weights=self.folds_weights)

    def reply_layout(self) -> ReplyLayout:
        """Every key a client's reply holds and its form (see the module doc): here the shared weights (the
        keys, shapes and dtypes of ``self.weights``) and ``num_examples``. A method whose client uploads more
        extends it; the Flower server refuses a reply that does not fit before decoding it."""
        return {"weights": weights_layout(self.weights), "num_examples": int}

    def validate_reply(self, reply: Payload, who: str = "reply") -> None:
        """Raise UpdateError naming the problem unless ``reply`` is a well-formed, finite update.

        The engines call this for every reply before aggregation and drop the
        invalid ones; methods that upload more than weights extend it.
        """
        if not isinstance(reply, Mapping):
            raise UpdateError(f"{who} is a {type(reply).__name__}, expected a dict")
        check_weights(reply.get("weights"), self.weights, who=who)
        count = reply.get("num_examples")
        if (isinstance(count, bool) or not isinstance(count, (int, float)) or not math.isfinite(count)
                or count <= 0):
            raise UpdateError(f"{who} has num_examples={count!r}; it must be a finite number > 0")

    def validate_replies(self, replies: Sequence[Payload]) -> None:
        """:meth:`validate_reply` for every reply (named ``reply {index}``), before any state changes.

        Replies whose weights were folded are skipped: the engine validated
        each one as it appended it, and the weights are no longer there."""
        if isinstance(replies, Replies) and replies.folds_weights:
            return
        for index, reply in enumerate(replies):
            self.validate_reply(reply, who=f"reply {index}")

    def average_weights(self, replies: Sequence[Payload]) -> Weights:
        """FedAvg of the replies' weights by their ``num_examples`` (Algorithm 1's aggregation).

        For folded :class:`Replies` the sum was built as the replies arrived; a list of replies is
        validated, then folded in its order with the same code (:func:`weighted_average`)."""
        if isinstance(replies, Replies) and replies.folds_weights:
            return replies.average_weights()
        self.validate_replies(replies)
        return weighted_average([reply["weights"] for reply in replies], [reply["num_examples"] for reply in replies])

    def global_weights(self) -> Weights:
        return self.weights

    def inference_model(self, model: nn.Module) -> nn.Module:
        """What the engine evaluates for ``model`` (loaded with the weights to test): the model itself;
        a method with another inference rule (nearest prototype) returns a module that applies it."""
        return model

    def exposed_prototypes(self) -> tuple[Tensor, Tensor, str] | None:
        """The server's global prototypes, for diagnostics (prototype distance, t-SNE): ``(C x d, mask C
        bool, kind)``, ``kind`` ``"hyper"`` for FedHPro's averaged hyper-prototypes H, ``"global"`` for a
        method's own (FedProto's P, FedSA's anchors). None, the default: the method has none (FedAvg)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.weights = dict(state["weights"])


#: the old form of a method's extra loss, ``(z, y, logits) -> {name: term}``; :func:`train_epochs` still takes it
#: (scripts, benchmarks), the methods write :data:`LossTerms`
Regularizer = Callable[[Tensor, Tensor, Tensor], dict[str, Tensor]]


@dataclass
class Batch:
    """One training batch as the shared loop hands it to a method's loss terms (:data:`LossTerms`)."""

    x: Tensor  # the inputs the feature extractor ran on (after augmentation)
    y: Tensor  # the labels
    z: Tensor  # the features ``features(x)``
    logits: Tensor  # ``classifier(z)``
    #: the outputs of the modules the method declared (:meth:`Client.activation_modules`), in the order the
    #: forward pass produced them (a module that did not run in this forward gives none)
    activations: list[Tensor] = field(default_factory=list)


#: a method's extra loss: ``Batch -> {name: term}``; the loop minimises CE plus the sum of the terms and reports
#: each term's mean under its name
LossTerms = Callable[[Batch], dict[str, Tensor]]


@dataclass
class LocalRound:
    """One client's local round, as :meth:`Client.fit` hands it to the method's hooks."""

    model: nn.Module  # the working model, loaded with the payload's weights
    payload: Payload  # what the server broadcast
    data: ClientData  # the client's training data
    state: dict[str, Any]  # the client's own state, kept between its rounds
    generator: torch.Generator  # the round's random draws (batch order, then the hooks' draws)
    #: numbers reported with the losses, after them, in the order the hooks write them
    notes: dict[str, float] = field(default_factory=dict)
    #: what :meth:`Client.prepare` computed for the loss terms and the upload (the method's own keys)
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.data.x.device


class Client:
    """Client part. The default is FedAvg: load the global weights, run E epochs of SGD on CE.

    :meth:`fit` is the same sequence for every method (it is ``final``): load the payload's weights,
    :meth:`prepare`, train with the shared loop (:func:`train_epochs`, CE plus :meth:`loss_terms`, the
    settings of :meth:`train_settings`, the activations of :meth:`activation_modules`), then reply the
    trained shared weights, ``num_examples`` and :meth:`upload`. A method overrides those hooks; they
    share one :class:`LocalRound` (the hooks' numbers go to ``round.notes``, what ``prepare`` computed
    for the others to ``round.scratch``).
    """

    #: ``privacy=sample``: the names of the loss terms (:meth:`loss_terms`) that do not depend on the batch's
    #: samples, only on the parameters and on what the server sent (FedProx's proximal term, FedSA's calibration
    #: on the anchors): DP-SGD adds their gradient after the per-sample clipping and noise (post-processing).
    #: Every other term must be a mean over the batch of per-sample terms (each sample's term depends on that
    #: sample alone), as the cross-entropy is.
    public_loss_terms: frozenset[str] = frozenset()

    def __init__(self, context: MethodContext):
        self.context = context
        self.options = context.options
        self.num_classes = context.num_classes
        self.train = context.train
        if self.train.dp_clip is not None:
            self.check_sample_privacy(context.model)

    @property
    def sample_private(self) -> bool:
        """Whether this run trains with DP-SGD (``privacy=sample``: :attr:`TrainSettings.dp_clip` is set)."""
        return self.train.dp_clip is not None

    def sample_privacy_problem(self) -> str | None:
        """Why this method, under its options, cannot run with ``privacy=sample`` (a loss that couples the samples
        of a batch, an upload whose sensitivity is not bounded by the clip), or None: it can."""
        return None

    def check_sample_privacy(self, model: nn.Module) -> None:
        """ConfigError (one line) unless DP-SGD can train ``model`` with this method, options and settings."""
        sample_dp.opacus()
        problem = (self.sample_privacy_problem() or sample_dp.model_problem(model)
                   or sample_dp.settings_problem(self.train.amp, bool(self.train.channels_last), self.train.compile))
        if problem is not None:
            raise ConfigError(problem)

    def release_statistics(self, round: LocalRound, labels: Tensor, parts: Mapping[str, Tensor],
                           num_classes: int | None = None) -> sample_dp.Released:
        """``privacy=sample``: the round's one release of the client's class statistics
        (:func:`~fedhpro.methods.sample_dp.release_class_statistics`: noisy counts and, per part, noisy class means
        of the per-sample rows ``parts``, each ``len(labels) x ...``), noise from the round's generator (the operating
        system's under :attr:`TrainSettings.dp_secure_noise`). A second
        release in a round is refused: the accountant charges one per round."""
        if RELEASED in round.scratch:
            raise RuntimeError("a client released its statistics twice in one round; the accountant charges one")
        assert self.train.dp_clip is not None
        noise = sample_dp.os_generator() if self.train.dp_secure_noise else round.generator
        released = sample_dp.release_class_statistics(
            labels, self.num_classes if num_classes is None else num_classes, parts, float(self.train.dp_clip),
            float(self.train.dp_noise_multiplier), noise, len(round.data))
        round.scratch[RELEASED] = released
        return released

    def prepare(self, round: LocalRound) -> None:
        """Before training, on the received model: per-round state (frozen copies, class statistics,
        margins) in ``round.scratch``. The default does nothing."""

    def loss_terms(self, round: LocalRound) -> LossTerms | None:
        """The round's extra loss, ``Batch -> {name: term}``, built once after :meth:`prepare`; None (the
        default): CE only."""
        return None

    def activation_modules(self, round: LocalRound) -> Sequence[nn.Module]:
        """Modules of the model whose outputs the loss terms read (``Batch.activations``); none by default."""
        return ()

    def train_settings(self, round: LocalRound) -> TrainSettings:
        """The local optimisation settings of this round: the run's by default."""
        return self.train

    def upload(self, round: LocalRound) -> Payload:
        """After training: what the reply holds besides ``weights`` and ``num_examples`` (declared in the
        server's :meth:`Server.reply_layout`); none by default."""
        return {}

    @final
    def fit(self, model: nn.Module, payload: Payload, data: ClientData, state: dict[str, Any],
            generator: torch.Generator, *, reply_views: bool = False) -> tuple[Payload, dict[str, float]]:
        """The client's local round (the sequence of the class docstring); returns ``(reply, losses)``.

        The reply's ``weights`` are copies of the trained model's shared tensors, or with ``reply_views``
        the model's own tensors (detached, no copy): for an engine that consumes the reply before the model
        changes again (the simulator folds it into the round's sum, then loads the next client in place).
        The no-grad passes of the hooks (:func:`extract_features`) run in the precision of this client's
        training (:func:`no_grad_precision`)."""
        with no_grad_precision(self.train.amp, data.x.device):
            return self._fit(model, payload, data, state, generator, reply_views)

    def _fit(self, model: nn.Module, payload: Payload, data: ClientData, state: dict[str, Any],
             generator: torch.Generator, reply_views: bool) -> tuple[Payload, dict[str, float]]:
        load_weights(model, payload["weights"])
        round = LocalRound(model, payload, data, state, generator)
        self.prepare(round)
        if self.sample_private:
            losses = self._train_private(round)
        else:
            losses = train_epochs(model, data, self.train_settings(round), generator,
                                  loss_terms=self.loss_terms(round), activations=self.activation_modules(round))
        # reply exactly the keys received: the shared part of the model
        shared = (model_weights(model, payload["weights"]) if reply_views
                  else clone_weights(model, payload["weights"]))
        reply: Payload = {"weights": shared, "num_examples": len(data)}
        reply.update(self.upload(round))
        if self.sample_private:
            # num_examples from the round's release (a count-only release when the method uploads no statistics)
            released = round.scratch.get(RELEASED)
            if released is None:
                released = self.release_statistics(round, torch.zeros(len(data), dtype=torch.long), {}, num_classes=1)
            if released.total == 0:
                raise UpdateError(f"privacy=sample: every released class count of this client ({len(data)} samples) "
                                  "is below the noise threshold, so it has nothing to send this round")
            reply["num_examples"] = released.total
        losses.update(round.notes)
        return reply, losses

    def _train_private(self, round: LocalRound) -> dict[str, float]:
        """DP-SGD (:func:`~fedhpro.methods.sample_dp.train_private`) on CE plus the method's loss terms."""
        model = round.model
        settings = self.train_settings(round)
        self.check_sample_privacy(model)
        loss_terms = self.loss_terms(round)
        recorded: list[Tensor] = []
        handles = [module.register_forward_hook(lambda module, args, output: recorded.append(output))
                   for module in self.activation_modules(round)]
        features = features_of(model)

        def forward(x: Tensor) -> Tensor:
            recorded.clear()
            return features(x)

        def batch_terms(x: Tensor, y: Tensor, z: Tensor, logits: Tensor) -> dict[str, Tensor]:
            assert loss_terms is not None
            return loss_terms(Batch(x, y, z, logits, list(recorded)))

        try:
            return sample_dp.train_private(model, forward, classifier_of(model), round.data, settings,
                                           round.generator, batch_terms if loss_terms is not None else None,
                                           self.public_loss_terms)
        finally:
            for handle in handles:
                handle.remove()


def lends_weights(client: Any) -> bool:
    """Whether ``client.fit`` is the library's own :meth:`Client.fit` (``fit(..., reply_views=True)`` then replies
    with the model's own tensors); False for a wrapper put on the instance (a spy, a test's fault), which may
    keep its replies past the round and so gets copies."""
    return getattr(getattr(client, "fit", None), "__func__", None) is Client.fit


def train_epochs(model: nn.Module, data: ClientData, train: TrainSettings, generator: torch.Generator,
                 regularizer: Regularizer | None = None, *, loss_terms: LossTerms | None = None,
                 activations: Sequence[nn.Module] = ()) -> dict[str, float]:
    """E epochs of mini-batch SGD on ``CE + sum(loss terms)``; returns the mean of each term.

    ``loss_terms`` gets each :class:`Batch`, with the outputs of ``activations`` (modules of ``model``)
    recorded during its forward pass; ``regularizer`` is the older ``(z, y, logits)`` form (not both).
    Batches are index slices of the resident tensors, in an order drawn from
    ``generator`` (on the CPU, so the order is the same on every device). A
    trailing batch of one sample is skipped (BatchNorm cannot train on it).
    """
    if regularizer is not None:
        if loss_terms is not None:
            raise ValueError("give train_epochs a regularizer or loss_terms, not both")
        loss_terms = regularizer_terms(regularizer)
    recorded: list[Tensor] = []
    handles = [module.register_forward_hook(lambda module, args, output: recorded.append(output))
               for module in activations]
    try:
        return _train_loop(model, data, train, generator, loss_terms, recorded)
    finally:
        for handle in handles:
            handle.remove()


def regularizer_terms(regularizer: Regularizer) -> LossTerms:
    """The :data:`LossTerms` of an old-form ``(z, y, logits)`` regulariser."""
    return lambda batch: regularizer(batch.z, batch.y, batch.logits)


def _train_loop(model: nn.Module, data: ClientData, train: TrainSettings, generator: torch.Generator,
                loss_terms: LossTerms | None, recorded: list[Tensor]) -> dict[str, float]:
    model.train()
    channels_last = False
    autocast_dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None
    if train.fast_path:
        channels_last = runtime.trains_channels_last(train.channels_last, train.amp, model) and (
            train.channels_last is not None or model not in _CONTIGUOUS_TRAINING)
        if channels_last:
            model.to(memory_format=torch.channels_last)  # in place, before the optimiser takes the parameters
        precision = runtime.amp_precision(train.amp, data.x.device)
        autocast_dtype = AUTOCAST_DTYPES.get(precision)
        if precision == "fp16":  # float16's narrow range: the loss is scaled, steps with inf/NaN gradients skipped
            scaler = torch.amp.GradScaler(data.x.device.type)
    optimizer = local_optimizer(model, train, data.x.device)
    features = compiled_features(model) if train.compile else features_of(model)
    classifier = classifier_of(model)
    n = len(data)
    totals: dict[str, Tensor] = {}
    steps = 0
    for _ in range(train.epochs):
        # one host-to-device copy per epoch; the batch loop itself never waits for the device (FedAvg's and
        # FedHPro's losses do not either; tests/test_performance.py counts the synchronisations on a GPU)
        order = torch.randperm(n, generator=generator).to(data.x.device)
        for start in range(0, n, train.batch_size):
            index = order[start:start + train.batch_size]
            if index.numel() < 2 and n > 1:
                continue
            x, y = data.x[index], data.y[index]
            if data.augment is not None:  # off by default: the default path draws nothing more
                x = data.augment(x, generator)
            recorded.clear()
            if train.fast_path:
                try:
                    x, z, logits = _fast_forward(classifier, features, x, channels_last, autocast_dtype)
                except RuntimeError:
                    if not channels_last or train.channels_last is not None:
                        raise
                    # channels_last=auto on a model that cannot take it (a user's model that .view()s its
                    # activations): remembered, and trained in the contiguous format from here on
                    _CONTIGUOUS_TRAINING[model] = True
                    channels_last = False
                    model.to(memory_format=torch.contiguous_format)
                    recorded.clear()
                    x, z, logits = _fast_forward(classifier, features, x.contiguous(), False, autocast_dtype)
            else:  # the default path: exactly these operations, so results stay bit for bit as before
                z = features(x)
                logits = classifier(z)
            terms = {"ce": F.cross_entropy(logits, y)}
            if loss_terms is not None:
                terms.update(loss_terms(Batch(x, y, z, logits, list(recorded))))
            recorded.clear()
            first, *rest = terms.values()
            loss = sum(rest, first)  # ce + each extra term, in order
            optimizer.zero_grad(set_to_none=True)
            if scaler is None:
                loss.backward()
                if train.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
                optimizer.step()
            else:  # fp16: the scaled loss's gradients, unscaled (before any clipping) by the scaler's step
                scaler.scale(loss).backward()
                if train.max_grad_norm is not None:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
            terms["loss"] = loss
            for name, value in terms.items():
                totals[name] = totals.get(name, 0.0) + value.detach()
            steps += 1
        if "loss" in totals and not bool(torch.isfinite(totals["loss"])):
            raise UpdateError("local training produced a non-finite loss (NaN/Inf); lower lr or check the data")
    return {name: float(total) / max(steps, 1) for name, total in totals.items()}


#: the SGD optimiser of each working model and the settings and parameters it was built for (dropped with the model)
_OPTIMIZERS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[Any, ...], list[nn.Parameter], torch.optim.SGD]] = (
    weakref.WeakKeyDictionary())


def local_optimizer(model: nn.Module, train: TrainSettings, device: torch.device) -> torch.optim.SGD:
    """The local round's SGD optimiser of ``model``: one per working model, reused by every client that trains
    on it with its state cleared (no momentum buffer: the first step then sets it to the gradient, as a new
    optimiser's does), so a client costs no optimiser construction. A new one when the settings or the
    model's parameters changed. Fused on the CPU and CUDA: one kernel for all parameters' update (a third of
    the foreach step's time on the CPU), the same bits."""
    fused = device.type in ("cpu", "cuda") or None
    settings = (train.lr, train.momentum, train.weight_decay, fused)
    parameters = list(model.parameters())
    held = _OPTIMIZERS.get(model)
    if (held is not None and held[0] == settings and len(held[1]) == len(parameters)
            and all(a is b for a, b in zip(held[1], parameters))):
        optimizer = held[2]
        optimizer.state.clear()
        return optimizer
    optimizer = torch.optim.SGD(parameters, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay,
                                fused=fused)
    _OPTIMIZERS[model] = (settings, parameters, optimizer)
    return optimizer


def _fast_forward(classifier: nn.Module, features: Callable[[Tensor], Tensor], x: Tensor, channels_last: bool,
                  autocast_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(x, z, logits)`` of the opt-in fast path: channels_last input (the ``x`` returned), autocast in
    ``autocast_dtype`` (bfloat16, or float16 on a GPU without native bfloat16; None: float32), float32 outputs.

    Only the network's forward runs under autocast (its backward follows it); the outputs are cast back to
    float32 so the losses (softmax, HPCL's logsumexp, HPAL's Huber) and the method's loss terms run in full
    precision whatever ran the network, and the weights, their updates, the reply and everything the server
    does (aggregation, matching, clipping, privacy noise) stay float32.
    """
    if channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast(device_type=x.device.type, dtype=autocast_dtype or torch.bfloat16,
                        enabled=autocast_dtype is not None):
        z = features(x)
        logits = classifier(z)
    return x, z.float(), logits.float()


#: models whose forward failed on channels_last batches under ``channels_last=auto`` (a user's model that
#: ``.view()``s its activations): trained in the contiguous format (dropped with the model)
_CONTIGUOUS_TRAINING: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


#: compiled feature extractors, one per working model's ``features`` module (dropped with the module)
_COMPILED: weakref.WeakKeyDictionary[nn.Module, Callable[[Tensor], Tensor]] = weakref.WeakKeyDictionary()


def compiled_features(model: nn.Module) -> Callable[[Tensor], Tensor]:
    """``torch.compile(model.features)``, compiled on first use and cached for this module.

    The compiled wrapper shares the module's parameters (they are read at
    every call), so loading new weights into the working model or stepping the
    optimiser needs no recompilation; the state-dict keys do not change.
    """
    module = features_of(model)
    compiled = _COMPILED.get(module)
    if compiled is None:
        compiled = torch.compile(module)
        _COMPILED[module] = compiled
    return compiled


def eval_batch_size(device: torch.device) -> int:
    """Rows per forward pass of the no-grad passes (features, evaluation).

    A fixed choice per device, so runs stay reproducible; another batch size
    can change the last float digits (CPU kernels block small batches
    differently). On the CPU, 64 keeps a ``cnn`` batch's activations in
    cache: ~1.8x faster per sample than 1024 on one thread (bench/RESULTS.md);
    accelerators prefer large batches.
    """
    return 64 if device.type == "cpu" else 1024


def eval_layout(batch: Tensor) -> Tensor:
    """An image batch of a no-grad pass in ``channels_last`` on the CPU (other inputs as they are).

    oneDNN's NHWC convolutions are faster on the CPU (the ``cnn``'s
    3-channel first convolution 3x, its forward pass 1.5x, one thread); the
    features differ from the NCHW ones only in rounding (measured < 1e-6).
    Training keeps its own layout (the ``channels_last`` setting).
    """
    if batch.dim() == 4 and batch.device.type == "cpu":
        return batch.contiguous(memory_format=torch.channels_last)
    return batch


#: modules that failed on a channels_last batch (a user's model that ``.view()``s its activations): NCHW for them
_NCHW_ONLY: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()

#: the autocast dtype of the no-grad passes in the current context (None: float32); :func:`no_grad_precision` sets it
_NO_GRAD_AUTOCAST: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("no_grad_autocast",
                                                                                      default=None)
#: the autocast dtype of each :func:`fedhpro.runtime.amp_precision` (float32: none)
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def no_grad_precision(amp: str, device: torch.device) -> Iterator[None]:
    """The no-grad passes of the block (:func:`extract_features`, the engines' evaluation: :func:`no_grad_pass`)
    compute under the autocast local training uses for ``amp`` on ``device`` (:func:`fedhpro.runtime.amp_precision`:
    bfloat16, or float16 on a GPU without native bfloat16) and hand back float32 features and logits. ``amp=off``:
    float32, exactly the operations they ran before. A client's :meth:`Client.fit` and the engines' evaluation
    (:func:`fedhpro.engines.driver.test_client`) enter it; the server's step stays float32."""
    token = _NO_GRAD_AUTOCAST.set(AUTOCAST_DTYPES.get(runtime.amp_precision(amp, device)))
    try:
        yield
    finally:
        _NO_GRAD_AUTOCAST.reset(token)


def no_grad_pass(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """What a no-grad pass over many batches runs in: the autocast of the current :func:`no_grad_precision`,
    entered once for the whole pass (autocast keeps its casts of the weights while it is entered), or nothing."""
    dtype = _NO_GRAD_AUTOCAST.get()
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def eval_forward(module: nn.Module, batch: Tensor) -> Tensor:
    """``module(batch)`` for a no-grad pass, in :func:`eval_layout` where the module accepts it; float32 when
    it ran under :func:`no_grad_pass`'s autocast (the callers' statistics stay float32).

    A module that raises on the channels_last batch (``.view`` needs
    contiguous NCHW strides) is remembered and run on the batch as given.
    """
    output = _laid_out_forward(module, batch)
    if _NO_GRAD_AUTOCAST.get() is not None and output.dtype in (torch.bfloat16, torch.float16):
        return output.float()
    return output


def _laid_out_forward(module: nn.Module, batch: Tensor) -> Tensor:
    if module not in _NCHW_ONLY:
        laid_out = eval_layout(batch)
        if laid_out is batch:
            return module(batch)
        try:
            return module(laid_out)
        except RuntimeError:
            _NCHW_ONLY[module] = True
    return module(batch)


@torch.no_grad()
def extract_features(model: nn.Module, x: Tensor, batch_size: int | None = None) -> Tensor:
    """``f(x)`` for all rows of ``x`` in eval mode (restores the previous mode); float32, computed in the current
    :func:`no_grad_precision`."""
    batch_size = batch_size or eval_batch_size(x.device)
    was_training = model.training
    model.eval()
    with no_grad_pass(x.device):
        features = torch.cat([eval_forward(features_of(model), x[i:i + batch_size])
                              for i in range(0, x.shape[0], batch_size)])
    model.train(was_training)
    return features


@dataclass(frozen=True)
class InferenceRule:
    """A method's own inference rule as a trained model keeps it (:attr:`MethodSpec.inference_rule`).

    ``name``: the rule's name in a run folder's model.json (``inference``; not ``head``, the network's own
    classifier). ``build(network, num_classes)``: the module applying the rule to ``network`` with its own
    state empty (FedProto's prototypes as zeros), of the same keys and shapes as the module the method's
    :meth:`Server.inference_model` gives during the run: model.pt holds that module's state dict, and
    ``fedhpro.load_model`` builds this one and loads it."""

    name: str
    build: Callable[[nn.Module, int], nn.Module]


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: its name, option group, server part and client part."""

    name: str
    options: type
    server: type[Server]
    client: type[Client]
    description: str = ""
    #: optional ``(model, options, num_classes) -> model``: a method that changes the network (MOON's
    #: projection head) wraps the engine's model here; the result keeps ``features``/``classifier``
    model_wrapper: Callable[[nn.Module, Any, int], nn.Module] | None = None
    #: named recipes: recipe name -> the settings ``<name>.recipe=<recipe>`` applies before the user's (the
    #: options need a ``recipe`` field); fedhpro.config applies whatever recipe a method declares
    recipes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: optional ``options -> "all" | "none"``: which model weights travel between server and clients under
    #: these options ("none": every client keeps its own model and only the method's other payloads travel,
    #: e.g. the prototype methods' protocol=proto-only); without it, "all". The engines send the classifier
    #: only when the clients' architectures differ (heterogeneity=), whatever the method declares.
    weights_travel: Callable[[Any], str] | None = None
    #: why the server's step needs each client's own upload, not only their sums (FedTGP trains on every
    #: client's prototypes); "" (the default): a function of sums, weighted as the reply layout declares
    #: (:attr:`ClassRows.averaged`). Secure aggregation refuses a method that says why, quoting it.
    needs_each_upload: str = ""
    #: the rule the method's :meth:`Server.inference_model` applies when it is not the network itself (the
    #: prototype methods' nearest prototype): with it a run's exported model keeps the rule; without it a
    #: model tested through another module is exported as the network with its own classifier, with a warning
    inference_rule: InferenceRule | None = None
    #: the method's place in the paper's tables (FedAvg, FedProx, MOON, FedProto, FedTGP, FedGMKD, FedRCL,
    #: FedSA, FedHPro): a default ``fedhpro compare`` runs every registered method, these in this order and
    #: the others (plug-ins) after them by name; None: not in the paper
    paper_order: int | None = None
    #: the method a comparison's gain column is measured against (one method: FedAvg)
    baseline: bool = False
