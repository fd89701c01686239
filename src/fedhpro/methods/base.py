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

The reply's layout is a contract: ``Server.reply_layout()`` declares every key a client's reply holds and
its form, and the Flower server refuses a reply that does not fit before it decodes a single array, so a
plug-in method must declare every key its client uploads (:mod:`fedhpro.methods.layout`: the forms,
:class:`~fedhpro.methods.layout.ClassRows` for per-class rows).

This module is the interface; the jobs around it have modules of their own: the reply layouts
(:mod:`fedhpro.methods.layout`), a model's two parts (:mod:`fedhpro.methods.parts`), the shared training loop
(:mod:`fedhpro.methods.training`) and the no-grad passes with their precision (:mod:`fedhpro.methods.no_grad`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, final, overload

import torch
from torch import Tensor, nn

from fedhpro.averaging import WeightedSum
from fedhpro.data.federation import Augment, ClientData
from fedhpro.errors import ConfigError, UpdateError
from fedhpro.functional import weighted_average
from fedhpro.methods import sample_dp
from fedhpro.methods.declaration import MethodDeclaration, check_dp_clipping
from fedhpro.methods.layout import Payload, ReplyLayout, Weights, weights_layout
from fedhpro.methods.no_grad import no_grad_precision
from fedhpro.methods.parts import classifier_of, features_of
from fedhpro.methods.training import Batch, LocalRound, LossTerms, TrainSettings, train_epochs

__all__ = [
    "RELEASED", "Client", "InferenceRule", "MethodContext", "MethodSpec", "Replies", "Server", "all_finite",
    "check_weights", "clone_weights", "lends_weights", "load_weights", "model_weights",
]

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
        if self.train.max_grad_norm is None:  # the run leaves the cap to the method
            self.train = dataclasses.replace(self.train, max_grad_norm=self.default_max_grad_norm())
        if self.train.dp_clip is not None:
            self.check_sample_privacy(context.model)

    @property
    def sample_private(self) -> bool:
        """Whether this run trains with DP-SGD (``privacy=sample``: :attr:`TrainSettings.dp_clip` is set)."""
        return self.train.dp_clip is not None

    def default_max_grad_norm(self) -> float | None:
        """The cap on the local gradient's global L2 norm this method trains with when the run leaves
        ``max_grad_norm`` unset (:attr:`TrainSettings.max_grad_norm`; None or 0: no cap, the default, as the
        paper trains). A method whose authors clip says so here (FedRCL: 10); the run key, when set, wins."""
        return None

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

    def augment(self, round: LocalRound) -> Augment | None:
        """This round's augmentation of every training mini-batch (``augment(x, generator) -> x``, drawn from the
        round's generator), asked before :meth:`prepare`: by default the data's own (``ClientData.augment``: none unless
        the data set has one); a method may add its own (FedHPro's ``local_augment``)."""
        return round.data.augment

    def _fit(self, model: nn.Module, payload: Payload, data: ClientData, state: dict[str, Any],
             generator: torch.Generator, reply_views: bool) -> tuple[Payload, dict[str, float]]:
        load_weights(model, payload["weights"])
        round = LocalRound(model, payload, data, state, generator)
        augment = self.augment(round)
        if augment is not data.augment:  # the training loops read the round's data's augmentation
            data = round.data = data.with_augment(augment)
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
    """A registered method: its name, option group, server part and client part.

    The fields a config reads without running the method (``name``, ``options``, ``description``, ``recipes``,
    ``weights_travel``, ``needs_each_upload``, ``paper_order``, ``baseline``, ``dp_clipping``) are those of its
    :attr:`declaration` (:class:`~fedhpro.methods.declaration.MethodDeclaration`, which documents each); a built-in's
    spec is built from its torch-free declaration (:meth:`from_declaration`). The others are the method's code."""

    name: str
    options: type
    server: type[Server]
    client: type[Client]
    description: str = ""
    #: optional ``(model, options, num_classes) -> model``: a method that changes the network (MOON's
    #: projection head) wraps the engine's model here; the result keeps ``features``/``classifier``
    model_wrapper: Callable[[nn.Module, Any, int], nn.Module] | None = None
    recipes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    weights_travel: Callable[[Any], str] | None = None
    needs_each_upload: str = ""
    #: the rule the method's :meth:`Server.inference_model` applies when it is not the network itself (the
    #: prototype methods' nearest prototype): with it a run's exported model keeps the rule; without it a
    #: model tested through another module is exported as the network with its own classifier, with a warning
    inference_rule: InferenceRule | None = None
    paper_order: int | None = None
    baseline: bool = False
    dp_clipping: str = "joint"

    def __post_init__(self) -> None:
        check_dp_clipping(type(self).__name__, self.name, self.dp_clipping)

    @classmethod
    def from_declaration(cls, declaration: MethodDeclaration, *, server: type[Server], client: type[Client],
                         model_wrapper: Callable[[nn.Module, Any, int], nn.Module] | None = None,
                         inference_rule: InferenceRule | None = None) -> MethodSpec:
        """The spec of the method ``declaration`` declares, with its code: its server and client parts, and
        optionally its model wrapper and inference rule (a built-in's ``METHOD``, its fields written once)."""
        declared = {part.name: getattr(declaration, part.name) for part in dataclasses.fields(MethodDeclaration)}
        return cls(**declared, server=server, client=client, model_wrapper=model_wrapper,
                   inference_rule=inference_rule)

    @property
    def declaration(self) -> MethodDeclaration:
        """What a config reads of this method without its code (``REGISTRY.declared(name)`` of a spec
        registered whole), made of its fields: equal to the declaration a built-in's spec was built from."""
        return MethodDeclaration(**{part.name: getattr(self, part.name)
                                    for part in dataclasses.fields(MethodDeclaration)})
