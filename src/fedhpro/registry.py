"""One registry of named things (methods, data sets, partitioners, models, robust aggregation rules), and their
entry-point groups.

A :class:`Registry` maps a name to an entry. Entries join in three ways:

* built in, in the module that owns the registry (one line each);
* from Python: ``REGISTRY.register("name", entry)`` or ``@REGISTRY.register("name")`` as a decorator;
* from an installed package: an entry point in the registry's group (``fedhpro.methods``,
  ``fedhpro.datasets``, ``fedhpro.partitioners``, ``fedhpro.models``, ``fedhpro.aggregation_rules``), loaded
  lazily, once per process: on the first lookup of a name that is not registered, or when the names are listed.

The names are read at each use (:meth:`Registry.names`, :attr:`Registry.choices`), never frozen at import,
so a config's ``method=``/``dataset=``/``model=``/``partition=`` accept whatever is registered when it is
read. Every error is one line: an unknown name (with the closest names), a name taken twice, an entry point
that fails to import (naming the entry point and its package).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any, Generic, TypeVar, overload

from fedhpro.errors import ConfigError

T = TypeVar("T")
S = TypeVar("S")

#: what a registered name may be: a plain word (it becomes ``method=<name>`` and ``<name>.<knob>`` keys)
NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


def close_names(name: object, names: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``names`` closest to ``name`` (closest first; none when nothing is close)."""
    return difflib.get_close_matches(str(name), list(names), n=n, cutoff=0.6)


def did_you_mean(name: object, names: Iterable[str]) -> str:
    """`` (did you mean 'a' or 'b'?)`` for the names close to ``name``; empty when none is."""
    quoted = [f"'{close}'" for close in close_names(name, names)]
    if not quoted:
        return ""
    return " (did you mean " + (", ".join(quoted[:-1]) + " or " + quoted[-1] if len(quoted) > 1 else quoted[0]) + "?)"


class LiveChoices(Sequence[str]):
    """The valid values of a setting, read from ``names()`` at each use (never frozen into an options class)."""

    def __init__(self, names: Callable[[], Sequence[str]], first: Sequence[str] = ()) -> None:
        self._names = names
        self._first = tuple(first)

    def _all(self) -> list[str]:
        return [*self._first, *(name for name in self._names() if name not in self._first)]

    def __len__(self) -> int:
        return len(self._all())

    def __getitem__(self, index):  # type: ignore[override]
        return self._all()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __contains__(self, name: object) -> bool:
        return name in self._all()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"LiveChoices({self._all()})"


class Registry(MutableMapping[str, T], Generic[T]):
    """Name -> entry, with an entry-point group loaded lazily once.

    Args:
        kind: what an entry is, in messages ("method", "data set", ...).
        group: the entry-point group of installed packages (None: no plug-ins).
        key: the setting that chooses an entry (``method``, ``dataset``), in messages.
        check: ``(name, loaded object, where) -> entry``: validates (raising ConfigError) and converts what
            :meth:`register` is given or an entry point names; default: taken as it is.
        hint: said after the list of valid names in an unknown-name error.
        reserved: names that may not be registered (they are config sections of their own).

    As a mapping it is live: iterating or ``len`` loads the entry points first, ``in`` and ``[name]`` load
    them when ``name`` is not registered yet. :attr:`entries` is the plain dict underneath (no loading).
    """

    def __init__(self, kind: str, group: str | None = None, *, key: str | None = None,
                 check: Callable[[str, Any, str], T] | None = None, hint: str = "",
                 reserved: Iterable[str] = ()) -> None:
        self.kind = kind
        self.group = group
        self.key = key or kind
        self.hint = hint
        self.reserved = frozenset(reserved)
        self._check = check
        #: the entries, in registration order (built-ins first); the registry's own storage
        self.entries: dict[str, T] = {}
        #: the names registered while :meth:`builtin` was in force
        self.builtins: dict[str, T] = {}
        self._loaded = group is None
        #: name -> the one-line error of an entry point that failed to load (raised when the name is asked for)
        self._broken: dict[str, str] = {}

    # -- registering -------------------------------------------------------------------------------------

    @overload
    def register(self, name: str, entry: Any, *, replace: bool = False) -> T: ...

    @overload
    def register(self, name: str, *, replace: bool = False) -> Callable[[Any], Any]: ...

    def register(self, name: str, entry: Any = None, *, replace: bool = False) -> Any:
        """Add ``entry`` as ``name``; returns the registered entry. Without ``entry``, a decorator.

        A name already taken (built in, registered, or installed) is a one-line ConfigError unless
        ``replace=True``; so is a name that is not a plain word or is reserved, or an entry ``check`` refuses.
        """
        if entry is None:
            def decorator(value: Any) -> Any:
                self.register(name, value, replace=replace)
                return value

            return decorator
        checked = self._checked(name, entry, f"register({name!r}, ...)")
        self.load_entry_points()  # an entry point of the same name must not silently replace this one later
        if name in self.entries and not replace:
            taken = f"a built-in {self.kind}" if self.is_builtin(name) else "already registered"
            raise ConfigError(f"{self.kind} {name!r} is {taken}; choose another name or pass replace=True "
                              "to replace it")
        self.entries[name] = checked
        self._broken.pop(name, None)
        return checked

    def builtin(self, name: str, entry: T) -> T:
        """Register a built-in ``entry`` (no checks, no entry points loaded): the package's own line."""
        self.entries[name] = self.builtins[name] = entry
        return entry

    def is_builtin(self, name: str) -> bool:
        return name in self.builtins and self.entries.get(name) is self.builtins[name]

    def unregister(self, name: str) -> None:
        self.entries.pop(name, None)

    def _checked(self, name: str, entry: Any, where: str) -> T:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ConfigError(f"{self.kind} name {name!r} is not a plain word; use letters, digits, '_' or '-', "
                              f"starting with a letter (it becomes {self.key}=<name>)")
        if name in self.reserved:
            raise ConfigError(f"{self.kind} name {name!r} is a config section of its own; choose another name")
        return self._check(name, entry, where) if self._check is not None else entry

    # -- looking up --------------------------------------------------------------------------------------

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """The entry ``name`` (loading the entry points first when it is not registered), else ``default``."""
        if name not in self.entries:
            self.load_entry_points()
        return self.entries.get(name, default)

    def lookup(self, name: str) -> T:
        """The entry ``name``; a one-line ConfigError for an unknown name (with the closest ones) or for an
        installed entry point that failed to load (naming it and its package)."""
        if isinstance(name, str) and name not in self.entries:
            self.load_entry_points()
        if isinstance(name, str) and name in self.entries:
            return self.entries[name]
        if isinstance(name, str) and name in self._broken:
            raise ConfigError(self._broken[name])
        raise ConfigError(self.unknown_message(name))

    def unknown_message(self, name: object) -> str:
        names = self.names()
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
        return (f"{self.key}={shown} is not valid{did_you_mean(name, names)}; choose one of: "
                f"{', '.join(names)}{self.hint}")

    def names(self) -> list[str]:
        """Every name, the built-ins first, then those registered or installed (entry points loaded)."""
        self.load_entry_points()
        return list(self.entries)

    @property
    def choices(self) -> LiveChoices:
        """The names as a live sequence, for an option's ``choices`` (read at each use)."""
        return LiveChoices(self.names)

    def __getitem__(self, name: str) -> T:
        if name not in self.entries:
            self.load_entry_points()
        if name in self.entries:
            return self.entries[name]
        raise KeyError(name)

    def __setitem__(self, name: str, entry: T) -> None:
        self.entries[name] = entry

    def __delitem__(self, name: str) -> None:
        del self.entries[name]

    def __contains__(self, name: object) -> bool:
        if name in self.entries:
            return True
        self.load_entry_points()
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self.entries)})"

    # -- entry points ------------------------------------------------------------------------------------

    def load_entry_points(self) -> None:
        """Load the group's entry points (once per process).

        A name already registered keeps its entry (a warning names the package). An entry point that fails
        to load is remembered: asking for its name raises a one-line ConfigError naming the entry point and
        its package; the other entries work as before.
        """
        if self._loaded:
            return
        self._loaded = True
        for entry in self._entry_points():
            package = package_of(entry)
            if entry.name in self.entries:
                owner = f"the built-in {self.kind}" if self.is_builtin(entry.name) else \
                    f"a {self.kind} registered before"
                print(f"fedhpro: warning: the {self.kind} {entry.name!r} of package {package} is ignored: {owner} "
                      f"has that name (rename the entry point in {package})", file=sys.stderr)
                continue
            try:
                checked = self._checked(entry.name, entry.load(), f"entry point {entry.value!r}")
            except Exception as error:  # any failure of a third-party import is reported, never fatal for others
                reason = (str(error).strip().splitlines() or [""])[0]
                self._broken[entry.name] = (
                    f"{self.kind} {entry.name!r} of package {package} failed to load ({type(error).__name__}: "
                    f"{reason}); fix or reinstall {package} (entry point {entry.name} = {entry.value!r} in group "
                    f"{self.group!r}), or pip uninstall {package}")
                continue
            self.entries[entry.name] = checked

    def _entry_points(self) -> Iterable[importlib.metadata.EntryPoint]:
        return installed_entry_points(self.group) if self.group else ()

    def broken(self) -> dict[str, str]:
        """Name -> the one-line error of each installed entry point that failed to load."""
        self.load_entry_points()
        return dict(self._broken)


#: ``(sys.path, every installed entry point)`` as last read by :func:`installed_entry_points` (what
#: ``importlib.metadata.entry_points()`` gives: SelectableGroups on Python 3.11, EntryPoints after; both select)
_INSTALLED: list[tuple[tuple[str, ...], Any]] = []


def installed_entry_points(group: str) -> importlib.metadata.EntryPoints:
    """The installed entry points of ``group``, as ``importlib.metadata.entry_points(group=group)`` gives them.

    Every installed package's entry points are read once for all groups: each read parses the entry_points.txt of
    every installed package (~4 ms of a start-up for 200 packages), and the five registries each read them for
    their own group. They are read again when ``sys.path`` has changed (a folder of packages added); a package
    installed into a folder already read is seen by a new process."""
    path = tuple(sys.path)
    if not _INSTALLED or _INSTALLED[0][0] != path:
        _INSTALLED[:] = [(path, importlib.metadata.entry_points())]
    return _INSTALLED[0][1].select(group=group)


def package_of(entry: importlib.metadata.EntryPoint) -> str:
    """The distribution that declares ``entry`` (its module's name when unknown)."""
    dist = getattr(entry, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return name or entry.value.split(":")[0].split(".")[0]


def spec_or_factory(loaded: Any, cls: type) -> Any:
    """What an entry point names, as an entry: an instance of ``cls``, or a zero-argument callable's result."""
    return loaded if isinstance(loaded, cls) or not callable(loaded) else loaded()


def checked_spec(name: str, loaded: Any, where: str, cls: type[S], *, path: str, give: str, keys: str,
                 callables: Mapping[str, str] | None = None, optional_options: bool = False,
                 check: Callable[[S, str], None] | None = None) -> S:
    """The spec registered as ``name`` (the ``check`` of a :class:`Registry` of specs): ``loaded``, what
    :meth:`Registry.register` is given or an entry point names (``where`` says which in messages), an instance of
    the dataclass ``cls`` or a zero-argument callable returning one, checked and renamed to ``name``; a one-line
    ConfigError naming the problem and the fix otherwise. Checked, in this order:

    * that it is a ``cls`` (``path``: the class's public dotted name; ``give``: how to make one);
    * that its ``options`` is a dataclass class (``keys``: the config keys its fields become) whose fields all
      have defaults (a run may leave every knob unset); with ``optional_options``, None passes too;
    * that each attribute named in ``callables`` is callable (the value says what it must be);
    * ``check(spec, where)``: the kind's own further checks (raising ConfigError).
    """
    spec: Any = spec_or_factory(loaded, cls)
    if not isinstance(spec, cls):
        raise ConfigError(f"{where} gives a {type(spec).__name__}, not a {path}; give {give}")
    found: Any = spec  # a dataclass with ``name`` and ``options`` (any spec class registered this way)
    kind = cls.__name__
    options = found.options
    if options is not None or not optional_options:
        if not dataclasses.is_dataclass(options) or not isinstance(options, type):
            raise ConfigError(f"{where}: {kind}.options must be a dataclass class ({keys}), got {options!r}")
        try:
            options()
        except TypeError:
            raise ConfigError(f"{where}: every field of {options.__name__} needs a default "
                              "(a run may leave every knob unset)") from None
    for part, what in (callables or {}).items():
        if not callable(getattr(found, part)):
            raise ConfigError(f"{where}: {kind}.{part} must be {what}")
    if check is not None:
        check(spec, where)
    return spec if found.name == name else dataclasses.replace(found, name=name)


__all__ = ["LiveChoices", "NAME", "Registry", "checked_spec", "close_names", "did_you_mean",
           "installed_entry_points", "package_of", "spec_or_factory"]
