"""FedRCL (Seo et al., CVPR 2024): relaxed supervised contrastive learning at every stage of the backbone.

For each stage ``l`` of the feature extractor the stage output is globally
average-pooled (``B x C x H x W -> B x C``; any ``B x C x ...`` is averaged over
its trailing axes) and L2-normalised to ``u_i``; ``s_ij = u_i . u_j`` within the
batch. With ``P(i)`` the other samples of ``i``'s class in the batch (``i``
itself excluded) and ``N(i)`` the samples of other classes:

* hardest positive ``p_i = min_{j in P(i)} s_ij`` (the least similar same-class batch-mate);
* hardest negatives: the ``K = num_negatives`` largest ``s_ij``, ``j in N(i)``
  (fewer when ``|N(i)| < K``; none gives a zero term);
* ``scl_i = -log( e^{p_i/tau} / (e^{p_i/tau} + sum_{n in hardest negatives} e^{s_in/tau}) )``;
* ``m'_i = p_i`` if ``P(i)`` is non-empty and ``p_i >= threshold``, else ``-1``;
  ``div_i = softplus((m'_i - 1)/tau) = -log(e^{1/tau} / (e^{1/tau} + e^{m'_i/tau}))``
  (the authors' "penalty" pair: the sample itself, similarity 1, against its
  least similar batch-mate);
* stage loss: ``SCL_l = mean of scl_i over the samples with P(i) non-empty``
  (samples without a positive in the batch contribute no contrastive term; the
  batch has ``SCL_l = 0`` when no sample has one) and ``DIV_l = mean of div_i
  over all B samples`` (a sample without a batch-mate has ``m' = -1``, a
  constant ``softplus(-2/tau)`` with no gradient).

Client loss: ``CE + mean_l SCL_l + beta * mean_l DIV_l`` (reported as ``rcl`` and
``div``; ``beta = 0`` drops the penalty, not even computed). Server: FedAvg.

Stages (:func:`stage_modules`): ``model.stage_modules`` when the model provides
it (a list of modules, or a method returning one): exactly those modules'
outputs (an empty list, or modules that never run in a forward: ``z`` only).
Otherwise, for a ``features`` that is an ``nn.Sequential``, a stage ends
at each top-level child before the first ``nn.Flatten`` / global (adaptive)
pooling child that is

* a local pooling layer (``MaxPool``/``AvgPool``; FedAvgCNN's two pools, a ResNet's ImageNet-stem max-pool),
* a child named ``layer<k>`` (torchvision ResNet stages ``layer1..layer4``), or
* the last such child (the last spatial output, e.g. TinyBNNet's ReLU),

plus the final feature vector ``z`` unless everything after the last stage is
parameter-free (then ``z`` is only the pooled last stage, e.g. ResNet with
``d = 512``). A ``features`` that is not a Sequential (TextCNN) uses ``z`` only.

Differences from the authors' code (documented, deliberate): stage outputs are
taken after the block's last activation (the authors use pre-ReLU block outputs,
``feature_relu: False``); their loss uses the sample itself as positive when it
has no same-class batch-mate, here such a sample has no contrastive term (as the
brief requires); no learning-rate decay or AMP (the shared ``train_epochs``
SGD loop of all methods). The authors' gradient clipping (global norm 10) is
kept, as FedRCL's default of the run key ``max_grad_norm`` (:meth:`FedRCLClient.default_max_grad_norm`;
``fedrcl.max_grad_norm`` is its old spelling): without it the 1/tau = 20 gradients of the
contrastive terms swamp the cross-entropy with this loop's SGD (measured on
digits-offline, 3 rounds: AVG 8.6% without clipping, the CE rising to 19;
42.2% with it, FedAvg 42.0%).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedhpro.methods.base import Client, MethodSpec, Server
from fedhpro.methods.fedrcl_options import DECLARATION
from fedhpro.methods.fedrcl_options import FedRCLOptions as FedRCLOptions
from fedhpro.methods.training import Batch, LocalRound, LossTerms

_LOCAL_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
_GLOBAL_POOLS = (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
                 nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)
_STAGE_NAME = re.compile(r"layer\d+")


def stage_modules(model: nn.Module) -> tuple[list[nn.Module], bool]:
    """``(modules whose outputs are stages, whether the final feature vector z is one more stage)``."""
    given = getattr(model, "stage_modules", None)
    if given is not None:
        if callable(given) and not isinstance(given, nn.Module):
            given = given()
        given = list(given)
        return given, not given  # an empty list: z only
    features = model.features
    if not isinstance(features, nn.Sequential):
        return [], True
    children = list(features.named_children())
    spatial_end = next((i for i, (_, child) in enumerate(children) if isinstance(child, (nn.Flatten, *_GLOBAL_POOLS))),
                       len(children))
    ends = [i for i, (name, child) in enumerate(children[:spatial_end])
            if isinstance(child, _LOCAL_POOLS) or _STAGE_NAME.fullmatch(name)]
    if 0 < spatial_end < len(children) and (spatial_end - 1) not in ends:
        ends.append(spatial_end - 1)
    if not ends:
        return [], True
    tail = [child for _, child in children[ends[-1] + 1:]]
    include_z = any(True for child in tail for _ in child.parameters())
    return [children[i][1] for i in ends], include_z


def pool_stage(output: Tensor) -> Tensor:
    """Global average pooling over every axis after the channel axis: ``B x C x ... -> B x C``."""
    if output.dim() > 2:
        return output.flatten(2).mean(2)
    return output


class Pairs(NamedTuple):
    """The pairs picked for each sample of a batch (``B`` rows)."""

    positive: Tensor  # B: similarity to the hardest positive (+inf where there is none)
    positive_index: Tensor  # B: its index (meaningless where has_positive is false)
    has_positive: Tensor  # B bool: a same-class batch-mate exists
    negatives: Tensor  # B x K: the K largest other-class similarities, descending (-inf where fewer exist)
    negative_index: Tensor  # B x K: their indices


def select_pairs(u: Tensor, labels: Tensor, num_negatives: int) -> Pairs:
    """Hardest positive (least similar same-class batch-mate, the sample itself excluded) and the
    ``num_negatives`` hardest negatives (most similar other-class samples) of L2-normalised ``u`` (B x C)."""
    sim = u @ u.T
    batch = sim.shape[0]
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(batch, dtype=torch.bool, device=sim.device)
    positive_mask = same & ~eye
    positive, positive_index = sim.masked_fill(~positive_mask, float("inf")).min(dim=1)
    negatives, negative_index = sim.masked_fill(same, float("-inf")).topk(min(int(num_negatives), batch), dim=1)
    return Pairs(positive, positive_index, positive_mask.any(dim=1), negatives, negative_index)


def relaxed_contrastive_terms(features: Tensor, labels: Tensor, tau: float, threshold: float,
                              num_negatives: int, with_penalty: bool = True) -> tuple[Tensor, Tensor | None]:
    """One stage's ``(SCL, DIV)`` for pooled features ``B x C`` (see the module docstring); DIV is None
    when ``with_penalty`` is false."""
    pairs = select_pairs(F.normalize(features, p=2, dim=1), labels, num_negatives)
    # rows without a positive get a finite stand-in value (no inf in the graph), then weight 0
    positive = torch.where(pairs.has_positive, pairs.positive, torch.zeros_like(pairs.positive))
    logits = torch.cat([positive[:, None], pairs.negatives], dim=1) / tau
    per_sample = -torch.log_softmax(logits, dim=1)[:, 0]
    weight = pairs.has_positive.to(per_sample.dtype)  # no host sync: mean over the samples that have a positive
    scl = (per_sample * weight).sum() / weight.sum().clamp(min=1.0)
    penalty = None
    if with_penalty:
        relaxed = torch.where(pairs.has_positive & (pairs.positive >= threshold), pairs.positive,
                              torch.full_like(pairs.positive, -1.0))
        penalty = F.softplus((relaxed - 1.0) / tau).mean()
    return scl, penalty


def fedrcl_loss(stages: list[Tensor], labels: Tensor, options: FedRCLOptions) -> dict[str, Tensor]:
    """``{"rcl": mean_l SCL_l, "div": beta * mean_l DIV_l}`` over pooled stage features (``div`` absent if beta = 0)."""
    with_penalty = options.beta > 0
    scls, divs = [], []
    for features in stages:
        scl, div = relaxed_contrastive_terms(features, labels, options.tau, options.threshold,
                                             options.num_negatives, with_penalty)
        scls.append(scl)
        if div is not None:  # computed only with_penalty
            divs.append(div)
    terms = {"rcl": torch.stack(scls).mean()}
    if with_penalty:
        terms["div"] = options.beta * torch.stack(divs).mean()
    return terms


class FedRCLClient(Client):
    def sample_privacy_problem(self) -> str | None:
        return ("fedrcl's relaxed contrastive loss compares each sample with its batch-mates (hardest positive and "
                "negatives within the batch), so it has no per-sample gradient: privacy=sample refuses fedrcl")

    def activation_modules(self, round: LocalRound) -> list[nn.Module]:
        return stage_modules(round.model)[0]

    def loss_terms(self, round: LocalRound) -> LossTerms:
        include_z = stage_modules(round.model)[1]
        options = self.options

        def terms(batch: Batch) -> dict[str, Tensor]:
            stages = [pool_stage(output) for output in batch.activations]
            if include_z or not stages:
                stages.append(batch.z)
            return fedrcl_loss(stages, batch.y, options)

        return terms

    def default_max_grad_norm(self) -> float | None:
        return float(self.options.max_grad_norm)  # the authors' 10 (or fedrcl.max_grad_norm's value, 0: off)


METHOD = MethodSpec.from_declaration(
    DECLARATION,
    server=Server,
    client=FedRCLClient,
)
