"""A federation: the clients' training data and the test sets, resident as tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

#: ``augment(x, generator) -> x``: a per-batch training augmentation (e.g. TinyImageNet's AutoAugment)
Augment = Callable[[Tensor, torch.Generator], Tensor]


@dataclass
class ClientData:
    """One client's training data, resident as tensors on the training device.

    ``augment``, when set, is applied to every training mini-batch (never to
    the data used for prototypes or evaluation); its randomness comes from the
    client's training generator, so a run stays reproducible.
    """

    x: Tensor
    y: Tensor
    num_classes: int
    augment: Optional[Augment] = None

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass
class Federation:
    """Clients' training tensors, test sets by domain (or one ``"all"``), and how they were made.

    ``partition`` is JSON-serialisable: per client its domain, the indices it
    took from its domain's training set, and its class counts.
    """

    name: str
    num_classes: int
    input_shape: tuple[int, ...]
    clients: list[ClientData]
    client_domains: list[str]
    test_sets: dict[str, tuple[Tensor, Tensor]]
    partition: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def client_test_name(self, k: int) -> str:
        """The test set of client ``k``'s own distribution: its domain's, else the only/``all`` one."""
        domain = self.client_domains[k] if self.client_domains else None
        if domain in self.test_sets:
            return domain
        if "all" in self.test_sets or len(self.test_sets) != 1:
            return "all"
        return next(iter(self.test_sets))

    def to(self, device: torch.device) -> "Federation":
        """Move every tensor to ``device`` (once, before training: data stays resident)."""
        self.clients = [ClientData(c.x.to(device), c.y.to(device), c.num_classes, c.augment) for c in self.clients]
        self.test_sets = {name: (x.to(device), y.to(device)) for name, (x, y) in self.test_sets.items()}
        return self


def normalize_images(images: Tensor) -> Tensor:
    """uint8 N x C x H x W -> float32 in [-1, 1] (mean 0.5, std 0.5 per channel)."""
    return images.float().div_(127.5).sub_(1.0)
