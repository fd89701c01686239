"""FedHPro: federated hyper-prototype learning via gradient matching (the paper, Algorithm 1).

Server: FedAvg on the weights, then ``match_steps`` steps of gradient
matching (Eq. 6-9) on the hyper-prototypes S (C x |I| x d), which persist
across rounds. Client: CE + HPCL (Eq. 11-12, with the margin of Eq. 10) +
HPAL (Eq. 13) against S, then the class-wise feature gradients of Eq. 5.

Table 6's ablation, ``prototypes=global|global-hpcl|global-hpal``: the clients
also upload their local prototypes (only then: the method itself never reads
them), and the server aggregates them into the global prototypes P of
Eq. 4 (as printed, so scaled by 1/|A^c|; both losses are scale-free in the
default normalised HPAL) and sends them; clients then use P (as ``C x 1 x d``)
in place of S in both losses, in HPCL only or in HPAL only. A class nobody has
held yet has no P: its samples get no term from the loss that uses P and it is
no negative in HPCL; before the first aggregation (round 0) that loss is off,
as FedProto's prototype term. Classes nobody holds in a later round keep their
previous P.

The authors' published code differs from the paper in a few settings; each is
an option here, and ``recipe=authors`` sets all of them at once
(:data:`AUTHORS_RECIPE`), among them a server step the paper does not
describe, ``classifier_step=synthetic`` (:class:`~fedhpro.methods.hyper.SyntheticClassifier`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from fedhpro import authors_code
from fedhpro import functional as HF
from fedhpro.data.federation import Augment, ClientData
from fedhpro.errors import ConfigError
from fedhpro.methods.base import Client, MethodContext, MethodSpec, Server, load_weights
from fedhpro.methods.hyper import (
    HYPER_INITS,
    SAMPLE_CHOICES,
    HyperPrototypeBank,
    SyntheticClassifier,
    class_statistics,
    divide_by_counts,
    feature_statistics,
    sampled_features,
)
from fedhpro.methods.layout import COUNTS, HOLDERS, ClassRows, Payload, ReplyLayout
from fedhpro.methods.no_grad import extract_features
from fedhpro.methods.parts import classifier_of
from fedhpro.methods.prototypes import feature_dim_of, merge_prototypes, private_class_uploads, stack_prototypes
from fedhpro.methods.training import Batch, LocalRound, LossTerms
from fedhpro.options import option
from fedhpro.search_space import LogUniform


@dataclass
class FedHProOptions:
    hpcl_weight: float = option(1.0, min=0.0, help="lambda of L_HPCL (Eq. 12); 0 turns HPCL off (Table 5)",
                                search=LogUniform(0.01, 10.0))
    hpal_weight: float = option(1.0, min=0.0, help="lambda of L_HPAL (Eq. 13); 0 turns HPAL off (Table 5)",
                                search=LogUniform(0.01, 10.0))
    margin: str = option("raw", choices=("raw", "normalized", "off", "dot"),
                         help="client margin d_k of Eq. 10: raw feature distances (the paper), "
                              "distances of L2-normalised prototypes, off (Figure 7), or dot: the authors' "
                              "code's (dot products of the prototypes, added to HPCL's denominator)")
    num_hyper: int = option(5, min=1, help="|I|, hyper-prototypes per class")
    match_steps: int = option(30, min=0, help="M, gradient-matching steps per round (0: frozen random S)")
    tau: float = option(0.05, gt=0.0, help="temperature of HPCL", search=LogUniform(0.01, 1.0))
    hyper_lr: float = option(0.1, gt=0.0, help="step size of gradient matching", search=LogUniform(0.01, 1.0))
    hyper_optimizer: str = option("sgd", choices=("sgd", "adam"), help="optimiser of gradient matching")
    hyper_init: str = option("gaussian", choices=HYPER_INITS,
                             help="starting hyper-prototypes: gaussian N(0, 1) (the paper), simplex (equiangular "
                                  "classes, cosine -1/(C-1)) or orthogonal-nonnegative (orthogonal classes on "
                                  "disjoint coordinate blocks, reachable by features after a ReLU); only gaussian is "
                                  "the paper's (docs/explanation/fedhpro-vs-fedsa.md)")
    hpal_form: str = option("normalized", choices=("normalized", "paper"),
                            help="HPAL on L2-normalised z and H, mean-reduced (the authors' code, default), "
                                 "or Eq. 13 as printed (sum over d)")
    gradient_timing: str = option("after", choices=("after", "before"),
                                  help="class gradients g_k^c after local training (Algorithm 1) "
                                       "or before it (the authors' code)")
    prototypes: str = option("hyper", choices=("hyper", "global", "global-hpcl", "global-hpal"),
                             help="what HPCL and HPAL pull towards: the hyper-prototypes S (the method), or the "
                                  "global prototypes P of Eq. 4 in both losses, in HPCL only or in HPAL only "
                                  "(Table 6)")
    gradient_samples_per_class: int = option(0, min=0,
                                             help="use at most this many samples per class for g_k^c (0: all; "
                                                  "the authors' code uses 100)")
    hpcl_batch_divide: bool = option(False, help="divide HPCL's batch mean once more by the batch size, as the "
                                                 "authors' code does (in effect a weight of 1/B)")
    classifier_step: str = option("none", choices=("none", "synthetic"),
                                  help="none (the paper), or synthetic: the authors' server step that replaces "
                                       "the global classifier by one trained on synthetic features matched to "
                                       "the clients' classifier gradients")
    matching_distance: str = option("cosine", choices=HF.MATCHING_DISTANCES,
                                    help="distance of gradient matching: cosine of whole class gradients (Eq. 8), "
                                         "or elementwise: the authors' code's sum over the d elements of "
                                         "1 - ab/(|a||b| + 1e-6), against g_HP/|I| (utils/gradient_matching.py "
                                         "match_loss, dis_metric='matching')")
    class_gradient_divide: bool = option(False, help="divide each g_k^c by the number of samples it was computed on, "
                                                     "as the authors' code does (gradients of the class's mean CE; "
                                                     "main_run.py lines 328-343)")
    gradient_sample_choice: str = option("first", choices=SAMPLE_CHOICES,
                                         help="which samples of a class gradient_samples_per_class keeps: the first "
                                              "ones, or random ones drawn each round (the authors' code, main_run.py "
                                              "lines 297-300)")
    gradient_augment: str = option("none", choices=("none", "dsa"),
                                   help="augment the class-gradient samples: none, or dsa: the authors' "
                                        "differentiable augmentation, one strategy and one draw per class "
                                        "(main_run.py lines 318-320, utils/param_aug.py)")
    local_augment: str = option("none", choices=("none", "crop-flip"),
                                help="augment local training batches: none, or crop-flip: the authors' random crop "
                                     "(padding 4) and horizontal flip, drawn once per batch (main_run.py lines "
                                     "395-398, 415)")
    authors_last_client: bool = option(False, help="NOT the method, NOT in recipe=authors: the global model is the "
                                                   "round's last client's model instead of the average, as the "
                                                   "authors' published main_run.py computes by mistake (lines "
                                                   "492-509); only to reproduce their published numbers")
    recipe: str = option("paper", choices=("paper", "authors"),
                         help="paper: the defaults above; authors: the settings of the authors' published code "
                              "(AUTHORS_RECIPE in fedhpro.methods.fedhpro; keys you set still win)")


#: ``fedhpro.recipe=authors``: every setting in which the authors' published code (mala-lab/FedHPro, the
#: command of its README) differs from the paper, in one place. ``load_config`` puts these assignments before
#: the user's, so a key the user sets wins (``fedhpro.recipe=authors lr=0.05`` trains with 0.05). It applies
#: whenever ``fedhpro.recipe=authors`` is given, whatever the method: the run keys (d, the local optimiser)
#: are the authors' training setup, which a comparison's baselines then share; the ``fedhpro.*`` keys only
#: matter to FedHPro. One key per difference:
#:
#: - ``feature_dim=256``: their ``--dim`` (the paper: d = 512).
#: - ``lr=0.1``, ``momentum=0``, ``weight_decay=0``: their local ``SGD(lr=0.1)`` (the paper: 0.01, 0.9, 1e-5).
#: - ``fedhpro.gradient_timing=before``, ``fedhpro.gradient_samples_per_class=100``: their class gradients
#:   come from the received model before local training, on at most ``--batch_real`` 100 samples per class
#:   (Algorithm 1: after training, on all samples).
#: - ``fedhpro.margin=off``: their margin is behind ``--use_margin``, an argparse ``type=bool`` flag whose
#:   default is False, and the README's command does not pass it, so the published run has no margin
#:   (passing any value, even "False", would turn it on: ``bool("False")`` is True). Their margin itself, when
#:   on, is ``fedhpro.margin=dot``.
#: - ``fedhpro.hpal_form=normalized``: their HPAL on L2-normalised z and H (already the default; set here so
#:   the recipe does not depend on it).
#: - ``fedhpro.hpcl_batch_divide=true``: their HPCL is the batch mean divided once more by the batch size.
#: - ``fedhpro.classifier_step=synthetic``: their server replaces the aggregated classifier by one trained on
#:   synthetic features matched to the clients' classifier gradients (:class:`SyntheticClassifier`).
#: - ``model=resnet10-authors``: their ResNet-10 (``backbone/ResNet10.py``; :mod:`fedhpro.models.authors_resnet`).
#: - ``local_epochs=10``: their ``--num_epochs_local_training`` default (``options.py`` line 17).
#: - ``fedhpro.matching_distance=elementwise``: their ``match_loss`` with ``dis_metric='matching'``
#:   (``utils/gradient_matching.py`` lines 8-12, 75-90), per element where Eq. 8 has one cosine.
#: - ``fedhpro.class_gradient_divide=true``: their class gradients are those of each class's mean CE
#:   (``main_run.py`` lines 328-343), ``1/n_c`` of Eq. 5's.
#: - ``fedhpro.gradient_sample_choice=random``: their 100 samples per class are random (lines 297-300).
#: - ``fedhpro.gradient_augment=dsa``: their differentiable augmentation of those samples (lines 318-320).
#: - ``fedhpro.local_augment=crop-flip``: their random crop and flip of each training batch (lines 395-398, 415).
#: - ``data.mean``, ``data.std``: their ``transforms.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994,
#:   0.2010))`` (``main_run.py``, ``FedHPro()``), which they apply to CIFAR-10 and CIFAR-100 alike (fedhpro's
#:   CIFAR-10 std is 0.2470, 0.2435, 0.2616). Set on the data sets that take channel statistics (the
#:   label-skew image benchmarks, ``data.mean``/``data.std``); others keep their own.
#:
#: Not here: ``fedhpro.authors_last_client`` (their aggregation bug, which no faithful recipe should carry).
AUTHORS_RECIPE: dict[str, Any] = {
    "feature_dim": 256,
    "lr": 0.1,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "fedhpro.gradient_timing": "before",
    "fedhpro.gradient_samples_per_class": 100,
    "fedhpro.margin": "off",
    "fedhpro.hpal_form": "normalized",
    "fedhpro.hpcl_batch_divide": True,
    "fedhpro.classifier_step": "synthetic",
    "model": "resnet10-authors",
    "local_epochs": 10,
    "fedhpro.matching_distance": "elementwise",
    "fedhpro.class_gradient_divide": True,
    "fedhpro.gradient_sample_choice": "random",
    "fedhpro.gradient_augment": "dsa",
    "fedhpro.local_augment": "crop-flip",
    "data.mean": [0.4914, 0.4822, 0.4465],
    "data.std": [0.2023, 0.1994, 0.2010],
}

#: the warning a run with ``fedhpro.authors_last_client=true`` starts with
LAST_CLIENT_WARNING = ("fedhpro.authors_last_client=true: each round's global model is the LAST client's trained "
                       "model (BatchNorm statistics included), not the average of the clients' models: the mistake "
                       "of the authors' published main_run.py (one Local object reused for every client, whose "
                       "state_dict() tensors alias the live model). Use it only to reproduce their published "
                       "numbers; it is not FedHPro")


class FedHProServer(Server):
    def __init__(self, context: MethodContext):
        super().__init__(context)
        o = self.options
        feature_dim = feature_dim_of(context.model)
        self.bank = HyperPrototypeBank(self.num_classes, feature_dim, context.seed,
                                       num_hyper=o.num_hyper, match_steps=o.match_steps, lr=o.hyper_lr,
                                       optimizer=o.hyper_optimizer, init=o.hyper_init,
                                       distance=o.matching_distance)
        if o.authors_last_client:
            warnings.warn(LAST_CLIENT_WARNING, UserWarning, stacklevel=2)
            self.folds_weights = False  # the replies keep their weights: the server reads the last one
        self.scratch = context.model
        self.uses_global = o.prototypes != "hyper"
        self.global_prototypes = torch.zeros(self.num_classes, feature_dim)
        self.global_mask = torch.zeros(self.num_classes, dtype=torch.bool)
        self.synthetic: SyntheticClassifier | None = None
        if o.classifier_step == "synthetic":
            self.synthetic = SyntheticClassifier(self.num_classes, feature_dim, context.seed, lr=o.hyper_lr)
            self.classifier_keys = classifier_keys(context.model, self.weights)

    @property
    def hyper(self) -> torch.Tensor:
        return self.bank.hyper

    def exposed_prototypes(self) -> tuple[torch.Tensor, torch.Tensor, str]:
        """The averaged hyper-prototypes H (C x d), every class present (also under the Table 6 ablations,
        whose global prototypes P only some losses use)."""
        return self.bank.averaged.detach(), torch.ones(self.num_classes, dtype=torch.bool), "hyper"

    def broadcast(self, round: int) -> Payload:
        payload = {"weights": self.weights, "hyper_prototypes": self.bank.hyper}
        if self.uses_global:
            payload["global_prototypes"] = self.global_prototypes.clone()
            payload["global_mask"] = self.global_mask.clone()
        return payload

    def reply_layout(self) -> ReplyLayout:
        """What the server reads of a reply: the base layout plus ``class_counts`` (C, int64) and
        ``class_gradients`` (C x d, the model's dtype) under every option; the clients' ``prototypes`` (C x d)
        only for Table 6's global prototypes (``prototypes != hyper``: the method itself never reads them, so
        its clients do not send them); with ``classifier_step=synthetic`` also the classifier gradients; all
        of them per class (:class:`ClassRows`). The server averages the gradients over the clients that hold
        a class (Eq. 6), the prototypes by the clients' class counts (Eq. 4)."""
        classes, dim = self.num_classes, self.global_prototypes.shape[1]
        dtype = classifier_of(self.scratch).weight.dtype
        layout: ReplyLayout = {**super().reply_layout(), "class_counts": ClassRows((classes,), torch.int64),
                               "class_gradients": ClassRows((classes, dim), dtype, HOLDERS)}
        if self.uses_global:
            layout["prototypes"] = ClassRows((classes, dim), dtype, COUNTS)
        if self.synthetic is not None:  # classifier_step=synthetic: C x C x d and C x C classifier gradients
            layout.update(classifier_weight_gradients=ClassRows((classes, classes, dim), dtype, HOLDERS),
                          classifier_bias_gradients=ClassRows((classes, classes), dtype, HOLDERS))
        return layout

    def validate_reply(self, reply: Payload, who: str = "reply") -> None:
        super().validate_reply(reply, who)
        self.bank.validate([reply])
        if self.synthetic is not None:
            self.synthetic.validate([reply])

    def aggregate(self, round: int, replies: Sequence[Payload]) -> dict[str, float]:
        # validate everything before changing any state: a rejected round leaves the server as it was
        gradients, present = self.bank.validate(replies)
        if self.uses_global:
            prototypes, held_by, counts = stack_prototypes(replies, self.num_classes, self.global_prototypes.shape[1])
        metrics: dict[str, float] = {}
        if self.synthetic is not None:
            weight_gradients, bias_gradients, held_by_client = self.synthetic.validate(replies)
            weight_key, bias_key = self.classifier_keys
            # the head the clients received (and computed their classifier gradients with)
            sent_weight, sent_bias = self.weights[weight_key], self.weights[bias_key]
        self.weights = self.last_client_weights(replies) if self.options.authors_last_client else \
            self.average_weights(replies)
        if self.synthetic is not None:
            weight, bias, metrics = self.synthetic.update(round, weight_gradients, bias_gradients, held_by_client,
                                                          sent_weight, sent_bias)
            self.weights[weight_key], self.weights[bias_key] = weight, bias
        load_weights(self.scratch, self.weights)
        metrics.update(self.bank.update(gradients, present, classifier_of(self.scratch)))
        if self.uses_global:
            new, held = HF.global_prototypes(prototypes, held_by, counts)
            self.global_prototypes, self.global_mask = merge_prototypes(self.global_prototypes, self.global_mask,
                                                                        new, held)
        return metrics

    def last_client_weights(self, replies: Sequence[Payload]) -> dict[str, torch.Tensor]:
        """``fedhpro.authors_last_client``: a copy of the weights of the round's last reply (the engine's order),
        every tensor, BatchNorm statistics included, as the authors' ``get_agg_params`` returns when all the
        dicts it averages are the last client's (``main_run.py`` lines 123-131, 427, 492-507)."""
        self.validate_replies(replies)
        return {key: value.detach().clone() for key, value in replies[-1]["weights"].items()}

    def state_dict(self) -> dict[str, Any]:
        state = {"weights": self.weights, **self.bank.state_dict()}
        if self.uses_global:
            state.update(global_prototypes=self.global_prototypes, global_mask=self.global_mask)
        if self.synthetic is not None:
            state.update(self.synthetic.state_dict())
        return state

    def load_state_dict(self, state) -> None:
        self.weights = dict(state["weights"])
        self.bank.load_state_dict(state)
        if self.uses_global:
            self.global_prototypes = state["global_prototypes"].clone()
            self.global_mask = state["global_mask"].clone().bool()
        if self.synthetic is not None:
            self.synthetic.load_state_dict(state)


def classifier_keys(model: torch.nn.Module, weights: Payload) -> tuple[str, str]:
    """The state keys of the model's classifier weight and bias among the shared ``weights``; ConfigError
    when the classifier has no bias or is not shared (the synthetic classifier step replaces both)."""
    head = classifier_of(model)
    prefix = next(name for name, module in model.named_modules() if module is head)
    keys = (f"{prefix}.weight", f"{prefix}.bias")
    if head.bias is None or any(key not in weights for key in keys):
        raise ConfigError("fedhpro.classifier_step=synthetic needs a shared classifier with a bias; "
                          "set fedhpro.classifier_step=none for this model")
    return keys


def weighted(weight: float, term: torch.Tensor) -> torch.Tensor:
    """``weight * term``; the term itself for a weight of 1 (the default lambdas), whose product is the same
    value and gradient bit for bit, without the two small kernels (forward, backward) every batch."""
    return term if weight == 1.0 else weight * term


class PrototypeTargets(NamedTuple):
    """What a loss pulls towards: ``C x I x d`` targets and, for global prototypes, which classes have one."""

    targets: torch.Tensor
    mask: torch.Tensor | None  # None: every class has targets (the hyper-prototypes)

    @property
    def usable(self) -> bool:
        return self.mask is None or bool(self.mask.any())

    def restrict(self, z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(z, y, targets)`` over the samples and classes that have targets, labels renumbered to
        match; the inputs themselves when every class has targets; None when no sample of the batch has."""
        if self.mask is None or bool(self.mask.all()):
            return z, y, self.targets
        classes = self.mask.nonzero().squeeze(1)
        position = torch.full(self.mask.shape, -1, dtype=torch.long, device=self.mask.device)
        position[classes] = torch.arange(classes.numel(), device=classes.device)
        keep = self.mask[y]
        if not bool(keep.any()):
            return None
        return z[keep], position[y[keep]], self.targets[classes]


class FedHProClient(Client):
    def sample_privacy_problem(self) -> str | None:
        """``privacy=sample`` needs per-sample losses and uploads whose every sample moves them by at most the clip;
        these options break one or the other."""
        o = self.options
        if o.prototypes != "hyper":
            return (f"fedhpro.prototypes={o.prototypes} averages its losses over the batch's samples whose class has "
                    "a global prototype, a count that couples the samples: use fedhpro.prototypes=hyper with "
                    "privacy=sample")
        if o.hpcl_batch_divide:
            return ("fedhpro.hpcl_batch_divide=true scales each sample's HPCL by 1/(batch size), which couples the "
                    "samples of a batch: set fedhpro.hpcl_batch_divide=false with privacy=sample")
        if o.class_gradient_divide or o.gradient_augment != "none":
            return ("fedhpro.class_gradient_divide and fedhpro.gradient_augment change the class gradients that "
                    "privacy=sample releases from clipped features: leave them at false / none with privacy=sample")
        if o.gradient_samples_per_class > 0:
            return ("fedhpro.gradient_samples_per_class keeps the first samples of each class, so removing one brings "
                    "in another (twice the clip): set fedhpro.gradient_samples_per_class=0 with privacy=sample")
        if o.classifier_step == "synthetic":
            return ("fedhpro.classifier_step=synthetic uploads classifier gradients that privacy=sample does not "
                    "privatize: set fedhpro.classifier_step=none with privacy=sample")
        return None

    def prepare(self, round: LocalRound) -> None:
        """On the received model: the loss targets, the margin d_k (Eq. 10) and, with
        ``gradient_timing=before`` or ``classifier_step=synthetic``, the class and classifier gradients."""
        if self.sample_private:
            self._prepare_private(round)
            return
        options, model, data, device = self.options, round.model, round.data, round.device
        scratch = round.scratch
        hyper = scratch["hyper"] = round.payload["hyper_prototypes"].to(device)
        scratch["hpcl_targets"] = scratch["hpal_targets"] = PrototypeTargets(hyper, None)
        if options.prototypes != "hyper":
            # Table 6: P (C x 1 x d) with its mask in place of S in one or both losses
            global_targets = PrototypeTargets(round.payload["global_prototypes"].to(device).unsqueeze(1),
                                              round.payload["global_mask"].to(device).bool())
            if options.prototypes in ("global", "global-hpcl"):
                scratch["hpcl_targets"] = global_targets
            if options.prototypes in ("global", "global-hpal"):
                scratch["hpal_targets"] = global_targets
        scratch["classifier_uploads"] = {}
        if options.gradient_timing == "before" or options.classifier_step == "synthetic":
            # one eval-mode pass of the received model, on the same samples, serves the class gradients
            # (timing=before) and the authors' classifier gradients (taken before training in their code)
            features, labels = self._sampled_features(round)
            if options.gradient_timing == "before":
                gradients, prototypes = feature_statistics(classifier_of(model), features, labels, self.num_classes)
                if options.class_gradient_divide:
                    gradients = divide_by_counts(gradients, labels, self.num_classes)
                counts = torch.bincount(data.y, minlength=self.num_classes)[:self.num_classes]
                scratch["statistics"] = gradients, counts, prototypes
            if options.classifier_step == "synthetic":
                head = classifier_of(model)
                weight_gradients, bias_gradients = authors_code.classifier_class_gradients(
                    features, labels, head.weight, head.bias, self.num_classes)
                scratch["classifier_uploads"] = {"classifier_weight_gradients": weight_gradients.cpu(),
                                                 "classifier_bias_gradients": bias_gradients.cpu()}
        margin = torch.zeros((), device=device)
        if options.margin != "off" and options.hpcl_weight > 0:
            # d_k: from the received model, before training, fixed for the round (Eq. 10)
            if (options.gradient_timing == "before" and options.gradient_samples_per_class == 0
                    and options.gradient_sample_choice == "first" and options.gradient_augment == "none"):
                # the class-statistics pass just made exactly these prototypes (same model in eval mode, same
                # data, same call): reuse them instead of a second pass over the data
                margin_prototypes, present = prototypes, counts > 0
            else:
                margin_prototypes, present = HF.local_prototypes(extract_features(model, data.x), data.y,
                                                                 self.num_classes)
            margin = self._margin(margin_prototypes, present)
        scratch["margin"] = margin

    def _prepare_private(self, round: LocalRound) -> None:
        """``privacy=sample``'s :meth:`prepare` (``prototypes=hyper``; :meth:`sample_privacy_problem` refuses the
        rest): with ``gradient_timing=before`` the round's one release (class gradients, prototypes, counts) of
        the received model; the margin d_k from released prototypes only, so that it is post-processing and
        every sample's loss stays its own: this round's (``before``) or those of the client's previous release
        (``after``; none on a first participation: d_k = 0)."""
        options, device = self.options, round.device
        scratch = round.scratch
        hyper = scratch["hyper"] = round.payload["hyper_prototypes"].to(device)
        scratch["hpcl_targets"] = scratch["hpal_targets"] = PrototypeTargets(hyper, None)
        scratch["classifier_uploads"] = {}
        released = None
        if options.gradient_timing == "before":
            released = self._release(round)
            scratch["statistics"] = (released["class_gradients"], released["class_counts"], released["prototypes"])
        elif "released_prototypes" in round.state:
            released = {"prototypes": round.state["released_prototypes"],
                        "class_counts": round.state["released_counts"]}
        margin = torch.zeros((), device=device)
        if released is not None and options.margin != "off" and options.hpcl_weight > 0:
            margin = self._margin(released["prototypes"].to(device), released["class_counts"].to(device) > 0)
        scratch["margin"] = margin

    def _margin(self, prototypes: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
        """The margin d_k (Eq. 10) of the client's class prototypes (``present``: the classes it holds), as
        ``fedhpro.margin`` computes it: the authors' dot products, or feature distances (raw or normalized)."""
        if self.options.margin == "dot":
            return authors_code.dot_product_margin(prototypes, present)
        return HF.client_margin(prototypes, present, normalized=self.options.margin == "normalized")

    def _release(self, round: LocalRound) -> Payload:
        """The round's one release of the class statistics of the working model as it is now (eval mode);
        its prototypes and counts are kept for the next participation's margin."""
        features = extract_features(round.model, round.data.x)
        released = private_class_uploads(self, round, classifier_of(round.model), features, round.data.y,
                                         with_gradients=True)
        round.state["released_prototypes"] = released["prototypes"]
        round.state["released_counts"] = released["class_counts"]
        return released

    def loss_terms(self, round: LocalRound) -> LossTerms:
        """HPCL (Eq. 11-12) and HPAL (Eq. 13) against the prepared targets."""
        options = self.options
        hyper, margin = round.scratch["hyper"], round.scratch["margin"]
        hpcl_targets, hpal_targets = round.scratch["hpcl_targets"], round.scratch["hpal_targets"]
        normalized = options.hpal_form == "normalized"
        both_on_hyper = (options.prototypes == "hyper" and options.hpcl_weight > 0 and options.hpal_weight > 0
                         and options.margin != "dot")
        hpcl_of = authors_code.hpcl_loss_log_margin if options.margin == "dot" else HF.hpcl_loss

        def hpcl_weighted(z, hpcl):
            # the authors' code divides HPCL's batch mean once more by the batch size
            return weighted(options.hpcl_weight / z.shape[0] if options.hpcl_batch_divide else options.hpcl_weight,
                            hpcl)

        def terms(batch: Batch) -> dict[str, torch.Tensor]:
            z, y = batch.z, batch.y
            if both_on_hyper:  # the method's default: both losses against S, sharing z/||z||
                hpcl, hpal = HF.hyper_prototype_losses(z, y, hyper, margin, options.tau, normalized=normalized)
                return {"hpcl": hpcl_weighted(z, hpcl), "hpal": weighted(options.hpal_weight, hpal)}
            out = {}
            if options.hpcl_weight > 0 and hpcl_targets.usable:
                kept = hpcl_targets.restrict(z, y)
                if kept is not None:
                    kept_z, kept_y, targets = kept
                    out["hpcl"] = hpcl_weighted(z, hpcl_of(kept_z, kept_y, targets, margin, options.tau))
            if options.hpal_weight > 0 and hpal_targets.usable:
                kept = hpal_targets.restrict(z, y)
                if kept is not None:
                    kept_z, kept_y, targets = kept
                    out["hpal"] = weighted(options.hpal_weight,
                                           HF.hpal_loss(kept_z, kept_y, targets, normalized=normalized))
            return out

        return terms

    def upload(self, round: LocalRound) -> Payload:
        """The class counts and gradients g_k^c (Eq. 5; after training unless ``gradient_timing=before``), the
        prototypes p_k^c only for Table 6's global prototypes (``prototypes != hyper``: what the server's
        :meth:`FedHProServer.reply_layout` declares; under ``privacy=sample`` the released prototypes stay
        with the client for its margin), and the classifier gradients of ``classifier_step=synthetic``; the
        margin as a note."""
        if self.sample_private and self.options.gradient_timing == "after":
            released = self._release(round)
            gradients, counts, prototypes = (released["class_gradients"], released["class_counts"],
                                             released["prototypes"])
        elif self.options.gradient_timing == "after":
            gradients, counts, prototypes = self._class_gradients(round)
        else:
            gradients, counts, prototypes = round.scratch["statistics"]
        round.notes["margin"] = float(round.scratch["margin"])
        upload: Payload = {"class_counts": counts.cpu(), "class_gradients": gradients.cpu()}
        if self.options.prototypes != "hyper":
            upload["prototypes"] = prototypes.cpu()
        return {**upload, **round.scratch["classifier_uploads"]}

    def _class_gradients(self, round: LocalRound) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(g_k^c, n_k^c, p_k^c)`` of the model as it is now, on the samples the options choose."""
        options, model, data = self.options, round.model, round.data
        if (options.gradient_sample_choice == "first" and options.gradient_augment == "none"
                and not options.class_gradient_divide):
            return class_statistics(model, data, self.num_classes, options.gradient_samples_per_class)
        features, labels = self._sampled_features(round)
        gradients, prototypes = feature_statistics(classifier_of(model), features, labels, self.num_classes)
        if options.class_gradient_divide:
            gradients = divide_by_counts(gradients, labels, self.num_classes)
        return gradients, torch.bincount(data.y, minlength=self.num_classes)[:self.num_classes], prototypes

    def _sampled_features(self, round: LocalRound) -> tuple[torch.Tensor, torch.Tensor]:
        """The features (eval mode) and labels of the class-gradient samples: ``gradient_samples_per_class`` of
        each class, the first or random ones, augmented by ``gradient_augment``; random draws from the round's
        generator."""
        options = self.options
        augment = None
        if options.gradient_augment == "dsa":
            require_images(round.data, "fedhpro.gradient_augment=dsa")
            augment = authors_code.class_batch_augment
        return sampled_features(round.model, round.data, options.gradient_samples_per_class,
                                choice=options.gradient_sample_choice, generator=round.generator, augment=augment)

    def augment(self, round: LocalRound) -> Augment | None:
        """``local_augment=crop-flip``: the authors' batch augmentation after the data's own (if any)."""
        if self.options.local_augment != "crop-flip":
            return round.data.augment
        require_images(round.data, "fedhpro.local_augment=crop-flip")
        return then_crop_flip(round.data.augment)


def require_images(data: ClientData, option: str) -> None:
    """ConfigError unless the client's inputs are images (``N x C x H x W`` floats), which ``option`` augments."""
    if data.x.dim() != 4 or not data.x.is_floating_point():
        raise ConfigError(f"{option} augments images (N x C x H x W floats); this data's inputs are "
                          f"{data.x.dtype} of shape {tuple(data.x.shape)}: set it to none")


def then_crop_flip(first: Augment | None) -> Augment:
    """An augmentation that applies ``first`` (when set), then :func:`fedhpro.authors_code.batch_crop_flip`."""
    if first is None:
        return authors_code.batch_crop_flip

    def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return authors_code.batch_crop_flip(first(x, generator), generator)

    return augment


METHOD = MethodSpec(
    name="fedhpro",
    paper_order=8,
    options=FedHProOptions,
    server=FedHProServer,
    client=FedHProClient,
    description="FedHPro: hyper-prototypes by gradient matching, HPCL + HPAL",
    recipes={"authors": AUTHORS_RECIPE},
)
