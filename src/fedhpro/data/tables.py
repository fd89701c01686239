"""Tabular own data: CSV files read with :func:`pandas.read_csv`, and pandas DataFrames, as rows of features
and labels.

A table's **label column** is ``data.label_column`` (default ``label``); every other column is a feature,
except the site and split columns of a table that holds several sites (``data.site_column``, default
``site``; ``data.split_column``, default ``split``). Features must be numbers (integers, floats or
booleans; they become float32, as float features of a ``.npz`` do); a column of text is refused in one
line naming it, and so is a missing (NaN, an empty cell, ``NA``) or infinite value, with the column and
the number of rows. Labels are integers (class indices, as ``y`` of a ``.npz``) or names (text such as
``benign``), which :mod:`fedhpro.data.clients` maps to classes.

What a file can make fedhpro allocate is bounded as a ``.npz``'s is (:mod:`fedhpro.arrays`): the file's
bytes, and its rows times columns as float32, may not exceed ``FEDHPRO_MAX_ARRAY_BYTES`` (1 GiB); the
header is read first, a bounded line, then the file's lines are counted (streamed, a chunk at a time), so that a
file with more rows than the bound is refused before any row is held; only a file within it is parsed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedhpro.arrays import MAX_ARRAY_BYTES_VARIABLE, max_array_bytes
from fedhpro.errors import DataError

#: the longest header line read (a million characters: tens of thousands of named columns)
MAX_HEADER_CHARS = 1 << 20
#: the most columns a table may have
MAX_COLUMNS = 100_000
#: the bytes read at a time when a file's lines are counted, and the rows parsed at a time when they must be
#: counted by the parser (a file with quoted fields, whose cells may hold line breaks)
COUNT_CHUNK_BYTES = 1 << 20
COUNT_CHUNK_ROWS = 1 << 14
#: pandas 2 parses floats exactly only when asked to (its default parser may be off by one unit in the last
#: place); pandas 3 parses them exactly by default and deprecates the argument
EXACT_FLOATS: dict[str, Any] = {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}
#: the split column's values: which rows train and which test (compared case-folded)
SPLIT_VALUES = {"train": "train", "training": "train", "test": "test", "testing": "test"}


@dataclass
class Rows:
    """One table's rows: float32 ``N x F`` features, the N labels as the table holds them (int64 class
    indices or an object array of names), the feature columns' names and where the rows come from."""

    x: np.ndarray
    labels: np.ndarray
    columns: list[str]
    where: str

    @property
    def named(self) -> bool:
        """Whether the labels are names (text), not class indices."""
        return self.labels.dtype == object


@dataclass
class SiteRows:
    """One site of a table that holds several: its name, training rows and test rows (None: no test rows)."""

    name: str
    train: Rows
    test: Rows | None


def read_csv(path: str | os.PathLike) -> pd.DataFrame:
    """The table in the CSV file ``path``, read by :func:`pandas.read_csv` (exact float parsing), bounded:
    the file's size and its rows times columns (as float32) at most ``FEDHPRO_MAX_ARRAY_BYTES``; one
    DataError line for a file that is not there, too large, or not a CSV."""
    path = Path(path)
    limit = max_array_bytes()
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            header = handle.readline(MAX_HEADER_CHARS + 1)
    except OSError as error:
        raise DataError(f"cannot read {path} ({error.strerror or error}); give a CSV file") from None
    if size > limit:
        raise DataError(f"{path} holds {size:,} bytes, over fedhpro's limit of {limit:,} for one data file; split "
                        f"the rows over several sites or set {MAX_ARRAY_BYTES_VARIABLE}=BYTES")
    if len(header) > MAX_HEADER_CHARS:
        raise DataError(f"{path}: its first line is longer than {MAX_HEADER_CHARS:,} characters; give a CSV file "
                        "whose first line names the columns")
    columns = header.count(b",") + 1
    if columns > MAX_COLUMNS:
        raise DataError(f"{path}: its header names {columns:,} columns, more than {MAX_COLUMNS:,}; give fewer "
                        "feature columns")
    max_rows = max(1, limit // (4 * columns))
    try:
        over = _more_rows_than(path, max_rows)
        frame = None if over else pd.read_csv(path, nrows=max_rows + 1, low_memory=False, **EXACT_FLOATS)
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError, OSError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise DataError(f"cannot read {path} as CSV ({reason}); give a comma-separated file whose first line "
                        "names the columns") from None
    if frame is None or len(frame) > max_rows:
        raise DataError(f"{path} has more than {max_rows:,} rows of {columns} columns, over fedhpro's limit of "
                        f"{limit:,} bytes of float32 values for one data file; split the rows over several sites or "
                        f"set {MAX_ARRAY_BYTES_VARIABLE}=BYTES")
    return frame


def _more_rows_than(path: Path, max_rows: int) -> bool:
    """Whether the CSV ``path`` has more than ``max_rows`` data rows, found without holding them: its line breaks
    counted a chunk at a time (every row ends in one), and where that count is over but may overstate the rows
    (a quoted cell can hold a line break, a blank line is no row), the rows counted by the parser a chunk at a
    time."""
    breaks, unsure, tail = 0, False, b""
    with path.open("rb") as handle:
        while chunk := handle.read(COUNT_CHUNK_BYTES):
            # a lone "\r" ends a line too (old Mac files): the larger count bounds the rows either way
            breaks += max(chunk.count(b"\n"), chunk.count(b"\r"))
            if not unsure:  # a blank line may straddle two chunks: their seam is looked at too
                seam = tail + chunk[:2]
                unsure = b'"' in chunk or any(blank in part for part in (chunk, seam)
                                              for blank in (b"\n\n", b"\r\r", b"\n\r\n"))
            tail = chunk[-2:]
    lines = breaks + (1 if tail[-1:] not in (b"", b"\n", b"\r") else 0)  # the last line may have no line break
    if lines - 1 <= max_rows:
        return False
    if not unsure:
        return True
    rows = 0
    with pd.read_csv(path, chunksize=COUNT_CHUNK_ROWS, usecols=[0], dtype=str, low_memory=True) as chunks:
        for part in chunks:
            rows += len(part)
            if rows > max_rows:
                return True
    return False


def read_csv_header(path: str | os.PathLike) -> list[str]:
    """The column names of the CSV file ``path``: its first line (bounded), through pandas."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            header = handle.readline(MAX_HEADER_CHARS + 1)
    except OSError as error:
        raise DataError(f"cannot read {path} ({error.strerror or error}); give a CSV file") from None
    if len(header) > MAX_HEADER_CHARS or header.count(b",") + 1 > MAX_COLUMNS:
        raise DataError(f"{path}: its first line is longer than {MAX_HEADER_CHARS:,} characters or names more than "
                        f"{MAX_COLUMNS:,} columns; give a CSV file whose first line names the columns")
    try:
        return [str(c) for c in pd.read_csv(path, nrows=0).columns]
    except (ValueError, pd.errors.ParserError, UnicodeDecodeError, OSError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise DataError(f"cannot read {path} as CSV ({reason}); give a comma-separated file") from None


def check_frame(frame: Any, where: str) -> pd.DataFrame:
    """``frame`` if it is a DataFrame with unique text column names; else one DataError line."""
    if not isinstance(frame, pd.DataFrame):
        raise DataError(f"{where} is a {type(frame).__name__}, not a pandas DataFrame; give a DataFrame")
    names = [str(c) for c in frame.columns]
    repeated = sorted({c for c in names if names.count(c) > 1})
    if repeated:
        raise DataError(f"{where} has the column names {repeated} more than once; give every column its own name")
    limit = max_array_bytes()
    if frame.shape[0] * max(1, frame.shape[1]) * 4 > limit:
        raise DataError(f"{where} has {frame.shape[0]:,} rows of {frame.shape[1]} columns, over fedhpro's limit "
                        f"of {limit:,} bytes of float32 values for one data set; set {MAX_ARRAY_BYTES_VARIABLE}=BYTES")
    return frame


def frame_rows(frame: pd.DataFrame, where: str, label_column: str, skip: Sequence[str] = ()) -> Rows:
    """The rows of ``frame``: its ``label_column`` as labels, every other column but ``skip`` as float32
    features, each checked (numbers only, no missing or infinite value): one DataError line naming the
    column otherwise."""
    frame = check_frame(frame, where)
    names = [str(c) for c in frame.columns]
    if label_column not in names:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise DataError(f"{where} has no label column {label_column!r} (its columns: {shown}); name the label "
                        "column with data.label_column=NAME")
    features = [c for c in names if c != label_column and c not in skip]
    if not features:
        raise DataError(f"{where} has no feature column besides {label_column!r}; give at least one column of "
                        "numbers")
    frame = frame.set_axis(names, axis=1)
    x = feature_matrix(frame, features, where)
    return Rows(x, _label_values(frame[label_column], label_column, where, frame),
                features, where)


def feature_matrix(frame: pd.DataFrame, features: Sequence[str], where: str) -> np.ndarray:
    """The ``features`` columns of ``frame`` (its column names as text) as float32 ``N x F``; one DataError line
    naming a column of text, a missing value or a number beyond float32."""
    if not len(frame):  # a header without rows: pandas cannot tell the columns' types
        return np.empty((0, len(features)), dtype=np.float32)
    for name in features:
        column = frame[name]
        if not (pd.api.types.is_numeric_dtype(column) or pd.api.types.is_bool_dtype(column)):
            text = column[~column.map(_is_number)]
            first = f" ({text.iloc[0]!r} in data row {_row(frame, text.index[0])})" if len(text) else ""
            raise DataError(f"{where}: column {name!r} holds text{first}, not numbers; feature columns must be "
                            "numbers: map it to numbers (e.g. pandas.get_dummies) or drop it")
        _refuse_missing(column, name, where, frame)
    x = frame[list(features)].to_numpy(dtype=np.float64)
    if not bool(np.isfinite(x).all()):
        bad = ~np.isfinite(x)
        index = int(bad.any(axis=0).argmax())
        raise DataError(f"{where}: column {features[index]!r} holds {int(bad[:, index].sum())} infinite values; "
                        "clean the data")
    with np.errstate(over="ignore"):
        x32 = x.astype(np.float32)
    if not bool(np.isfinite(x32).all()):
        column = features[int((~np.isfinite(x32)).any(axis=0).argmax())]
        raise DataError(f"{where}: column {column!r} holds values beyond float32's range; rescale the column")
    return np.ascontiguousarray(x32)


def label_names(labels: np.ndarray) -> list[str]:
    """The distinct names among ``labels`` (an object array of names), sorted."""
    return sorted(str(name) for name in pd.unique(labels))


def name_codes(labels: np.ndarray, classes: Sequence[str]) -> np.ndarray:
    """int64 indices of ``labels`` (an object array of names) in ``classes``; -1 for a name not among them."""
    return np.asarray(pd.Categorical(labels, categories=list(classes)).codes, dtype=np.int64)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def _row(frame: pd.DataFrame, index: Any) -> int:
    """The 1-based position of the row labelled ``index`` among the data rows (the header not counted)."""
    return int(frame.index.get_loc(index)) + 1 if frame.index.is_unique else 0


def _refuse_missing(column: pd.Series, name: str, where: str, frame: pd.DataFrame) -> None:
    missing = column.isna()
    if bool(missing.any()):
        rows = [_row(frame, i) for i in column.index[missing][:3]]
        count = int(missing.sum())
        shown = ", ".join(map(str, rows)) + (", ..." if count > 3 else "")
        raise DataError(f"{where}: column {name!r} has {count} missing value{'s' if count != 1 else ''} (data rows "
                        f"{shown}); fill them (e.g. DataFrame.fillna) or drop those rows")


def _label_values(column: pd.Series, name: str, where: str, frame: pd.DataFrame) -> np.ndarray:
    """The labels: int64 class indices (a column of whole numbers) or an object array of names (text)."""
    _refuse_missing(column, name, where, frame)
    if not len(column):  # no rows: no label to tell names from indices
        return np.empty(0, dtype=np.int64)
    if pd.api.types.is_bool_dtype(column):
        return column.to_numpy(dtype=np.int64, copy=True)
    if pd.api.types.is_integer_dtype(column):
        return column.to_numpy(dtype=np.int64, copy=True)
    if pd.api.types.is_float_dtype(column):
        values = column.to_numpy(dtype=np.float64)
        if not bool(np.all(np.isfinite(values) & (values == np.round(values)))):
            raise DataError(f"{where}: label column {name!r} holds numbers that are not whole; labels are class "
                            "indices 0..C-1 or class names")
        if values.size and float(np.abs(values).max()) > 2.0 ** 53:
            raise DataError(f"{where}: label column {name!r} holds labels beyond 2**53; labels are class indices "
                            "0..C-1 or class names")
        return values.astype(np.int64)
    names = column.astype(str).str.strip().to_numpy(dtype=object)
    empty = [_row(frame, i) for i in column.index[names == ""][:3]]
    if empty:
        raise DataError(f"{where}: label column {name!r} has empty labels (data rows {', '.join(map(str, empty))}); "
                        "give every row its class")
    return names


# --------------------------------------------------------------------------- one table, several sites


def is_table(data_dir: str | os.PathLike | None) -> bool:
    """Whether ``data_dir`` is one table of several sites: a ``.csv`` file, or a folder holding
    ``train.csv`` itself (rather than one folder per site)."""
    if not data_dir:
        return False
    path = Path(data_dir).expanduser()
    return (path.is_file() and path.suffix.lower() == ".csv") or (path.is_dir() and (path / "train.csv").is_file())


def table_sites(data_dir: str | os.PathLike, label_column: str, site_column: str,
                split_column: str) -> list[SiteRows]:
    """The sites of one table: ``data_dir`` a CSV file with a site and a split column (``train``/``test``),
    or a folder with ``train.csv`` and, optionally, ``test.csv``, each with a site column."""
    path = Path(data_dir).expanduser()
    if path.is_file():
        frame = read_csv(path)
        return split_sites(frame, None, str(path), label_column, site_column, split_column)
    train = read_csv(path / "train.csv")
    test = read_csv(path / "test.csv") if (path / "test.csv").is_file() else None
    return split_sites(train, test, str(path / "train.csv"), label_column, site_column, None,
                       test_where=str(path / "test.csv"))


def split_sites(train: pd.DataFrame, test: pd.DataFrame | None, where: str, label_column: str, site_column: str,
                split_column: str | None, test_where: str = "the test table") -> list[SiteRows]:
    """One :class:`SiteRows` per value of ``site_column``, sorted by name (as client folders are): the rows
    of ``train`` (split by ``split_column`` when given) and of ``test``."""
    train = check_frame(train, where)
    frames: dict[str, pd.DataFrame] = {}
    if split_column is not None:
        _require(train, split_column, where, "split",
                 "give each row train or test in it, or give a folder with train.csv and test.csv")
        _refuse_missing(train[split_column], split_column, where, train)
        split = train[split_column].map(lambda value: SPLIT_VALUES.get(str(value).strip().casefold()))
        if bool(split.isna().any()):
            odd = train[split_column][split.isna()].iloc[0]
            raise DataError(f"{where}: split column {split_column!r} holds {odd!r}; give train or test for each row")
        frames["train"] = train[split == "train"]
        frames["test"] = train[split == "test"]
        skip = [site_column, split_column]
    else:
        frames["train"] = train
        if test is not None:
            frames["test"] = check_frame(test, test_where)
        skip = [site_column]
    names: dict[str, dict[str, pd.DataFrame]] = {}
    for part, frame in frames.items():
        source = test_where if part == "test" and split_column is None else where
        _require(frame, site_column, source, "site", "name each row's site in it")
        _refuse_missing(frame[site_column], site_column, source, frame)
        sites = frame[site_column].map(_site_name)
        for name, rows in frame.groupby(sites, sort=False):
            names.setdefault(str(name), {})[part] = rows
    only_test = sorted(name for name, parts in names.items() if "train" not in parts)
    if only_test:
        raise DataError(f"{where}: sites {only_test} have test rows but no training rows; give each site training "
                        "rows, or drop those rows")
    result = []
    for name in sorted(names):
        parts = names[name]
        site_where = f"{where} (site {name})"
        rows = {part: frame_rows(frame, site_where + ("" if part == "train" else " test rows"), label_column,
                                 skip) for part, frame in parts.items() if part == "train" or len(frame)}
        result.append(SiteRows(name, rows["train"], rows.get("test")))
    if not result:
        raise DataError(f"{where} has no rows; give at least one site's training rows")
    return result


def _site_name(value: Any) -> str:
    """A site column's value as a site name: whole floats without ``.0`` (a column with a gap reads as floats)."""
    if isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        return str(int(value))
    return str(value).strip()


def _require(frame: pd.DataFrame, column: str, where: str, what: str, fix: str) -> None:
    names = [str(c) for c in frame.columns]
    if column not in names:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        raise DataError(f"{where} has no {what} column {column!r} (its columns: {shown}); {fix} (or name the "
                        f"column with data.{what}_column=NAME)")


def frames_sites(data: Any, test: Any, label_column: str, site_column: str,
                 split_column: str | None) -> list[SiteRows]:
    """The sites of DataFrames given from Python: ``data`` a mapping site name -> DataFrame (or ->
    ``(train, test)`` DataFrames, ``test`` None for a site without one), else one DataFrame with a site
    column (and a split column, or the test rows in ``test``, a DataFrame with the same site column)."""
    if isinstance(data, Mapping):
        if test is not None:
            raise DataError("give the sites' test rows with their training rows: {site: (train, test)}, not test=")
        sites = []
        names = [str(name) for name in data]
        for name, value in sorted(zip(names, data.values()), key=lambda item: item[0]):
            where = f"site {name}"
            if isinstance(value, tuple) and len(value) != 2:
                raise DataError(f"{where}: give a DataFrame or a (train, test) pair of DataFrames")
            train_frame, test_frame = value if isinstance(value, tuple) else (value, None)
            train_rows = frame_rows(train_frame, f"{where} training rows", label_column)
            test_rows = None if test_frame is None else frame_rows(test_frame, f"{where} test rows", label_column)
            sites.append(SiteRows(name, train_rows, test_rows))
        if not sites:
            raise DataError("no sites; give at least one site's DataFrame")
        return sites
    if split_column is not None and test is None and isinstance(data, pd.DataFrame) and split_column in data.columns:
        return split_sites(data, None, "the DataFrame", label_column, site_column, split_column)
    return split_sites(data, test, "the DataFrame", label_column, site_column, None, test_where="the test DataFrame")


__all__ = ["MAX_COLUMNS", "Rows", "SiteRows", "check_frame", "feature_matrix", "frame_rows", "frames_sites",
           "is_table", "label_names", "name_codes", "read_csv", "read_csv_header", "split_sites", "table_sites"]
