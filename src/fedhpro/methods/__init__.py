"""Federated learning methods, by name.

A built-in method is one module plus one line in ``BUILTIN_METHODS``. Others
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

import dataclasses
import importlib.metadata
import re
import sys
from collections.abc import Iterable

from fedhpro.errors import ConfigError
from fedhpro.methods import fedavg, fedgmkd, fedhpro, fedproto, fedprox, fedrcl, fedsa, fedtgp, moon
from fedhpro.methods.base import (
    Client,
    ClientData,
    MethodContext,
    MethodSpec,
    Replies,
    Server,
    TrainSettings,
)

#: the entry-point group through which installed packages add methods
ENTRY_POINT_GROUP = "fedhpro.methods"

BUILTIN_METHODS: dict[str, MethodSpec] = {
    "fedavg": fedavg.METHOD,
    "fedhpro": fedhpro.METHOD,
    "fedprox": fedprox.METHOD,
    "moon": moon.METHOD,
    "fedrcl": fedrcl.METHOD,
    "fedproto": fedproto.METHOD,
    "fedtgp": fedtgp.METHOD,
    "fedgmkd": fedgmkd.METHOD,
    "fedsa": fedsa.METHOD,
}

#: the live registry: the built-ins, then what :func:`register` and the entry points added. Look methods up
#: with :func:`get_method` and list them with :func:`method_names`, which load the entry points first.
METHODS: dict[str, MethodSpec] = dict(BUILTIN_METHODS)

#: config sections a method's name would shadow (its knobs are the ``<name>.<knob>`` keys)
RESERVED_NAMES = frozenset({"data", "faults", "partition", "flower", "federation"})

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")

_entry_points_loaded = False
#: name -> the one-line error of an entry point that failed to load (raised when that name is asked for)
_broken: dict[str, str] = {}


def register(name: str, spec: MethodSpec, *, replace: bool = False) -> MethodSpec:
    """Add ``spec`` as ``method=name`` for this process; returns the registered spec (named ``name``).

    Raises a one-line ConfigError for a name that is not a plain word, a spec
    that is not a :class:`MethodSpec` with a defaults-only options dataclass,
    or a name already taken (a built-in, or registered before) unless
    ``replace=True``.
    """
    spec = _checked_spec(name, spec, f"register({name!r}, ...)")
    load_entry_points()  # an entry point of the same name must not silently replace this one later
    if name in METHODS and not replace:
        kind = "a built-in method" if METHODS[name] is BUILTIN_METHODS.get(name) else "already registered"
        raise ConfigError(f"method {name!r} is {kind}; choose another name or pass replace=True to replace it")
    METHODS[name] = spec
    _broken.pop(name, None)
    return spec


def get_method(name: str) -> MethodSpec:
    """The method registered as ``name`` (built-in, registered or from an installed entry point).

    Raises a one-line ConfigError for an unknown name (listing the valid ones)
    or for an entry point that failed to load (naming its package).
    """
    if name not in METHODS:
        load_entry_points()
    if name in METHODS:
        return METHODS[name]
    if name in _broken:
        raise ConfigError(_broken[name])
    raise ConfigError(f"method={name!r} is not valid; choose one of: {', '.join(METHODS)} (or add one with "
                      f"fedhpro.methods.register or a package's {ENTRY_POINT_GROUP!r} entry point)")


def method_names() -> list[str]:
    """Every method's name: the built-ins first, then those registered or installed."""
    load_entry_points()
    return list(METHODS)


def all_methods() -> dict[str, MethodSpec]:
    """A copy of the registry after loading the entry points: name -> spec."""
    load_entry_points()
    return dict(METHODS)


def load_entry_points() -> None:
    """Load the ``fedhpro.methods`` entry points into the registry (once per process).

    A name that is already registered keeps its method (a built-in is never
    replaced by a package; a warning names the package). An entry point that
    fails to load is remembered: asking for its name raises a one-line
    ConfigError naming the package; the other methods work as before.
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for entry in _entry_points():
        package = _package_of(entry)
        if entry.name in METHODS:
            owner = "the built-in method" if entry.name in BUILTIN_METHODS else "a method registered before"
            print(f"fedhpro: warning: the method {entry.name!r} of package {package} is ignored: {owner} "
                  f"has that name (rename the entry point in {package})", file=sys.stderr)
            continue
        try:
            loaded = entry.load()
            spec = loaded if isinstance(loaded, MethodSpec) or not callable(loaded) else loaded()
            spec = _checked_spec(entry.name, spec, f"entry point {entry.value!r}")
        except Exception as error:  # any failure of a third-party import is reported, never fatal for others
            reason = (str(error).strip().splitlines() or [""])[0]
            _broken[entry.name] = (f"method {entry.name!r} of package {package} failed to load "
                                   f"({type(error).__name__}: {reason}); fix or reinstall {package} "
                                   f"(entry point {entry.name} = {entry.value!r}), or pip uninstall {package}")
            continue
        METHODS[entry.name] = spec


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def _package_of(entry: importlib.metadata.EntryPoint) -> str:
    """The distribution that declares ``entry`` (its module's name when unknown)."""
    dist = getattr(entry, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return name or entry.value.split(":")[0].split(".")[0]


def _checked_spec(name: str, spec: object, where: str) -> MethodSpec:
    """``spec`` named ``name``, or a ConfigError saying what a method must be."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"method name {name!r} is not a plain word; use letters, digits, '_' or '-', "
                          "starting with a letter (it becomes method=<name> and the <name>.<knob> keys)")
    if name in RESERVED_NAMES:
        raise ConfigError(f"method name {name!r} is a config section of its own; choose another name")
    if not isinstance(spec, MethodSpec):
        raise ConfigError(f"{where} gives a {type(spec).__name__}, not a fedhpro.methods.MethodSpec; "
                          "give MethodSpec(name, options, server, client) (see fedhpro.methods.fedavg)")
    if not dataclasses.is_dataclass(spec.options) or not isinstance(spec.options, type):
        raise ConfigError(f"{where}: MethodSpec.options must be a dataclass class (the <name>.<knob> keys), "
                          f"got {spec.options!r}")
    try:
        spec.options()
    except TypeError:
        raise ConfigError(f"{where}: every field of {spec.options.__name__} needs a default "
                          "(a run may leave every knob unset)") from None
    for part in ("server", "client"):
        if not callable(getattr(spec, part)):
            raise ConfigError(f"{where}: MethodSpec.{part} must be a class built from a MethodContext")
    return spec if spec.name == name else dataclasses.replace(spec, name=name)


__all__ = ["METHODS", "BUILTIN_METHODS", "ENTRY_POINT_GROUP", "Client", "ClientData", "MethodContext", "MethodSpec",
           "Replies", "Server", "TrainSettings", "all_methods", "get_method", "load_entry_points", "method_names",
           "register"]
