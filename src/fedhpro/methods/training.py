"""The shared local training loop every method's client runs (:meth:`fedhpro.methods.base.Client.fit` calls
:func:`train_epochs`): its settings (:class:`TrainSettings`), what it hands a method's loss terms
(:class:`Batch`, :class:`LocalRound`), the one SGD optimiser per working model (:func:`local_optimizer`) and the
opt-in fast paths (amp, channels_last, ``torch.compile``: :func:`compiled_features`)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro import runtime
from fedhpro.data.federation import ClientData
from fedhpro.errors import TrainingDiverged
from fedhpro.methods.layout import Payload
from fedhpro.methods.no_grad import AUTOCAST_DTYPES
from fedhpro.methods.parts import classifier_of, features_of


@dataclass(frozen=True)
class TrainSettings:
    """Local optimisation settings shared by all methods (SGD, as the paper)."""

    epochs: int = 1
    batch_size: int = 64
    lr: float = 0.01
    momentum: float = 0.9
    weight_decay: float = 1e-5
    #: clip the local gradient's global L2 norm to this before each step (the run key ``max_grad_norm``): > 0 the
    #: cap, 0 off, None the method's own default (:meth:`fedhpro.methods.base.Client.default_max_grad_norm`:
    #: FedRCL's authors clip at 10, the others do not; :func:`train_epochs` called directly does not clip)
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
    #: the outputs of the modules the method declared (:meth:`~fedhpro.methods.base.Client.activation_modules`), in
    #: the order the forward pass produced them (a module that did not run in this forward gives none)
    activations: list[Tensor] = field(default_factory=list)


#: a method's extra loss: ``Batch -> {name: term}``; the loop minimises CE plus the sum of the terms and reports
#: each term's mean under its name
LossTerms = Callable[[Batch], dict[str, Tensor]]


@dataclass
class LocalRound:
    """One client's local round, as :meth:`~fedhpro.methods.base.Client.fit` hands it to the method's hooks."""

    model: nn.Module  # the working model, loaded with the payload's weights
    payload: Payload  # what the server broadcast
    data: ClientData  # the client's training data
    state: dict[str, Any]  # the client's own state, kept between its rounds
    generator: torch.Generator  # the round's random draws (batch order, then the hooks' draws)
    #: numbers reported with the losses, after them, in the order the hooks write them
    notes: dict[str, float] = field(default_factory=dict)
    #: what :meth:`~fedhpro.methods.base.Client.prepare` computed for the loss terms and the upload (the method's
    #: own keys)
    scratch: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.data.x.device


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
    first_ce: Tensor | None = None  # the first batch's cross-entropy: the reference of the divergence check
    num_classes = 0
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
                if train.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
                optimizer.step()
            else:  # fp16: the scaled loss's gradients, unscaled (before any clipping) by the scaler's step
                scaler.scale(loss).backward()
                if train.max_grad_norm:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), train.max_grad_norm)
                scaler.step(optimizer)
                scaler.update()
            terms["loss"] = loss
            for name, value in terms.items():
                totals[name] = totals.get(name, 0.0) + value.detach()
            if first_ce is None:  # kept on the device: read once, at the end of the round
                first_ce, num_classes = terms["ce"].detach(), logits.shape[-1]
            steps += 1
        if "loss" in totals and not bool(torch.isfinite(totals["loss"])):
            assert first_ce is not None
            raise nonfinite_divergence(float(first_ce), float(totals["ce"]) / steps, train)
    means = {name: float(total) / max(steps, 1) for name, total in totals.items()}
    if first_ce is not None:
        diverged = divergence(float(first_ce), means["ce"], num_classes, train)
        if diverged is not None:
            raise diverged
    return means


#: a local round whose mean cross-entropy exceeds this many times its first batch's has diverged
#: (:func:`divergence`)
DIVERGENCE_FACTOR = 100.0


def divergence(first_ce: float, mean_ce: float, num_classes: int, train: TrainSettings) -> TrainingDiverged | None:
    """The :class:`~fedhpro.errors.TrainingDiverged` of a local round whose mean cross-entropy term ``mean_ce`` is
    non-finite or above :data:`DIVERGENCE_FACTOR` x its first batch's ``first_ce``, else None. The cross-entropy
    alone, not the total loss: a method's own terms may be large by design (FedHPro's raw margin adds d_k/tau
    to HPCL). A first batch below the chance level ``ln(num_classes)`` is measured against the chance level
    instead: a well-trained model's first batch may have a cross-entropy near 0 and its next ones 0.2, which is
    no explosion; an explosion (a cosine loss at a small temperature blowing up small features) is 1e3..1e22."""
    if math.isfinite(mean_ce) and mean_ce <= DIVERGENCE_FACTOR * max(first_ce, math.log(max(num_classes, 1))):
        return None
    ratio = mean_ce / first_ce if first_ce > 0 else math.inf
    times = "from" if not math.isfinite(ratio) else f"{ratio:.0f}x" if ratio < 1e5 else f"{ratio:.2g}x"
    return TrainingDiverged(f"its mean cross-entropy rose to {mean_ce:.2g}, {times} its first batch's {first_ce:.3g} "
                            f"({settings_hint(train)}")


def nonfinite_divergence(first_ce: float, mean_ce: float, train: TrainSettings) -> TrainingDiverged:
    """The :class:`~fedhpro.errors.TrainingDiverged` of a local round whose loss became NaN or infinite: its
    cross-entropy if that is what did, else the method's terms."""
    if not math.isfinite(mean_ce):
        return TrainingDiverged(f"its mean cross-entropy rose to {mean_ce:.2g} from its first batch's "
                                f"{first_ce:.3g} ({settings_hint(train)}")
    return TrainingDiverged(f"its loss (cross-entropy {mean_ce:.3g} plus the method's terms) became non-finite "
                            f"({settings_hint(train)}")


def settings_hint(train: TrainSettings) -> str:
    """The end of a divergence's line: the lr and the cap that trained, and what to change."""
    if train.max_grad_norm:
        return (f"lr={train.lr:g}, max_grad_norm={train.max_grad_norm:g}); lower lr or max_grad_norm")
    return f"lr={train.lr:g}, max_grad_norm off); lower lr or set max_grad_norm=10"


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
