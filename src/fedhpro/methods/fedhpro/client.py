"""FedHPro's client (Algorithm 1's client side): CE + HPCL (Eq. 11-12, with the margin of Eq. 10) + HPAL
(Eq. 13) against the hyper-prototypes S (or Table 6's global prototypes P), then the class-wise feature
gradients of Eq. 5; its modes are chosen once, when it is built (:mod:`~fedhpro.methods.fedhpro.modes`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from fedhpro import functional
from fedhpro.data.federation import Augment, ClientData
from fedhpro.errors import ConfigError
from fedhpro.methods.base import Client, MethodContext
from fedhpro.methods.fedhpro import authors_code, equations
from fedhpro.methods.fedhpro.hyper import class_statistics, divide_by_counts, feature_statistics, sampled_features
from fedhpro.methods.fedhpro.modes import modes_of
from fedhpro.methods.layout import Payload
from fedhpro.methods.no_grad import extract_features
from fedhpro.methods.parts import classifier_of
from fedhpro.methods.prototypes import private_class_uploads
from fedhpro.methods.training import Batch, LocalRound, LossTerms

#: the key of FedHPro's :class:`Prepared` in ``LocalRound.scratch`` (shared with the base client's own keys)
PREPARED = "fedhpro"


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


@dataclass
class Prepared:
    """What :meth:`FedHProClient.prepare` computes on the received model, for the round's loss terms and upload."""

    hyper: torch.Tensor  # S, C x I x d, on the client's device
    hpcl_targets: PrototypeTargets  # what HPCL pulls towards: S, or Table 6's P
    hpal_targets: PrototypeTargets
    margin: torch.Tensor  # d_k (Eq. 10), 0-dim; 0 when off
    #: (g_k^c, n_k^c, p_k^c) of the received model (gradient_timing=before); None: computed after training
    statistics: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    #: classifier_step=synthetic: the authors' classifier gradients, taken before training
    classifier_uploads: dict[str, torch.Tensor] = field(default_factory=dict)


def prepared(round: LocalRound) -> Prepared:
    """The round's :class:`Prepared` (written by :meth:`FedHProClient.prepare`)."""
    found = round.scratch[PREPARED]
    assert isinstance(found, Prepared)
    return found


class FedHProClient(Client):
    def __init__(self, context: MethodContext):
        # before the base's checks, which ask sample_privacy_problem
        self.modes = modes_of(context.options)
        super().__init__(context)

    def sample_privacy_problem(self) -> str | None:
        """``privacy=sample`` needs per-sample losses and uploads whose every sample moves them by at most the clip;
        these options break one or the other."""
        o, modes = self.options, self.modes
        if modes.uses_global:
            return (f"fedhpro.prototypes={o.prototypes} averages its losses over the batch's samples whose class has "
                    "a global prototype, a count that couples the samples: use fedhpro.prototypes=hyper with "
                    "privacy=sample")
        if o.hpcl_batch_divide:
            return ("fedhpro.hpcl_batch_divide=true scales each sample's HPCL by 1/(batch size), which couples the "
                    "samples of a batch: set fedhpro.hpcl_batch_divide=false with privacy=sample")
        if o.class_gradient_divide or modes.gradient_augment is not None:
            return ("fedhpro.class_gradient_divide and fedhpro.gradient_augment change the class gradients that "
                    "privacy=sample releases from clipped features: leave them at false / none with privacy=sample")
        if o.gradient_samples_per_class > 0:
            return ("fedhpro.gradient_samples_per_class keeps the first samples of each class, so removing one brings "
                    "in another (twice the clip): set fedhpro.gradient_samples_per_class=0 with privacy=sample")
        if modes.synthetic_classifier:
            return ("fedhpro.classifier_step=synthetic uploads classifier gradients that privacy=sample does not "
                    "privatize: set fedhpro.classifier_step=none with privacy=sample")
        return None

    def prepare(self, round: LocalRound) -> None:
        """On the received model: the loss targets, the margin d_k (Eq. 10) and, with
        ``gradient_timing=before`` or ``classifier_step=synthetic``, the class and classifier gradients."""
        if self.sample_private:
            self._prepare_private(round)
            return
        modes, model, data, device = self.modes, round.model, round.data, round.device
        hyper = round.payload["hyper_prototypes"].to(device)
        hpcl_targets = hpal_targets = PrototypeTargets(hyper, None)
        if modes.uses_global:
            # Table 6: P (C x 1 x d) with its mask in place of S in one or both losses
            global_targets = PrototypeTargets(round.payload["global_prototypes"].to(device).unsqueeze(1),
                                              round.payload["global_mask"].to(device).bool())
            if modes.hpcl_on_global:
                hpcl_targets = global_targets
            if modes.hpal_on_global:
                hpal_targets = global_targets
        statistics = None
        classifier_uploads: dict[str, torch.Tensor] = {}
        if modes.gradients_before or modes.synthetic_classifier:
            # one eval-mode pass of the received model, on the same samples, serves the class gradients
            # (timing=before) and the authors' classifier gradients (taken before training in their code)
            features, labels = self._sampled_features(round)
            if modes.gradients_before:
                gradients, prototypes = feature_statistics(classifier_of(model), features, labels, self.num_classes)
                if self.options.class_gradient_divide:
                    gradients = divide_by_counts(gradients, labels, self.num_classes)
                counts = torch.bincount(data.y, minlength=self.num_classes)[:self.num_classes]
                statistics = gradients, counts, prototypes
            if modes.synthetic_classifier:
                head = classifier_of(model)
                weight_gradients, bias_gradients = authors_code.classifier_class_gradients(
                    features, labels, head.weight, head.bias, self.num_classes)
                classifier_uploads = {"classifier_weight_gradients": weight_gradients.cpu(),
                                      "classifier_bias_gradients": bias_gradients.cpu()}
        margin = torch.zeros((), device=device)
        if modes.margin is not None:
            # d_k: from the received model, before training, fixed for the round (Eq. 10)
            if modes.statistics_give_margin_prototypes:
                # the class-statistics pass just made exactly these prototypes: no second pass over the data
                margin_prototypes, present = prototypes, counts > 0
            else:
                margin_prototypes, present = functional.local_prototypes(extract_features(model, data.x), data.y,
                                                                         self.num_classes)
            margin = modes.margin(margin_prototypes, present)
        round.scratch[PREPARED] = Prepared(hyper, hpcl_targets, hpal_targets, margin, statistics, classifier_uploads)

    def _prepare_private(self, round: LocalRound) -> None:
        """``privacy=sample``'s :meth:`prepare` (``prototypes=hyper``; :meth:`sample_privacy_problem` refuses the
        rest): with ``gradient_timing=before`` the round's one release (class gradients, prototypes, counts) of
        the received model; the margin d_k from released prototypes only, so that it is post-processing and
        every sample's loss stays its own: this round's (``before``) or those of the client's previous release
        (``after``; none on a first participation: d_k = 0)."""
        modes, device = self.modes, round.device
        hyper = round.payload["hyper_prototypes"].to(device)
        statistics = None
        released = None
        if modes.gradients_before:
            released = self._release(round)
            statistics = (released["class_gradients"], released["class_counts"], released["prototypes"])
        elif "released_prototypes" in round.state:
            released = {"prototypes": round.state["released_prototypes"],
                        "class_counts": round.state["released_counts"]}
        margin = torch.zeros((), device=device)
        if released is not None and modes.margin is not None:
            margin = modes.margin(released["prototypes"].to(device), released["class_counts"].to(device) > 0)
        targets = PrototypeTargets(hyper, None)
        round.scratch[PREPARED] = Prepared(hyper, targets, targets, margin, statistics)

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
        options, modes, ready = self.options, self.modes, prepared(round)
        hyper, margin = ready.hyper, ready.margin
        hpcl_targets, hpal_targets = ready.hpcl_targets, ready.hpal_targets
        normalized = modes.hpal_normalized
        hpcl_of = modes.hpcl

        def hpcl_weighted(z, hpcl):
            # the authors' code divides HPCL's batch mean once more by the batch size
            return weighted(options.hpcl_weight / z.shape[0] if options.hpcl_batch_divide else options.hpcl_weight,
                            hpcl)

        def terms(batch: Batch) -> dict[str, torch.Tensor]:
            z, y = batch.z, batch.y
            if modes.fused_losses:  # the method's default: both losses against S, sharing z/||z||
                hpcl, hpal = equations.hyper_prototype_losses(z, y, hyper, margin, options.tau, normalized=normalized)
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
                                           equations.hpal_loss(kept_z, kept_y, targets, normalized=normalized))
            return out

        return terms

    def upload(self, round: LocalRound) -> Payload:
        """The class counts and gradients g_k^c (Eq. 5; after training unless ``gradient_timing=before``), the
        prototypes p_k^c only for Table 6's global prototypes (``prototypes != hyper``: what the server's
        :meth:`~fedhpro.methods.fedhpro.server.FedHProServer.reply_layout` declares; under ``privacy=sample`` the
        released prototypes stay with the client for its margin), and the classifier gradients of
        ``classifier_step=synthetic``; the margin as a note."""
        ready = prepared(round)
        if ready.statistics is not None:
            gradients, counts, prototypes = ready.statistics
        elif self.sample_private:
            released = self._release(round)
            gradients, counts, prototypes = (released["class_gradients"], released["class_counts"],
                                             released["prototypes"])
        else:
            gradients, counts, prototypes = self._class_gradients(round)
        round.notes["margin"] = float(ready.margin)
        upload: Payload = {"class_counts": counts.cpu(), "class_gradients": gradients.cpu()}
        if self.modes.uses_global:
            upload["prototypes"] = prototypes.cpu()
        return {**upload, **ready.classifier_uploads}

    def _class_gradients(self, round: LocalRound) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(g_k^c, n_k^c, p_k^c)`` of the model as it is now, on the samples the options choose."""
        options, model, data = self.options, round.model, round.data
        if self.modes.plain_class_statistics:
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
        augment = self.modes.gradient_augment
        if augment is not None:
            require_images(round.data, "fedhpro.gradient_augment=dsa")
        return sampled_features(round.model, round.data, self.options.gradient_samples_per_class,
                                choice=self.options.gradient_sample_choice, generator=round.generator,
                                augment=augment)

    def augment(self, round: LocalRound) -> Augment | None:
        """``local_augment=crop-flip``: the authors' batch augmentation after the data's own (if any)."""
        if not self.modes.crop_flip:
            return round.data.augment
        require_images(round.data, "fedhpro.local_augment=crop-flip")
        return then_crop_flip(round.data.augment)


def require_images(data: ClientData, option: str) -> None:
    """ConfigError unless the client's inputs are images (``N x C x H x W`` floats), which ``option`` augments."""
    if data.x.dim() != 4 or not data.x.is_floating_point():
        raise ConfigError(f"{option} augments images (N x C x H x W floats); this data's inputs are "
                          f"{data.x.dtype} of shape {tuple(data.x.shape)}: set it to none")


def then_crop_flip(first: Augment | None) -> Augment:
    """An augmentation that applies ``first`` (when set), then
    :func:`~fedhpro.methods.fedhpro.authors_code.batch_crop_flip`."""
    if first is None:
        return authors_code.batch_crop_flip

    def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return authors_code.batch_crop_flip(first(x, generator), generator)

    return augment
