"""FedSA (Zhou et al., AAAI 2025): semantic anchors for prototype-based FL.

The anchors, losses and defaults as the FedSA paper describes them.

Anchors ``A`` (C x d): class codes ``R ~ N(0, I)`` (C x d) through a FIXED random
2-layer MLP, ``A = ReLU(BN(W2 ReLU(BN(W1 R + b1)) + b2))`` (the authors' layout:
Linear-BN-ReLU-Linear-BN-ReLU, BatchNorm in training mode, i.e. normalised with
the batch statistics of the C codes, biased variance, eps 1e-5, unit scale and
zero shift). ``W, b ~ U(-1/sqrt(d), 1/sqrt(d))`` (PyTorch's Linear default
range) and ``R`` are drawn from a CPU generator seeded with the server's seed,
so the same seed gives the same anchors on every device. The MLP is never
trained; after each round the server moves the anchors of the classes held by
some participant: ``A_c <- m A_c + (1 - m) Pbar_c`` with ``m = anchor_momentum``
(0.9999) and ``Pbar_c`` the unweighted mean of the uploaded prototypes over the
clients holding c; other classes keep their anchors.

Client loss (on top of CE), with ``A`` the received anchors::

    lambda1 * CE(h(A), [0..C-1])                     classifier calibration on the anchors
  + lambda2 * MSE(z, A_y)                            F.mse_loss, mean over B x d
  + lambda3 * CE(-(||z - A_c||_2 + gamma * onehot(y)), y)   margin-enhanced contrastive

The distance is ``sqrt(clamp(sum_j (z_j - A_cj)^2, min=1e-12))`` (exact
differences, clamped before the square root: finite gradients at z == A_c).
``gamma = max(global gap, local gap)``, fixed for the round, where a gap is the
mean over classes of the distance to the nearest other class: the global gap
of the received anchors, the local gap of the client's own prototypes of its
previous participation (``state["last_prototypes"]``, over the classes it held
then, ``state["last_present"]``); with fewer than two such classes (or on a
first participation) only the global gap counts, as in the authors' code.

After training, one eval-mode pass gives the uploaded prototypes (class means
of the features; the authors collect training-mode features during the epochs)
and the class counts; they are also stored in ``state`` for the next gap.

``dagger``: the server does FedAvg (by n_k) on the weights and the anchor
update; ``proto-only``: only the anchor update (engine ``shared="none"``).
``prototypes=hyper`` (paper Table 3): ``H`` (C x d, FedHPro's averaged
hyper-prototypes, matched against the new global head each round) replaces
the anchors in all three terms and in the global gap; clients upload
``class_gradients`` (Eq. 5) from the same eval pass in place of their prototypes
(which they keep for the local gap); needs ``protocol=dagger``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedhpro import functional
from fedhpro.methods.base import MethodContext, MethodSpec
from fedhpro.methods.fedsa_options import DECLARATION
from fedhpro.methods.fedsa_options import FedSAOptions as FedSAOptions
from fedhpro.methods.layout import HOLDERS, Payload
from fedhpro.methods.parts import classifier_of
from fedhpro.methods.prototypes import (
    NEAREST_PROTOTYPE,
    PrototypeClient,
    PrototypeServer,
    Uploads,
    margin_ce,
)
from fedhpro.methods.training import Batch, LocalRound, LossTerms

# ----------------------------------------------------------------------------
# pure pieces
# ----------------------------------------------------------------------------


def _batch_norm(x: Tensor, eps: float = 1e-5) -> Tensor:
    """BatchNorm1d in training mode with unit scale and zero shift (identity-like for a batch of one)."""
    if x.shape[0] < 2:
        return x / math.sqrt(1.0 + eps)  # eval mode with the initial running statistics
    return (x - x.mean(0)) / torch.sqrt(x.var(0, unbiased=False) + eps)


def semantic_anchors(num_classes: int, feature_dim: int, seed: int) -> Tensor:
    """The initial anchors ``A = MLP(R)`` (C x d, float32, CPU), a pure function of the seed."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randn(num_classes, feature_dim, generator=generator)
    bound = 1.0 / math.sqrt(feature_dim)

    def uniform(*shape):
        return (torch.rand(*shape, generator=generator) * 2.0 - 1.0) * bound

    w1, b1 = uniform(feature_dim, feature_dim), uniform(feature_dim)
    w2, b2 = uniform(feature_dim, feature_dim), uniform(feature_dim)
    hidden = torch.relu(_batch_norm(codes @ w1.T + b1))
    return torch.relu(_batch_norm(hidden @ w2.T + b2))


def class_gap(vectors: Tensor, present: Tensor | None = None) -> float | None:
    """Mean over the (present) classes of the distance to the nearest other (present) class; None if < 2."""
    if present is not None:
        vectors = vectors[present]
    if vectors.shape[0] < 2:
        return None
    distances = torch.cdist(vectors.double().unsqueeze(0), vectors.double().unsqueeze(0),
                            compute_mode="donot_use_mm_for_euclid_dist")[0]
    distances.fill_diagonal_(float("inf"))
    return float(distances.min(1).values.mean())


def calibration_ce(classifier, anchors: Tensor) -> Tensor:
    """``CE(h(A), [0..C-1])``: each anchor must be classified as its class."""
    return F.cross_entropy(classifier(anchors), torch.arange(anchors.shape[0], device=anchors.device))


def ema_anchors(anchors: Tensor, mean_prototypes: Tensor, held: Tensor, momentum: float) -> Tensor:
    """``A_c <- m A_c + (1 - m) Pbar_c`` for held classes; the others unchanged."""
    moved = momentum * anchors + (1.0 - momentum) * mean_prototypes.to(anchors.dtype)
    return torch.where(held.unsqueeze(1), moved, anchors)


# ----------------------------------------------------------------------------
# server and client
# ----------------------------------------------------------------------------


class FedSAServer(PrototypeServer):
    """FedSA's global prototypes are its anchors (``self.prototypes``): every class has one from round 0
    (the mask is all True); the prototype step moves them towards the clients' mean prototypes."""

    rows_averaged = HOLDERS  # the clients' mean prototype of a class: over the clients that hold it

    def __init__(self, context: MethodContext):
        super().__init__(context)
        self.prototypes = semantic_anchors(self.num_classes, self.feature_dim, context.seed)
        self.prototype_mask = torch.ones(self.num_classes, dtype=torch.bool)

    @property
    def anchors(self) -> Tensor:
        """The semantic anchors ``A`` (C x d)."""
        return self.prototypes

    def broadcast(self, round: int) -> Payload:
        return {"weights": self.broadcast_weights(), "anchors": self.broadcast_prototypes()[0].clone()}

    def prototype_step(self, round: int, uploads: Uploads, replies: Sequence[Payload]) -> dict[str, float]:
        # the unweighted mean over the holders of each class, in float64
        pbar, held = functional.mean_client_prototypes(uploads.prototypes.double(), uploads.present)
        before = self.prototypes
        self.prototypes = ema_anchors(before, pbar, held, self.options.anchor_momentum)
        return {"anchor_shift": float((self.prototypes - before).norm())}

    def aggregate(self, round: int, replies: Sequence[Payload]) -> dict[str, float]:
        metrics = super().aggregate(round, replies)
        gap = class_gap(self.broadcast_prototypes()[0])
        metrics["anchor_gap"] = gap if gap is not None else 0.0
        return metrics

    def method_state(self) -> dict[str, Any]:
        return {"anchors": self.prototypes}  # the mask is all True, always

    def load_method_state(self, state) -> None:
        self.prototypes = state["anchors"].clone()


class FedSAClient(PrototypeClient):
    #: the calibration CE(h(A), [0..C-1]) runs the head on the received anchors, not on samples: under
    #: privacy=sample its gradient is added after DP-SGD's clipping and noise
    public_loss_terms = frozenset({"calibration"})

    def loss_terms(self, round: LocalRound) -> LossTerms:
        """Calibration, anchor MSE and margin CE; the gap of the margin (global vs local) goes to the notes."""
        o, model, state = self.options, round.model, round.state
        anchors = round.payload["anchors"].to(round.device)
        global_gap = class_gap(anchors)
        local_gap = None
        if "last_prototypes" in state:
            local_gap = class_gap(state["last_prototypes"], state["last_present"].bool())
        gaps = [g for g in (global_gap, local_gap) if g is not None]
        gap = max(gaps) if gaps else 0.0

        def terms(batch: Batch) -> dict[str, Tensor]:
            z, y = batch.z, batch.y
            a = anchors.to(z.dtype)
            out = {}
            if o.lambda1 > 0:
                out["calibration"] = o.lambda1 * calibration_ce(classifier_of(model), a)
            if o.lambda2 > 0:
                out["anchor_mse"] = o.lambda2 * F.mse_loss(z, a[y])
            if o.lambda3 > 0:
                out["margin_ce"] = o.lambda3 * margin_ce(z, y, a, gap)
            return out

        round.notes.update(gap=float(gap), global_gap=float(global_gap) if global_gap is not None else 0.0)
        if local_gap is not None:
            round.notes["local_gap"] = float(local_gap)
        return terms

    def upload(self, round: LocalRound) -> Payload:
        """The default uploads; the prototypes and presence are also kept in ``state`` for the local gap of the
        next participation (with ``prototypes=hyper`` too, where they are not sent)."""
        statistics = self.class_statistics(round)
        round.state["last_prototypes"] = statistics["prototypes"]
        round.state["last_present"] = statistics["class_counts"] > 0
        return self.sent(statistics)


METHOD = MethodSpec.from_declaration(
    DECLARATION,
    server=FedSAServer,
    client=FedSAClient,
    inference_rule=NEAREST_PROTOTYPE,
)
