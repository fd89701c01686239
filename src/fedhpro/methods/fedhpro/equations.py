"""FedHPro's equations (Eq. 4-13 of *Federated Hyper-Prototype Learning via Gradient Matching*, ICML) as
small, pure, batched functions, like ``torch.nn.functional``; the equations the prototype baselines share
(Eq. 1-3) are in :mod:`fedhpro.functional`.

Shapes: ``B`` samples, ``C`` classes, ``d`` feature dimension, ``I`` the
number of hyper-prototypes per class (the paper's ``|I|``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro import functional
from fedhpro.methods.fedhpro.options import MATCHING_DISTANCES

__all__ = [
    "global_prototypes",
    "client_margin",
    "over_class_pairs",
    "class_gradients",
    "aggregate_class_gradients",
    "hyper_prototype_gradients",
    "gradient_matching_loss",
    "match_hyper_prototypes",
    "hyper_similarity",
    "hpcl_loss",
    "hpal_loss",
    "hyper_prototype_losses",
    "elementwise_matching_loss",
]


def global_prototypes(prototypes: Tensor, present: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """Global prototypes ``P``, Eq. 4, as the paper prints it.

    ``p^c = 1/|A^c| * sum_{k in A^c} (n_k^c / n^c) p_k^c`` where ``A^c`` is the
    set of clients holding class ``c``.

    Args:
        prototypes: ``K x C x d`` local prototypes of ``K`` clients.
        present: ``K x C`` bool, which client holds which class.
        counts: ``K x C`` per-client class counts ``n_k^c``.

    Returns:
        ``(P, held)``: ``C x d`` global prototypes (zeros for a class no client
        holds) and the ``C`` bool mask of classes held by some client.
    """
    counts = counts.to(prototypes.dtype) * present.to(prototypes.dtype)
    class_totals = counts.sum(0)  # n^c
    holders = present.sum(0)  # |A^c|
    held = holders > 0
    weights = counts / class_totals.clamp(min=1e-12)  # n_k^c / n^c
    summed = torch.einsum("kc,kcd->cd", weights, prototypes)
    return summed / holders.clamp(min=1).unsqueeze(1).to(prototypes.dtype), held


def client_margin(prototypes: Tensor, present: Tensor, normalized: bool = False) -> Tensor:
    """Client-specific margin ``d_k``, Eq. 10.

    ``d_k = 1/(C-1)^2 * sum_{c1} sum_{c2 != c1} ||p^c1 - p^c2||_2`` over the
    ordered pairs of classes the client holds, with ``C`` the total number of
    classes. A client with fewer than two classes has ``d_k = 0``.

    Args:
        prototypes: ``C x d`` local prototypes (Eq. 2).
        present: ``C`` bool mask of the classes the client holds.
        normalized: compute the distances between L2-normalised prototypes
            instead of raw ones. Then ``d_k <= sqrt(2) * (C/(C-1))^1.5``:
            at most 4 (C = 2, two opposite prototypes), 2.598 for C = 3 (three
            at 120 degrees), falling to sqrt(2) as C grows. The bound
            is reached by a regular simplex of all C classes (d >= C-1), since
            over ``m <= C`` unit vectors ``sum_{ordered pairs} ||u_i - u_j||^2
            = 2m^2 - 2||sum_i u_i||^2 <= 2C^2`` and, by Cauchy-Schwarz, the sum
            of the ``C(C-1)`` distances is at most ``sqrt(C(C-1) * 2C^2)``.

    Returns:
        A 0-dim tensor.
    """

    def distances(held: Tensor) -> Tensor:
        if normalized:
            held = F.normalize(held, dim=1)
        # the exact (not matrix-product) form: no cancellation for close prototypes
        return torch.cdist(held.unsqueeze(0), held.unsqueeze(0), compute_mode="donot_use_mm_for_euclid_dist")[0].sum()

    return over_class_pairs(prototypes, present, distances)


def over_class_pairs(prototypes: Tensor, present: Tensor, total: Callable[[Tensor], Tensor]) -> Tensor:
    """``total(held) / (C-1)^2``, a client margin: ``total`` sums over the ordered pairs of ``held``, the rows of the
    ``C x d`` ``prototypes`` of the classes ``present`` marks (a pair of one row with itself adds 0); 0 when the
    client holds fewer than two classes or ``C < 2``. Eq. 10 (:func:`client_margin`) and the authors' code
    (:func:`fedhpro.methods.fedhpro.authors_code.dot_product_margin`)."""
    num_classes = prototypes.shape[0]
    held = prototypes[present]
    if held.shape[0] < 2 or num_classes < 2:
        return prototypes.new_zeros(())
    return total(held) / float((num_classes - 1) ** 2)


def class_gradients(features: Tensor, labels: Tensor, classifier: nn.Module, num_classes: int) -> tuple[Tensor, Tensor]:
    """Class-wise average feature gradients ``g_k^c``, Eq. 5.

    ``g_k^c = 1/n_k^c * sum_{i: y_i = c} d CE(h(z_i), y_i) / d z_i`` with
    ``z_i`` a leaf (the feature extractor is not differentiated). Exact, with
    one backward pass through the head for the whole batch.

    Args:
        features: ``B x d`` features ``z_i`` (detached inside).
        labels: ``B`` class labels.
        classifier: the linear head ``h`` (``nn.Linear(d, C)``), used as given
            (no parameter receives a gradient).
        num_classes: ``C``.

    Returns:
        ``(gradients, counts)``: ``C x d`` per-class mean gradients (zeros for
        absent classes) and the ``C`` per-class sample counts.
    """
    with torch.enable_grad():
        per_sample = functional.per_sample_input_gradients(features, labels, classifier, create_graph=False)
    means, present = functional.local_prototypes(per_sample, labels, num_classes)
    counts = torch.bincount(labels, minlength=num_classes)[:num_classes]
    return means.detach(), counts


def aggregate_class_gradients(gradients: Tensor, present: Tensor) -> tuple[Tensor, Tensor]:
    """Server-side class gradients ``g^c``, Eq. 6.

    ``g^c = 1/|A^c| * sum_{k in A^c} g_k^c``: an unweighted mean over the
    clients ``A^c`` that hold class ``c``.

    Args:
        gradients: ``K x C x d`` uploaded ``g_k^c`` (rows of absent classes ignored).
        present: ``K x C`` bool, which client holds which class.

    Returns:
        ``(g, held)``: ``C x d`` (zeros for a class nobody holds) and the ``C``
        bool mask of classes held by at least one client.
    """
    holders = present.sum(0)
    summed = torch.where(present.unsqueeze(2), gradients, torch.zeros((), dtype=gradients.dtype)).sum(0)
    return summed / holders.clamp(min=1).unsqueeze(1).to(gradients.dtype), holders > 0


def _plain_linear(module: nn.Module) -> TypeGuard[nn.Linear]:
    """True for an ``nn.Linear`` whose output is exactly ``F.linear(x, weight, bias)``.

    A subclass that overrides ``forward`` (a cosine or normalised head, say) or
    a module with forward hooks is not: those take the autograd path.
    """
    return (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
            and not module._forward_hooks and not module._forward_pre_hooks)


def _linear_head_hyper_gradients(hyper: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """Eq. 7 for a linear head ``h(s) = W s + b`` in closed form (``C x I x d`` -> ``C x d``).

    ``d CE(W s + b, c) / d s = W^T (softmax(W s + b) - e_c)``, so
    ``g_HP^c = W^T (1/|I| sum_i softmax(W s_i^c + b) - e_c)``: one matmul
    for the ``C |I| x C`` logits of all vectors, a softmax, the mean over the
    ``|I|`` vectors of each class, minus the identity (the one-hot rows
    ``e_c``), one ``C x C`` by ``C x d`` matmul. ``W`` and ``b`` are detached.
    """
    num_classes, per_class, dim = hyper.shape
    weight = weight.detach()
    bias = bias.detach() if bias is not None else None
    logits = F.linear(hyper.reshape(num_classes * per_class, dim), weight, bias)
    probs = torch.softmax(logits, dim=1).reshape(num_classes, per_class, logits.shape[1]).mean(1)
    eye = torch.eye(num_classes, logits.shape[1], dtype=probs.dtype, device=probs.device)
    return (probs - eye) @ weight


def hyper_prototype_gradients(hyper: Tensor, classifier: nn.Module) -> Tensor:
    """Gradients of the hyper-prototypes under the virtual loss, Eq. 7.

    ``g_HP^c = 1/|I| * sum_i d CE(h*(s_i^c), c) / d s_i^c``: each vector's
    gradient of its own loss, then averaged over the ``|I|`` vectors.
    Differentiable with respect to ``hyper``, as gradient matching
    (Eq. 8-9) needs.

    For a plain ``nn.Linear`` head (every model in the zoo) the gradient is
    computed in closed form, ``W^T (mean_i softmax(W s_i^c + b) - e_c)``, as
    ordinary tensor ops of ``hyper`` (``W``, ``b`` detached): differentiating
    ``L_GM`` through it is then a first-order backward through a softmax and
    two matmuls, instead of autograd's double backward through
    ``cross_entropy`` (``create_graph=True``), which is several times slower
    per matching step. The maths is exact, the same function as the autograd
    path, but not the same float operations (the mean over ``|I|`` is taken
    before multiplying by ``W^T``), so results agree to rounding, not bit for
    bit. Any other head takes the autograd path (per-sample input gradients,
    second order through ``h`` when ``hyper`` requires grad).

    Args:
        hyper: ``C x I x d`` hyper-prototypes ``S``.
        classifier: the global head ``h*`` (``nn.Linear(d, C)``); no parameter
            receives a gradient.

    Returns:
        ``C x d``.
    """
    num_classes, per_class, dim = hyper.shape
    if _plain_linear(classifier):
        with torch.enable_grad():  # differentiable w.r.t. hyper even when called under no_grad
            return _linear_head_hyper_gradients(hyper, classifier.weight, classifier.bias)
    flat = hyper.reshape(num_classes * per_class, dim)
    virtual_labels = torch.arange(num_classes, device=hyper.device).repeat_interleave(per_class)
    with torch.enable_grad():
        if not flat.requires_grad:
            flat = flat.detach().requires_grad_(True)
            gradients = functional.per_sample_input_gradients(flat, virtual_labels, classifier,
                                                              create_graph=False).detach()
        else:
            gradients = functional.per_sample_input_gradients(flat, virtual_labels, classifier, create_graph=True)
    return gradients.reshape(num_classes, per_class, dim).mean(1)


def gradient_matching_loss(g_real: Tensor, g_hyper: Tensor, present: Tensor) -> Tensor:
    """Gradient-matching loss ``L_GM``, Eq. 8, summed over the present classes.

    ``sum_{c present} 1 - cos(g^c, g_HP^c)`` with the cosine of whole
    ``d``-vectors.

    Args:
        g_real: ``C x d`` aggregated real-sample gradients ``g^c`` (Eq. 6).
        g_hyper: ``C x d`` hyper-prototype gradients ``g_HP^c`` (Eq. 7).
        present: ``C`` bool mask of classes that have a ``g^c``.

    Returns:
        A 0-dim tensor (0 when no class is present).
    """
    cosine = F.cosine_similarity(g_real, g_hyper, dim=1, eps=1e-12)
    return ((1.0 - cosine) * present.to(cosine.dtype)).sum()


#: Eq. 8 under the name :func:`match_hyper_prototypes` uses beside :func:`elementwise_matching_loss`
cosine_matching_loss = gradient_matching_loss


def match_hyper_prototypes(
    hyper: Tensor,
    classifier: nn.Module,
    g_real: Tensor,
    present: Tensor,
    steps: int,
    lr: float,
    optimizer: str = "sgd",
    distance: str = "cosine",
) -> tuple[Tensor, float, float]:
    """Optimise the hyper-prototypes by gradient matching, Eq. 9.

    Runs ``steps`` (the paper's ``M``) optimiser steps on ``L_GM`` (Eq. 8)
    with respect to ``S`` only; the classifier is not changed. Classes not
    present keep their vectors exactly. ``distance="elementwise"`` replaces
    Eq. 8 by the authors' code's loss (:func:`elementwise_matching_loss`
    of ``g^c`` and ``g_HP^c / |I|``, the hyper-prototype gradients as their
    code takes them).

    Args:
        hyper: ``C x I x d`` hyper-prototypes before matching (not modified).
        classifier: the global linear head ``h*``.
        g_real: ``C x d`` aggregated real-sample gradients (Eq. 6).
        present: ``C`` bool mask of classes with a ``g^c``.
        steps: ``M``; 0 returns the input unchanged.
        lr: the step size ``lr_hp``.
        optimizer: ``"sgd"`` (the paper) or ``"adam"``.
        distance: ``"cosine"`` (Eq. 8, the paper) or ``"elementwise"`` (the authors' code).

    Returns:
        ``(new_hyper, loss_before, loss_after)``: the ``C x I x d`` matched
        hyper-prototypes (detached), and ``L_GM`` before and after matching.
    """
    if optimizer not in ("sgd", "adam"):
        raise ValueError(f"optimizer must be 'sgd' or 'adam', got {optimizer!r}")
    if distance not in MATCHING_DISTANCES:
        raise ValueError(f"distance must be one of {MATCHING_DISTANCES}, got {distance!r}")
    g_real = g_real.detach()
    per_class = hyper.shape[1]

    def matching_loss(g_real: Tensor, g_hyper: Tensor, present: Tensor) -> Tensor:
        if distance == "elementwise":  # their match_loss receives the gradients of the class's mean CE
            return elementwise_matching_loss(g_real, g_hyper / per_class, present)
        return cosine_matching_loss(g_real, g_hyper, present)

    with torch.enable_grad():
        start = hyper.detach()
        if steps <= 0 or not bool(present.any()):
            loss_before = float(matching_loss(g_real, hyper_prototype_gradients(start, classifier), present))
            return start.clone(), loss_before, loss_before
        variable = start.clone().requires_grad_(True)
        opt = torch.optim.SGD([variable], lr=lr) if optimizer == "sgd" else torch.optim.Adam([variable], lr=lr)
        first_loss: Tensor | None = None
        for _ in range(steps):
            # with a linear head, hyper_prototype_gradients is closed form: a first-order backward here
            loss = matching_loss(g_real, hyper_prototype_gradients(variable, classifier), present)
            if first_loss is None:
                first_loss = loss.detach()  # L_GM of the start: the first step's forward, not a second one
            (grad,) = torch.autograd.grad(loss, variable)
            variable.grad = grad
            opt.step()
        assert first_loss is not None  # steps > 0: the loop ran at least once
        loss_before = float(first_loss)
        matched = variable.detach()
        # absent classes: keep the input bit for bit (Adam's eps could nudge them)
        matched = torch.where(present.view(-1, 1, 1), matched, start)
        loss_after = float(matching_loss(g_real, hyper_prototype_gradients(matched, classifier), present))
    return matched, loss_before, loss_after


#: ``_unit``'s clamp of the norm of a row divided by its largest ``|entry|``: such a row has norm 0 (a zero
#: row) or at least 1, so an eps below 1 leaves every non-zero row's value and gradient exactly as without a
#: clamp (not 1 itself: at a norm of exactly 1, a one-entry row, the clamp would cut the norm's gradient),
#: and bounds the gradient at a zero row by ``1/eps`` (F.normalize's default 1e-12 made it ~1e12)
_UNIT_EPS = 0.5


def _unit(x: Tensor, dim: int) -> Tensor:
    """``x / ||x||`` along ``dim`` without overflow or underflow of the norm.

    A zero row stays zero, with a gradient of ``2 * upstream`` there (bounded:
    a feature extractor without a final ReLU can output an exact zero row).
    """
    scale = x.detach().abs().amax(dim=dim, keepdim=True)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return F.normalize(x / scale, dim=dim, eps=_UNIT_EPS)


#: values derived from a tensor that does not require grad (the hyper-prototypes of a round): local training
#: calls the losses with the same hyper-prototypes for every batch, so their class directions are computed once
#: per round. A value is reused only for the very same tensor object (held by a weak reference), unmodified
#: since (its version counter).
_DERIVED: dict[str, tuple[weakref.ref, int, Tensor]] = {}


def _derived(name: str, tensor: Tensor, compute: Callable[[Tensor], Tensor]) -> Tensor:
    """``compute(tensor)``, reused while ``tensor`` is the same, unmodified object (see ``_DERIVED``).

    Not cached: a tensor that requires grad (part of a graph), an inference
    tensor (it has no version counter to tell a change) and any value computed
    under ``torch.inference_mode()`` (an inference tensor, which a later
    training call could not save for backward).
    """
    if tensor.requires_grad or tensor.is_inference():
        return compute(tensor)
    entry = _DERIVED.get(name)
    if entry is not None and entry[0]() is tensor and entry[1] == tensor._version:
        return entry[2]
    with torch.no_grad():
        value = compute(tensor)
    if not torch.is_inference_mode_enabled():
        _DERIVED[name] = (weakref.ref(tensor), tensor._version, value)
    return value


def _class_directions(hyper: Tensor) -> Tensor:
    """``C x d``: the mean over ``j`` of the unit vectors ``s_j^c / ||s_j^c||``."""
    return _unit(hyper, dim=2).mean(1)


def hyper_similarity(z: Tensor, hyper: Tensor) -> Tensor:
    """Similarity of every sample to every class's hyper-prototypes, Eq. 11.

    ``s(z, S^c) = 1/|I| * sum_j cos(z, s_j^c)``, computed as
    ``z/||z|| . (1/|I| sum_j s_j^c/||s_j^c||)`` (the same sum, by linearity):
    one ``B x d`` by ``d x C`` product, the class directions computed once
    per hyper-prototype tensor, not per batch.

    Args:
        z: ``B x d`` features.
        hyper: ``C x I x d`` hyper-prototypes.

    Returns:
        ``B x C``.
    """
    return _similarity_of_units(_unit(z, dim=1), hyper)


def _similarity_of_units(z_unit: Tensor, hyper: Tensor) -> Tensor:
    return z_unit @ _derived("class_directions", hyper, _class_directions).T


def hpcl_loss(z: Tensor, y: Tensor, hyper: Tensor, margin: float | Tensor, tau: float) -> Tensor:
    """Hyper-prototype contrastive loss ``L_HPCL``, Eq. 11-12, batch mean.

    Per sample: ``log(1 + sum_{j != y} exp((s(z, S^j) + d_k)/tau) / exp(s(z, S^y)/tau))``,
    computed as ``softplus(logsumexp_{j != y}((s_j + d_k)/tau) - s_y/tau)``,
    which never overflows.

    Args:
        z: ``B x d`` features.
        y: ``B`` labels.
        hyper: ``C x I x d`` hyper-prototypes.
        margin: the client margin ``d_k`` (Eq. 10), a number or 0-dim tensor.
        tau: temperature.

    Returns:
        A 0-dim tensor.
    """
    return _hpcl_of_similarity(hyper_similarity(z, hyper), y, margin, tau)


def _hpcl_of_similarity(similarity: Tensor, y: Tensor, margin: float | Tensor, tau: float) -> Tensor:
    if similarity.shape[1] < 2:
        return similarity.sum() * 0.0
    return _hpcl_terms(similarity, y.view(-1, 1), margin, tau)[0]


def _hpcl_terms(similarity: Tensor, column: Tensor, margin: float | Tensor, tau: float
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Eq. 12 for ``C >= 2`` classes, labels as a ``B x 1`` ``column``: ``(L_HPCL, negatives, their logsumexp,
    gap)``, the intermediates being what the closed-form backward of :class:`_HyperPrototypeLosses` reuses."""
    positive = similarity.gather(1, column).squeeze(1) / tau
    # the positive's entry set to -inf by a scatter: the values and gradient of a one-hot masked_fill, without
    # building the mask (F.one_hot also checks the labels' range, a host sync, every batch)
    negatives = ((similarity + margin) / tau).scatter(1, column, float("-inf"))
    log_sum = torch.logsumexp(negatives, dim=1)
    gap = log_sum - positive
    # log(1 + e^x) as logaddexp(0, x): exact for every x (softplus switches to x above 20)
    return torch.logaddexp(torch.zeros_like(gap), gap).mean(), negatives, log_sum, gap


def hpal_loss(z: Tensor, y: Tensor, hyper: Tensor, normalized: bool = False) -> Tensor:
    """Hyper-prototype alignment loss ``L_HPAL``, Eq. 13, batch mean.

    With ``H^c`` the mean of class ``c``'s hyper-prototypes, Eq. 13 as printed
    (``normalized=False``) is, per sample, the Huber / smooth-L1 (beta = 1)
    of ``z - H^y`` summed over the ``d`` dimensions; the batch mean is returned.
    ``normalized=True`` is the authors' code: the same Huber between
    ``z/||z||`` and ``H^y/||H^y||``, averaged over all ``B x d`` elements.

    Args:
        z: ``B x d`` features.
        y: ``B`` labels.
        hyper: ``C x I x d`` hyper-prototypes.
        normalized: see above.

    Returns:
        A 0-dim tensor.
    """
    if normalized:
        return _normalized_hpal_of_units(_unit(z, dim=1), y, hyper)
    targets = _derived("class_means", hyper, lambda h: h.mean(1))[y]
    return F.smooth_l1_loss(z, targets, beta=1.0, reduction="none").sum(1).mean()


def _normalized_hpal_of_units(z_unit: Tensor, y: Tensor, hyper: Tensor) -> Tensor:
    # targets H^c / ||H^c|| per class: the same per-row values as normalising the gathered rows
    targets = _derived("unit_class_means", hyper, _unit_class_means)[y]
    return F.smooth_l1_loss(z_unit, targets, beta=1.0, reduction="mean")


def _unit_class_means(hyper: Tensor) -> Tensor:
    """``C x d``: ``H^c / ||H^c||``, the unit mean of each class's hyper-prototypes (Eq. 13's normalised
    targets)."""
    return _unit(hyper.mean(1), dim=1)


def hyper_prototype_losses(z: Tensor, y: Tensor, hyper: Tensor, margin: float | Tensor, tau: float,
                           normalized: bool = False) -> tuple[Tensor, Tensor]:
    """``(L_HPCL, L_HPAL)`` of one batch against the same hyper-prototypes (Eq. 11-13).

    Equal to ``(hpcl_loss(z, y, hyper, margin, tau), hpal_loss(z, y, hyper, normalized))``
    (to rounding), with ``z / ||z||`` computed, and backpropagated, once for
    both losses: FedHPro's local training calls this for every batch.

    With ``normalized=True`` (the default HPAL of FedHPro's local training),
    when only ``z`` needs a gradient (the hyper-prototypes and the margin do
    not), both losses are one autograd node, :class:`_HyperPrototypeLosses`:
    the forward values are bit for bit those of the composite path, and the
    gradient w.r.t. ``z`` is computed in closed form with a few large ops
    (equal to autograd's through the composite path to float rounding, not
    bit for bit). Otherwise (a gradient w.r.t. ``hyper`` or the margin, no
    gradient at all, ``C < 2``, an empty batch, autocast on) the composite
    autograd path runs.
    """
    if normalized and _closed_form_applies(z, hyper, margin):
        directions = _derived("class_directions", hyper, _class_directions)
        unit_means = _derived("unit_class_means", hyper, _unit_class_means)
        hpcl, hpal = _HyperPrototypeLosses.apply(z, y, directions, unit_means, margin, tau)
        return hpcl, hpal
    return _composite_hyper_prototype_losses(z, y, hyper, margin, tau, normalized)


def _closed_form_applies(z: Tensor, hyper: Tensor, margin: float | Tensor) -> bool:
    """Whether :class:`_HyperPrototypeLosses` computes the default path of Eq. 11-13: a ``B x d`` ``z``
    (``B >= 1``) that needs a gradient, recorded (grad mode on, no autocast: its backward computes in the
    forward's dtypes), while ``hyper`` and the margin need none, and ``C >= 2``."""
    return (torch.is_grad_enabled() and z.requires_grad and z.dim() == 2 and z.shape[0] > 0
            and not hyper.requires_grad and hyper.shape[0] >= 2
            and not (isinstance(margin, Tensor) and margin.requires_grad)
            and not torch.is_autocast_enabled(z.device.type))


def _composite_hyper_prototype_losses(z: Tensor, y: Tensor, hyper: Tensor, margin: float | Tensor, tau: float,
                                      normalized: bool) -> tuple[Tensor, Tensor]:
    """:func:`hyper_prototype_losses` (Eq. 11-13) as autograd ops: every gradient (``z``, ``hyper``, margin)."""
    z_unit = _unit(z, dim=1)
    hpcl = _hpcl_of_similarity(_similarity_of_units(z_unit, hyper), y, margin, tau)
    if normalized:
        return hpcl, _normalized_hpal_of_units(z_unit, y, hyper)
    return hpcl, hpal_loss(z, y, hyper, normalized=False)


class _HyperPrototypeLosses(torch.autograd.Function):
    """``(L_HPCL, L_HPAL)`` of Eq. 11-13 (normalised HPAL) as one autograd node with a closed-form backward
    w.r.t. ``z`` only (the class directions, the unit class means and the margin are constants).

    Forward: the composite path's ops, one for one (:func:`_unit`, :func:`_similarity_of_units`,
    :func:`_hpcl_of_similarity`, :func:`_normalized_hpal_of_units`), so the values are the same bits.

    Backward, with ``u = x / max(||x||, eps)``, ``x = z / scale`` (``scale`` the row's largest ``|entry|``,
    a constant), ``s = u D^T`` (Eq. 11, ``D`` the ``C x d`` class directions), ``a_ij = (s_ij + d_k)/tau``
    for ``j != y_i`` (Eq. 12's negatives), ``gap_i = logsumexp_{j != y_i} a_ij - s_iy_i/tau``:

    * Eq. 12, ``L_HPCL = mean_i softplus(gap_i)``: ``dL/ds_ij = sigmoid(gap_i)/(B tau) * (p_ij - [j = y_i])``
      with ``p_i`` the softmax of ``a_i`` over the negatives (0 at the label): one ``B x C`` matrix;
    * Eq. 13, ``L_HPAL = mean over B x d of Huber_1(u - H^y/||H^y||)``: ``dL/du = clamp(u - t, -1, 1)/(B d)``;
    * so ``dL/du = (dL/ds) D + clamp(u - t, -1, 1)/(B d)``, one ``B x C`` by ``C x d`` product added to the
      Huber gradient;
    * through the normalisation, ``dL/dx = (g - u (u . g)) / ||x||`` where ``||x|| >= eps`` (every non-zero
      row: its largest entry is exactly 1, so ``||x|| >= 1 > eps``); at a zero row ``u = 0`` and the clamp
      gives ``g / eps``, the bounded gradient of :func:`_unit`; then ``dL/dz = dL/dx / scale``.

    A backward with ``create_graph=True`` (a second derivative) differentiates the composite ops instead, so
    that the gradient it returns is itself differentiable.
    """

    @staticmethod
    def forward(ctx: Any, z: Tensor, y: Tensor, directions: Tensor, unit_means: Tensor,
                margin: float | Tensor, tau: float) -> tuple[Tensor, Tensor]:
        # _unit(z, dim=1): the same ops as F.normalize(z / scale, dim=1, eps=_UNIT_EPS)
        scale = z.abs().amax(dim=1, keepdim=True)
        scale = torch.where(scale > 0, scale, 1.0)  # the same values as with torch.ones_like(scale)
        x = z / scale
        norm = x.norm(2.0, 1, keepdim=True).clamp_min(_UNIT_EPS)
        unit = x / norm  # elementwise the same division as by norm.expand_as(x)
        # Eq. 11-12: _hpcl_of_similarity(_similarity_of_units(unit, hyper), y, margin, tau)
        column = y.view(-1, 1)
        hpcl, negatives, log_sum, gap = _hpcl_terms(unit @ directions.T, column, margin, tau)
        # Eq. 13, normalised: _normalized_hpal_of_units(unit, y, hyper); index_select copies the same rows as
        # unit_means[y] (advanced indexing), faster
        targets = unit_means.index_select(0, y)
        hpal = F.smooth_l1_loss(unit, targets, beta=1.0, reduction="mean")
        ctx.save_for_backward(z, y, unit, norm, scale, directions, unit_means, targets, negatives, log_sum, gap,
                              column)
        ctx.margin, ctx.tau = margin, tau
        return hpcl, hpal

    @staticmethod
    def backward(ctx: Any, hpcl_grad: Tensor, hpal_grad: Tensor) -> tuple[Tensor | None, ...]:
        (z, y, unit, norm, scale, directions, unit_means, targets, negatives, log_sum, gap,
         column) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a differentiable gradient, through the composite ops
            return (_composite_gradient(z, y, directions, unit_means, ctx.margin, ctx.tau, hpcl_grad, hpal_grad),
                    None, None, None, None, None)
        return (_closed_form_gradient(unit, norm, scale, directions, targets, negatives, log_sum, gap, column,
                                      ctx.tau, hpcl_grad, hpal_grad), None, None, None, None, None)


def _closed_form_gradient(unit: Tensor, norm: Tensor, scale: Tensor, directions: Tensor, targets: Tensor,
                          negatives: Tensor, log_sum: Tensor, gap: Tensor, column: Tensor, tau: float,
                          hpcl_grad: Tensor, hpal_grad: Tensor) -> Tensor:
    """``d(hpcl_grad * L_HPCL + hpal_grad * L_HPAL)/dz`` (Eq. 11-13) from the forward's intermediates: see
    :class:`_HyperPrototypeLosses` (called with grad mode off: nothing is recorded)."""
    batch, dim = unit.shape
    # Eq. 12: softmax over the negatives (exp(-inf) = 0 at the label), -1 at the label, each row times
    # sigmoid(gap_i) (softplus' derivative) and the upstream gradient over B tau
    weights = torch.exp(negatives - log_sum.unsqueeze(1))
    weights.scatter_(1, column, -1.0)
    weights *= (torch.sigmoid(gap) * (hpcl_grad / (batch * tau))).unsqueeze(1)
    # Eq. 13: the Huber's (beta = 1) gradient, then Eq. 11's similarity: + (dL/ds) D
    grad = torch.sub(unit, targets).clamp_(-1.0, 1.0).mul_(hpal_grad / (batch * dim))
    grad.addmm_(weights, directions)
    # through u = x / max(||x||, eps) and x = z / scale (see the class docstring): one multiplication by
    # 1 / (||x|| scale) (in float32, a row whose largest |entry| is beyond ~1e37 overflows the product and gets
    # a zero gradient, where the exact one is a denormal below ~3e-39)
    grad.addcmul_(unit, (unit * grad).sum(1, keepdim=True), value=-1.0)
    return grad.mul_((norm * scale).reciprocal_())


def _composite_gradient(z: Tensor, y: Tensor, directions: Tensor, unit_means: Tensor, margin: float | Tensor,
                        tau: float, hpcl_grad: Tensor, hpal_grad: Tensor) -> Tensor:
    """The same gradient (Eq. 11-13) by autograd through the composite ops, with ``create_graph``: differentiable
    w.r.t. ``z`` (and the upstream gradients)."""
    unit = _unit(z, dim=1)
    hpcl = _hpcl_of_similarity(unit @ directions.T, y, margin, tau)
    hpal = F.smooth_l1_loss(unit, unit_means[y], beta=1.0, reduction="mean")
    (grad,) = torch.autograd.grad((hpcl, hpal), z, (hpcl_grad, hpal_grad), create_graph=True)
    return grad


#: the eps of the authors' ``distance_wb`` (``utils/gradient_matching.py``), in :func:`elementwise_matching_loss`
ELEMENTWISE_EPS = 1e-6


def elementwise_matching_loss(g_real: Tensor, g_hyper: Tensor, present: Tensor,
                              eps: float = ELEMENTWISE_EPS) -> Tensor:
    """The authors' hyper-prototype matching loss, element by element (the authors' code, not Eq. 8).

    Their ``match_loss`` with the default ``dis_metric='matching'``
    (``utils/gradient_matching.py`` lines 8-12) loops over the ``d`` elements
    of a class's gradient and adds, for each scalar pair, their
    ``distance_wb`` (lines 75-90) of two 0-dim tensors:
    ``1 - a_i b_i / (|a_i| |b_i| + eps)`` with ``eps = 1e-6``, i.e. ``1 - sign(a_i b_i)``
    softened by the eps. Summed over the elements and over the classes present
    (their ``obtain_hyper_prototypes``, ``main_run.py`` lines 106-117). With
    ``|a_i b_i|`` far below the eps, its gradient w.r.t. ``b_i`` is about
    ``-a_i / eps``: a scaled dot product, where Eq. 8's cosine of the whole
    vectors ignores their scale.

    Args:
        g_real: ``C x d`` real-sample class gradients (theirs: of each class's mean CE).
        g_hyper: ``C x d`` hyper-prototype class gradients (theirs: ``g_HP^c / |I|``).
        present: ``C`` bool mask of the classes with a real gradient.

    Returns:
        A 0-dim tensor (0 when no class is present).
    """
    per_element = 1.0 - g_real * g_hyper / (g_real.abs() * g_hyper.abs() + eps)
    return (per_element.sum(1) * present.to(per_element.dtype)).sum()
