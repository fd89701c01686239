"""Federated learning methods, by name.

A built-in method is its code (a module or package, whose ``METHOD`` is its :class:`MethodSpec`), its torch-free
declaration beside it (``DECLARATION``, a :class:`MethodDeclaration`: options, description, recipes; e.g.
:mod:`fedhpro.methods.fedavg_options`) and one ``REGISTRY.declare`` line below. Others join at run time, without
editing the package:

* from Python, ``fedhpro.methods.register("fedavgm", METHOD)``;
* from an installed package, an entry point in the group ``fedhpro.methods``
  (``[project.entry-points."fedhpro.methods"] fedavgm = "fedhpro_fedavgm:METHOD"``)
  naming a :class:`MethodSpec` or a zero-argument callable returning one, or a
  :class:`~fedhpro.registry.Declared` (``Declared(MethodDeclaration(...), "fedhpro_fedavgm.code:METHOD")``) to keep
  its keys torch-free too.

Either way ``method=<name>`` then works everywhere a method is chosen: the
CLI, config validation (``<name>.<knob>`` keys), ``fedhpro compare`` and the
Flower apps, which all look methods up here (:func:`get_method`,
:func:`method_names`). Entry points are loaded once, lazily: on the first
lookup of a name that is not registered, or when the methods are listed.

Importing this package imports no torch: the config reads the declarations (:func:`declared_method`,
:func:`method_declarations`, :func:`recipes_of`, :func:`method_names`) before torch loads; a method's code is
imported on the first lookup of its name (:func:`get_method`, :func:`all_methods`), and the classes of the method
interface (:class:`MethodSpec`, :class:`Client`, :class:`Server`, ...) on first use of their names here.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, overload

from fedhpro.errors import ConfigError
from fedhpro.methods.declaration import MethodDeclaration
from fedhpro.methods.fedavg_options import DECLARATION as FEDAVG
from fedhpro.methods.fedgmkd_options import DECLARATION as FEDGMKD
from fedhpro.methods.fedhpro.options import DECLARATION as FEDHPRO
from fedhpro.methods.fedproto_options import DECLARATION as FEDPROTO
from fedhpro.methods.fedprox_options import DECLARATION as FEDPROX
from fedhpro.methods.fedrcl_options import DECLARATION as FEDRCL
from fedhpro.methods.fedsa_options import DECLARATION as FEDSA
from fedhpro.methods.fedtgp_options import DECLARATION as FEDTGP
from fedhpro.methods.moon_options import DECLARATION as MOON
from fedhpro.registry import Declared, Registry, checked_spec
from fedhpro.reports import plots as _plots

if TYPE_CHECKING:
    from fedhpro.data.federation import ClientData
    from fedhpro.methods.base import Client, InferenceRule, MethodContext, MethodSpec, Replies, Server
    from fedhpro.methods.layout import ClassRows
    from fedhpro.methods.training import Batch, LocalRound, LossTerms, TrainSettings

#: the entry-point group through which installed packages add methods
ENTRY_POINT_GROUP = "fedhpro.methods"

#: config sections a method's name would shadow (its knobs are the ``<name>.<knob>`` keys)
RESERVED_NAMES = frozenset({"data", "faults", "partition", "flower", "federation", "aggregation"})

#: the method interface's names this package gives, each imported (with torch) on its first use: name -> module
_LAZY = {
    "ClientData": "fedhpro.data.federation",
    **dict.fromkeys(("Client", "InferenceRule", "MethodContext", "MethodSpec", "Replies", "Server"),
                    "fedhpro.methods.base"),
    "ClassRows": "fedhpro.methods.layout",
    **dict.fromkeys(("Batch", "LocalRound", "LossTerms", "TrainSettings"), "fedhpro.methods.training"),
}


def _interface(name: str) -> Any:
    """The method interface's ``name`` (a key of :data:`_LAZY`), its module imported on first use."""
    return getattr(importlib.import_module(_LAZY[name]), name)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _interface(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check(name: str, loaded: object, where: str) -> MethodSpec:
    """``loaded`` (a :class:`MethodSpec` or a zero-argument callable returning one) named ``name``, or a one-line
    ConfigError saying what a method must be."""
    # MethodSpec's module imports torch: taken from the lazy table only when a method's code is registered or
    # loaded (which imports torch anyway), so that listing and reading the declarations does not
    built = "a class built from a MethodContext"
    return checked_spec(name, loaded, where, _interface("MethodSpec"), path="fedhpro.methods.MethodSpec",
                        give="MethodSpec(name, options, server, client) (see fedhpro.methods.fedavg)",
                        keys="the <name>.<knob> keys", callables={"server": built, "client": built})


def _declaration_of(spec: MethodSpec) -> MethodDeclaration:
    return spec.declaration


#: the registry of methods (:class:`fedhpro.registry.Registry`); ``method=<name>`` chooses one. ``declared(name)``
#: is the method's :class:`MethodDeclaration` (no code imported), ``lookup(name)`` its :class:`MethodSpec`
REGISTRY: Registry[MethodSpec] = Registry(
    "method", ENTRY_POINT_GROUP, key="method", check=_check, reserved=RESERVED_NAMES,
    declaration_of=_declaration_of, declaration_type=MethodDeclaration,
    hint=f" (or add one with fedhpro.methods.register or a package's {ENTRY_POINT_GROUP!r} entry point)")

# the built-in methods: one line each, the declaration now, the code on first lookup
REGISTRY.declare("fedavg", FEDAVG, "fedhpro.methods.fedavg:METHOD")
REGISTRY.declare("fedhpro", FEDHPRO, "fedhpro.methods.fedhpro.method:METHOD")
REGISTRY.declare("fedprox", FEDPROX, "fedhpro.methods.fedprox:METHOD")
REGISTRY.declare("moon", MOON, "fedhpro.methods.moon:METHOD")
REGISTRY.declare("fedrcl", FEDRCL, "fedhpro.methods.fedrcl:METHOD")
REGISTRY.declare("fedproto", FEDPROTO, "fedhpro.methods.fedproto:METHOD")
REGISTRY.declare("fedtgp", FEDTGP, "fedhpro.methods.fedtgp:METHOD")
REGISTRY.declare("fedgmkd", FEDGMKD, "fedhpro.methods.fedgmkd:METHOD")
REGISTRY.declare("fedsa", FEDSA, "fedhpro.methods.fedsa:METHOD")


class BuiltinMethods(Mapping[str, "MethodSpec"]):
    """The built-in methods as a live mapping name -> spec (each one's code imported on first access)."""

    def __getitem__(self, name: str) -> MethodSpec:
        if not REGISTRY.is_builtin(name):
            raise KeyError(name)
        return REGISTRY.lookup(name)

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY.builtin_names())

    def __len__(self) -> int:
        return len(REGISTRY.builtin_names())


#: the built-in methods, name -> spec
BUILTIN_METHODS: Mapping[str, MethodSpec] = BuiltinMethods()

#: the methods as a live mapping name -> spec: the built-ins, then what :func:`register` and the entry points added
METHODS: Registry[MethodSpec] = REGISTRY

#: recipes given to :func:`register`'s ``recipes=`` for a spec that does not declare them itself:
#: method -> recipe name -> the settings ``<method>.recipe=<name>`` applies before the user's. A built-in
#: declares its recipes in its declaration (``recipes=``, e.g. FedHPro's authors' recipe); config.py applies
#: whatever recipe a method declares.
RECIPES: dict[str, dict[str, dict[str, Any]]] = {}


def _declared_or_none(name: str) -> MethodDeclaration | None:
    """The declaration of ``name``, None for a name that is not a method (or whose entry point failed)."""
    return REGISTRY.declared(name) if name in REGISTRY else None


# figures name a method as its description leads ("FedAvg: ...") and tables order methods as the paper does;
# the reports cannot import this package. They read the declarations: no method's code is imported for a report
_plots.set_describer(lambda name: getattr(_declared_or_none(name), "description", None),
                     lambda name: getattr(_declared_or_none(name), "paper_order", None),
                     lambda name: bool(getattr(_declared_or_none(name), "baseline", False)))


@overload
def register(name: str, spec: MethodSpec, *, replace: bool = False,
             recipes: Mapping[str, Mapping[str, Any]] | None = None) -> MethodSpec: ...


@overload
def register(name: str, spec: Declared, *, replace: bool = False,
             recipes: Mapping[str, Mapping[str, Any]] | None = None) -> Declared: ...


def register(name: str, spec: MethodSpec | Declared, *, replace: bool = False,
             recipes: Mapping[str, Mapping[str, Any]] | None = None) -> MethodSpec | Declared:
    """Add ``spec`` as ``method=name`` for this process; returns the registered spec (named ``name``).

    ``spec``: a :class:`MethodSpec`, or a :class:`~fedhpro.registry.Declared` (a :class:`MethodDeclaration` and
    where its code's MethodSpec is, imported on the first lookup of ``name``). Raises a one-line ConfigError for a
    name that is not a plain word, a spec that is not a :class:`MethodSpec` with a defaults-only options dataclass
    (nor a Declared of a MethodDeclaration), or a name already taken (a built-in, or registered before) unless
    ``replace=True``. ``recipes``: recipe name -> settings that ``<name>.recipe=<recipe>`` applies first (the
    method's options need a ``recipe`` field).
    """
    if isinstance(spec, Declared) and not isinstance(spec.declaration, MethodDeclaration):
        raise ConfigError(f"register({name!r}, Declared(...)): its declaration is a "
                          f"{type(spec.declaration).__name__}; give Declared(MethodDeclaration(...), "
                          "'package.module:METHOD')")
    registered = REGISTRY.register(name, spec, replace=replace)
    if recipes is not None:
        RECIPES[name] = {recipe: dict(values) for recipe, values in recipes.items()}
    return registered


def get_method(name: str) -> MethodSpec:
    """The method registered as ``name`` (built-in, registered or from an installed entry point), its code imported.

    Raises a one-line ConfigError for an unknown name (listing the valid ones)
    or for an entry point that failed to load (naming its package).
    """
    return REGISTRY.lookup(name)


def declared_method(name: str) -> MethodDeclaration:
    """What a config reads of method ``name`` (options, description, recipes, ...), without importing its code.

    Raises the one-line ConfigError of :func:`get_method` for an unknown name."""
    declaration: MethodDeclaration = REGISTRY.declared(name)
    return declaration


def method_declarations() -> dict[str, MethodDeclaration]:
    """Every method's declaration, name -> :class:`MethodDeclaration`, in the order of :func:`method_names` (no
    declared code imported; a plug-in registered whole gives its spec's)."""
    return REGISTRY.declarations()


def method_names() -> list[str]:
    """Every method's name: the built-ins first, then those registered or installed."""
    return REGISTRY.names()


def all_methods() -> dict[str, MethodSpec]:
    """A copy of the registry after loading the entry points: name -> spec (every method's code imported)."""
    REGISTRY.load_entry_points()
    return dict(METHODS)


def recipes_of(name: str) -> dict[str, dict[str, Any]]:
    """The recipes method ``name`` declares (and those :func:`register` was given for it): recipe name ->
    settings (empty when none, or for a name that is not a method). No method's code is imported."""
    declared = getattr(_declared_or_none(name), "recipes", None) or {}
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
           "InferenceRule", "LocalRound", "LossTerms", "MethodContext", "MethodDeclaration", "MethodSpec",
           "RECIPES", "REGISTRY", "Replies", "Server", "TrainSettings", "all_methods", "declared_method",
           "get_method", "load_entry_points", "method_declarations", "method_names", "recipes_of", "register"]
