"""The robust aggregation rules of ``aggregation=``, by name: :data:`REGISTRY`.

A rule is one :class:`~fedhpro.robust.base.RobustRule` subclass in a module of its own and one line here
(:meth:`~fedhpro.registry.Registry.builtin`); from Python, ``REGISTRY.register("name", MyRule)``; from an
installed package, an entry point in the group ``fedhpro.aggregation_rules``. Nothing else names a rule: the
round protocol (:mod:`fedhpro.engines.robust`) applies whichever rule the run chooses, and
:data:`AGGREGATION_RULES` (name -> what the rule needs of each client's own update) is read from the registry
at each use, so a registered rule is refused under ``privacy=client`` and SecAgg+ with its own words.

The built-in rules: ``mean`` (the method's own, the default), ``median``, ``trimmed-mean``, ``norm-clip`` and
``krum``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from fedhpro.errors import ConfigError
from fedhpro.registry import Registry
from fedhpro.robust.base import RobustRule
from fedhpro.robust.krum import Krum
from fedhpro.robust.mean import Mean
from fedhpro.robust.median import Median
from fedhpro.robust.norm_clip import NormClip
from fedhpro.robust.trimmed_mean import TrimmedMean


def _checked_rule(name: str, loaded: Any, where: str) -> type[RobustRule]:
    """A registered rule must be a RobustRule subclass whose ``needs`` is words (a one-line ConfigError else)."""
    if not (isinstance(loaded, type) and issubclass(loaded, RobustRule)):
        raise ConfigError(f"{where} gives {loaded!r}, not a fedhpro.robust.base.RobustRule subclass; give a class "
                          "with weights() and rows() (see fedhpro.robust.base)")
    if not isinstance(loaded.needs, str):
        raise ConfigError(f"{where}: {loaded.__name__}.needs must be a string (what the rule needs of each "
                          "client's own update, '' for none)")
    return loaded


#: name -> rule class (``aggregation=<name>``)
REGISTRY: Registry[type[RobustRule]] = Registry("aggregation rule", "fedhpro.aggregation_rules", key="aggregation",
                                                check=_checked_rule)
REGISTRY.builtin("mean", Mean)
REGISTRY.builtin("median", Median)
REGISTRY.builtin("trimmed-mean", TrimmedMean)
REGISTRY.builtin("norm-clip", NormClip)
REGISTRY.builtin("krum", Krum)


class RuleNeeds(Mapping[str, str]):
    """Rule name -> what it needs of each client's own update ("" for ``mean``), read from :data:`REGISTRY` at
    each use (read-only)."""

    def __getitem__(self, name: str) -> str:
        return REGISTRY[name].needs

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY)

    def __len__(self) -> int:
        return len(REGISTRY)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in REGISTRY

    def __repr__(self) -> str:
        return f"RuleNeeds({dict(self)!r})"


#: the values of ``aggregation=`` (``aggregation.rule``), each with what it needs of each client's own update
#: ("": nothing, the replies reach the method as they came); live: a rule registered later is listed
AGGREGATION_RULES = RuleNeeds()


def rule_for(options: Any) -> RobustRule:
    """The rule ``options.rule`` names (``options``: the ``aggregation.*`` options), built from the options; a
    one-line ConfigError for an unknown name (with the closest ones)."""
    return REGISTRY.lookup(options.rule)(options)


__all__ = ["AGGREGATION_RULES", "REGISTRY", "RobustRule", "RuleNeeds", "rule_for"]
