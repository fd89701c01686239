"""Federated learning methods, by name.

A built-in method is one module plus one ``REGISTRY.builtin`` line below. Others
join at run time, without editing the package:

* from Python, ``fedhpro.methods.register("fedavgm", METHOD)``;
* from an installed package, an entry point in the group ``fedhpro.methods``
  (``[project.entry-points."fedhpro.methods"] fedavgm = "fedhpro_fedavgm:METHOD"``)
  naming a :class:`MethodSpec` or a zero-argument callable returning one.

Either way ``method=<name>`` then works everywhere a method is chosen: the
CLI, config validation (``<name>.<knob>`` keys), ``fedhpro compare`` and the
Flower apps, which all look methods up here (:func:`get_method`,
:func:`method_names`). Entry points are loaded once, lazily: on the first
lookup of a name that is not registered, or when the methods are listed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedhpro.data.federation import ClientData
from fedhpro.methods import fedavg, fedgmkd, fedproto, fedprox, fedrcl, fedsa, fedtgp, moon
from fedhpro.methods.base import Client, InferenceRule, MethodContext, MethodSpec, Replies, Server
from fedhpro.methods.fedhpro import method as fedhpro
from fedhpro.methods.layout import ClassRows
from fedhpro.methods.training import Batch, LocalRound, LossTerms, TrainSettings
from fedhpro.registry import Registry, checked_spec
from fedhpro.reports import plots as _plots

#: the entry-point group through which installed packages add methods
ENTRY_POINT_GROUP = "fedhpro.methods"

#: config sections a method's name would shadow (its knobs are the ``<name>.<knob>`` keys)
RESERVED_NAMES = frozenset({"data", "faults", "partition", "flower", "federation", "aggregation"})


def _check(name: str, loaded: object, where: str) -> MethodSpec:
    """``loaded`` (a :class:`MethodSpec` or a zero-argument callable returning one) named ``name``, or a one-line
    ConfigError saying what a method must be."""
    built = "a class built from a MethodContext"
    return checked_spec(name, loaded, where, MethodSpec, path="fedhpro.methods.MethodSpec",
                        give="MethodSpec(name, options, server, client) (see fedhpro.methods.fedavg)",
                        keys="the <name>.<knob> keys", callables={"server": built, "client": built})


#: the registry of methods (:class:`fedhpro.registry.Registry`); ``method=<name>`` chooses one
REGISTRY: Registry[MethodSpec] = Registry(
    "method", ENTRY_POINT_GROUP, key="method", check=_check, reserved=RESERVED_NAMES,
    hint=f" (or add one with fedhpro.methods.register or a package's {ENTRY_POINT_GROUP!r} entry point)")

# the built-in methods: one line each
REGISTRY.builtin("fedavg", fedavg.METHOD)
REGISTRY.builtin("fedhpro", fedhpro.METHOD)
REGISTRY.builtin("fedprox", fedprox.METHOD)
REGISTRY.builtin("moon", moon.METHOD)
REGISTRY.builtin("fedrcl", fedrcl.METHOD)
REGISTRY.builtin("fedproto", fedproto.METHOD)
REGISTRY.builtin("fedtgp", fedtgp.METHOD)
REGISTRY.builtin("fedgmkd", fedgmkd.METHOD)
REGISTRY.builtin("fedsa", fedsa.METHOD)

#: the built-in methods, name -> spec
BUILTIN_METHODS: dict[str, MethodSpec] = REGISTRY.builtins

#: the methods as a live mapping name -> spec: the built-ins, then what :func:`register` and the entry points added
METHODS: Registry[MethodSpec] = REGISTRY

#: recipes given to :func:`register`'s ``recipes=`` for a spec that does not declare them itself:
#: method -> recipe name -> the settings ``<method>.recipe=<name>`` applies before the user's. A built-in
#: declares its recipes in its MethodSpec (``recipes=``, e.g. FedHPro's authors' recipe); config.py applies
#: whatever recipe a method declares.
RECIPES: dict[str, dict[str, dict[str, Any]]] = {}


# figures name a method as its description leads ("FedAvg: ...") and tables order methods as the paper does;
# the reports cannot import this package
_plots.set_describer(lambda name: getattr(METHODS.get(name), "description", None),
                     lambda name: getattr(METHODS.get(name), "paper_order", None),
                     lambda name: bool(getattr(METHODS.get(name), "baseline", False)))


def register(name: str, spec: MethodSpec, *, replace: bool = False,
             recipes: Mapping[str, Mapping[str, Any]] | None = None) -> MethodSpec:
    """Add ``spec`` as ``method=name`` for this process; returns the registered spec (named ``name``).

    Raises a one-line ConfigError for a name that is not a plain word, a spec
    that is not a :class:`MethodSpec` with a defaults-only options dataclass,
    or a name already taken (a built-in, or registered before) unless
    ``replace=True``. ``recipes``: recipe name -> settings that
    ``<name>.recipe=<recipe>`` applies first (the method's options need a ``recipe`` field).
    """
    registered = REGISTRY.register(name, spec, replace=replace)
    if recipes is not None:
        RECIPES[name] = {recipe: dict(values) for recipe, values in recipes.items()}
    return registered


def get_method(name: str) -> MethodSpec:
    """The method registered as ``name`` (built-in, registered or from an installed entry point).

    Raises a one-line ConfigError for an unknown name (listing the valid ones)
    or for an entry point that failed to load (naming its package).
    """
    return REGISTRY.lookup(name)


def method_names() -> list[str]:
    """Every method's name: the built-ins first, then those registered or installed."""
    return REGISTRY.names()


def all_methods() -> dict[str, MethodSpec]:
    """A copy of the registry after loading the entry points: name -> spec."""
    REGISTRY.load_entry_points()
    return dict(METHODS)


def recipes_of(name: str) -> dict[str, dict[str, Any]]:
    """The recipes method ``name`` declares: recipe name -> settings (empty when none)."""
    declared = getattr(METHODS.get(name), "recipes", None) or {}
    return {**declared, **RECIPES.get(name, {})}


def load_entry_points() -> None:
    """Load the ``fedhpro.methods`` entry points into the registry (once per process).

    A name that is already registered keeps its method (a built-in is never
    replaced by a package; a warning names the package). An entry point that
    fails to load is remembered: asking for its name raises a one-line
    ConfigError naming the package; the other methods work as before.
    """
    REGISTRY.load_entry_points()


__all__ = ["METHODS", "BUILTIN_METHODS", "ENTRY_POINT_GROUP", "Batch", "ClassRows", "Client", "ClientData",
           "InferenceRule", "LocalRound", "LossTerms", "MethodContext", "MethodSpec",
           "RECIPES", "REGISTRY", "Replies", "Server", "TrainSettings", "all_methods", "get_method",
           "load_entry_points", "method_names", "recipes_of", "register"]
