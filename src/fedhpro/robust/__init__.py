"""The robust aggregation rules of ``aggregation=``, by name: :data:`REGISTRY`.

A rule is one :class:`~fedhpro.robust.base.RobustRule` subclass in a module of its own and one line here
(:meth:`~fedhpro.registry.Registry.builtin`); from Python, ``REGISTRY.register("name", MyRule)``; from an
installed package, an entry point in the group ``fedhpro.aggregation_rules``. Nothing else names a rule: the
round protocol (:mod:`fedhpro.engines.robust`) applies whichever rule the run chooses, and
:data:`AGGREGATION_RULES` (name -> what the rule needs of each client's own update) is read from the registry
at each use, so a registered rule is refused under ``privacy=client`` and SecAgg+ with its own words.

A rule declares its own knobs beside its code (``RobustRule.options_class``, a dataclass of ``option(...)``
fields, torch-free like the rule modules, which import torch only to aggregate): each field is a key
``aggregation.<field>`` of the config, listed by ``fedhpro config --keys``, without any change to
:mod:`fedhpro.config`. :func:`aggregation_options_class` joins every registered rule's knobs with the bounds
all rules share (:class:`~fedhpro.robust.options.AggregationOptions`) into the class of the ``aggregation``
section; :func:`rule_for` builds the chosen rule with its own knobs' values from that section.

The built-in rules: ``mean`` (the method's own, the default), ``median``, ``trimmed-mean``, ``norm-clip``,
``krum`` and ``geometric-median``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator, Mapping
from typing import Any

from fedhpro.errors import ConfigError
from fedhpro.registry import Registry
from fedhpro.robust.base import RobustRule
from fedhpro.robust.geometric_median import GeometricMedian
from fedhpro.robust.krum import Krum
from fedhpro.robust.mean import Mean
from fedhpro.robust.median import Median
from fedhpro.robust.norm_clip import NormClip
from fedhpro.robust.options import AggregationOptions, answer_with
from fedhpro.robust.trimmed_mean import TrimmedMean


def _checked_rule(name: str, loaded: Any, where: str) -> type[RobustRule]:
    """A registered rule must be a RobustRule subclass whose ``needs`` is words (a one-line ConfigError else)."""
    if not (isinstance(loaded, type) and issubclass(loaded, RobustRule)):
        raise ConfigError(f"{where} gives {loaded!r}, not a fedhpro.robust.base.RobustRule subclass; give a class "
                          "with weights() and rows() (see fedhpro.robust.base)")
    if not isinstance(loaded.needs, str):
        raise ConfigError(f"{where}: {loaded.__name__}.needs must be a string (what the rule needs of each "
                          "client's own update, '' for none)")
    knobs = loaded.options_class
    if knobs is not None:
        if not (isinstance(knobs, type) and dataclasses.is_dataclass(knobs)):
            raise ConfigError(f"{where}: {loaded.__name__}.options_class must be a dataclass class (its fields "
                              f"become aggregation.<field> keys), got {knobs!r}")
        try:
            knobs()
        except TypeError:
            raise ConfigError(f"{where}: every field of {knobs.__name__} needs a default (a run may leave every "
                              "knob unset)") from None
        shared = {field.name for field in dataclasses.fields(AggregationOptions)}
        taken = {field.name: name for name, rule in REGISTRY.entries.items() if rule.options_class is not None
                 for field in dataclasses.fields(rule.options_class)}
        for field in dataclasses.fields(knobs):
            owner = "every rule" if field.name in shared else taken.get(field.name)
            if owner is not None and owner != name:
                raise ConfigError(f"{where}: the knob aggregation.{field.name} of {knobs.__name__} is already "
                                  f"{owner}'s; name it after the rule (e.g. {name.replace('-', '_')}_"
                                  f"{field.name})")
    return loaded


#: name -> rule class (``aggregation=<name>``)
REGISTRY: Registry[type[RobustRule]] = Registry("aggregation rule", "fedhpro.aggregation_rules", key="aggregation",
                                                check=_checked_rule)
REGISTRY.builtin("mean", Mean)
REGISTRY.builtin("median", Median)
REGISTRY.builtin("trimmed-mean", TrimmedMean)
REGISTRY.builtin("norm-clip", NormClip)
REGISTRY.builtin("krum", Krum)
REGISTRY.builtin("geometric-median", GeometricMedian)


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


def rule_options(rule: type[RobustRule], section: AggregationOptions) -> object:
    """An instance of ``rule``'s own knobs (:attr:`RobustRule.options_class`) with the values ``section`` (the
    ``aggregation.*`` options) holds for them, each knob it lacks at its default (a section built before the rule
    was registered); ``section`` itself for a rule without its own knobs."""
    knobs = rule.options_class
    if knobs is None:
        return section
    values = {field.name: getattr(section, field.name) for field in dataclasses.fields(knobs)
              if hasattr(section, field.name)}
    return knobs(**values)


def rule_for(options: AggregationOptions) -> RobustRule:
    """The rule ``options.rule`` names (``options``: the ``aggregation.*`` options), built with its own knobs'
    values; a one-line ConfigError for an unknown name (with the closest ones)."""
    rule = REGISTRY.lookup(options.rule)
    return rule(rule_options(rule, options))


def _check_knobs(section: AggregationOptions) -> None:
    """Each registered rule's checks of its own knobs on ``section``'s values (building them raises)."""
    for name in REGISTRY.names():
        rule_options(REGISTRY[name], section)


answer_with(REGISTRY.names, _check_knobs)

#: (the registered rules' knob classes) -> the section class joining them, built once for each set of rules
_SECTION_CLASSES: dict[tuple[tuple[str, type | None], ...], type[AggregationOptions]] = {}
#: the name the section class is pickled under (resolved by this module's ``__getattr__``)
SECTION_CLASS_NAME = "AggregationSection"


def aggregation_options_class(*, builtin: bool = False) -> type[AggregationOptions]:
    """The class of the ``aggregation`` section for the rules registered now: :class:`AggregationOptions` (the
    rule's name and the shared bounds) with every rule's own knobs, each a field of that name. Its fields are
    listed (and written to config.yaml) in the order ``rule``, each rule's knobs in the registry's order, then
    the shared bounds: the order the section has always had. Built once for each set of rules, so two configs
    read under the same rules hold the same class (and compare equal). ``builtin``: of the built-in rules only
    (no installed package is loaded)."""
    names = list(REGISTRY.builtins) if builtin else REGISTRY.names()
    rules = tuple((name, REGISTRY.entries[name].options_class) for name in names)
    built = _SECTION_CLASSES.get(rules)
    if built is not None:
        return built
    knobs = [field for _, options in rules if options is not None for field in dataclasses.fields(options)]
    types = {name: kind for _, options in rules if options is not None
             for name, kind in typing.get_type_hints(options).items()}
    section = dataclasses.make_dataclass(
        SECTION_CLASS_NAME, [(field.name, types[field.name], copy) for field, copy in zip(knobs, _fresh(knobs))],
        bases=(AggregationOptions,), namespace={"__module__": __name__})
    # the fields in the order config.yaml has always held them: the rule, its knobs, the shared bounds
    fields = section.__dataclass_fields__  # type: ignore[attr-defined]
    shared = [name for name in fields if name != "rule" and name not in {field.name for field in knobs}]
    section.__dataclass_fields__ = {name: fields[name]  # type: ignore[attr-defined]
                                    for name in ["rule", *(field.name for field in knobs), *shared]}
    _SECTION_CLASSES[rules] = section
    return section


def written(section: AggregationOptions) -> dict[str, Any]:
    """The ``aggregation`` section as config.yaml holds it: every field, but a knob of a rule the run does not
    choose only where that rule's knobs were always written (:attr:`RobustRule.always_written`) or the knob is off
    its default: a rule added later leaves the config.yaml of every run that does not use it as it was."""
    values = dataclasses.asdict(section)  # type: ignore[call-overload]
    for name, rule in REGISTRY.entries.items():
        knobs = rule.options_class
        if knobs is None or rule.always_written or name == section.rule:
            continue
        defaults = dataclasses.asdict(knobs())
        for knob, default in defaults.items():
            if knob in values and values[knob] == default:
                del values[knob]
    return values


def _fresh(fields: list[dataclasses.Field]) -> list[dataclasses.Field]:
    """Copies of the rules' fields (a dataclass field belongs to one class), with their defaults and metadata."""
    return [dataclasses.field(default=field.default, metadata=field.metadata) if field.default_factory is
            dataclasses.MISSING else dataclasses.field(default_factory=field.default_factory, metadata=field.metadata)
            for field in fields]


def __getattr__(name: str) -> Any:
    # the section class is built from the registry, so it is found by name (pickling a config) at each use
    if name == SECTION_CLASS_NAME:
        return aggregation_options_class()
    raise AttributeError(f"module 'fedhpro.robust' has no attribute {name!r}")


__all__ = ["AGGREGATION_RULES", "AggregationOptions", "REGISTRY", "RobustRule", "RuleNeeds",
           "aggregation_options_class", "rule_for", "rule_options", "written"]
