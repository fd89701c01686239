"""Hyper-prototypes as a reusable part: FedHPro's server step and the client statistics it needs.

FedHPro uses it, and so does any prototype method run with
``prototypes=hyper`` (the paper's plug-and-play, Table 3): the server keeps a
:class:`HyperPrototypeBank`, clients upload :func:`class_statistics`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedhpro import functional as HF
from fedhpro.data.federation import ClientData
from fedhpro.errors import UpdateError
from fedhpro.methods.base import Payload, classifier_of, extract_features


class HyperPrototypeBank:
    """The server's hyper-prototypes S (C x |I| x d): N(0, 1) at the start, matched every round (Eq. 6-9)."""

    def __init__(self, num_classes: int, feature_dim: int, seed: int, *, num_hyper: int = 5,
                 match_steps: int = 30, lr: float = 0.1, optimizer: str = "sgd"):
        generator = torch.Generator().manual_seed(seed)
        # drawn on the CPU: the same values on every device
        self.hyper = torch.randn(num_classes, num_hyper, feature_dim, generator=generator)
        self.initial = self.hyper.clone()
        self.num_classes = num_classes
        self.match_steps = match_steps
        self.lr = lr
        self.optimizer = optimizer

    @property
    def averaged(self) -> Tensor:
        """H (C x d), the mean of each class's |I| vectors."""
        return self.hyper.mean(1)

    def validate(self, replies: Sequence[Payload]) -> tuple[Tensor, Tensor]:
        """Stack the replies' ``class_gradients`` (K x C x d) and presence masks (K x C); UpdateError if malformed."""
        return stack_class_gradients(replies, self.num_classes, self.hyper.shape[2])

    def update(self, gradients: Tensor, present: Tensor, classifier: nn.Linear) -> dict[str, float]:
        """Eq. 6 then Eq. 9 against the (new global) ``classifier``; returns L_GM before/after and the movement."""
        g_real, held = HF.aggregate_class_gradients(gradients, present)
        device = classifier.weight.device
        hyper, before, after = HF.match_hyper_prototypes(
            self.hyper.to(device), classifier, g_real.to(device), held.to(device),
            steps=self.match_steps, lr=self.lr, optimizer=self.optimizer)
        self.hyper = hyper.to(self.hyper.device)
        movement = float((self.hyper - self.initial).norm() / self.initial.norm())
        return {"gm_loss_before": before, "gm_loss_after": after, "hyper_movement": movement}

    def state_dict(self) -> dict[str, Any]:
        return {"hyper_prototypes": self.hyper, "hyper_initial": self.initial}

    def load_state_dict(self, state) -> None:
        self.hyper = state["hyper_prototypes"].clone()
        self.initial = state["hyper_initial"].clone()


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
    x, y = data.x, data.y
    if samples_per_class > 0:
        rank = torch.zeros_like(y)
        for c in torch.unique(y):
            where = (y == c).nonzero().squeeze(1)
            rank[where] = torch.arange(where.numel(), device=y.device)
        keep = rank < samples_per_class
        x, y = x[keep], y[keep]
    gradients, prototypes = feature_statistics(classifier_of(model), extract_features(model, x), y, num_classes)
    counts = torch.bincount(data.y, minlength=num_classes)[:num_classes]
    return gradients, counts, prototypes


def feature_statistics(classifier: nn.Module, features: Tensor, labels: Tensor,
                       num_classes: int) -> tuple[Tensor, Tensor]:
    """``(g_k^c (Eq. 5), p_k^c (Eq. 2))`` of features already extracted (one eval-mode pass), the
    gradients through ``classifier`` in eval mode (its previous mode is restored)."""
    was_training = classifier.training
    classifier.eval()
    gradients, _ = HF.class_gradients(features, labels, classifier, num_classes)
    classifier.train(was_training)
    prototypes, _ = HF.local_prototypes(features, labels, num_classes)
    return gradients, prototypes
