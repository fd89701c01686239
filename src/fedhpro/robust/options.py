"""The ``aggregation.*`` knobs every rule shares (the weight caps and the content bound): :class:`AggregationOptions`.

Torch-free, as every option declaration: ``fedhpro config`` and a refused key answer before torch loads. A rule's
own knobs (``aggregation.trim``, ``aggregation.byzantine``, ...) are declared by the rule beside its code
(``RobustRule.options``, a dataclass); :func:`fedhpro.robust.aggregation_options_class` joins them with these
into the section a config holds, so every flat key ``aggregation.<knob>`` reads as it always did.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fedhpro.errors import ConfigError
from fedhpro.options import option
from fedhpro.registry import LiveChoices

#: the config section of these options (``aggregation=NAME`` is short for ``aggregation.rule=NAME``)
AGGREGATION_SECTION = "aggregation"


#: what the section asks of the registry of rules, which lives in the package above this module
#: (:mod:`fedhpro.robust` fills it with :func:`answer_with` when it is imported): the rules' names, and a check of
#: each rule's own knobs on a section's values
_REGISTRY_ANSWERS: dict[str, Callable] = {}


def answer_with(names: Callable[[], list[str]], check_knobs: Callable[[AggregationOptions], None]) -> None:
    """Let this module read the rules from the registry (called once, by :mod:`fedhpro.robust`)."""
    _REGISTRY_ANSWERS.update(names=names, check_knobs=check_knobs)


def _rule_names() -> list[str]:
    return list(_REGISTRY_ANSWERS["names"]()) if _REGISTRY_ANSWERS else []


@dataclass
class AggregationOptions:
    """The rule's name and the bounds that hold under every rule; the class a config holds adds each registered
    rule's own knobs after ``rule`` (:func:`fedhpro.robust.aggregation_options_class`)."""

    rule: str = option("mean", choices=LiveChoices(_rule_names),
                       help="how the server combines a round's replies before the method aggregates them: mean "
                            "(the method's own rule), or robustly against hostile clients: median or "
                            "trimmed-mean (coordinate-wise, of the weights and of each class's rows of the "
                            "class tensors over its holders), norm-clip (each update's norm clipped), krum (the "
                            "update closest to its K - f - 2 nearest others, f = aggregation.byzantine), "
                            "geometric-median (the point of least summed distance to the updates, "
                            "aggregation.iterations Weiszfeld steps), or a rule registered in "
                            "fedhpro.robust.REGISTRY")
    max_share: float = option(0.75, gt=0.0, max=1.0,
                              help="the largest share of the federation's total aggregation weight one client "
                                   "may hold: a client's weight (its num_examples, and its class counts in "
                                   "proportion) and its test count in the pooled accuracy are capped so that "
                                   "none exceeds max_share of all clients' sizes (water-filling); sizes are "
                                   "claims, so one client cannot buy the model or the accuracy by claiming a "
                                   "huge data set (1: no cap)")
    max_ratio: float = option(2.0, min=0.0,
                              help="where sizes are claims nobody vouches for (a Flower deployment whose nodes hold "
                                   "their own data, without flower.roster), no client's weight or pooled test count "
                                   "may exceed max_ratio x the median client's claim (the lower median), so one "
                                   "liar weighs as at most max_ratio honest median sites however many there are; "
                                   "the simulator and partition mode know the sizes (0: no such bound)")
    max_row_norm: float = option(0.0, min=0.0,
                                 help="the largest L2 norm of one class-tensor row a client sends (a prototype, a "
                                      "class gradient, a class's soft predictions: the per-class tensors of the "
                                      "method's reply_layout): longer rows are scaled down to it before any rule "
                                      "aggregates, so one client's row of +1000 cannot drag every class mean; set "
                                      "it a few times above the honest rows' norms (0: no bound)")
    update_bound: str = option("auto", choices=("auto", "on", "off"),
                               help="bound what one reply's content can buy: at close, each reply's pull n_k x "
                                    "||w_k - w_global|| is scaled to at most update_multiple x the round's median "
                                    "pull, and each class row's n_kc x ||row|| to that multiple of the class's "
                                    "median over the clients that hold it, before the method or the robust rule "
                                    "aggregates; auto: on where the nodes hold their own data (a Flower "
                                    "dataset=clients run, roster or not: it vouches for sizes, not content), off "
                                    "in the simulator and partition mode, whose clients the run knows; never under "
                                    "privacy=client (its clip bounds each upload) or SecAgg+ (the server sees only "
                                    "the sum)")
    update_multiple: float = option(2.0, min=1.0, help="update_bound's kappa: how many times the round's median "
                                                       "pull one reply (and one class row) may pull")

    def __post_init__(self) -> None:
        if 0.0 < self.max_ratio < 1.0:
            raise ConfigError(f"{AGGREGATION_SECTION}.max_ratio={self.max_ratio:g} would cap the median site itself; "
                              "give 0 (no such bound) or a ratio >= 1, e.g. aggregation.max_ratio=2")
        self.check_rule_knobs()

    def check_rule_knobs(self) -> None:
        """Each registered rule's own checks of its knobs (its options' ``__post_init__``), on the values this
        section holds: a bad knob is refused when the config is read, whichever rule the run chooses."""
        if _REGISTRY_ANSWERS:
            _REGISTRY_ANSWERS["check_knobs"](self)


__all__ = ["AGGREGATION_SECTION", "AggregationOptions", "answer_with"]
