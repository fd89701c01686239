"""``privacy=sample``: DP-SGD in the shared client loop, and the one privatized release of a client's class statistics.

Two Gaussian mechanisms act on a client's training data in a round it takes part in, and nothing else it
computes from that data leaves it:

* **DP-SGD** (:func:`train_private`): ``epochs x steps_per_epoch`` steps, each on a Poisson-sampled batch (every
  sample in with probability ``q``, drawn from the round's seeded generator, :func:`poisson_plan`); each sample's
  gradient of the per-sample loss clipped to ``dp_clip`` in L2 over all parameters, the clipped gradients summed,
  ``N(0, (dp_noise_multiplier x dp_clip)^2)`` added to every coordinate, divided by the expected batch size
  ``q n``. Opacus computes the per-sample gradients (``GradSampleHooks``) and does the clip, noise and scale
  (``DPOptimizer``); the noise comes from a generator seeded from the round's generator, so runs repeat
  (with :attr:`~fedhpro.methods.training.TrainSettings.dp_secure_noise`, the noise and the batches come from the
  operating system's randomness instead, and Opacus's ``secure_mode`` draws the noise).
  Loss terms a method declares public (:attr:`~fedhpro.methods.base.Client.public_loss_terms`: functions of the
  parameters and of what the server sent only, e.g. FedProx's proximal term) are differentiated apart and
  their gradient added after the noise: post-processing, outside the clipping.
* **the statistics release** (:func:`release_class_statistics`), once per round for every method: each sample
  contributes a vector of L2 norm <= ``dp_clip`` (its class count and, as the method needs, its feature, its class
  gradient, its soft prediction, each part clipped to ``dp_clip / sqrt(parts)``) to its class's row; the per-class
  sums get ``N(0, (dp_noise_multiplier x dp_clip)^2)`` on every coordinate. The noisy counts (rounded, kept only
  above three count-noise stds) give ``num_examples`` and ``class_counts``; the noisy sums divided by them give the
  prototypes, class gradients and soft predictions. A method that uploads none of them (FedAvg) still releases its
  count (``num_examples``), so the accountant (:mod:`fedhpro.privacy.sample`) charges every method the same.

Adjacency: adding or removing one sample (Opacus's and the RDP accountant's).
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro.errors import ConfigError, TrainingDiverged, UpdateError
from fedhpro.methods.training import DIVERGENCE_FACTOR, divergence, settings_hint

#: the one line shown when Opacus is missing
INSTALL_HINT = 'privacy=sample needs Opacus and dp-accounting: pip install "fedhpro[privacy]"'

#: the attributes Opacus and DP-SGD put on parameters; removed after the local round (the working model is reused)
_PARAMETER_ATTRIBUTES = ("grad_sample", "_forward_counter", "_current_grad_sample", "_norm_sample", "summed_grad")

#: a released count is kept (the class counted as held) only at or above this many count-noise stds
COUNT_THRESHOLD_STDS = 3.0


def opacus() -> Any:
    """The ``opacus`` module, imported on first use; ConfigError with the install line when it is missing."""
    try:
        import opacus as module
        from opacus.grad_sample import GradSampleHooks  # noqa: F401
        from opacus.optimizers import DPOptimizer  # noqa: F401
    except ImportError as error:
        raise ConfigError(INSTALL_HINT) from error
    return module


class PoissonPlan(NamedTuple):
    """The batches of one client's DP-SGD: ``steps_per_epoch`` Poisson batches at sampling rate ``rate``."""

    rate: float  # q: each sample is in a batch with this probability
    steps_per_epoch: int

    def expected_batch(self, n: int) -> float:
        return self.rate * n


def poisson_plan(num_samples: int, batch_size: int) -> PoissonPlan:
    """``q = 1 / ceil(n / B)`` and ``ceil(n / B)`` steps per epoch: one epoch sees ``n`` samples in expectation,
    the batches average ``n / ceil(n / B) <= B`` samples (Opacus's ``DPDataLoader`` makes the same choice)."""
    if num_samples < 1 or batch_size < 1:
        raise ValueError(f"need at least one sample and a batch size >= 1, got n={num_samples}, B={batch_size}")
    steps = math.ceil(num_samples / batch_size)
    return PoissonPlan(1.0 / steps, steps)


def model_problem(model: nn.Module) -> str | None:
    """Why DP-SGD cannot train ``model``, in one line naming the first module at fault and the fix, or None.

    Refused (at least everything Opacus's ``ModuleValidator.validate(model, strict=False)`` flags on a model in
    training mode, and more):

    * every BatchNorm (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, the lazy ones), affine or not, tracking running
      statistics or not: in training it normalises each sample with its batch's statistics, coupling the samples
      the per-sample bound treats as independent (Opacus flags only the affine ones);
    * ``InstanceNorm`` with ``track_running_stats=True``: running statistics of the raw data;
    * any module Opacus's validators refuse (``LSTM``, ``GRU``, ``MultiheadAttention``: no per-sample gradient);
    * any other module with a registered buffer: state outside the noised gradients, which would reach the
      server and ``model.pt`` unprivatized if training updates it (running statistics); which buffers training
      updates cannot be told from the model alone, so every one is refused.

    Refused rather than converted: a converted model (BatchNorm -> GroupNorm) would no longer be the architecture
    the run's other parts (server, checkpoints) were built with.
    """
    opacus()
    from opacus.validators import ModuleValidator

    for name, module in model.named_modules():
        what = f"module {name or '(the model)'!r} ({type(module).__name__})"
        if isinstance(module, nn.modules.batchnorm._NormBase) and not isinstance(
                module, nn.modules.instancenorm._InstanceNorm):
            return (f"{what} normalises each sample with its batch's statistics (coupling the samples DP-SGD bounds "
                    "one by one) and keeps running statistics of the raw data; privacy=sample refuses every "
                    "BatchNorm, affine or not: use GroupNorm or LayerNorm instead, or model=cnn, cnn4, mlp or textcnn")
        if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
            return (f"{what} tracks running statistics of the raw data, which would reach the server without noise; "
                    "privacy=sample refuses them: set track_running_stats=False")
        validator = ModuleValidator.VALIDATORS.get(type(module))
        trainable = any(p.requires_grad for p in module.parameters(recurse=False))
        if validator is not None and trainable and validator(module):
            return (f"{what} has no per-sample gradient in Opacus (its ModuleValidator refuses it); privacy=sample "
                    "refuses it: use Opacus's drop-in replacement (opacus.layers: DPLSTM, DPGRU, "
                    "DPMultiheadAttention)")
        buffers = [key for key, _ in module.named_buffers(recurse=False)]
        if buffers:
            return (f"{what} holds the buffer {buffers[0]!r}, state outside DP-SGD's noised gradients that would "
                    "reach the server unprivatized if training updates it (running statistics); privacy=sample "
                    "refuses every buffer: remove it, or hold a constant as nn.Parameter(..., requires_grad=False)")
    return None


def settings_problem(amp: str, channels_last: bool, compile: bool) -> str | None:
    """Why DP-SGD cannot run with these opt-in speed settings, or None."""
    if amp != "off" or channels_last or compile:
        return ("privacy=sample trains in eager float32 (Opacus's per-sample gradient hooks): "
                "set amp=off, channels_last=false and compile=false")
    return None


def clip_rows(rows: Tensor, bound: float) -> Tensor:
    """Each row (the first axis; the rest flattened) scaled to L2 norm ``<= bound`` (rows within it unchanged)."""
    flat = rows.reshape(rows.shape[0], -1)
    norms = flat.norm(dim=1)
    factor = (bound / norms.clamp(min=torch.finfo(flat.dtype).tiny)).clamp(max=1.0)
    return rows * factor.reshape(-1, *([1] * (rows.dim() - 1)))


# ----------------------------------------------------------------------------------------------------------------
# DP-SGD
# ----------------------------------------------------------------------------------------------------------------


@contextmanager
def _not_inplace(model: nn.Module):
    """Activations computed out of place while Opacus's backward hooks are on (an in-place ReLU on a hooked
    layer's output is refused by autograd); the same values, restored afterwards."""
    changed = [module for module in model.modules() if getattr(module, "inplace", False) is True]
    for module in changed:
        module.inplace = False  # type: ignore[assignment]
    try:
        yield
    finally:
        for module in changed:
            module.inplace = True  # type: ignore[assignment]


def os_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded from the operating system's randomness (``secrets``): not reproducible,
    and no seed anyone could know (``privacy.secure_noise``)."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(62))


def dp_sgd_noise_generator(generator: torch.Generator, device: torch.device, secure: bool = False) -> torch.Generator:
    """DP-SGD's noise generator on ``device``: seeded from one draw of ``generator`` (the round's CPU generator), or
    with ``secure`` from the operating system (:func:`os_generator`; the draw is made all the same, so the round's
    other draws do not move)."""
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
    if secure:
        return os_generator(device)
    return torch.Generator(device=device).manual_seed(seed)


def train_private(model: nn.Module, features: Callable[[Tensor], Tensor], classifier: nn.Module, data: Any,
                  train: Any, generator: torch.Generator, batch_terms: Callable[[Tensor, Tensor, Tensor, Tensor],
                                                                                 dict[str, Tensor]] | None,
                  public_terms: frozenset[str]) -> dict[str, float]:
    """``train.epochs`` epochs of DP-SGD (see the module doc) on ``CE + the method's terms``; returns
    ``{"dp_steps": steps}`` (the losses are functions of the data that the epsilon does not cover: not reported).

    ``batch_terms(x, y, z, logits) -> {name: term}``: the method's loss terms of a batch; those named in
    ``public_terms`` do not depend on the batch and are differentiated apart, added after the noise.
    """
    if train.dp_clip is None:
        raise ValueError("train_private needs train.dp_clip")
    module = opacus()
    from opacus.grad_sample import GradSampleHooks
    from opacus.optimizers import DPOptimizer

    del module
    problem = model_problem(model) or settings_problem(train.amp, train.channels_last, train.compile)
    if problem is not None:
        raise ConfigError(problem)
    n = len(data)
    plan = poisson_plan(n, train.batch_size)
    device = data.x.device
    secure = bool(getattr(train, "dp_secure_noise", False))
    # which samples a batch holds is part of the mechanism (amplification by sampling assumes it is secret)
    batches = os_generator() if secure else generator
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=train.lr, momentum=train.momentum,
                                weight_decay=train.weight_decay)
    parameters = [p for p in model.parameters() if p.requires_grad]
    steps = 0
    # the divergence check's cross-entropies (:func:`~fedhpro.methods.training.divergence`), kept on the device
    first_ce: Tensor | None = None
    ce_total: Tensor | None = None
    ce_batches, num_classes = 0, 0
    with _not_inplace(model), warnings.catch_warnings():
        # Opacus's full backward hooks warn on the first layer (its input needs no gradient): expected here
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        hooks = GradSampleHooks(model, batch_first=True, loss_reduction="mean", strict=True)
        private = DPOptimizer(optimizer, noise_multiplier=float(train.dp_noise_multiplier),
                              max_grad_norm=float(train.dp_clip), expected_batch_size=plan.expected_batch(n),
                              loss_reduction="mean", generator=dp_sgd_noise_generator(generator, device, secure),
                              secure_mode=secure)  # secure: Opacus's noise robust to floating-point attacks
        try:
            for _ in range(train.epochs):
                for _ in range(plan.steps_per_epoch):
                    # the batch: every sample in with probability q, drawn on the CPU (the same on every device)
                    index = (torch.rand(n, generator=batches) < plan.rate).nonzero().squeeze(1).to(device)
                    private.zero_grad(set_to_none=True)
                    public, ce, classes = _private_backward(hooks, parameters, features, classifier, data, index,
                                                            generator, batch_terms, public_terms)
                    if ce is not None:
                        ce_total = ce if ce_total is None else ce_total + ce
                        if first_ce is None:
                            first_ce, num_classes = ce, classes
                        ce_batches += 1
                    private.pre_step()  # clip each sample's gradient, sum, add the noise, divide by q n
                    for parameter, gradient in zip(parameters, public):
                        if gradient is not None:
                            assert parameter.grad is not None  # pre_step set every noisy mean
                            parameter.grad = parameter.grad + gradient
                    if train.max_grad_norm:  # post-processing of the noisy gradient (run key max_grad_norm)
                        torch.nn.utils.clip_grad_norm_(parameters, train.max_grad_norm)
                    optimizer.step()
                    steps += 1
        finally:
            hooks.cleanup()
            for parameter in model.parameters():
                for name in _PARAMETER_ATTRIBUTES:
                    if hasattr(parameter, name):
                        delattr(parameter, name)
                parameter.grad = None
            for submodule in model.modules():
                for name in ("activations", "max_batch_len"):
                    if name in submodule.__dict__:
                        delattr(submodule, name)
    if first_ce is not None and ce_total is not None and divergence(
            float(first_ce), float(ce_total) / ce_batches, num_classes, train) is not None:
        # the cross-entropies are functions of the data the epsilon does not cover: the line says no number
        raise TrainingDiverged(f"its mean cross-entropy became non-finite or rose past {DIVERGENCE_FACTOR:g}x its "
                               "first batch's (privacy=sample: the values stay on the client) "
                               f"({settings_hint(train)}")
    for parameter in parameters:
        if not bool(torch.isfinite(parameter).all()):
            raise UpdateError("DP-SGD produced non-finite weights; lower lr or raise privacy.clip")
    return {"dp_steps": float(steps)}


def _private_backward(hooks: Any, parameters: Sequence[nn.Parameter], features: Callable[[Tensor], Tensor],
                      classifier: nn.Module, data: Any, index: Tensor, generator: torch.Generator,
                      batch_terms: Callable[[Tensor, Tensor, Tensor, Tensor], dict[str, Tensor]] | None,
                      public_terms: frozenset[str]) -> tuple[list[Tensor | None], Tensor | None, int]:
    """One batch's backward passes: the public terms' gradient (returned, hooks off), then the per-sample loss's
    per-sample gradients (``grad_sample``, hooks on). An empty batch has zero per-sample gradients. Returns
    ``(public gradients, the batch's cross-entropy (detached; None for an empty batch), the number of classes)``."""
    if index.numel() == 0:
        for parameter in parameters:
            parameter.grad_sample = parameter.new_zeros((0, *parameter.shape))  # type: ignore[attr-defined]
        return [None] * len(parameters), None, 0
    x, y = data.x[index], data.y[index]
    if data.augment is not None:
        x = data.augment(x, generator)
    z = features(x)
    logits = classifier(z)
    terms = {"ce": F.cross_entropy(logits, y)}
    if batch_terms is not None:
        hooks.disable_hooks()  # a term may run a layer on other inputs (the head on the prototypes): not a sample
        try:
            terms.update(batch_terms(x, y, z, logits))
        finally:
            hooks.enable_hooks()
    shared = [value for name, value in terms.items() if name in public_terms]
    per_sample = [value for name, value in terms.items() if name not in public_terms]
    public: list[Tensor | None] = [None] * len(parameters)
    if shared:
        hooks.disable_hooks()
        try:
            first, *rest = shared
            total = sum(rest, first)
            if total.requires_grad and any(g is not None for g in torch.autograd.grad(
                    total, [z, logits], retain_graph=True, allow_unused=True)):
                names = sorted(name for name in terms if name in public_terms)
                raise ConfigError(f"the loss terms {names} are declared public (public_loss_terms) but depend on "
                                  "the batch's features: under privacy=sample they must not (or leave them out)")
            if total.requires_grad:
                public = list(torch.autograd.grad(total, parameters, allow_unused=True))
        finally:
            hooks.enable_hooks()
    first, *rest = per_sample
    sum(rest, first).backward()
    return [None if g is None else g.detach() for g in public], terms["ce"].detach(), logits.shape[-1]


# ----------------------------------------------------------------------------------------------------------------
# the statistics release
# ----------------------------------------------------------------------------------------------------------------


def class_sums(labels: Tensor, num_classes: int, parts: Mapping[str, Tensor], clip: float) -> dict[str, Tensor]:
    """The noiseless per-class sums of the release: ``"counts"`` (C float64, each sample adds ``clip / sqrt(m)``) and,
    per part (``B x ...``), the sum over the class's samples of the rows clipped to ``clip / sqrt(m)``, with ``m``
    the number of parts counting the counts. Each sample's whole contribution has L2 norm ``<= clip``."""
    bound = clip / math.sqrt(len(parts) + 1)
    labels = labels.reshape(-1)
    device = labels.device
    ones = torch.full((labels.shape[0],), bound, dtype=torch.float64, device=device)
    sums = {"counts": torch.zeros(num_classes, dtype=torch.float64, device=device).index_add_(0, labels, ones)}
    for name, rows in parts.items():
        clipped = clip_rows(rows.detach(), bound)
        sums[name] = rows.new_zeros((num_classes, *rows.shape[1:])).index_add_(0, labels, clipped)
    return sums


@dataclass
class Released:
    """One client's released class statistics (every tensor on the CPU)."""

    counts: Tensor  # C int64: the noisy counts, rounded, zero below the threshold
    means: dict[str, Tensor]  # per part: C x ... the noisy sums over the released counts (zeros where count 0)

    @property
    def total(self) -> int:
        return int(self.counts.sum())


def release_class_statistics(labels: Tensor, num_classes: int, parts: Mapping[str, Tensor], clip: float,
                             noise_multiplier: float, generator: torch.Generator, num_samples: int) -> Released:
    """The Gaussian mechanism on :func:`class_sums` (sensitivity ``clip``: one sample added or removed), noise
    ``N(0, (noise_multiplier x clip)^2)`` on every coordinate, drawn on the CPU from ``generator`` (counts first,
    then each part in order); then post-processing: counts rounded, zeroed below ``max(1, 3 x count std)``, cut
    down (largest first) to sum to at most ``num_samples`` (the protocol knows each client's size already);
    the means are the noisy sums over the kept counts."""
    sums = class_sums(labels, num_classes, parts, clip)
    bound = clip / math.sqrt(len(parts) + 1)
    std = noise_multiplier * clip
    noisy = {}
    for name, total in sums.items():
        total = total.detach().cpu().double()
        noise = torch.randn(total.shape, generator=generator, dtype=torch.float64) * std if std > 0 else 0.0
        noisy[name] = total + noise
    estimated = noisy.pop("counts") / bound
    threshold = max(1.0, COUNT_THRESHOLD_STDS * std / bound)
    rounded = estimated.round()
    counts = torch.where(rounded >= threshold, rounded, torch.zeros((), dtype=torch.float64))
    counts = _at_most(counts.to(torch.int64), num_samples)
    divisor = counts.clamp(min=1).double()
    means = {}
    for name, total in noisy.items():
        shape = (-1, *([1] * (total.dim() - 1)))
        mean = torch.where(counts.reshape(shape) > 0, total / divisor.reshape(shape),
                           torch.zeros((), dtype=total.dtype))
        means[name] = mean.to(parts[name].dtype)
    return Released(counts, means)


def _at_most(counts: Tensor, limit: int) -> Tensor:
    """``counts`` with one taken off the largest (the first of equals) until they sum to at most ``limit``."""
    counts = counts.clone()
    excess = int(counts.sum()) - int(limit)
    while excess > 0:
        counts[int(counts.argmax())] -= 1
        excess -= 1
    return counts
