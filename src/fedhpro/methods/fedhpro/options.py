"""FedHPro's options, its recipes, its description and its declaration: what config validation,
``fedhpro config --keys`` and ``--help`` read. It imports no torch (the method's code, which does, is
:mod:`fedhpro.methods.fedhpro.method`), so they answer before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedhpro.methods.declaration import MethodDeclaration
from fedhpro.options import option
from fedhpro.search_space import LogUniform

#: ``init`` of :func:`~fedhpro.methods.fedhpro.hyper.initial_hyper_prototypes`: the paper's N(0, 1), then two
#: geometries that are not the paper's
HYPER_INITS = ("gaussian", "simplex", "orthogonal-nonnegative")

#: ``choice`` of :func:`~fedhpro.methods.fedhpro.hyper.sampled_features`: the first samples of each class, or
#: random ones (the authors' code)
SAMPLE_CHOICES = ("first", "random")

#: ``distance`` of :func:`~fedhpro.methods.fedhpro.equations.match_hyper_prototypes`: Eq. 8's cosine of whole
#: vectors, or the authors' per element
MATCHING_DISTANCES = ("cosine", "elementwise")

#: the method's one line in ``fedhpro methods`` and the reports
DESCRIPTION = "FedHPro: hyper-prototypes by gradient matching, HPCL + HPAL"


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
    matching_distance: str = option("cosine", choices=MATCHING_DISTANCES,
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

#: ``method=fedhpro`` as the registry declares it (its code, ``fedhpro.methods.fedhpro.method:METHOD``, loads on
#: first use)
DECLARATION = MethodDeclaration(
    name="fedhpro",
    options=FedHProOptions,
    paper_order=8,
    description=DESCRIPTION,
    recipes={"authors": AUTHORS_RECIPE},
)
