"""Result files a person can open: atomic JSON/YAML/JSONL writes (through :mod:`fedhpro.files`), tables
and PNG plots.

:mod:`.tables` formats Markdown/CSV tables, :mod:`.plots` draws curves, bars, sweeps and t-SNE
scatters, :mod:`.runs` reads finished runs back and builds ``fedhpro report``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from fedhpro.bounded import read_jsonl_file
from fedhpro.errors import DataError
from fedhpro.files import strict_json, write_atomic  # the writers, kept importable from here
from fedhpro.files import write_atomic_with as write_atomic_with


def write_json(path: str | os.PathLike, value: Any) -> None:
    """``value`` as strict JSON (non-finite floats as null: :func:`fedhpro.files.strict_json`), atomically."""
    write_atomic(path, strict_json(value, indent=2, sort_keys=False) + "\n")


def write_yaml(path: str | os.PathLike, value: Any) -> None:
    write_atomic(path, yaml.safe_dump(value, sort_keys=False))


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict[str, Any]]) -> None:
    """The whole file, rewritten atomically (rows are few: one per round); each row strict JSON."""
    write_atomic(path, "".join(strict_json(row) + "\n" for row in rows))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``.jsonl`` file of a run folder (``[]`` when there is none yet), read within fedhpro's
    bounds (:func:`fedhpro.bounded.read_jsonl_file`); a damaged file, or a row whose ``round`` is not a whole
    number, is one :class:`~fedhpro.errors.DataError` line."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = read_jsonl_file(path, DataError)
    for number, row in enumerate(rows, 1):
        if "round" in row and not is_count(row["round"]):
            raise DataError(f"{path} row {number}: round is {row['round']!r}, not a whole number >= 0; the file is "
                            "damaged: replace it or delete the run folder")
    return rows


def is_count(value: Any) -> bool:
    """Whether ``value`` is a whole number >= 0 (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def accuracy_table(accuracy: dict[str, float], title: str = "") -> str:
    """A two-row text table: domains then AVG, in percent with two decimals (as the paper prints)."""
    names = [name for name in accuracy if name != "AVG"] + ["AVG"]
    widths = [max(len(name), 6) for name in names]
    head = "  ".join(name.rjust(w) for name, w in zip(names, widths))
    values = "  ".join(f"{accuracy[name]:.2f}".rjust(w) for name, w in zip(names, widths))
    return (f"{title}\n" if title else "") + head + "\n" + values

