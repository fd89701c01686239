"""Hyper-prototypes as a reusable part: FedHPro's server step and the client statistics it needs.

FedHPro uses it, and so does any prototype method run with
``prototypes=hyper`` (the paper's plug-and-play, Table 3): the server keeps a
:class:`HyperPrototypeBank`, clients upload :func:`class_statistics`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedhpro import functional
from fedhpro.data.federation import ClientData
from fedhpro.errors import ConfigError, UpdateError
from fedhpro.methods.fedhpro import authors_code, equations
from fedhpro.methods.fedhpro.options import HYPER_INITS, MATCHING_DISTANCES, SAMPLE_CHOICES
from fedhpro.methods.layout import Payload
from fedhpro.methods.no_grad import extract_features
from fedhpro.methods.parts import classifier_of
from fedhpro.seeds import derive_seed

#: seed streams of :class:`SyntheticClassifier`: its features (drawn once) and each round's fresh head
_SYNTHETIC_FEATURES, _SYNTHETIC_HEAD = 51, 52




def initial_hyper_prototypes(num_classes: int, num_hyper: int, feature_dim: int, generator: torch.Generator,
                             init: str = "gaussian") -> Tensor:
    """The starting hyper-prototypes S (C x |I| x d, float32, drawn from ``generator`` on the CPU).

    - ``gaussian`` (the paper): every entry N(0, 1).
    - ``simplex``: the |I| vectors of class c are ``sqrt(d) u_c`` plus N(0, 0.1^2) noise, with ``u_1..u_C`` the
      unit vertices of a regular simplex (pairwise cosine ``-1/(C-1)``, the most separated C directions) in a
      random C-dimensional subspace.
    - ``orthogonal-nonnegative``: class c's vectors are |N(0, 1)| * sqrt(C) on its own block of about d/C
      coordinates and 0 elsewhere: pairwise orthogonal classes (cosine 0) with no negative entry, a direction
      that features after a ReLU can reach exactly (those of the other two cannot: a non-negative ``z`` has a
      cosine of at most about 0.71 with a Gaussian vector).

    The two last need ``d >= C``.
    """
    if init == "gaussian":
        return torch.randn(num_classes, num_hyper, feature_dim, generator=generator)
    if init not in HYPER_INITS:
        raise ConfigError(f"unknown hyper-prototype init {init!r}: use one of {', '.join(HYPER_INITS)}")
    if feature_dim < num_classes:
        raise ConfigError(f"hyper_init={init} needs feature_dim >= the number of classes ({feature_dim} < "
                          f"{num_classes}): raise feature_dim or use hyper_init=gaussian")
    if init == "simplex":
        basis, _ = torch.linalg.qr(torch.randn(feature_dim, num_classes, generator=generator, dtype=torch.float64))
        vertices = torch.eye(num_classes, dtype=torch.float64) - 1.0 / num_classes
        directions = torch.nn.functional.normalize(vertices @ basis.T, dim=1)  # C x d, unit
        noise = 0.1 * torch.randn(num_classes, num_hyper, feature_dim, generator=generator, dtype=torch.float64)
        return (feature_dim ** 0.5 * directions.unsqueeze(1) + noise).float()
    blocks = torch.arange(feature_dim) * num_classes // feature_dim  # coordinate -> its class's block
    own = (blocks.unsqueeze(0) == torch.arange(num_classes).unsqueeze(1)).float()  # C x d
    magnitudes = torch.randn(num_classes, num_hyper, feature_dim, generator=generator).abs()
    return magnitudes * own.unsqueeze(1) * num_classes ** 0.5


class HyperPrototypeBank:
    """The server's hyper-prototypes S (C x |I| x d): N(0, 1) at the start (or another ``init``, see
    :func:`initial_hyper_prototypes`), matched every round (Eq. 6-9)."""

    def __init__(self, num_classes: int, feature_dim: int, seed: int, *, num_hyper: int = 5,
                 match_steps: int = 30, lr: float = 0.1, optimizer: str = "sgd", init: str = "gaussian",
                 distance: str = "cosine"):
        if distance not in MATCHING_DISTANCES:
            raise ConfigError(f"unknown matching distance {distance!r}: use one of {', '.join(MATCHING_DISTANCES)}")
        generator = torch.Generator().manual_seed(seed)
        # drawn on the CPU: the same values on every device
        self.hyper = initial_hyper_prototypes(num_classes, num_hyper, feature_dim, generator, init)
        self.initial = self.hyper.clone()
        self.num_classes = num_classes
        self.match_steps = match_steps
        self.lr = lr
        self.optimizer = optimizer
        self.distance = distance

    @property
    def averaged(self) -> Tensor:
        """H (C x d), the mean of each class's |I| vectors."""
        return self.hyper.mean(1)

    def validate(self, replies: Sequence[Payload]) -> tuple[Tensor, Tensor]:
        """Stack the replies' ``class_gradients`` (K x C x d) and presence masks (K x C); UpdateError if malformed."""
        return stack_class_gradients(replies, self.num_classes, self.hyper.shape[2])

    def update(self, gradients: Tensor, present: Tensor, classifier: nn.Linear) -> dict[str, float]:
        """Eq. 6 then Eq. 9 against the (new global) ``classifier``; returns L_GM before/after and the movement."""
        g_real, held = equations.aggregate_class_gradients(gradients, present)
        device = classifier.weight.device
        hyper, before, after = equations.match_hyper_prototypes(
            self.hyper.to(device), classifier, g_real.to(device), held.to(device),
            steps=self.match_steps, lr=self.lr, optimizer=self.optimizer, distance=self.distance)
        self.hyper = hyper.to(self.hyper.device)
        movement = float((self.hyper - self.initial).norm() / self.initial.norm())
        return {"gm_loss_before": before, "gm_loss_after": after, "hyper_movement": movement}

    def state_dict(self) -> dict[str, Any]:
        return {"hyper_prototypes": self.hyper, "hyper_initial": self.initial}

    def load_state_dict(self, state) -> None:
        self.hyper = state["hyper_prototypes"].clone()
        self.initial = state["hyper_initial"].clone()


class SyntheticClassifier:
    """The authors' server-side classifier step (the authors' code, not in the paper).

    Their ``Global.set_meta_params`` then ``Global.meta_revised`` (``main_run.py``
    of mala-lab/FedHPro), run every round after FedAvg and before the
    hyper-prototypes are matched:

    1. Clients upload, per class ``c`` they hold, the gradient of the mean CE
       of that class's sampled features (the received model's, detached)
       w.r.t. the classifier's weight and bias
       (:func:`~fedhpro.methods.fedhpro.authors_code.classifier_class_gradients`; their
       ``compute_gradient``, at most 100 samples per class). Being a mean,
       each is ``1/n_c`` times the summed per-sample gradients; the
       distance below is a cosine, blind to that scale up to its ``eps``.
    2. The server averages them per class over the clients holding it,
       unweighted (as Eq. 6 averages the feature gradients).
    3. It keeps a second set of synthetic features, ``C x m x d`` (their
       ``meta_hp``, ``m = 50``), drawn once from N(0, 1) (seeded) and carried
       across rounds (in the server's state and checkpoints), each labelled
       with its class.
    4. ``match_steps`` (100) steps of plain SGD (step ``lr``, FedHPro's
       ``hyper_lr``, 0.1 in their code) move the features to minimise, over
       the classes with real gradients, the layer-wise distance
       (:func:`~fedhpro.methods.fedhpro.authors_code.classifier_matching_loss`; their
       ``distance_wb``: for the ``C x d`` weight the sum over output rows of
       ``1 - cos``, for the bias one row) between the averaged real gradients
       and the gradients of ``CE(h(s^c), c)`` (mean over the class's ``m``
       features) w.r.t. ``(W, b)`` of a linear layer ``h`` loaded with the
       classifier the clients used (the one broadcast this round); their code
       differentiates those with ``create_graph``, here they are in closed
       form (:func:`~fedhpro.methods.fedhpro.authors_code.synthetic_classifier_gradients`).
    5. A fresh ``Linear(d, C)`` (seeded per round) is trained on all ``C m``
       matched features and their labels: ``epochs`` (100) epochs, batches
       of ``batch_size`` (50), shuffled (seeded), plain SGD with step
       ``train_lr`` (0.01), mean CE
       (:func:`~fedhpro.methods.fedhpro.authors_code.train_linear_classifier`).
    6. Its weight and bias replace the aggregated global model's classifier;
       the hyper-prototypes are then matched against this classifier, and
       it is what the clients receive next round.

    One difference: in their first round the clients' gradients come from
    a separately initialised random head, not the global model's; here
    they always come from the classifier the clients received.
    """

    def __init__(self, num_classes: int, feature_dim: int, seed: int, *, per_class: int = 50,
                 match_steps: int = 100, lr: float = 0.1, epochs: int = 100, batch_size: int = 50,
                 train_lr: float = 0.01):
        generator = torch.Generator().manual_seed(derive_seed(seed, _SYNTHETIC_FEATURES))
        # drawn on the CPU: the same values on every device
        self.features = torch.randn(num_classes, per_class, feature_dim, generator=generator)
        self.num_classes = num_classes
        self.seed = seed
        self.match_steps = match_steps
        self.lr = lr
        self.epochs = epochs
        self.batch_size = batch_size
        self.train_lr = train_lr

    @property
    def labels(self) -> Tensor:
        """The ``C m`` labels of the flattened features: ``m`` of class 0, then of class 1, ..."""
        return torch.arange(self.num_classes).repeat_interleave(self.features.shape[1])

    def validate(self, replies: Sequence[Payload]) -> tuple[Tensor, Tensor, Tensor]:
        """Stack the replies' classifier gradients (K x C x C x d, K x C x C) and presence masks (K x C);
        UpdateError if malformed."""
        return stack_classifier_gradients(replies, self.num_classes, self.features.shape[2])

    def update(self, round: int, weight_gradients: Tensor, bias_gradients: Tensor, present: Tensor,
               weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor, dict[str, float]]:
        """Steps 2-5 against the head ``(weight, bias)`` the clients used; returns the new ``(weight, bias)``
        (on that head's device and dtype) and the matching loss before and after."""
        device, dtype = weight.device, weight.dtype
        num_clients, num_classes = present.shape
        weight_real, held = equations.aggregate_class_gradients(weight_gradients.reshape(num_clients, num_classes, -1),
                                                         present)
        bias_real, _ = equations.aggregate_class_gradients(bias_gradients, present)
        weight_real = weight_real.reshape(num_classes, num_classes, -1)
        features, before, after = authors_code.match_classifier_features(
            self.features.to(device, dtype), weight, bias, weight_real.to(device, dtype),
            bias_real.to(device, dtype), held.to(device), steps=self.match_steps, lr=self.lr)
        self.features = features.to(self.features.device, self.features.dtype)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, _SYNTHETIC_HEAD, round))
        weight, bias = authors_code.train_linear_classifier(
            features.reshape(-1, features.shape[2]), self.labels.to(device), num_classes, generator,
            epochs=self.epochs, batch_size=self.batch_size, lr=self.train_lr)
        return weight, bias, {"classifier_match_before": before, "classifier_match_after": after}

    def state_dict(self) -> dict[str, Any]:
        return {"classifier_features": self.features}

    def load_state_dict(self, state) -> None:
        self.features = state["classifier_features"].clone()


def stack_classifier_gradients(replies: Sequence[Payload], num_classes: int,
                               feature_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    weights, biases, present = [], [], []
    for index, reply in enumerate(replies):
        w = _tensor_of_shape(reply, "classifier_weight_gradients", (num_classes, num_classes, feature_dim), index)
        b = _tensor_of_shape(reply, "classifier_bias_gradients", (num_classes, num_classes), index)
        counts = reply.get("class_counts")
        if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != (num_classes,):
            raise UpdateError(f"reply {index}: class_counts must be a tensor of {num_classes} counts")
        holds = counts > 0
        if not (bool(torch.isfinite(w[holds]).all()) and bool(torch.isfinite(b[holds]).all())):
            raise UpdateError(f"reply {index}: classifier gradients contain NaN/Inf")
        weights.append(w.float())
        biases.append(b.float())
        present.append(holds)
    return torch.stack(weights), torch.stack(biases), torch.stack(present)


def _tensor_of_shape(reply: Payload, name: str, shape: tuple[int, ...], index: int) -> Tensor:
    value = reply.get(name)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        raise UpdateError(f"reply {index}: {name} must be a {' x '.join(map(str, shape))} tensor, "
                          f"got {getattr(value, 'shape', type(value).__name__)}")
    return value


def stack_class_gradients(replies: Sequence[Payload], num_classes: int, feature_dim: int) -> tuple[Tensor, Tensor]:
    gradients, present = [], []
    for index, reply in enumerate(replies):
        g = reply.get("class_gradients")
        counts = reply.get("class_counts")
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != (num_classes, feature_dim):
            raise UpdateError(f"reply {index}: class_gradients must be a {num_classes} x {feature_dim} tensor, "
                              f"got {getattr(g, 'shape', type(g).__name__)}")
        if not isinstance(counts, torch.Tensor) or tuple(counts.shape) != (num_classes,):
            raise UpdateError(f"reply {index}: class_counts must be a tensor of {num_classes} counts")
        holds = counts > 0
        if not bool(torch.isfinite(g[holds]).all()):
            raise UpdateError(f"reply {index}: class_gradients contain NaN/Inf")
        gradients.append(g.float())
        present.append(holds)
    return torch.stack(gradients), torch.stack(present)


def class_statistics(model: nn.Module, data: ClientData, num_classes: int,
                     samples_per_class: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(g_k^c (Eq. 5), n_k^c, p_k^c (Eq. 2))`` from one eval-mode pass over the client's data.

    ``samples_per_class > 0`` uses only the first that many samples of each
    class for the gradients and prototypes (the counts stay the full counts).
    """
    features, labels = sampled_features(model, data, samples_per_class)
    gradients, prototypes = feature_statistics(classifier_of(model), features, labels, num_classes)
    counts = torch.bincount(data.y, minlength=num_classes)[:num_classes]
    return gradients, counts, prototypes




def sampled_features(model: nn.Module, data: ClientData, samples_per_class: int = 0, *, choice: str = "first",
                     generator: torch.Generator | None = None,
                     augment: Callable[[Tensor, torch.Generator], Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """``(features, labels)`` of the client's samples in one eval-mode pass: all of them, or with
    ``samples_per_class > 0`` at most that many of each class.

    ``choice="first"`` keeps the first ones in the client's order; ``choice="random"`` draws them from
    ``generator`` (the authors' code, ``main_run.py`` lines 297-300: ``torch.randperm`` of the class's samples,
    the first ``n`` of it, class by class in increasing order). ``augment(x, generator)``, when given, is applied
    to each class's selected images as one batch (the authors' code, lines 316-320); the rows then come class by
    class. ``choice="random"`` and ``augment`` need ``generator``.
    """
    if choice not in SAMPLE_CHOICES:
        raise ConfigError(f"unknown sample choice {choice!r}: use one of {', '.join(SAMPLE_CHOICES)}")
    x, y = data.x, data.y
    if choice == "first" and augment is None:
        if samples_per_class > 0:
            rank = torch.zeros_like(y)
            for c in torch.unique(y):
                where = (y == c).nonzero().squeeze(1)
                rank[where] = torch.arange(where.numel(), device=y.device)
            keep = rank < samples_per_class
            x, y = x[keep], y[keep]
        return extract_features(model, x), y
    if generator is None:
        raise ValueError("sampled_features: choice='random' and augment draw from a generator; pass one")
    images, labels = [], []
    for c in torch.unique(y).tolist():
        where = (y == c).nonzero().squeeze(1)
        if choice == "random":
            where = where[torch.randperm(where.numel(), generator=generator).to(where.device)]
        if samples_per_class > 0:
            where = where[:samples_per_class]
        chosen = x[where]
        images.append(augment(chosen, generator) if augment is not None else chosen)
        labels.append(y[where])
    return extract_features(model, torch.cat(images)), torch.cat(labels)


def divide_by_counts(gradients: Tensor, labels: Tensor, num_classes: int) -> Tensor:
    """``g_k^c / n_c`` with ``n_c`` the number of rows of class ``c`` in ``labels`` (the samples the gradients
    were computed on): the authors' class gradients (the authors' code, ``main_run.py`` lines 328-343), which
    average over the samples the gradient of the class's *mean* CE w.r.t. each feature, each ``1/n_c`` of that
    sample's own gradient. Rows of absent classes stay 0."""
    counts = torch.bincount(labels, minlength=num_classes)[:num_classes]
    return gradients / counts.clamp(min=1).unsqueeze(1).to(gradients.dtype)


def feature_statistics(classifier: nn.Module, features: Tensor, labels: Tensor,
                       num_classes: int) -> tuple[Tensor, Tensor]:
    """``(g_k^c (Eq. 5), p_k^c (Eq. 2))`` of features already extracted (one eval-mode pass), the
    gradients through ``classifier`` in eval mode (its previous mode is restored)."""
    was_training = classifier.training
    classifier.eval()
    gradients, _ = equations.class_gradients(features, labels, classifier, num_classes)
    classifier.train(was_training)
    prototypes, _ = functional.local_prototypes(features, labels, num_classes)
    return gradients, prototypes
