"""Client-level differential privacy (``privacy=client``): what a client sends and what the server releases.

What leaves client ``k`` is one vector ``u_k``: the update ``Delta = w_k - w_global`` of every
floating-point weight that travels (BatchNorm running statistics included), and every per-class
floating-point tensor its method's reply layout declares (:class:`~fedhpro.methods.layout.ClassRows`:
prototypes, class gradients, soft predictions), the rows of classes the client does not hold set to
zero. :func:`privatize_upload` clips ``u_k`` to the L2 norm ``C = privacy.clip`` (jointly, or each of the
``G`` tensor groups to ``C / sqrt(G)``: the same joint bound) and, with ``privacy.noise=local``, adds
``N(0, sigma^2 C^2)`` to every coordinate before it leaves. Which classes the client holds is private
too: it sends them as a 0/1 vector ``h_k`` (:data:`HOLDERS_KEY`, L2 norm at most ``sqrt(classes)``), noised
locally with ``N(0, sigma^2 classes)`` under local noise. The reply's ``num_examples`` and ``class_counts``,
which only weight the clients, become public constants (1 and zeros): under DP the server's denominators
are fixed (McMahan et al. 2018, DP-FedAvg), not the clients' counts.

The server (:class:`PrivateSum`, driven by the round protocol) sums the privatized uploads as they
arrive (re-clipping each under central noise, a no-op for an honest client), then
:meth:`PrivateSum.release` adds ``N(0, sigma^2 C^2)`` to the sum and ``N(0, sigma^2 classes)`` to the holder
counts (central noise; with local noise the clients did) and divides by public denominators: the weight
update is ``S_w / (q N)`` (``q`` the Poisson sampling rate, ``N`` the clients), class ``c``'s rows are
``S_c / max(noisy count_c, 1)``, and a class whose noisy count is below 0.5 counts as held by nobody this
round. :func:`private_reply` turns the release into one reply in the method's own layout (weights =
``w_global`` + the update, identical public counts), which the method aggregates with its own rule: its
mean of that one reply is the privatized value, and a server step that is not a mean (FedTGP's trained
prototypes, FedHPro's gradient matching) works on privatized inputs (post-processing).

The noise comes from a ``torch.Generator`` seeded from the run's seed (:func:`upload_noise_generator`,
stream :data:`PRIVACY`), so a run is reproducible; anyone who knows the seed can redraw it, so for a
deployment set ``privacy.secure_noise=true`` (the operating system's randomness, not reproducible).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fedhpro.aggregation import clip_factor
from fedhpro.errors import FedHProError
from fedhpro.methods.layout import ClassRows
from fedhpro.privacy.options import PrivacyOptions
from fedhpro.seeds import derive_seed

#: the seed streams of the privacy noise: a client's local noise (PRIVACY, round, client) and the server's
#: central noise (CENTRAL_NOISE, round); two tags, as NumPy's seed sequences read (.., round) and
#: (.., round, 0) alike (the round protocol's streams are 1-5: fedhpro.engines.protocol)
PRIVACY, CENTRAL_NOISE = 6, 7
#: the reply key of a client's (noised, under local noise) 0/1 vector of the classes it holds
HOLDERS_KEY = "dp_holders"
#: the reply key that marks a privatized upload (True): the server refuses a reply without it, so an engine that
#: forgot to privatize is told, instead of having a model's weights read as an update
PRIVATIZED_KEY = "dp_privatized"
#: the reply key of adaptive clipping's indicator (``privacy.clip_quantile``): ``[1 if the upload's norm was at most
#: the clip else 0] - 1/2``, shape ``(1,)`` (centred, so one client moves the sum by at most 1/2), noised locally
#: under local noise
BELOW_CLIP_KEY = "dp_below_clip"
#: the reply keys the privatization replaces by public constants: they only weight the clients
COUNT_KEYS = ("num_examples", "class_counts")
#: per-class tensors whose rows are probability vectors (FedGMKD's soft predictions): the released rows are
#: projected back onto the simplex (clamped at 0, rows renormalised), post-processing that keeps the method's
#: own checks (probabilities >= 0) true after noise
PROBABILITY_ROWS = ("soft_predictions",)


class PrivacyError(FedHProError):
    """A reply that cannot be privatized (a key that is neither a weight nor a declared per-class tensor)."""


@dataclass(frozen=True)
class ClientPrivacy:
    """What a client and the server need to privatize a round (``privacy=client``).

    ``clip``: the L2 bound ``C`` of a client's whole upload; ``clipping``: ``joint`` (the whole vector) or
    ``per-group`` (each of the ``G`` tensor groups, the weights and each per-class tensor, to
    ``C / sqrt(G)``); ``noise``: ``central`` (the server noises the sum) or ``local`` (each client its own
    upload); ``noise_multiplier``: sigma, the noise's std is ``sigma x C`` (``sigma x sqrt(classes)`` for
    the holder counts); ``secure_noise``: draw the noise from the operating system, not the run's seed;
    ``noise_scale``: what the central noise's std is multiplied by (``privacy.noise_cohort``: the trained
    cohort over the noise cohort; 1 otherwise); ``adaptive``: the upload carries :data:`BELOW_CLIP_KEY` (adaptive
    clipping, ``privacy.clip_quantile``), whose noise has std ``quantile_noise`` (on the sum under central noise,
    on each client's indicator under local noise). ``clip`` is then the round's clip, which the round protocol
    moves after every round (:func:`next_clip`).
    """

    clip: float
    noise_multiplier: float
    clipping: str = "joint"
    noise: str = "central"
    secure_noise: bool = False
    noise_scale: float = 1.0
    adaptive: bool = False
    quantile_noise: float = 0.0

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"clip must be > 0, got {self.clip}")
        if self.clipping not in ("joint", "per-group"):
            raise ValueError(f"clipping must be joint or per-group, got {self.clipping!r}")
        if self.noise not in ("central", "local"):
            raise ValueError(f"noise must be central or local, got {self.noise!r}")
        if not self.noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if not 0 < self.noise_scale <= 1:
            raise ValueError(f"noise_scale must be in (0, 1], got {self.noise_scale}")
        if self.noise_scale != 1 and self.noise != "central":
            raise ValueError("noise_scale (a noise cohort) applies to central noise only")
        if not self.quantile_noise >= 0:
            raise ValueError(f"quantile_noise must be >= 0, got {self.quantile_noise}")


def client_privacy(options: PrivacyOptions, noise_multiplier: float, noise_scale: float = 1.0,
                   quantile_noise: float | None = None) -> ClientPrivacy:
    """The :class:`ClientPrivacy` of ``privacy.*`` options (``config.privacy``) with the ledger's sigma
    (``ledger.noise_multiplier``: ``privacy.noise_multiplier``, or the one calibrated to ``target_epsilon``),
    its ``noise_scale`` (``privacy.noise_cohort``'s; 1 without) and its ``quantile_noise`` (adaptive clipping's
    indicator noise; None: adaptive clipping off)."""
    return ClientPrivacy(clip=float(options.clip), noise_multiplier=float(noise_multiplier),
                         clipping=options.clipping, noise=options.noise,
                         secure_noise=bool(getattr(options, "secure_noise", False)), noise_scale=float(noise_scale),
                         adaptive=quantile_noise is not None, quantile_noise=float(quantile_noise or 0.0))


def next_clip(clip: float, below: float, quantile: float, lr: float) -> float:
    """Adaptive clipping's geometric update (Andrew et al. 2021, Algorithm 1): ``clip x exp(-lr (below -
    quantile))``, ``below`` the round's released (noised) fraction of clients whose update norm was at most
    ``clip``: the clip shrinks while more than the target ``quantile`` of the updates fit under it, and grows
    while fewer do.

    The released fraction is clamped to ``[0, 1]`` first (post-processing of a released value: no privacy
    cost): noise, or one client's indicator under local noise, can push it outside, and a fraction outside
    ``[0, 1]`` is no fraction. So one round moves the clip by at most ``exp(+-lr)``: it can neither overflow
    nor reach zero, whatever the release."""
    fraction = min(max(float(below), 0.0), 1.0)
    return float(clip) * math.exp(-float(lr) * (fraction - float(quantile)))


def upload_noise_generator(settings: ClientPrivacy, seed: int, round: int, client: int | None = None
                           ) -> torch.Generator:
    """The generator of a round's noise: client ``client``'s local noise, or (``client=None``) the server's
    central noise. Seeded from ``(seed, PRIVACY, round, client)``, resp. ``(seed, CENTRAL_NOISE, round)``
    (reproducible, the same on every engine), or from the operating system's randomness with
    ``settings.secure_noise``."""
    if settings.secure_noise:
        return torch.Generator().manual_seed(secrets.randbits(63))
    parts = (seed, CENTRAL_NOISE, round) if client is None else (seed, PRIVACY, round, client)
    return torch.Generator().manual_seed(derive_seed(*parts))


def poisson_participants(seed: int, num_clients: int, rate: float) -> list[int]:
    """The participants of a round under Poisson sampling: each of ``num_clients`` clients independently
    with probability ``rate`` (all of them when ``rate >= 1``), from a NumPy generator seeded with ``seed``
    (the round protocol's SAMPLE stream), sorted. The accountant's sampling rate is this ``rate``."""
    import numpy as np

    if rate >= 1.0:
        return list(range(num_clients))
    draws = np.random.default_rng(seed).random(num_clients)
    return [int(k) for k in np.flatnonzero(draws < rate)]


# ---------------------------------------------------------------------------- the client side


def _held_rows(reply: Mapping[str, Any], num_classes: int) -> Tensor:
    """``C`` bool: the classes the reply's client holds (``class_counts > 0``; all of them without counts)."""
    counts = reply.get("class_counts")
    if isinstance(counts, Tensor) and tuple(counts.shape) == (num_classes,):
        return counts.detach().cpu() > 0
    return torch.ones(num_classes, dtype=torch.bool)


def _clip_groups(groups: dict[str, dict[str, Tensor]], settings: ClientPrivacy) -> float:
    """Scale ``groups`` (group -> tensors, float64) in place to the joint L2 norm ``settings.clip``, or each
    non-empty group to ``clip / sqrt(G)`` (``per-group``). Returns their joint L2 norm before clipping."""
    norms = {name: math.sqrt(sum(float(t.pow(2).sum()) for t in tensors.values()))
             for name, tensors in groups.items() if tensors}
    if not norms:
        return 0.0
    joint = math.sqrt(sum(n * n for n in norms.values()))
    if settings.clipping == "joint":
        factor = clip_factor(joint, settings.clip)
        factors = dict.fromkeys(norms, factor)
    else:
        bound = settings.clip / math.sqrt(len(norms))
        factors = {name: clip_factor(norm, bound) for name, norm in norms.items()}
    for name, factor in factors.items():
        if factor != 1.0:
            for tensor in groups[name].values():
                tensor.mul_(factor)
    return joint


def _gaussian_like(tensor: Tensor, std: float, generator: torch.Generator) -> Tensor:
    """``N(0, std^2)`` noise of ``tensor``'s shape (float64, drawn on the CPU: the same on every device)."""
    return torch.randn(tensor.shape, generator=generator, dtype=torch.float64).mul_(std).to(tensor.device)


def privatize_upload(reply: Mapping[str, Any], broadcast: Mapping[str, Tensor], class_keys: Sequence[str],
                     settings: ClientPrivacy, generator: torch.Generator | None = None,
                     num_classes: int | None = None) -> dict[str, Any]:
    """Client ``k``'s reply as it leaves the client under ``privacy=client`` (a new dict; ``reply`` unchanged).

    Args:
        reply: what the method's ``Client.fit`` returned: ``weights`` (the trained shared weights, the keys
            the server broadcast), ``num_examples``, the method's per-class tensors and ``class_counts``.
        broadcast: the weights the server sent this round (``payload["weights"]``; ``{}`` when none travel).
        class_keys: the per-class floating-point keys of the method's reply layout
            (:func:`fedhpro.engines.protocol.declared_class_keys` of its server).
        settings: the round's :class:`ClientPrivacy`.
        generator: the client's noise generator (:func:`upload_noise_generator` with its client id); needed
            with ``noise=local`` only.
        num_classes: the number of classes (the length of ``class_counts``); default: the first per-class
            tensor's first dimension.

    Returns the reply in the method's layout plus :data:`HOLDERS_KEY`: ``weights`` holds the clipped (and,
    under local noise, noised) update ``Delta`` of each floating-point weight (zeros for integer counters:
    they are not sent), each per-class tensor its clipped rows (zero for classes the client does not
    hold, before noise), ``num_examples`` is 1, ``class_counts`` zeros, :data:`HOLDERS_KEY` the float 0/1
    vector of the held classes (noised under local noise; only when the method has per-class tensors),
    :data:`PRIVATIZED_KEY` True.

    Raises :class:`PrivacyError` for a reply key that is none of these (it would leave unprotected).
    """
    class_keys = [key for key in class_keys if isinstance(reply.get(key), Tensor)]
    unknown = sorted(set(reply) - {"weights", *COUNT_KEYS, *class_keys})
    if unknown:
        raise PrivacyError(f"the reply's key {unknown[0]!r} is neither a shared weight nor a per-class tensor of "
                           "the method's reply layout, so privacy=client cannot privatize it; declare it as "
                           "ClassRows in the server's reply_layout (or do not upload it)")
    if settings.noise == "local" and settings.noise_multiplier > 0 and generator is None:
        raise ValueError("privacy.noise=local needs the client's noise generator (upload_noise_generator(...))")
    weights = reply.get("weights")
    weights = weights if isinstance(weights, Mapping) else {}
    groups: dict[str, dict[str, Tensor]] = {"weights": {}}
    out_weights: dict[str, Tensor] = {}
    for key, value in weights.items():
        base = broadcast.get(key)
        if (isinstance(value, Tensor) and value.is_floating_point() and isinstance(base, Tensor)
                and base.shape == value.shape):
            groups["weights"][key] = (value.detach().to(torch.float64)
                                      - base.detach().to(device=value.device, dtype=torch.float64))
        elif isinstance(value, Tensor):
            out_weights[key] = torch.zeros_like(value)  # a counter (num_batches_tracked): not sent
        else:
            raise PrivacyError(f"the reply's weight {key!r} is a {type(value).__name__}, not a tensor")
    if class_keys:
        classes = num_classes if num_classes is not None else int(reply[class_keys[0]].shape[0])
        held = _held_rows(reply, classes)
        for key in class_keys:
            rows = reply[key].detach().to(torch.float64).clone()
            if rows.shape[0] != classes:
                raise PrivacyError(f"the reply's per-class tensor {key!r} has {rows.shape[0]} rows, not {classes}")
            rows[~held.to(rows.device)] = 0.0
            groups[key] = {key: rows}
    norm = _clip_groups(groups, settings)
    local = settings.noise == "local" and settings.noise_multiplier > 0
    std = settings.noise_multiplier * settings.clip
    out: dict[str, Any] = {}
    for key, value in weights.items():
        if key in groups["weights"]:
            delta = groups["weights"][key]
            if local:
                assert generator is not None
                delta = delta + _gaussian_like(delta, std, generator)
            out_weights[key] = delta.to(value.dtype)
    out["weights"] = {key: out_weights[key] for key in weights}
    if "num_examples" in reply:
        out["num_examples"] = 1
    for key in class_keys:
        rows = groups[key][key]
        if local:
            assert generator is not None
            rows = rows + _gaussian_like(rows, std, generator)
        out[key] = rows.to(reply[key].dtype)
    if isinstance(reply.get("class_counts"), Tensor):
        out["class_counts"] = torch.zeros_like(reply["class_counts"])
    if class_keys:
        holders = held.to(torch.float64)
        if local:
            assert generator is not None
            holders = holders + _gaussian_like(holders, settings.noise_multiplier * math.sqrt(classes), generator)
        out[HOLDERS_KEY] = holders.to(torch.float32)
    if settings.adaptive:  # drawn after every other noise: the other uploads' draws stay those without it
        below = torch.tensor([(1.0 if norm <= settings.clip else 0.0) - 0.5], dtype=torch.float64)
        if settings.noise == "local" and settings.quantile_noise > 0:
            if generator is None:
                raise ValueError("privacy.noise=local needs the client's noise generator (upload_noise_generator)")
            below = below + _gaussian_like(below, settings.quantile_noise, generator)
        out[BELOW_CLIP_KEY] = below.to(torch.float32)
    out[PRIVATIZED_KEY] = True
    return out


def privatized_layout(layout: Mapping[str, Any], num_classes: int, adaptive: bool = False) -> dict[str, Any]:
    """A method's reply layout (``server.reply_layout()``) as the replies look under ``privacy=client``: the
    same, plus :data:`PRIVATIZED_KEY` (``bool``), :data:`HOLDERS_KEY` (``ClassRows((C,), float32)``) when the
    method has per-class tensors and, with adaptive clipping (``adaptive``), :data:`BELOW_CLIP_KEY`
    (``((1,), float32)``). What the Flower server checks a reply's form against before decoding it."""
    out = dict(layout)
    out[PRIVATIZED_KEY] = bool
    if any(isinstance(entry, ClassRows) and entry.dtype.is_floating_point for entry in layout.values()):
        out[HOLDERS_KEY] = ClassRows((num_classes,), torch.float32)
    if adaptive:
        out[BELOW_CLIP_KEY] = ((1,), torch.float32)
    return out


# ---------------------------------------------------------------------------- the server side


@dataclass
class PrivateRelease:
    """What the server releases in one round (all of it privatized): the mean weight update (float
    entries), each per-class tensor's rows, the noisy holder counts and which classes count as held."""

    update: dict[str, Tensor]
    rows: dict[str, Tensor]
    counts: Tensor  # C float64: the noisy number of holders of each class
    held: Tensor  # C bool: noisy count >= 0.5
    #: adaptive clipping: the noised fraction of the expected clients whose update fit under the clip (else None)
    below_clip: float | None = None


class PrivateSum:
    """A round's sum of privatized uploads, folded as they arrive (one model's worth of memory), and its
    release (:meth:`release`).

    Args:
        settings: the round's :class:`ClientPrivacy`.
        broadcast: the weights the server sent (their float entries are summed; ``{}`` when none travel).
        layout: the method's reply layout (``server.reply_layout()``): its per-class floating-point tensors
            (:class:`~fedhpro.methods.layout.ClassRows`) are summed row-wise; also how a round nobody answered
            is released (noise only).
        num_classes: the number of classes.
        expected_clients: ``q N``, the public denominator of the weight update.
    """

    def __init__(self, settings: ClientPrivacy, broadcast: Mapping[str, Tensor], layout: Mapping[str, Any],
                 num_classes: int, expected_clients: float):
        self.settings = settings
        self.num_classes = num_classes
        self.expected_clients = float(expected_clients)
        self.broadcast = dict(broadcast)
        self.weight_sums = {key: torch.zeros(value.shape, dtype=torch.float64, device=value.device)
                            for key, value in broadcast.items() if value.is_floating_point()}
        self.class_layout = {key: entry for key, entry in layout.items()
                             if isinstance(entry, ClassRows) and entry.dtype.is_floating_point}
        self.row_sums = {key: torch.zeros(entry.shape, dtype=torch.float64) for key, entry in self.class_layout.items()}
        self.holder_sum = torch.zeros(num_classes, dtype=torch.float64)
        self.below_sum = 0.0  # adaptive clipping: the sum of the centred indicators
        self.count = 0

    @property
    def has_class_tensors(self) -> bool:
        return bool(self.class_layout)

    def problem(self, reply: Mapping[str, Any]) -> str | None:
        """Why ``reply`` cannot be summed (a privatized upload: finite update, finite rows, holders of
        shape ``(C,)``), or None."""
        if reply.get(PRIVATIZED_KEY) is not True:
            return ("it was not privatized on the client (privacy=client: the engine must send "
                    "fedhpro.privacy.privatize_upload's reply)")
        weights = reply.get("weights")
        if not isinstance(weights, Mapping):
            return "its weights are not a dict of tensors"
        for key, total in self.weight_sums.items():
            value = weights.get(key)
            if not isinstance(value, Tensor) or value.shape != total.shape:
                return f"its update of {key!r} is missing or has the wrong shape"
            if not bool(torch.isfinite(value).all()):
                return f"its update of {key!r} holds NaN/Inf"
        for key, total in self.row_sums.items():
            value = reply.get(key)
            if not isinstance(value, Tensor) or tuple(value.shape) != tuple(total.shape):
                return f"its per-class tensor {key!r} is missing or has the wrong shape"
            if not bool(torch.isfinite(value).all()):
                return f"its per-class tensor {key!r} holds NaN/Inf"
        if self.has_class_tensors:
            holders = reply.get(HOLDERS_KEY)
            if not isinstance(holders, Tensor) or tuple(holders.shape) != (self.num_classes,):
                return f"it has no {HOLDERS_KEY} vector of {self.num_classes} entries (privatize_upload makes it)"
            if not holders.is_floating_point() or not bool(torch.isfinite(holders).all()):
                return f"its {HOLDERS_KEY} are not finite floats"
        if self.settings.adaptive:
            below = reply.get(BELOW_CLIP_KEY)
            if (not isinstance(below, Tensor) or tuple(below.shape) != (1,) or not below.is_floating_point()
                    or not bool(torch.isfinite(below).all())):
                return f"it has no finite {BELOW_CLIP_KEY} of shape (1,) (adaptive clipping: privatize_upload makes it)"
            limit = self.indicator_limit
            if limit is not None and abs(float(below.detach().cpu().double()[0])) > limit:
                return (f"its {BELOW_CLIP_KEY} {float(below[0]):.4g} is beyond +-{limit:.4g} (an indicator of +-1/2 "
                        "plus privacy.quantile_noise's local noise cannot reach it: 6 standard deviations)")
        return None

    @property
    def indicator_limit(self) -> float | None:
        """Under local noise, the largest ``|indicator|`` an honest client sends but with probability ~2e-9
        (``1/2 + 6 quantile_noise``: +-1/2 plus its own Gaussian noise); None under central noise, where the
        server clamps each indicator to +-1/2 itself (:meth:`add`)."""
        if self.settings.noise != "local":
            return None
        return 0.5 + 6.0 * self.settings.quantile_noise

    def add(self, reply: Mapping[str, Any]) -> None:
        """Fold one privatized upload (checked by :meth:`problem` first). Under central noise the server
        clips it again (a no-op for an honest client) and projects its holders into ``[0, 1]``, so no
        client can weigh more than the bound the accountant assumes; under local noise it cannot (the
        upload is noised), so the bound rests on the clients' honesty, but for the clip's indicator, refused beyond
        :attr:`indicator_limit` (:meth:`problem`)."""
        groups: dict[str, dict[str, Tensor]] = {
            "weights": {key: reply["weights"][key].detach().to(device=total.device, dtype=torch.float64).clone()
                        for key, total in self.weight_sums.items()}}
        for key in self.row_sums:
            groups[key] = {key: reply[key].detach().cpu().to(torch.float64).clone()}
        holders = None
        if self.has_class_tensors:
            holders = reply[HOLDERS_KEY].detach().cpu().to(torch.float64)
        below = float(reply[BELOW_CLIP_KEY].detach().cpu().to(torch.float64)[0]) if self.settings.adaptive else 0.0
        if self.settings.noise == "central":
            _clip_groups(groups, self.settings)
            if holders is not None:
                holders = holders.clamp(0.0, 1.0)
            below = min(max(below, -0.5), 0.5)  # a claim: one client moves the count by at most 1/2
        for key, total in self.weight_sums.items():
            total.add_(groups["weights"][key])
        for key, total in self.row_sums.items():
            total.add_(groups[key][key])
        if holders is not None:
            self.holder_sum.add_(holders)
        self.below_sum += below
        self.count += 1

    def flat_sum(self) -> Tensor:
        """The sum of the clipped uploads so far as one float64 vector (weights, then the per-class tensors in
        layout order; not the holders): what one client's data can move by at most ``2C`` (``C`` when it is
        added or removed). For tests and audits."""
        parts = [total.flatten().cpu() for total in self.weight_sums.values()]
        parts += [total.flatten() for total in self.row_sums.values()]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)

    def release(self, generator: torch.Generator | None) -> PrivateRelease:
        """The round's privatized values: under central noise with ``generator``, the sums plus
        ``N(0, sigma^2 C^2)`` (holder counts: ``N(0, sigma^2 C_classes)``); without (local noise, or a
        noiseless check) the sums as they are; divided by the public denominators (module doc)."""
        # a noise cohort (noise_scale < 1) noises the sum as a cohort of noise_cohort clients would be: std
        # sigma C (q N / noise_cohort), so that the mean update's noise is sigma C / noise_cohort
        sigma, clip = self.settings.noise_multiplier * self.settings.noise_scale, self.settings.clip
        noise = generator if self.settings.noise == "central" and sigma > 0 else None

        def noised(total: Tensor, std: float) -> Tensor:
            return total if noise is None else total + _gaussian_like(total, std, noise)

        update = {key: noised(total, sigma * clip) / max(self.expected_clients, 1e-12)
                  for key, total in self.weight_sums.items()}
        counts = noised(self.holder_sum, sigma * math.sqrt(self.num_classes)) if self.has_class_tensors \
            else self.holder_sum.clone()
        held = counts >= 0.5
        denominators = counts.clamp(min=1.0)
        rows = {}
        for key, total in self.row_sums.items():
            noisy = noised(total, sigma * clip)
            mean = noisy / denominators.reshape(-1, *([1] * (noisy.dim() - 1)))
            mean[~held] = 0.0
            if key in PROBABILITY_ROWS:
                mean = _probability_rows(mean, held)
            rows[key] = mean
        below_clip = None
        if self.settings.adaptive:  # drawn after the other noise, so that their draws are those without it
            total = torch.tensor([self.below_sum], dtype=torch.float64)
            if self.settings.noise == "central" and generator is not None and self.settings.quantile_noise > 0:
                total = total + _gaussian_like(total, self.settings.quantile_noise * self.settings.noise_scale,
                                               generator)
            below_clip = float(total[0]) / max(self.expected_clients, 1e-12) + 0.5
        return PrivateRelease(update, rows, counts, held, below_clip)


def _probability_rows(rows: Tensor, held: Tensor) -> Tensor:
    """Each held row (over its last dimension) projected to a probability vector: clamped at 0, renormalised;
    a row without mass left becomes uniform (post-processing of a private release)."""
    flat = rows.clamp(min=0.0)
    total = flat.sum(dim=-1, keepdim=True)
    uniform = torch.full_like(flat, 1.0 / flat.shape[-1])
    out = torch.where(total > 0, flat / total.clamp(min=1e-300), uniform)
    out[~held] = 0.0
    return out


def private_reply(release: PrivateRelease, broadcast: Mapping[str, Tensor],
                  layout: Mapping[str, Any]) -> dict[str, Any]:
    """One reply in the method's own layout that carries the round's release: weights = the broadcast
    weights + the mean update (integer counters as broadcast), each per-class tensor the released rows
    (zeros for classes held by nobody), ``class_counts`` 1 for the held classes and 0 elsewhere,
    ``num_examples`` 1. The method's mean of it is the privatized value."""
    reply: dict[str, Any] = {}
    if "weights" in layout:
        weights = {}
        for key, value in broadcast.items():
            if key in release.update:
                weights[key] = (value.detach().to(torch.float64) + release.update[key].to(value.device)).to(value.dtype)
            else:
                weights[key] = value.detach().clone()
        reply["weights"] = weights
    if "num_examples" in layout:
        reply["num_examples"] = 1
    for key, entry in layout.items():
        if key in release.rows and isinstance(entry, ClassRows):
            reply[key] = release.rows[key].to(entry.dtype)
    counts = layout.get("class_counts")
    if isinstance(counts, ClassRows):
        reply["class_counts"] = release.held.to(counts.dtype)
    return reply
