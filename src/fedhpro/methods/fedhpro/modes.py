"""FedHPro's modes chosen once: each string option of :class:`~fedhpro.methods.fedhpro.options.FedHProOptions`
is looked up in a table when a client or server is built, and the steps read the flags and functions of
:class:`Modes`, never the option strings.

The tables are built by :func:`modes_of` at that time, not at import, so that they hold the functions of
:mod:`~fedhpro.methods.fedhpro.authors_code` and :mod:`~fedhpro.methods.fedhpro.equations` as they are then (a
test that replaces one with a spy before building the client sees its spy called).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from torch import Tensor

from fedhpro.data.federation import Augment
from fedhpro.methods.fedhpro import authors_code, equations
from fedhpro.methods.fedhpro.options import FedHProOptions

#: ``d_k`` of a client's class prototypes and the mask of the classes it holds
Margin = Callable[[Tensor, Tensor], Tensor]
#: ``hpcl(z, y, targets, margin, tau)``: Eq. 11-12, or the authors' log-margin form
HpclLoss = Callable[[Tensor, Tensor, Tensor, "float | Tensor", float], Tensor]

#: ``fedhpro.prototypes`` -> (HPCL pulls towards the global prototypes P, HPAL does): Table 6's ablations
GLOBAL_PROTOTYPES_IN = {"hyper": (False, False), "global": (True, True), "global-hpcl": (True, False),
                        "global-hpal": (False, True)}
#: ``fedhpro.gradient_timing`` -> the class gradients come from the received model, before local training
GRADIENTS_BEFORE = {"after": False, "before": True}
#: ``fedhpro.classifier_step`` -> the authors' synthetic classifier step is on
SYNTHETIC_CLASSIFIER = {"none": False, "synthetic": True}
#: ``fedhpro.hpal_form`` -> HPAL on L2-normalised z and H
HPAL_NORMALIZED = {"normalized": True, "paper": False}
#: ``fedhpro.local_augment`` -> the authors' crop and flip of every training batch
CROP_FLIP = {"none": False, "crop-flip": True}
#: ``fedhpro.gradient_sample_choice`` -> the first samples of each class (not random ones)
FIRST_SAMPLES = {"first": True, "random": False}
#: ``fedhpro.margin`` -> HPCL is Eq. 12's, whose margin the fused HPCL + HPAL call takes (``dot``'s is not)
EQ12_HPCL = {"raw": True, "normalized": True, "off": True, "dot": False}


def margins() -> dict[str, Margin | None]:
    """``fedhpro.margin`` -> the function computing d_k (Eq. 10), None for ``off``."""
    return {"raw": partial(equations.client_margin, normalized=False),
            "normalized": partial(equations.client_margin, normalized=True),
            "dot": authors_code.dot_product_margin, "off": None}


def hpcl_losses() -> dict[str, HpclLoss]:
    """``fedhpro.margin`` -> HPCL's form: the authors' margin sits in the denominator of a log (``dot``)."""
    return {"raw": equations.hpcl_loss, "normalized": equations.hpcl_loss, "off": equations.hpcl_loss,
            "dot": authors_code.hpcl_loss_log_margin}


def gradient_augments() -> dict[str, Augment | None]:
    """``fedhpro.gradient_augment`` -> the augmentation of the class-gradient samples (None: none)."""
    return {"none": None, "dsa": authors_code.class_batch_augment}


@dataclass(frozen=True)
class Modes:
    """What FedHPro's string options mean for the steps, chosen once by :func:`modes_of`."""

    hpcl_on_global: bool  # HPCL pulls towards the global prototypes P (Table 6), not the hyper-prototypes S
    hpal_on_global: bool  # HPAL likewise
    gradients_before: bool  # gradient_timing=before: g_k^c of the received model (the authors' code)
    synthetic_classifier: bool  # classifier_step=synthetic: the clients also upload classifier gradients
    margin: Margin | None  # d_k (Eq. 10); None when it is off or HPCL is (weight 0): d_k = 0
    hpcl: HpclLoss
    hpal_normalized: bool
    gradient_augment: Augment | None  # of the class-gradient samples
    crop_flip: bool  # local_augment=crop-flip
    #: both losses against S, with Eq. 10's margin: one fused call shares z/||z|| (the method's default)
    fused_losses: bool
    #: the statistics pass of gradient_timing=before made exactly the margin's prototypes (same model in eval
    #: mode, all samples, in order, unaugmented): the margin reuses them instead of a second pass over the data
    statistics_give_margin_prototypes: bool
    #: the class gradients of all samples, or the first ones, unaugmented and undivided: one fused pass
    plain_class_statistics: bool

    @property
    def uses_global(self) -> bool:
        """Whether the global prototypes P travel (the server aggregates them, the clients upload theirs)."""
        return self.hpcl_on_global or self.hpal_on_global


def modes_of(options: FedHProOptions) -> Modes:
    """Each string option of ``options`` looked up once in its table."""
    hpcl_on_global, hpal_on_global = GLOBAL_PROTOTYPES_IN[options.prototypes]
    gradients_before = GRADIENTS_BEFORE[options.gradient_timing]
    gradient_augment = gradient_augments()[options.gradient_augment]
    first_samples = FIRST_SAMPLES[options.gradient_sample_choice] and gradient_augment is None
    return Modes(
        hpcl_on_global=hpcl_on_global,
        hpal_on_global=hpal_on_global,
        gradients_before=gradients_before,
        synthetic_classifier=SYNTHETIC_CLASSIFIER[options.classifier_step],
        margin=margins()[options.margin] if options.hpcl_weight > 0 else None,
        hpcl=hpcl_losses()[options.margin],
        hpal_normalized=HPAL_NORMALIZED[options.hpal_form],
        gradient_augment=gradient_augment,
        crop_flip=CROP_FLIP[options.local_augment],
        fused_losses=(not (hpcl_on_global or hpal_on_global) and options.hpcl_weight > 0
                      and options.hpal_weight > 0 and EQ12_HPCL[options.margin]),
        statistics_give_margin_prototypes=(gradients_before and options.gradient_samples_per_class == 0
                                           and first_samples),
        plain_class_statistics=first_samples and not options.class_gradient_divide,
    )
