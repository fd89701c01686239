"""What the FedHPro authors' code computes where it is not the paper (github.com/mala-lab/FedHPro): the
functions behind the options ``fedhpro.recipe=authors`` sets, each docstring naming the file and lines of their
code it follows. Pure functions on tensors, like :mod:`fedhpro.methods.fedhpro.equations` (the paper's
equations), whose helpers they share; the authors' element-wise matching distance stays there, beside Eq. 8
(:func:`fedhpro.methods.fedhpro.equations.elementwise_matching_loss`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fedhpro.methods.fedhpro.equations import hyper_similarity, over_class_pairs

__all__ = [
    "dot_product_margin",
    "hpcl_loss_log_margin",
    "classifier_class_gradients",
    "synthetic_classifier_gradients",
    "layerwise_distance",
    "classifier_matching_loss",
    "match_classifier_features",
    "train_linear_classifier",
    "batch_crop_flip",
    "class_batch_augment",
]


def dot_product_margin(prototypes: Tensor, present: Tensor) -> Tensor:
    """The client margin as the authors' code computes it (their ``compute_margin``), not Eq. 10.

    ``k = 1/(C-1)^2 * sum_{c1} sum_{c2 != c1} <p^c1, p^c2>`` over the ordered
    pairs of classes the client holds, with ``C`` the total number of classes:
    dot products of the raw local prototypes where Eq. 10 has Euclidean
    distances. A client with fewer than two classes has ``k = 0``. It enters
    HPCL as a term added to the softmax denominator
    (:func:`hpcl_loss_log_margin`), not to the negatives' similarities.

    Args:
        prototypes: ``C x d`` local prototypes (Eq. 2).
        present: ``C`` bool mask of the classes the client holds.

    Returns:
        A 0-dim tensor.
    """

    def off_diagonal_products(held: Tensor) -> Tensor:
        products = held @ held.T
        return products.sum() - products.diagonal().sum()

    return over_class_pairs(prototypes, present, off_diagonal_products)


def hpcl_loss_log_margin(z: Tensor, y: Tensor, hyper: Tensor, margin: float | Tensor, tau: float) -> Tensor:
    """HPCL with the margin as the authors' code adds it, batch mean (not Eq. 12).

    Per sample: ``log(sum_j exp(s(z, S^j)/tau) + k) - s(z, S^y)/tau`` with
    ``s`` of Eq. 11 and ``k`` the client's :func:`dot_product_margin`: the
    margin is one more term of the denominator (their ``logaddexp`` with
    ``log k``), where Eq. 12 adds ``d_k`` to every negative's similarity. With
    ``k = 0`` both are the plain InfoNCE ``logsumexp_j(s_j/tau) - s_y/tau``. A
    ``k <= 0`` adds nothing (the authors' code skips ``k = 0``; a negative
    ``k``, possible only for features that can be negative, has no logarithm).
    """
    logits = hyper_similarity(z, hyper) / tau
    positive = logits.gather(1, y.view(-1, 1)).squeeze(1)
    denominator = torch.logsumexp(logits, dim=1)
    margin = torch.as_tensor(margin, dtype=logits.dtype, device=logits.device)
    if bool(margin > 0):
        denominator = torch.logaddexp(denominator, margin.log())
    return (denominator - positive).mean()


def classifier_class_gradients(features: Tensor, labels: Tensor, weight: Tensor, bias: Tensor,
                               num_classes: int) -> tuple[Tensor, Tensor]:
    """Per class, the gradient of the class's mean CE w.r.t. a linear head's weight and bias (the authors'
    code, not in the paper: the client's upload for their server-side classifier step).

    For class ``c`` with samples ``z_i`` (``n_c`` of them, features detached):
    ``G_W^c = d/dW [1/n_c sum_i CE(W z_i + b, c)] = 1/n_c sum_i (softmax(W z_i + b) - e_c) z_i^T``
    and ``G_b^c = 1/n_c sum_i (softmax(W z_i + b) - e_c)``, in closed form
    (the gradient autograd gives for ``F.cross_entropy`` with mean reduction,
    as the authors' code takes it). The mean makes them ``1/n_c`` times the
    summed per-sample gradients; the distance they are matched with
    (:func:`layerwise_distance`) is a cosine, blind to that scale up to its
    ``eps``.

    Args:
        features: ``B x d`` features ``z_i``.
        labels: ``B`` class labels.
        weight: ``C x d`` weight ``W`` of the head.
        bias: ``C`` bias ``b``.
        num_classes: ``C``.

    Returns:
        ``(G_W, G_b)``: ``C x C x d`` and ``C x C`` (zeros for a class with no sample).
    """
    features = features.detach()
    residual = torch.softmax(F.linear(features, weight.detach(), bias.detach()), dim=1)
    residual = residual - F.one_hot(labels, residual.shape[1]).to(residual.dtype)
    weight_gradients = features.new_zeros(num_classes, weight.shape[0], features.shape[1])
    bias_gradients = features.new_zeros(num_classes, weight.shape[0])
    for c in torch.unique(labels).tolist():
        rows = labels == c
        count = float(rows.sum())
        weight_gradients[c] = residual[rows].T @ features[rows] / count
        bias_gradients[c] = residual[rows].sum(0) / count
    return weight_gradients, bias_gradients


def synthetic_classifier_gradients(features: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """The same gradients for synthetic features, differentiable w.r.t. them (the authors' code, not in the
    paper).

    ``features`` is ``C x m x d``: ``m`` synthetic features labelled ``c`` per
    class. Per class, ``G_W^c = 1/m sum_i (softmax(W s_i^c + b) - e_c) (s_i^c)^T``
    and ``G_b^c = 1/m sum_i (softmax(W s_i^c + b) - e_c)``: the gradient of
    ``CE(h(s^c), c)`` (mean over the ``m``) w.r.t. the head's ``(W, b)``,
    which the authors' code takes with autograd and ``create_graph``; here it
    is ordinary tensor ops of ``features`` (``W``, ``b`` detached), the same
    function, so matching differentiates it with a first-order backward.

    Returns:
        ``(G_W, G_b)``: ``C x C x d`` and ``C x C``.
    """
    num_classes, per_class, _ = features.shape
    logits = F.linear(features, weight.detach(), bias.detach())  # C x m x C
    eye = torch.eye(num_classes, logits.shape[2], dtype=logits.dtype, device=logits.device)
    residual = torch.softmax(logits, dim=2) - eye.unsqueeze(1)
    return torch.einsum("cmk,cmd->ckd", residual, features) / per_class, residual.mean(1)


#: the ``eps`` of the authors' layer-wise distance: added to the product of the two norms
LAYERWISE_EPS = 1e-6


def _row_cosine_distances(real: Tensor, synthetic: Tensor, eps: float) -> Tensor:
    """``1 - <r, s> / (||r|| ||s|| + eps)`` along the last dimension."""
    products = (real * synthetic).sum(-1)
    return 1.0 - products / (real.norm(dim=-1) * synthetic.norm(dim=-1) + eps)


def layerwise_distance(real: Tensor, synthetic: Tensor, eps: float = LAYERWISE_EPS) -> Tensor:
    """The authors' distance between one layer's real and synthetic gradients (their ``distance_wb``; the
    authors' code, not in the paper).

    A 2-D gradient (a linear weight, ``out x in``) is compared row by row:
    the sum over the output units of ``1 - cos`` of their rows; a 1-D one (a
    bias) is one row. The cosine's denominator is ``||r|| ||s|| + eps``, so
    the distance ignores the gradients' scale except where that product is
    near ``eps``.

    Returns:
        A 0-dim tensor.
    """
    if real.dim() == 1:
        real, synthetic = real.reshape(1, -1), synthetic.reshape(1, -1)
    else:
        real, synthetic = real.reshape(real.shape[0], -1), synthetic.reshape(synthetic.shape[0], -1)
    return _row_cosine_distances(real, synthetic, eps).sum()


def classifier_matching_loss(weight_real: Tensor, bias_real: Tensor, weight_synthetic: Tensor,
                             bias_synthetic: Tensor, present: Tensor, eps: float = LAYERWISE_EPS) -> Tensor:
    """``sum_{c present} layerwise_distance(G_W^c) + layerwise_distance(G_b^c)``, batched (the authors' code,
    not in the paper: their ``match_meta`` summed over the classes).

    Args:
        weight_real: ``C x C x d`` averaged client gradients of the head's weight.
        bias_real: ``C x C`` averaged client gradients of the head's bias.
        weight_synthetic: the same as ``weight_real`` for the synthetic features.
        bias_synthetic: the same as ``bias_real`` for the synthetic features.
        present: ``C`` bool mask of the classes with real gradients.

    Returns:
        A 0-dim tensor (0 when no class is present).
    """
    per_class = (_row_cosine_distances(weight_real, weight_synthetic, eps).sum(1)
                 + _row_cosine_distances(bias_real, bias_synthetic, eps))
    return (per_class * present.to(per_class.dtype)).sum()


def match_classifier_features(features: Tensor, weight: Tensor, bias: Tensor, weight_real: Tensor,
                              bias_real: Tensor, present: Tensor, steps: int, lr: float,
                              eps: float = LAYERWISE_EPS) -> tuple[Tensor, float, float]:
    """Gradient matching of synthetic features against a head's real gradients (the authors' code, not in the
    paper: their ``set_meta_params``).

    ``steps`` steps of plain SGD (no momentum) on :func:`classifier_matching_loss`
    between the real gradients and :func:`synthetic_classifier_gradients`
    of ``features`` under the head ``(weight, bias)``, which is not changed.
    A class not present is in no term, so its features do not move.

    Args:
        features: ``C x m x d`` synthetic features (not modified).
        weight: the weight of the head the clients computed their gradients with.
        bias: that head's bias.
        weight_real: ``C x C x d`` averaged client gradients of the head's weight.
        bias_real: ``C x C`` averaged client gradients of the head's bias.
        present: ``C`` bool mask of the classes with real gradients.
        steps: number of SGD steps (0 returns the input).
        lr: the step size.

    Returns:
        ``(new_features, loss_before, loss_after)``, the features detached.
    """
    weight_real, bias_real = weight_real.detach(), bias_real.detach()

    def loss_of(x: Tensor) -> Tensor:
        return classifier_matching_loss(weight_real, bias_real, *synthetic_classifier_gradients(x, weight, bias),
                                        present, eps)

    with torch.enable_grad():
        variable = features.detach().clone()
        loss_before = float(loss_of(variable))
        if steps <= 0 or not bool(present.any()):
            return variable, loss_before, loss_before
        variable.requires_grad_(True)
        for _ in range(steps):
            (grad,) = torch.autograd.grad(loss_of(variable), variable)
            with torch.no_grad():
                variable -= lr * grad
        matched = variable.detach()
        loss_after = float(loss_of(matched))
    return matched, loss_before, loss_after


def train_linear_classifier(features: Tensor, labels: Tensor, num_classes: int, generator: torch.Generator, *,
                            epochs: int = 100, batch_size: int = 50, lr: float = 0.01) -> tuple[Tensor, Tensor]:
    """A fresh linear head trained on (synthetic) features (the authors' code, not in the paper: their
    ``meta_revised``).

    The head starts from the distribution of ``nn.Linear``'s default
    initialisation, ``U(-1/sqrt(d), 1/sqrt(d))`` for the weight then the
    bias, drawn from ``generator`` (on the CPU); then ``epochs`` epochs of
    plain SGD (no momentum, no weight decay) on the mean CE of mini-batches
    of ``batch_size`` (the last one smaller), in an order drawn from
    ``generator`` each epoch.

    Args:
        features: ``N x d`` inputs (detached inside).
        labels: ``N`` class labels.
        num_classes: ``C``, the head's outputs.
        generator: a CPU generator: the initialisation and the shuffling.

    Returns:
        ``(weight, bias)``: ``C x d`` and ``C``, detached.
    """
    count, dim = features.shape
    bound = 1.0 / dim ** 0.5
    device, dtype = features.device, features.dtype
    weight = ((torch.rand(num_classes, dim, generator=generator) * 2 - 1) * bound).to(device, dtype)
    bias = ((torch.rand(num_classes, generator=generator) * 2 - 1) * bound).to(device, dtype)
    features = features.detach()
    with torch.enable_grad():
        weight.requires_grad_(True)
        bias.requires_grad_(True)
        for _ in range(epochs):
            order = torch.randperm(count, generator=generator).to(device)
            for start in range(0, count, batch_size):
                batch = order[start:start + batch_size]
                loss = F.cross_entropy(F.linear(features[batch], weight, bias), labels[batch])
                weight_gradient, bias_gradient = torch.autograd.grad(loss, (weight, bias))
                with torch.no_grad():
                    weight -= lr * weight_gradient
                    bias -= lr * bias_gradient
    return weight.detach(), bias.detach()


#: the padding of the authors' local ``RandomCrop(32, padding=4)`` (``main_run.py`` line 396)
CROP_PADDING = 4


def batch_crop_flip(x: Tensor, generator: torch.Generator, padding: int = CROP_PADDING) -> Tensor:
    """The authors' local-training augmentation, drawn once for the whole batch (the authors' code, not in
    the paper).

    Their ``local_train`` (``main_run.py`` lines 395-398 and 415) applies
    ``transforms.Compose([RandomCrop(32, padding=4), RandomHorizontalFlip()])``
    to the batch *tensor* ``B x C x H x W``: torchvision then draws one crop
    offset and one coin for all the images of the batch. So: pad every image
    by ``padding`` zeros on each side (zero is the mean colour after
    normalisation), draw the top row ``i`` and the left column ``j`` of an
    ``H x W`` window, each uniform on ``0..2 padding`` (torchvision's
    ``RandomCrop.get_params``, row first), crop, then flip the whole batch
    left-right with probability 1/2 (``torch.rand(1) < 0.5``). The draws come
    from ``generator`` (on the CPU), not the global random state.

    Returns:
        A new ``B x C x H x W`` tensor.
    """
    height, width = x.shape[-2], x.shape[-1]
    top = int(torch.randint(0, 2 * padding + 1, (1,), generator=generator))
    left = int(torch.randint(0, 2 * padding + 1, (1,), generator=generator))
    flip = bool(torch.rand(1, generator=generator) < 0.5)
    padded = F.pad(x, (padding, padding, padding, padding))
    out = padded[..., top:top + height, left:left + width]
    return out.flip(-1) if flip else out.contiguous()


#: the strategies of the authors' differentiable augmentation (``options.py`` line 38, ``--dsa_strategy``),
#: one of which is drawn per class batch (``param_aug.py`` lines 36-41, mode "S")
DSA_STRATEGIES = ("color", "crop", "cutout", "flip", "scale", "rotate")


def class_batch_augment(x: Tensor, generator: torch.Generator) -> Tensor:
    """The authors' differentiable augmentation of one class's samples (the authors' code, not in the paper).

    Their ``compute_gradient`` (``main_run.py`` lines 317-320) passes each
    class's sampled images through ``DiffAugment(img, 'color_crop_cutout_flip_scale_rotate',
    seed, param)`` of ``utils/param_aug.py`` with a seed, which selects the
    "Siamese" mode: one strategy drawn uniformly from :data:`DSA_STRATEGIES`
    (lines 36-41) and one set of its parameters for the whole class batch
    (each function's ``if param.Siamese`` copies the first sample's draw to
    all). The strategies, with ``ParamAugment``'s constants (lines 6-17):

    - color: brightness ``x + (u - 1/2)``, then saturation
      ``(x - m_c) 2u' + m_c`` (``m_c`` the mean over the channels), then
      contrast ``(x - m) (u'' + 1/2) + m`` (``m`` the mean of each image);
    - crop: a shift by ``(t_h, t_w)``, each uniform on ``-4..4`` (an eighth of
      32, rounded), reading zeros beyond a one-pixel zero border (their index
      clamp);
    - cutout: zero a 16 x 16 square (half the side) centred at ``(o_h, o_w)``,
      each uniform on ``0..32``, cut at the image's edges;
    - flip: left-right with probability 1/2;
    - scale: ``affine_grid`` with ``diag(s_w, s_h)``, each uniform on
      ``[1/1.2, 1.2)``, bilinear ``grid_sample`` with zero padding;
    - rotate: the same with a rotation by ``theta`` uniform on ±15 degrees.

    Their seed is the wall clock (``int(time.time() * 1000) % 100000``) and
    re-seeds torch's global generator, so their runs do not repeat; here the
    draws (strategy, then its parameters) come from ``generator``.

    Args:
        x: ``n x C x H x W`` images of one class.
        generator: a CPU generator.

    Returns:
        A new ``n x C x H x W`` tensor.
    """
    strategy = DSA_STRATEGIES[int(torch.randint(0, len(DSA_STRATEGIES), (1,), generator=generator))]
    return DSA_FUNCTIONS[strategy](x, generator)


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand(1, generator=generator))


def _dsa_color(x: Tensor, generator: torch.Generator) -> Tensor:
    x = x + (_uniform(generator) - 0.5) * 1.0  # brightness 1.0
    channel_mean = x.mean(dim=1, keepdim=True)
    x = (x - channel_mean) * (_uniform(generator) * 2.0) + channel_mean  # saturation 2.0
    image_mean = x.mean(dim=[1, 2, 3], keepdim=True)
    return (x - image_mean) * (_uniform(generator) + 0.5) + image_mean  # contrast 0.5


def _dsa_crop(x: Tensor, generator: torch.Generator) -> Tensor:
    height, width = x.shape[2], x.shape[3]
    shift_h, shift_w = int(height * 0.125 + 0.5), int(width * 0.125 + 0.5)
    t_h = int(torch.randint(-shift_h, shift_h + 1, (1,), generator=generator))
    t_w = int(torch.randint(-shift_w, shift_w + 1, (1,), generator=generator))
    rows = (torch.arange(height, device=x.device) + t_h + 1).clamp(0, height + 1)
    columns = (torch.arange(width, device=x.device) + t_w + 1).clamp(0, width + 1)
    padded = F.pad(x, (1, 1, 1, 1))
    return padded[:, :, rows][:, :, :, columns]


def _dsa_cutout(x: Tensor, generator: torch.Generator) -> Tensor:
    height, width = x.shape[2], x.shape[3]
    size_h, size_w = int(height * 0.5 + 0.5), int(width * 0.5 + 0.5)
    o_h = int(torch.randint(0, height + (1 - size_h % 2), (1,), generator=generator))
    o_w = int(torch.randint(0, width + (1 - size_w % 2), (1,), generator=generator))
    mask = torch.ones(height, width, dtype=x.dtype, device=x.device)
    rows = (torch.arange(size_h, device=x.device) + o_h - size_h // 2).clamp(0, height - 1)
    columns = (torch.arange(size_w, device=x.device) + o_w - size_w // 2).clamp(0, width - 1)
    mask[rows.unsqueeze(1), columns.unsqueeze(0)] = 0
    return x * mask


def _dsa_flip(x: Tensor, generator: torch.Generator) -> Tensor:
    return x.flip(3) if _uniform(generator) < 0.5 else x.clone()


def _affine(x: Tensor, theta: list[list[float]]) -> Tensor:
    matrix = torch.tensor([theta], dtype=torch.float).expand(x.shape[0], 2, 3)
    grid = F.affine_grid(matrix, list(x.shape), align_corners=False).to(x.device, x.dtype)
    return F.grid_sample(x, grid, align_corners=False)


def _dsa_scale(x: Tensor, generator: torch.Generator) -> Tensor:
    ratio = 1.2
    s_w = _uniform(generator) * (ratio - 1.0 / ratio) + 1.0 / ratio
    s_h = _uniform(generator) * (ratio - 1.0 / ratio) + 1.0 / ratio
    return _affine(x, [[s_w, 0.0, 0.0], [0.0, s_h, 0.0]])


def _dsa_rotate(x: Tensor, generator: torch.Generator) -> Tensor:
    theta = (_uniform(generator) - 0.5) * 2 * 15.0 / 180 * math.pi
    cos, sin = math.cos(theta), math.sin(theta)
    return _affine(x, [[cos, -sin, 0.0], [sin, cos, 0.0]])


#: strategy -> its function ``(x, generator) -> x`` (see :func:`class_batch_augment`)
DSA_FUNCTIONS: dict[str, Callable[[Tensor, torch.Generator], Tensor]] = {
    "color": _dsa_color, "crop": _dsa_crop, "cutout": _dsa_cutout, "flip": _dsa_flip, "scale": _dsa_scale,
    "rotate": _dsa_rotate,
}
