"""Bounded parsing of untrusted YAML and JSON text (config values, config files, every file of a run folder).

Every YAML and JSON read of fedhpro goes through :func:`load_yaml` / :func:`load_json` (or the file readers
:func:`read_yaml_file`, :func:`read_json_file`, :func:`read_jsonl_file`), so that text from a user, a run
folder or the network cannot hang or exhaust the process:

* the text is at most :data:`MAX_YAML_CHARS` / :data:`MAX_JSON_CHARS` characters (a file's size in bytes
  is checked before it is read);
* YAML is composed with PyYAML's ``SafeLoader`` (no Python objects, no code) by :class:`BoundedLoader`, which
  counts while it composes: at most :data:`MAX_ALIASES` aliases, at most :data:`MAX_NODES` nodes *as a tree*
  (an alias counts the whole subtree it stands for, so ten levels of ten aliases, a "billion laughs", are
  refused after a few dozen nodes instead of being walked a billion times by whatever reads the value),
  at most :data:`MAX_DEPTH` levels of nesting (aliases expanded too), and no alias to a node that contains it
  (a recursive value, which every later walk of it would follow forever);
* JSON is at most :data:`MAX_DEPTH` levels deep (Python's own parser stops only at its recursion limit, and
  every later walk of the value would hit it again).

A bound exceeded is a :class:`LimitError`: a one-line :class:`~fedhpro.errors.ConfigError` naming the text,
the bound and the fix. :func:`load_yaml` / :func:`load_json` otherwise raise what ``yaml.safe_load`` /
``json.loads`` raise on text that is not YAML / JSON; the file readers turn every failure into one line of
the caller's error class.

This module imports only :mod:`fedhpro.errors`, so every other module can use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from fedhpro.errors import ConfigError, DataError, FedHProError

#: the most characters of YAML text read: configs, run settings, reproduce targets are a few KB; PyYAML is
#: pure Python (about a MB a second), so this also bounds the time a valid file takes
MAX_YAML_CHARS = 8 * 2**20
#: the most characters of JSON text read: a partition.json of 8 million samples' indices fits; parsed, such a
#: text can take about 20 times its size in memory, so this also bounds the memory a hostile file can claim
MAX_JSON_CHARS = 64 * 2**20
#: the most aliases (``*name``) in one YAML text: fedhpro's own config.yaml holds a few at most
MAX_ALIASES = 1000
#: the most nodes of one YAML text counted as a tree (each alias as the subtree it stands for): what every
#: walk of the value (validation, copies, reports) visits; a config of 100,000 class names fits
MAX_NODES = 1_000_000
#: the deepest nesting of lists and mappings in one YAML or JSON text, ``[[1]]`` being 2 (fedhpro's files nest
#: a few levels)
MAX_DEPTH = 100


class LimitError(ConfigError):
    """YAML or JSON text beyond one of fedhpro's bounds (size, aliases, nodes, depth): one line."""


def limit_from_environment(variable: str, default: int, most: str) -> int:
    """A size limit an environment variable may set: ``$variable`` when set (a whole number >= 1), else
    ``default``; anything else is a one-line ConfigError saying it should be ``most`` (what the limit counts,
    e.g. "bytes a file may declare")."""
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 2**62):
        raise ConfigError(f"{variable}={text[:40]!r} is not a whole number >= 1; set it to the most {most} "
                          f"(e.g. {default}) or unset it")
    return int(text)


def _name(where: str | None, kind: str) -> str:
    return where or f"the {kind} text"


class BoundedLoader(yaml.SafeLoader):
    """PyYAML's ``SafeLoader`` that counts, while it composes the node graph, the aliases, the nodes as a
    tree (an alias adds the size of the subtree it refers to) and the nesting depth as a tree (an alias
    reaches as deep below it as its subtree does), and stops with a :class:`LimitError` at the first bound
    exceeded: nothing is ever expanded."""

    def __init__(self, stream: str, where: str | None = None, *, max_aliases: int = MAX_ALIASES,
                 max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH):
        super().__init__(stream)
        self.where = _name(where, "YAML")
        self.max_aliases, self.max_nodes, self.max_depth = max_aliases, max_nodes, max_depth
        self.aliases = 0
        self.nodes = 0  # counted as a tree: what a walk of the constructed value visits
        self.depth = 0  # of the list or mapping being composed
        self.deepest = 0  # the deepest level reached below the node being composed, aliases expanded
        #: id(node) -> (its size, its height) as a tree, for every node fully composed (an alias adds them again)
        self.sizes: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)  # the anchored node (PyYAML refuses an unknown name)
            self.aliases += 1
            if self.aliases > self.max_aliases:
                raise LimitError(f"{self.where} holds more than {self.max_aliases} YAML aliases (*name); write "
                                 "the values out, or use fewer aliases")
            known = self.sizes.get(id(node))
            if known is None:  # its anchor's node is still being composed: the alias is inside it
                raise LimitError(f"{self.where} has an alias inside the value it refers to (line "
                                 f"{mark.line + 1}), a value that contains itself; write the value out")
            size, height = known
            self._reach(self.depth + height)  # the subtree it stands for, placed here
            self._add(size)
            return node
        if self.check_event(yaml.ScalarEvent):  # a leaf: no level of nesting (as json_depth counts)
            node = super().compose_node(parent, index)
            self._add(1)
            self.sizes[id(node)] = (1, 0)
            return node
        self.depth += 1
        self._reach(self.depth)
        outer, self.deepest = self.deepest, self.depth
        before = self.nodes
        node = super().compose_node(parent, index)
        height = self.deepest - self.depth + 1
        self.deepest = max(outer, self.deepest)
        self.depth -= 1
        self._add(1)
        self.sizes[id(node)] = (self.nodes - before, height)
        return node

    def _reach(self, depth: int) -> None:
        if depth > self.max_depth:
            raise LimitError(f"{self.where} nests lists and mappings more than {self.max_depth} levels deep"
                             f"{' once its YAML aliases (*name) are expanded' if self.aliases else ''}; flatten it")
        self.deepest = max(self.deepest, depth)

    def _add(self, count: int) -> None:
        self.nodes += count
        if self.nodes > self.max_nodes:
            raise LimitError(f"{self.where} holds more than {self.max_nodes:,} values once its YAML aliases "
                             "(*name) are expanded; write it without aliases of aliases")


def _text(text: str | bytes, where: str | None, kind: str, limit: int) -> str:
    """``text`` as a str within ``limit`` characters (bytes decoded as UTF-8, refused in one line if not)."""
    if len(text) > limit:
        raise LimitError(f"{_name(where, kind)} is {len(text):,} characters long, over fedhpro's limit of "
                         f"{limit:,}; shorten it")
    if isinstance(text, bytes):
        try:
            return text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise LimitError(f"{_name(where, kind)} is not UTF-8 text (byte 0x{text[error.start]:02x} at offset "
                             f"{error.start}); save it as UTF-8") from None
    return text


def load_yaml(text: str | bytes, where: str | None = None, *, max_chars: int = MAX_YAML_CHARS,
              max_aliases: int = MAX_ALIASES, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH) -> Any:
    """``yaml.safe_load`` of ``text`` within fedhpro's bounds (:class:`BoundedLoader`); ``where`` names the
    text in messages. A bound exceeded is a one-line :class:`LimitError`; text that is not YAML raises what
    ``yaml.safe_load`` raises (``yaml.YAMLError``, ``ValueError`` for a number past Python's digit limit)."""
    text = _text(text, where, "YAML", max_chars)
    loader = BoundedLoader(text, where, max_aliases=max_aliases, max_nodes=max_nodes, max_depth=max_depth)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def json_depth(value: Any, limit: int) -> int:
    """How deep lists and mappings nest in ``value`` (a scalar: 0), counted up to ``limit + 1`` (a value
    nested deeper is not walked further). Iterative: any depth is measured without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        depth += 1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                return deepest
        stack.extend((child, depth) for child in children if isinstance(child, (dict, list)))
    return deepest


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def load_json(text: str | bytes, where: str | None = None, *, max_chars: int = MAX_JSON_CHARS,
              max_depth: int = MAX_DEPTH, allow_nan: bool = True) -> Any:
    """``json.loads`` of ``text`` within fedhpro's bounds (at most ``max_chars`` characters and ``max_depth``
    levels of nesting); ``where`` names the text in messages. A bound exceeded is a one-line
    :class:`LimitError`; text that is not JSON raises ``ValueError`` as ``json.loads`` does (with
    ``allow_nan=False`` also for ``NaN``, ``Infinity`` and ``-Infinity``, which strict JSON does not have)."""
    text = _text(text, where, "JSON", max_chars)
    try:
        value = json.loads(text) if allow_nan else json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        value = None
        deep = True
    else:
        deep = json_depth(value, max_depth) > max_depth
    if deep:
        raise LimitError(f"{_name(where, 'JSON')} nests lists and objects more than {max_depth} levels deep; "
                         "flatten it")
    return value


# ---------------------------------------------------------------------------- files, every failure one line


def _first_line(error: BaseException) -> str:
    return ((str(error).strip().splitlines() or [type(error).__name__])[0])[:160]


def read_bounded(path: str | os.PathLike, limit: int, error: type[FedHProError] = ConfigError,
                 what: str | None = None) -> str:
    """The UTF-8 text of the file ``path``, at most ``limit`` bytes (checked before reading, and while
    reading: a file that grows is cut there and refused). Missing, unreadable, too large or not UTF-8: one
    line of ``error``."""
    path = Path(path)
    name = what or str(path)

    def too_large(size: int) -> FedHProError:
        return error(f"{name} is {size:,} bytes, over fedhpro's limit of {limit:,}; it is not a file fedhpro "
                     "wrote: replace it")

    try:
        size = path.stat().st_size
        if size > limit:
            raise too_large(size)
        with open(path, "rb") as handle:
            raw = handle.read(limit + 1)
    except OSError as problem:
        raise error(f"{name} cannot be read ({problem.strerror or type(problem).__name__})") from None
    if len(raw) > limit:
        raise too_large(len(raw))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as problem:
        raise error(f"{name} is not UTF-8 text (byte 0x{raw[problem.start]:02x} at offset {problem.start}); it "
                    "is damaged: replace it") from None


def read_yaml_file(path: str | os.PathLike, error: type[FedHProError] = ConfigError,
                   what: str | None = None) -> Any:
    """The value of the YAML file ``path`` (:func:`load_yaml`); every failure is one line of ``error``
    naming the file (``what``, default its path)."""
    name = what or str(path)
    text = read_bounded(path, MAX_YAML_CHARS, error, name)
    try:
        return load_yaml(text, name)
    except LimitError as problem:
        raise error(str(problem)) from None
    except yaml.MarkedYAMLError as problem:
        mark = problem.problem_mark or problem.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = f" ({problem.problem})" if problem.problem else ""
        raise error(f"{name} is not valid YAML{at}{reason}; fix or replace it".replace("\n", " ")) from None
    except (yaml.YAMLError, ValueError, OverflowError, TypeError, RecursionError) as problem:
        raise error(f"{name} is not valid YAML ({_first_line(problem)}); fix or replace it") from None


def read_json_file(path: str | os.PathLike, error: type[FedHProError] = ConfigError,
                   what: str | None = None) -> Any:
    """The value of the JSON file ``path`` (:func:`load_json`); every failure is one line of ``error``
    naming the file (``what``, default its path)."""
    name = what or str(path)
    return parse_json(read_bounded(path, MAX_JSON_CHARS, error, name), name, error)


def parse_json(text: str | bytes, where: str, error: type[FedHProError] = ConfigError) -> Any:
    """:func:`load_json` of ``text`` with every failure one line of ``error`` naming ``where``."""
    try:
        return load_json(text, where)
    except LimitError as problem:
        raise error(str(problem)) from None
    except ValueError as problem:  # json.JSONDecodeError, a number past Python's digit limit
        raise error(f"{where} is not valid JSON ({_first_line(problem)}); it is damaged: replace it") from None


def read_jsonl_file(path: str | os.PathLike, error: type[FedHProError] = ConfigError,
                    what: str | None = None) -> list[dict[str, Any]]:
    """The rows of the JSON-lines file ``path`` (one JSON object a line, blank lines skipped); every failure
    (a line that is not a JSON object included) is one line of ``error`` naming the file and the line."""
    name = what or str(path)
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(read_bounded(path, MAX_JSON_CHARS, error, name).splitlines(), 1):
        if not line.strip():
            continue
        row = parse_json(line, f"{name} line {number}", error)
        if not isinstance(row, dict):
            raise error(f"{name} line {number} holds a JSON {type(row).__name__}, not an object; it is damaged: "
                        "replace it")
        rows.append(row)
    return rows


def run_file(folder: str | os.PathLike, name: str, error: type[FedHProError] = DataError) -> Path:
    """``folder / name``: a file fedhpro writes into a run folder under a fixed name (``model.json``,
    ``summary.json``, ``metrics.jsonl``, ...), refused in one line of ``error`` when it resolves (symbolic
    links followed) outside the resolved ``folder``: a run folder is untrusted input, and a link in it would
    make fedhpro read, and show, a file from elsewhere. A link that stays inside the folder is its file."""
    folder = Path(folder)
    target = folder / name
    try:
        root, resolved = folder.resolve(), target.resolve()
    except (OSError, RuntimeError):  # a loop of symbolic links
        raise error(f"{target} is a symbolic link that cannot be resolved; a run folder's files are its own: "
                    "replace the link by the file") from None
    if not resolved.is_relative_to(root):
        raise error(f"{target} is a symbolic link that leads outside the run folder (to {resolved}); a run "
                    "folder's files are its own: replace the link by the file")
    return target


#: what a reader of a metrics.jsonl row relies on: key -> the keys of its mapping that must be numbers (None:
#: the value itself is a number)
_ROW_NUMBERS: dict[str, tuple[str, ...] | None] = {
    "bytes_up": None, "bytes_down": None, "params_up": None, "flops_train": None,
    "fairness": ("worst_10", "best_10", "mean", "std"),
}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_metrics_row(row: Any, where: str, error: type[FedHProError] = DataError) -> None:
    """One line of ``error`` unless what a report or a resumed run reads of the metrics.jsonl row ``row`` has
    the type the engines write (``round``, ``accuracy``, ``fairness``, the byte and FLOP counts, the server's
    and the prototype distances' numbers): a run folder is untrusted input (a damaged or hand-edited file)."""
    def bad(key: str, expected: str) -> FedHProError:
        return error(f"{where}: {key} is not {expected}; the file is damaged: replace it or delete the run folder")

    if not isinstance(row, dict):
        raise error(f"{where} is a {type(row).__name__}, not a row of metrics; the file is damaged: replace it or "
                    "delete the run folder")
    round_ = row.get("round")
    if not (isinstance(round_, int) and not isinstance(round_, bool) and round_ >= 0):
        raise bad("round", "a whole number >= 0")
    if "accuracy" in row:
        accuracy = row["accuracy"]
        if not (isinstance(accuracy, dict) and "AVG" in accuracy and all(map(_is_number, accuracy.values()))):
            raise bad("accuracy", "a mapping of test sets (and AVG) to numbers")
    for key, inner in _ROW_NUMBERS.items():
        if key not in row:
            continue
        value = row[key]
        if inner is None and not _is_number(value):
            raise bad(key, "a number")
        if inner is not None and not (isinstance(value, dict)
                                      and all(name in value and _is_number(value[name]) for name in inner)):
            raise bad(key, f"a mapping with the numbers {', '.join(inner)}")
    server = row.get("server", {})
    if not isinstance(server, dict):
        raise bad("server", "a mapping")
    numbers = [name for name in ("gm_loss_after", "hyper_movement") if name in server]
    if "gm_loss_before" in server:
        numbers += ["gm_loss_before", "gm_loss_after"]
    if not all(name in server and _is_number(server[name]) for name in numbers):
        raise bad("server", "a mapping whose gm_loss_before, gm_loss_after and hyper_movement are numbers")
    distances = row.get("prototype_distance", {})
    if not (isinstance(distances, dict) and all(
            isinstance(distances[source], dict) and _is_number(distances[source].get("l2"))
            and isinstance(distances[source].get("kind", ""), str)
            for source in ("server", "clients_mean") if source in distances)):
        raise bad("prototype_distance", "a mapping of sources to their l2 distance")


__all__ = ["MAX_ALIASES", "MAX_DEPTH", "MAX_JSON_CHARS", "MAX_NODES", "MAX_YAML_CHARS", "BoundedLoader", "LimitError",
           "check_metrics_row", "json_depth", "load_json", "load_yaml", "parse_json", "read_bounded", "read_json_file",
           "read_jsonl_file", "read_yaml_file", "run_file"]
