"""One registry of named things (methods, data sets, partitioners, models, robust aggregation rules), and their
entry-point groups.

A :class:`Registry` maps a name to an entry. Entries join in three ways:

* built in, in the module that owns the registry (one line each);
* from Python: ``REGISTRY.register("name", entry)`` or ``@REGISTRY.register("name")`` as a decorator;
* from an installed package: an entry point in the registry's group (``fedhpro.methods``,
  ``fedhpro.datasets``, ``fedhpro.partitioners``, ``fedhpro.models``, ``fedhpro.aggregation_rules``), loaded
  lazily, once per process: on the first lookup of a name that is not registered, or when the names are listed.

An entry may also be *declared* (:meth:`Registry.declare`, or a :class:`Declared` that ``register`` or an entry
point is given): its declaration (what a config needs to check its settings: an options class, a description,
recipes) is known at once, its code (``"module:attr"``) is imported on the first lookup of its name. Declarations
never import torch, so ``fedhpro config --keys`` and a refused key answer before torch loads.

The names are read at each use (:meth:`Registry.names`, :attr:`Registry.choices`), never frozen at import,
so a config's ``method=``/``dataset=``/``model=``/``partition=`` accept whatever is registered when it is
read. Every error is one line: an unknown name (with the closest names), a name taken twice, an entry point
that fails to import (naming the entry point and its package).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import importlib.metadata
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Declared:
    """An entry known by its ``declaration`` before its ``code`` is imported.

    ``declaration``: what a config reads of the entry (for a method, a
    :class:`~fedhpro.methods.declaration.MethodDeclaration`; for a robust rule, its options class), from a module
    that does not import torch; ``code``: ``"package.module:attribute"``, the entry itself (what :meth:`Registry.
    register` would be given), imported on the first lookup of the name. Give one to :meth:`Registry.register`, or
    name one from an installed package's entry point, to keep a plug-in's keys torch-free too.
    """

    declaration: Any
    code: str

    def __post_init__(self) -> None:
        module, _, attr = self.code.partition(":")
        if not module or not attr or not all(part.isidentifier() for part in [*module.split("."), *attr.split(".")]):
            raise ConfigError(f"Declared(code={self.code!r}): say where the code is as 'package.module:attribute'")

    def load(self) -> Any:
        """The object ``code`` names (its module imported)."""
        module, _, attr = self.code.partition(":")
        found: Any = importlib.import_module(module)
        for part in attr.split("."):
            found = getattr(found, part)
        return found


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
        declaration_of: ``entry -> declaration``: what :meth:`declared` answers for an entry registered whole
            (not declared); default: the entry itself.
        declaration_type: the class a :class:`Declared`'s declaration must be (given to :meth:`register` or named
            by an entry point; a one-line ConfigError otherwise); a dataclass with a ``name`` field is renamed to
            the name it is registered as. None: any declaration.

    As a mapping it is live: iterating or ``len`` loads the entry points first, ``in`` and ``[name]`` load
    them when ``name`` is not registered yet, ``[name]`` imports a declared entry's code. :attr:`entries` is the
    plain dict underneath (no loading; a declared entry is there once its code is imported).
    """

    def __init__(self, kind: str, group: str | None = None, *, key: str | None = None,
                 check: Callable[[str, Any, str], T] | None = None, hint: str = "",
                 reserved: Iterable[str] = (), declaration_of: Callable[[T], Any] | None = None,
                 declaration_type: type | None = None) -> None:
        self.kind = kind
        self.group = group
        self.key = key or kind
        self.hint = hint
        self.reserved = frozenset(reserved)
        self._check = check
        self._declaration_of = declaration_of
        self._declaration_type = declaration_type
        #: the entries whose code is loaded, in registration order (built-ins first); the registry's own storage
        self.entries: dict[str, T] = {}
        #: the names registered while :meth:`builtin` was in force
        self.builtins: dict[str, T] = {}
        #: every name, in registration order: those of :attr:`entries` and those declared, not loaded yet
        self._order: dict[str, None] = {}
        #: name -> its :class:`Declared` (its code imported or not); the built-in ones also in :attr:`_builtin_names`
        self._declared: dict[str, Declared] = {}
        self._builtin_names: set[str] = set()
        self._loaded = group is None
        #: name -> the one-line error of an entry point that failed to load (raised when the name is asked for)
        self._broken: dict[str, str] = {}

    # -- registering -------------------------------------------------------------------------------------

    @overload
    def register(self, name: str, entry: Any, *, replace: bool = False) -> T: ...

    @overload
    def register(self, name: str, *, replace: bool = False) -> Callable[[Any], Any]: ...

    def register(self, name: str, entry: Any = None, *, replace: bool = False) -> Any:
        """Add ``entry`` as ``name``; returns the registered entry (a :class:`Declared` as it is given: its code is
        imported on the first lookup). Without ``entry``, a decorator.

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
        if name in self._order and not replace:
            taken = f"a built-in {self.kind}" if self.is_builtin(name) else "already registered"
            raise ConfigError(f"{self.kind} {name!r} is {taken}; choose another name or pass replace=True "
                              "to replace it")
        self._put(name, checked)
        self._broken.pop(name, None)
        return checked

    def builtin(self, name: str, entry: T) -> T:
        """Register a built-in ``entry`` (no checks, no entry points loaded): the package's own line."""
        self._put(name, entry)
        self.builtins[name] = entry
        self._builtin_names.add(name)
        return entry

    def declare(self, name: str, declaration: Any, code: str) -> None:
        """Declare a built-in entry: its torch-free ``declaration`` now, its ``code`` (``"module:attr"``, what
        :meth:`builtin` would be given) imported on the first lookup of ``name``: the package's own line."""
        self._put(name, Declared(declaration, code))
        self._builtin_names.add(name)

    def _put(self, name: str, entry: Any) -> None:
        self.unregister(name)
        self._order[name] = None
        if isinstance(entry, Declared):
            self._declared[name] = entry
        else:
            self.entries[name] = entry

    def is_builtin(self, name: str) -> bool:
        """Whether ``name`` is the package's own entry (not replaced by a registered one)."""
        return name in self._builtin_names

    def unregister(self, name: str) -> None:
        for table in (self.entries, self._order, self._declared):
            table.pop(name, None)
        self._builtin_names.discard(name)

    def _checked(self, name: str, entry: Any, where: str) -> Any:
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ConfigError(f"{self.kind} name {name!r} is not a plain word; use letters, digits, '_' or '-', "
                              f"starting with a letter (it becomes {self.key}=<name>)")
        if name in self.reserved:
            raise ConfigError(f"{self.kind} name {name!r} is a config section of its own; choose another name")
        if isinstance(entry, Declared):
            return self._checked_declared(name, entry, where)  # its code is checked when it is imported (_load)
        return self._check(name, entry, where) if self._check is not None else entry

    def _checked_declared(self, name: str, entry: Declared, where: str) -> Declared:
        declaration, wanted = entry.declaration, self._declaration_type
        if wanted is None:
            return entry
        if not isinstance(declaration, wanted):
            raise ConfigError(f"{where}: the declaration of a {self.kind} is a {wanted.__module__}."
                              f"{wanted.__qualname__}, not a {type(declaration).__name__}")
        if dataclasses.is_dataclass(declaration) and getattr(declaration, "name", name) != name:
            return Declared(dataclasses.replace(declaration, name=name), entry.code)  # type: ignore[type-var]
        return entry

    # -- looking up --------------------------------------------------------------------------------------

    def _has(self, name: object) -> bool:
        """Whether ``name`` is registered or declared, the entry points loaded first when it is not."""
        if name not in self._order:
            self.load_entry_points()
        return name in self._order

    def _load(self, name: str) -> T:
        """The entry ``name``, a declared one's code imported and checked on the first call."""
        if name not in self.entries:
            declared = self._declared[name]
            where = f"{self.kind} {name!r} (code {declared.code!r})"
            try:
                loaded = declared.load()
            except (ImportError, AttributeError) as error:
                raise ConfigError(f"{where} cannot be imported ({type(error).__name__}: {error}); fix the "
                                  "declaration's code path or reinstall its package") from None
            entry = self._check(name, loaded, where) if self._check is not None else loaded
            options = getattr(declared.declaration, "options", declared.declaration)
            found = self._declaration_of(entry) if self._declaration_of is not None else entry
            if isinstance(options, type) and getattr(found, "options", found) is not options:
                raise ConfigError(f"{where} has options {getattr(found, 'options', found)!r}, not the declared "
                                  f"{options!r}; declare the options class the code uses")
            self.entries[name] = entry
            if name in self._builtin_names:
                self.builtins[name] = entry
        return self.entries[name]

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """The entry ``name`` (loading the entry points first when it is not registered), else ``default``."""
        return self._load(name) if self._has(name) else default

    def lookup(self, name: str) -> T:
        """The entry ``name`` (a declared entry's code imported); a one-line ConfigError for an unknown name (with
        the closest ones) or for an installed entry point that failed to load (naming it and its package)."""
        if isinstance(name, str) and self._has(name):
            return self._load(name)
        if isinstance(name, str) and name in self._broken:
            raise ConfigError(self._broken[name])
        raise ConfigError(self.unknown_message(name))

    def declared(self, name: str) -> Any:
        """What a config reads of ``name`` without importing its code: the declaration of a declared entry, else
        ``declaration_of`` the entry; the unknown-name error of :meth:`lookup` otherwise."""
        if isinstance(name, str) and self._has(name) and name in self._declared:
            return self._declared[name].declaration
        entry = self.lookup(name)
        return self._declaration_of(entry) if self._declaration_of is not None else entry

    def declarations(self) -> dict[str, Any]:
        """Every name's :meth:`declared` answer, in the order of :meth:`names` (no declared code imported)."""
        return {name: self.declared(name) for name in self.names()}

    @contextlib.contextmanager
    def kept(self) -> Iterator[Registry[T]]:
        """Everything registered or declared, put back as it was after the block (what the block registers,
        replaces or removes is undone; the entry points are read again on the next lookup if they were not yet)."""
        tables: tuple[dict[str, Any], ...] = (self.entries, self.builtins, self._order, self._declared, self._broken)
        saved = [dict(table) for table in tables]
        saved_builtins, saved_loaded = set(self._builtin_names), self._loaded
        try:
            yield self
        finally:
            for table, copy in zip(tables, saved):
                table.clear()
                table.update(copy)
            self._builtin_names = saved_builtins
            self._loaded = saved_loaded

    def builtin_names(self) -> list[str]:
        """The built-in names (declared or registered by :meth:`builtin`), in registration order."""
        return [name for name in self._order if self.is_builtin(name)]

    def is_loaded(self, name: str) -> bool:
        """Whether the code of ``name`` is imported (a declared entry's is not until its first lookup)."""
        return name in self.entries

    def unknown_message(self, name: object) -> str:
        names = self.names()
        shown = repr(name) if len(repr(name)) <= 60 else repr(name)[:57] + "..."
        return (f"{self.key}={shown} is not valid{did_you_mean(name, names)}; choose one of: "
                f"{', '.join(names)}{self.hint}")

    def names(self) -> list[str]:
        """Every name, the built-ins first, then those registered or installed (entry points loaded; no declared
        code imported)."""
        self.load_entry_points()
        return list(self._order)

    @property
    def choices(self) -> LiveChoices:
        """The names as a live sequence, for an option's ``choices`` (read at each use)."""
        return LiveChoices(self.names)

    def __getitem__(self, name: str) -> T:
        if self._has(name):
            return self._load(name)
        raise KeyError(name)

    def __setitem__(self, name: str, entry: T) -> None:
        self._put(name, entry)

    def __delitem__(self, name: str) -> None:
        if name not in self._order:
            raise KeyError(name)
        self.unregister(name)

    def __contains__(self, name: object) -> bool:
        return self._has(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._order)})"

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
            if entry.name in self._order:
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
            self._put(entry.name, checked)

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


__all__ = ["Declared", "LiveChoices", "NAME", "Registry", "checked_spec", "close_names", "did_you_mean",
           "installed_entry_points", "package_of", "spec_or_factory"]
