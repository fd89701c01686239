"""FedGMKD (Zhang, Shan & Han, NeurIPS 2024): Gaussian-mixture prototypes, knowledge distillation, DAT.

Clients train on ``CE + gamma * MSE(z, P_y) + lam * KL(S^ || softmax(h(P) / T))`` and upload, per class
they hold, a Gaussian-mixture prototype, a soft prediction and a count (:class:`FedGMKDClient`); the
server combines them with discrepancy-aware (DAT) weights and averages the models by each client's DAT
weight (:class:`FedGMKDServer`). The paper's losses and weighting: where the authors' code differs, the
paper wins.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedhpro import functional
from fedhpro.errors import UpdateError
from fedhpro.functional import weighted_average
from fedhpro.methods.base import MethodContext, MethodSpec
from fedhpro.methods.fedgmkd_options import DECLARATION
from fedhpro.methods.fedgmkd_options import FedGMKDOptions as FedGMKDOptions
from fedhpro.methods.layout import ClassRows, Payload, ReplyLayout, Weights
from fedhpro.methods.no_grad import extract_features
from fedhpro.methods.parts import classifier_of
from fedhpro.methods.prototypes import (
    NEAREST_PROTOTYPE,
    PrototypeClient,
    PrototypeServer,
    Uploads,
    check_class_tensor,
    class_uploads,
    feature_dim_of,
    merge_prototypes,
    private_class_uploads,
    prototype_mse,
    received_prototypes,
)
from fedhpro.methods.training import Batch, LocalRound, LossTerms

# ----------------------------------------------------------------------------
# pure pieces (tested one by one)
# ----------------------------------------------------------------------------


def select_gmm(features: np.ndarray, max_components: int, covariance: str = "full", seed: int = 0):
    """The GaussianMixture of lowest BIC over ``1..min(n, max_components)`` components (None if none fits)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.mixture import GaussianMixture

    best, best_bic = None, np.inf
    for k in range(1, min(features.shape[0], max_components) + 1):
        gmm = GaussianMixture(n_components=k, covariance_type=covariance, random_state=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            try:
                gmm.fit(features)
            except (ValueError, np.linalg.LinAlgError):  # ill-conditioned fit: skip this k
                continue
        bic = gmm.bic(features)
        if np.isfinite(bic) and bic < best_bic:
            best, best_bic = gmm, bic
    return best


def gmm_prototypes(features: Tensor, labels: Tensor, num_classes: int, *, max_components: int = 6,
                   max_samples: int = 500, covariance: str = "full", seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Per-class GMM prototypes ``sum_m pi_m mu_m`` in the original feature space.

    Returns ``(prototypes C x d (zeros for absent classes), present C bool, components C long)``;
    a class with one sample is that sample (1 component); a class whose every fit fails
    falls back to its mean (0 components).
    """
    x = features.detach().reshape(features.shape[0], -1).cpu().double().numpy()
    y = labels.cpu().numpy()
    rng = np.random.default_rng(seed)
    prototypes = np.zeros((num_classes, x.shape[1]))
    components = np.zeros(num_classes, dtype=np.int64)
    present = np.zeros(num_classes, dtype=bool)
    for c in range(num_classes):
        rows = np.flatnonzero(y == c)
        if rows.size == 0:
            continue
        present[c] = True
        if 0 < max_samples < rows.size:
            rows = np.sort(rng.choice(rows, size=max_samples, replace=False))
        members = x[rows]
        if members.shape[0] == 1:
            prototypes[c], components[c] = members[0], 1
            continue
        gmm = select_gmm(members, max_components, covariance, seed=(seed + c) % (2 ** 31 - 1))
        if gmm is None:
            prototypes[c] = members.mean(0)
        else:
            prototypes[c], components[c] = gmm.weights_ @ gmm.means_, gmm.n_components
    return (torch.from_numpy(prototypes).to(features.dtype), torch.from_numpy(present),
            torch.from_numpy(components))


def soft_predictions(logits: Tensor, labels: Tensor, num_classes: int, temperature: float) -> Tensor:
    """``S_k^c``: the mean of ``softmax(logits / T)`` over the samples of class c (zeros if absent), C x C."""
    means, _ = functional.local_prototypes(torch.softmax(logits / temperature, dim=1), labels, num_classes)
    return means


def knowledge_kl(classifier: nn.Module, prototypes: Tensor, soft: Tensor, held: Tensor, temperature: float,
                 reduction: str = "mean") -> Tensor:
    """FedGMKD's knowledge term ``KL(S^_c || softmax(h(P_c)/T))`` over the held classes c.

    ``reduction="batchmean"``: ``mean_{c held} KL_c`` (the divergence summed over the C outputs);
    ``reduction="mean"``: the pointwise terms averaged over held classes and outputs, ``mean_c KL_c / C``
    (``torch.nn.KLDivLoss``'s default, as in the authors' code).
    """
    if reduction not in ("mean", "batchmean"):
        raise ValueError(f"reduction must be 'mean' or 'batchmean', got {reduction!r}")
    log_q = torch.log_softmax(classifier(prototypes[held]) / temperature, dim=1)
    target = soft[held].to(log_q.dtype)
    pointwise = torch.special.xlogy(target, target) - target * log_q
    return pointwise.mean() if reduction == "mean" else pointwise.sum(1).mean()


def kl_rows(p: Tensor, q: Tensor) -> Tensor:
    """``KL(p_i || q_i)`` for each row (``0 log 0 = 0``; q clamped at the smallest normal number)."""
    tiny = torch.finfo(q.dtype).tiny
    return (torch.special.xlogy(p, p) - p * torch.log(q.clamp(min=tiny))).sum(-1)


def dat_weights(counts: Tensor, soft: Tensor, a: float, b: float) -> tuple[Tensor, Tensor]:
    """Discrepancy-aware per-class weights ``p_k^c`` (K x C) and discrepancies ``d_k^c`` (K x C).

    ``counts``: K x C class counts ``n_k^c``; ``soft``: K x C x C soft predictions ``S_k^c``.
    Columns of held classes sum to 1 over their holders; non-holders and unheld classes get 0.
    """
    present = counts > 0
    n = counts.double() * present
    w0 = n / n.sum(0).clamp(min=1e-300)  # n_k^c / n^c
    soft = soft.double()
    preliminary = torch.einsum("kc,kcj->cj", w0, soft)  # S0^c
    discrepancy = kl_rows(soft, preliminary.unsqueeze(0).expand_as(soft)) * present
    raw = torch.relu(w0 - a * discrepancy + b) * present
    total = raw.sum(0)
    weights = torch.where(total > 0, raw / total.clamp(min=1e-300), w0)
    return weights, discrepancy


def client_weights_from_dat(counts: Tensor, weights: Tensor) -> Tensor:
    """``w_k = sum_c (n^c / N) p_k^c`` (K): per-class DAT weights turned into one weight per client."""
    class_totals = (counts.double() * (counts > 0)).sum(0)
    share = class_totals / class_totals.sum().clamp(min=1e-300)
    return weights.double() @ share


# ----------------------------------------------------------------------------
# reply check
# ----------------------------------------------------------------------------


def check_counts(reply: Payload, num_classes: int, who: str) -> Tensor:
    counts = check_class_tensor(reply, "class_counts", (num_classes,), who)
    if counts.is_floating_point() or bool((counts < 0).any()):
        raise UpdateError(f"{who}: class_counts must be non-negative integers")
    return counts


# ----------------------------------------------------------------------------
# server and client
# ----------------------------------------------------------------------------


class FedGMKDServer(PrototypeServer):
    """DAT's knowledge step (prototypes and soft predictions) on :class:`PrototypeServer`'s round;
    the weights are averaged by the DAT client weights, so they are not folded as replies arrive.

    DAT (our reading of the paper's Figure 2 and Section 3, in the per-class form of the authors' code),
    for each class c over the clients A^c that hold it (n_k^c > 0):

    1. initial weights ``w0_k^c = n_k^c / sum_{j in A^c} n_j^c``;
    2. preliminary global soft prediction ``S0^c = sum_k w0_k^c S_k^c``;
    3. discrepancy ``d_k^c = KL(S_k^c || S0^c)``;
    4. ``p_k^c = ReLU(w0_k^c - a d_k^c + b) / sum_{j in A^c} ReLU(w0_j^c - a d_j^c + b)`` (a = ``dat_a`` =
       0.4, b = ``dat_b`` = 0.2, the authors' per-class values; if every numerator of a class is 0 the class
       falls back to ``w0``);
    5. global knowledge ``P^c = sum_k p_k^c P_k^c``, ``S^c = sum_k p_k^c S_k^c``.

    A class nobody held this round keeps its previous knowledge; one nobody has held yet has none (its mask
    False: never a zero vector). Weights (``dagger``): each client's weight is the class-share average of
    its DAT weights, ``w_k = sum_c (n^c / N) p_k^c`` (with ``a = b = 0`` exactly FedAvg's ``n_k / N``). The
    authors' code weights clients by FedDisco's ``ReLU(n_k - a ||D_k - U||_2 + b)`` instead and, from round
    2, uses the prototype discrepancy for both kinds of knowledge; neither is what the paper describes.
    ``protocol=proto-only``: no weights travel, only the knowledge step runs; ``prototypes=hyper`` (paper
    Table 3): a :class:`HyperPrototypeBank` sends ``H`` in place of ``P`` (it needs ``protocol=dagger``)."""

    folds_weights = False
    #: the soft predictions and the client weights come from the knowledge step, with hyper-prototypes too
    steps_with_hyper = True

    def __init__(self, context: MethodContext):
        super().__init__(context)
        self.soft = torch.zeros(self.num_classes, self.num_classes)
        self.soft_mask = torch.zeros(self.num_classes, dtype=torch.bool)
        #: the DAT client weights ``w_k`` of the last aggregated round (``dagger``): the weights' average uses them
        self.client_weights: Tensor | None = None

    def broadcast(self, round: int) -> Payload:
        return {**super().broadcast(round), "soft_predictions": self.soft.clone(), "soft_mask": self.soft_mask.clone()}

    def reply_layout(self) -> ReplyLayout:
        """The prototype methods' layout plus ``soft_predictions`` (C x C, the model's dtype, per class)."""
        c = self.num_classes
        dtype = classifier_of(self.scratch).weight.dtype
        return {**super().reply_layout(), "soft_predictions": ClassRows((c, c), dtype)}

    def validate_reply(self, reply: Payload, who: str = "reply") -> None:
        super().validate_reply(reply, who)
        c = self.num_classes
        held = check_counts(reply, c, who) > 0
        soft = check_class_tensor(reply, "soft_predictions", (c, c), who, held)
        if bool((soft[held] < 0).any()):
            raise UpdateError(f"{who}: soft_predictions must be probabilities (>= 0)")

    def prototype_step(self, round: int, uploads: Uploads, replies: Sequence[Payload]) -> dict[str, float]:
        counts, present = uploads.counts, uploads.present
        # rows of classes a client does not hold are never read (weight 0 and replaced by zeros)
        soft = torch.where(present.unsqueeze(2),
                           torch.stack([reply["soft_predictions"].detach().cpu().double() for reply in replies]),
                           torch.zeros((), dtype=torch.float64))
        weights, discrepancy = dat_weights(counts, soft, self.options.dat_a, self.options.dat_b)
        held = present.any(0)
        # classes nobody held this round keep their previous global knowledge (none before the first holder)
        knowledge = torch.einsum("kc,kcd->cd", weights, uploads.prototypes.double()).float()
        self.prototypes, self.prototype_mask = merge_prototypes(self.prototypes, self.prototype_mask, knowledge, held)
        self.soft, self.soft_mask = merge_prototypes(
            self.soft, self.soft_mask, torch.einsum("kc,kcj->cj", weights, soft).float(), held)
        metrics = {"discrepancy_mean": float(discrepancy[present].mean()) if bool(present.any()) else 0.0}
        if self.exchanges_weights:
            self.client_weights = client_weights_from_dat(counts, weights)
            metrics["client_weight_min"] = float(self.client_weights.min())
            metrics["client_weight_max"] = float(self.client_weights.max())
        return metrics

    def aggregate_weights(self, replies: Sequence[Payload]) -> Weights:
        """The replies' weights averaged by this round's DAT client weights ``w_k``."""
        assert self.client_weights is not None  # set by this round's prototype_step, which runs first
        return weighted_average([reply["weights"] for reply in replies], self.client_weights.tolist())

    def method_state(self) -> dict[str, Any]:
        return {**super().method_state(), "soft_predictions": self.soft, "soft_mask": self.soft_mask}

    def load_method_state(self, state) -> None:
        super().load_method_state(state)
        self.soft = state["soft_predictions"].clone()
        self.soft_mask = state["soft_mask"].clone().bool()


class FedGMKDClient(PrototypeClient):
    """The paper's local objective ``CE(h(z), y) + gamma * MSE(z, P_y) + lam * KL(S^ || softmax(h(P) / T))``.

    * ``MSE``: over all ``B x d`` entries of the batch; a sample whose class has no global prototype is its
      own target (it adds 0 but counts in the mean), as in the FedProto/FedGMKD code.
    * ``KL`` (:func:`knowledge_kl`): for every class with global knowledge, the global soft prediction is the
      target distribution (the authors' ``KLDivLoss(log q, S^)``); ``kl_reduction=mean`` (default) is the
      authors' ``nn.KLDivLoss()`` (``mean_c KL_c / C``), for which they tuned lam = 0.6; ``batchmean`` makes
      the same lam C times stronger (on digits-offline it cost 2.5 points of AVG against FedAvg: see
      docs/reproducing.md). Only the head receives its gradients.

    After training, one eval-mode pass gives the features and soft predictions; per class held the client
    uploads a prototype (:func:`gmm_prototypes`: a Gaussian mixture on at most ``max_samples`` features in
    the original space, components by lowest BIC; the authors' code standardises first and so sends zero
    vectors; the mixture's mean equals the class mean after EM, the fit decides the component count), its
    soft prediction (the mean of ``softmax(h(z)/T)`` over the class's samples) and its count. With
    ``prototypes=hyper`` it uploads class gradients too and plain class means instead of the mixture."""

    #: the knowledge KL runs the head on the received prototypes against the received soft predictions, not on
    #: samples: under privacy=sample its gradient is added after DP-SGD's clipping and noise
    public_loss_terms = frozenset({"kd_kl"})

    def loss_terms(self, round: LocalRound) -> LossTerms:
        o, model, device = self.options, round.model, round.device
        prototypes, prototype_mask = received_prototypes(round.payload, self.num_classes, feature_dim_of(model),
                                                         device)
        soft = round.payload["soft_predictions"].to(device)
        knowledge_mask = round.payload["soft_mask"].to(device).bool() & prototype_mask
        use_mse = o.gamma > 0 and bool(prototype_mask.any())
        use_kl = o.lam > 0 and bool(knowledge_mask.any())

        def terms(batch: Batch) -> dict[str, Tensor]:
            z, y = batch.z, batch.y
            out = {}
            if use_mse:
                out["proto_mse"] = o.gamma * prototype_mse(z, y, prototypes, prototype_mask)
            if use_kl:
                out["kd_kl"] = o.lam * knowledge_kl(classifier_of(model), prototypes.to(z.dtype), soft,
                                                    knowledge_mask, o.temperature, o.kl_reduction)
            return out

        return terms

    def upload(self, round: LocalRound) -> Payload:
        """GMM prototypes (class means and class gradients with ``prototypes=hyper``), soft predictions
        and counts, from one eval-mode pass of the trained model; the mean GMM component count as a note."""
        o, model, data = self.options, round.model, round.data
        features = extract_features(model, data.x)
        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = classifier_of(model)(features)
        model.train(was_training)
        if self.sample_private:
            # one release: noisy class means of the features (the GMM's mixture mean is the class mean, see the
            # module doc; no GMM is fitted) and of the soft predictions, noisy counts (+ class gradients)
            return private_class_uploads(self, round, classifier_of(model), features, data.y,
                                         with_gradients=o.prototypes == "hyper", temperature=o.temperature)
        soft = soft_predictions(logits, data.y, self.num_classes, o.temperature).detach().cpu()
        if o.prototypes == "hyper":
            upload = class_uploads(classifier_of(model), features, data.y, self.num_classes, with_gradients=True)
            return {**upload, "soft_predictions": soft}
        seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=round.generator))
        local, present, components = gmm_prototypes(
            features, data.y, self.num_classes, max_components=o.max_components,
            max_samples=o.max_samples, covariance=o.covariance, seed=seed)
        counts = torch.bincount(data.y, minlength=self.num_classes)[:self.num_classes]
        round.notes["gmm_components"] = float(components[present].double().mean())
        return {"prototypes": local.detach().cpu(), "class_counts": counts.cpu(), "soft_predictions": soft}


METHOD = MethodSpec.from_declaration(
    DECLARATION,
    server=FedGMKDServer,
    client=FedGMKDClient,
    inference_rule=NEAREST_PROTOTYPE,
)
