"""Tabular own data: CSV files read with :func:`pandas.read_csv`, and pandas DataFrames, as rows of features
and labels.

A table's **label column** is ``data.label_column`` (default ``label``); every other column is a feature,
except the site and split columns of a table that holds several sites (``data.site_column``, default
``site``; ``data.split_column``, default ``split``). Features must be numbers (integers, floats or
booleans; they become float32, as float features of a ``.npz`` do); a cell that is not a number is
refused in one line naming the column, the cell's row and its value, and so is a missing (NaN, an empty
cell, ``NA``) or infinite value. Labels are integers (class indices, as ``y`` of a ``.npz``) or names (text
such as ``benign``), which :mod:`fedhpro.data.clients` maps to classes.

A message names a CSV file's row as a spreadsheet shows the file: the header is row 1, the first data row
row 2 (blank lines, which the reader skips, are not counted); a DataFrame's row by its index label. Rows
are those of the whole file or DataFrame, never of one site's slice.

What a file can make fedhpro allocate is bounded as a ``.npz``'s is (:mod:`fedhpro.arrays`): the file's
bytes, and its rows times columns as float32, may not exceed ``FEDHPRO_MAX_ARRAY_BYTES`` (1 GiB); the
header is read first, a bounded line, then the file's lines are counted (streamed, a chunk at a time), so that a
file with more rows than the bound is refused before any row is held; only a file within it is parsed.
"""

from __future__ import annotations

import csv
import difflib
import itertools
import math
import os
from collections.abc import Iterable, Mapping, Sequence
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
#: how a message names a CSV file's rows: the header is row 1, so a frame's row k (0-based) is row k + 2
HEADER_ROWS = 2
#: the share of a column's cells that must be text for a message to advise encoding it as categories
MOSTLY_TEXT = 0.5
#: the most entries of a folder looked at for a name close to one that is not there
MAX_SIBLINGS = 10_000


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
    if not (isinstance(frame.index, pd.RangeIndex) and frame.index.start == 0 and frame.index.step == 1):
        # pandas takes the extra first cells of rows longer than the header as the index: every value would sit
        # one column to the right of its name
        row, cells = _first_long_row(path, len(frame.columns))
        raise DataError(f"{path}: row {row} holds {cells} cells but the header (row 1) names {len(frame.columns)} "
                        "columns, so the values would shift under the names; remove the extra cells (often a "
                        "trailing comma) or name every column in the header")
    return frame


def _first_long_row(path: Path, columns: int) -> tuple[int, int]:
    """``(row, cells)`` of the first row of the CSV ``path`` with more than ``columns`` cells (the header is row
    1, blank lines are not counted); ``(2, columns + 1)`` if none is found among the first rows read."""
    try:
        with path.open(newline="", encoding="utf-8", errors="replace") as handle:
            records = (cells for cells in csv.reader(handle) if cells)
            for row, cells in enumerate(itertools.islice(records, 1, COUNT_CHUNK_ROWS), start=2):
                if len(cells) > columns:
                    return row, len(cells)
    except (csv.Error, OSError):
        pass  # a cell beyond the csv module's size limit: the row is only to point the user at it
    return 2, columns + 1


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


def frame_rows(frame: pd.DataFrame, where: str, label_column: str, skip: Sequence[str] = (),
               file_rows: bool = True) -> Rows:
    """The rows of ``frame``: its ``label_column`` as labels, every other column but ``skip`` as float32
    features, each checked (numbers only, no missing or infinite value): one DataError line naming the
    column, the row and the value otherwise. ``file_rows``: ``frame`` (or the slice it is of) was read from
    a CSV file, whose rows messages number as a spreadsheet does; else rows are named by index label."""
    frame = check_frame(frame, where)
    names = [str(c) for c in frame.columns]
    if label_column not in names:
        shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
        close = close_name(label_column, names)
        fix = (f"did you mean data.label_column={close}?" if close else
               "name the label column with data.label_column=NAME")
        raise DataError(f"{where} has no label column {label_column!r} (its columns: {shown}); {fix}")
    features = [c for c in names if c != label_column and c not in skip]
    if not features:
        raise DataError(f"{where} has no feature column besides {label_column!r}; give at least one column of "
                        "numbers")
    frame = frame.set_axis(names, axis=1)
    x = feature_matrix(frame, features, where, file_rows)
    return Rows(x, _label_values(frame[label_column], label_column, where, file_rows), features, where)


def feature_matrix(frame: pd.DataFrame, features: Sequence[str], where: str, file_rows: bool = True) -> np.ndarray:
    """The ``features`` columns of ``frame`` (its column names as text) as float32 ``N x F``; one DataError line
    naming the column, the row (``file_rows``: of a CSV file, header = row 1; else the index label) and the
    value of a cell that is not a number, is missing or is beyond float32. A column of text whose cells all
    hold numbers (a CSV column is text for the whole file when one site has a word in it) is read as numbers."""
    if not len(frame):  # a header without rows: pandas cannot tell the columns' types
        return np.empty((0, len(features)), dtype=np.float32)
    read = {}
    for name in features:
        column = frame[name]
        if not (pd.api.types.is_numeric_dtype(column) or pd.api.types.is_bool_dtype(column)):
            column = read[name] = _numbers(column, name, where, file_rows)
        _refuse_missing(column, name, where, file_rows)
    if read:
        frame = _replaced(frame, read)
    x = frame[list(features)].to_numpy(dtype=np.float64)
    if not bool(np.isfinite(x).all()):
        bad = ~np.isfinite(x)
        index = int(bad.any(axis=0).argmax())
        position = int(bad[:, index].argmax())
        count = int(bad[:, index].sum())
        plural = "s" if count != 1 else ""
        raise DataError(f"{where}: column {features[index]!r} holds {count} infinite value{plural} "
                        f"({x[position, index]} {_place(frame.index[position], file_rows)}); replace "
                        f"{'it' if count == 1 else 'them'} with finite numbers or drop the row{plural}")
    with np.errstate(over="ignore"):
        x32 = x.astype(np.float32)
    if not bool(np.isfinite(x32).all()):
        bad = ~np.isfinite(x32)
        index = int(bad.any(axis=0).argmax())
        position = int(bad[:, index].argmax())
        raise DataError(f"{where}: column {features[index]!r} holds {x[position, index]:g} "
                        f"{_place(frame.index[position], file_rows)}, beyond float32's range (about 3.4e+38); "
                        "rescale the column")
    return np.ascontiguousarray(x32)


def _replaced(frame: pd.DataFrame, columns: Mapping[str, pd.Series]) -> pd.DataFrame:
    """A copy of ``frame`` with ``columns`` replaced."""
    frame = frame.copy()
    for name, column in columns.items():
        frame[name] = column
    return frame


def _numbers(column: pd.Series, name: str, where: str, file_rows: bool) -> pd.Series:
    """A column of text (or of mixed objects) as float64, its missing cells NaN; one DataError line where a cell
    is not a number, naming it (row, value), with advice that fits: one to correct, or a column of categories."""
    present = ~column.map(_missing).astype(bool)
    values = column.map(lambda value: math.nan if _missing(value) else _number(value))
    bad = present & values.isna()
    if not bool(bad.any()):
        return values.astype(np.float64)
    cells = column[bad]
    count = len(cells)
    shown = ", ".join(f"{_text(value)} {_place(index, file_rows, convention=False)}"
                      for index, value in cells.iloc[:3].items())
    listed = shown + (f" and {count - 3} more" if count > 3 else "") + _convention(file_rows, nested=True)
    cells_given = int(present.sum())
    if count > MOSTLY_TEXT * cells_given:
        raise DataError(f"{where}: column {name!r} holds text ({count} of its {cells_given} cells are not numbers: "
                        f"{listed}); a feature column holds numbers: encode it as numbers (e.g. pandas.get_dummies "
                        "for categories) or drop the column")
    if count == 1:
        raise DataError(f"{where}: column {name!r} holds {_text(cells.iloc[0])} "
                        f"{_place(cells.index[0], file_rows)}, which is not a number; a feature column holds numbers "
                        "only: correct the cell, or drop its row")
    raise DataError(f"{where}: column {name!r} has {count} cells that are not numbers ({listed}); a feature column "
                    "holds numbers only: correct those cells, or drop their rows")


def _missing(value: Any) -> bool:
    return value is None or value is pd.NA or value is pd.NaT or (isinstance(value, (float, np.floating))
                                                                  and math.isnan(value))


def _number(value: Any) -> float | None:
    """``value`` as a float if it is a number or text that reads as one (as pandas reads a CSV cell), else None."""
    if isinstance(value, (bool, np.bool_, complex, np.complexfloating)):
        return None
    if isinstance(value, (int, float, np.integer, np.floating)):
        try:
            return float(value)
        except OverflowError:  # an integer beyond float64: infinite, refused as such
            return math.inf if value > 0 else -math.inf
    if isinstance(value, str) and "_" not in value:  # float() reads '1_000'; pandas does not
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _text(value: Any) -> str:
    """A cell's value as a message shows it: its repr, cut at 60 characters."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _place(index: Any, file_rows: bool, convention: bool = True) -> str:
    """Where the row labelled ``index`` is: ``in row 8 of the file (the header is row 1)`` for a CSV file's
    frame (its index counts the data rows from 0), else ``at index 'h6'`` (a DataFrame's index label)."""
    if file_rows and isinstance(index, (int, np.integer)):
        return f"in row {int(index) + HEADER_ROWS}" + (_convention(file_rows) if convention else "")
    return f"at index {_label(index)!r}"


def _convention(file_rows: bool, nested: bool = False) -> str:
    """How rows are counted, for a message's row numbers (``nested``: said inside parentheses)."""
    if not file_rows:
        return ""
    return " of the file; the header is row 1" if nested else " of the file (the header is row 1)"


def _label(index: Any) -> Any:
    """An index label as a message shows it: a NumPy scalar as the Python value (7, not np.int64(7))."""
    return index.item() if isinstance(index, np.generic) else index


def _rows(indices: Sequence[Any], count: int, file_rows: bool) -> str:
    """The rows labelled ``indices`` (the first few of ``count``), named as :func:`_place` names one."""
    more = ", ..." if count > len(indices) else ""
    if file_rows and all(isinstance(i, (int, np.integer)) for i in indices):
        numbers = ", ".join(str(int(i) + HEADER_ROWS) for i in indices)
        return f"row{'s' if count > 1 else ''} {numbers}{more}{_convention(file_rows, nested=True)}"
    return f"index label{'s' if count > 1 else ''} {', '.join(repr(_label(i)) for i in indices)}{more}"


def close_name(name: str, candidates: Iterable[str]) -> str | None:
    """The one of ``candidates`` closest to ``name``, compared case-folded (:func:`difflib.get_close_matches`,
    its default cutoff), or None: what a "did you mean" offers."""
    folded: dict[str, str] = {}
    for candidate in candidates:
        folded.setdefault(str(candidate).casefold(), str(candidate))
    found = difflib.get_close_matches(str(name).casefold(), list(folded), n=1)
    return folded[found[0]] if found else None


def close_path(path: Path) -> Path | None:
    """A sibling of the missing ``path`` whose name is close to its name (:func:`close_name` of the names
    without their suffixes), or None; looks at the first :data:`MAX_SIBLINGS` entries of its folder."""
    parent = path.parent
    if not parent.is_dir():
        return None
    try:
        names = [entry.name for entry in itertools.islice(parent.iterdir(), MAX_SIBLINGS)
                 if not entry.name.startswith(".")]
    except OSError:
        return None
    stems: dict[str, str] = {}
    for name in names:  # stems compared: a shared suffix (.csv) alone makes two names close
        stems.setdefault(Path(name).stem, name)
    close = close_name(path.stem, stems)
    return parent / stems[close] if close else None


def label_names(labels: np.ndarray) -> list[str]:
    """The distinct names among ``labels`` (an object array of names), sorted."""
    return sorted(str(name) for name in pd.unique(labels))


def name_codes(labels: np.ndarray, classes: Sequence[str]) -> np.ndarray:
    """int64 indices of ``labels`` (an object array of names) in ``classes``; -1 for a name not among them."""
    return np.asarray(pd.Categorical(labels, categories=list(classes)).codes, dtype=np.int64)


def _refuse_missing(column: pd.Series, name: str, where: str, file_rows: bool) -> None:
    missing = column.isna()
    if bool(missing.any()):
        count = int(missing.sum())
        rows = _rows(list(column.index[missing][:3]), count, file_rows)
        raise DataError(f"{where}: column {name!r} has {count} missing value{'s' if count != 1 else ''} ({rows}); "
                        "fill them (e.g. DataFrame.fillna) or drop those rows")


def _label_values(column: pd.Series, name: str, where: str, file_rows: bool) -> np.ndarray:
    """The labels: int64 class indices (a column of whole numbers) or an object array of names (text)."""
    _refuse_missing(column, name, where, file_rows)
    if not len(column):  # no rows: no label to tell names from indices
        return np.empty(0, dtype=np.int64)
    if pd.api.types.is_bool_dtype(column):
        return column.to_numpy(dtype=np.int64, copy=True)
    if pd.api.types.is_integer_dtype(column):
        return _class_indices(column.to_numpy(dtype=np.int64, copy=True), column, name, where, file_rows)
    if pd.api.types.is_float_dtype(column):
        values = column.to_numpy(dtype=np.float64)
        whole = np.isfinite(values) & (values == np.round(values))
        if not bool(np.all(whole)):
            position = int((~whole).argmax())
            raise DataError(f"{where}: label column {name!r} holds {values[position]:g} "
                            f"{_place(column.index[position], file_rows)}, not a whole number; labels are class "
                            "indices 0..C-1 or class names")
        if values.size and float(np.abs(values).max()) > 2.0 ** 53:
            raise DataError(f"{where}: label column {name!r} holds labels beyond 2**53; labels are class indices "
                            "0..C-1 or class names")
        return _class_indices(values.astype(np.int64), column, name, where, file_rows)
    names = column.astype(str).str.strip().to_numpy(dtype=object)
    empty = names == ""
    if bool(empty.any()):
        rows = _rows(list(column.index[empty][:3]), int(empty.sum()), file_rows)
        raise DataError(f"{where}: label column {name!r} has empty labels ({rows}); give every row its class")
    return names


def _class_indices(values: np.ndarray, column: pd.Series, name: str, where: str, file_rows: bool) -> np.ndarray:
    """Integer labels, the first negative one refused naming its row."""
    if values.size and int(values.min()) < 0:
        position = int((values < 0).argmax())
        raise DataError(f"{where}: label column {name!r} holds {int(values[position])} "
                        f"{_place(column.index[position], file_rows)}; labels are class indices 0..C-1 or class "
                        "names")
    return values


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
                split_column: str | None, test_where: str = "the test table", file_rows: bool = True) -> list[SiteRows]:
    """One :class:`SiteRows` per value of ``site_column``, sorted by name (as client folders are): the rows
    of ``train`` (split by ``split_column`` when given) and of ``test``. ``file_rows``: the tables were read
    from CSV files (messages number their rows as a spreadsheet does; else by index label)."""
    train = check_frame(train, where)
    tables = [(train, where)] + ([] if test is None else [(check_frame(test, test_where), test_where)])
    for table, source in tables:  # the whole table lacks the column: said once, not for its first site
        _require(table, label_column, source, "label", "give each row its class in it")
    frames: dict[str, pd.DataFrame] = {}
    if split_column is not None:
        _require(train, split_column, where, "split",
                 "give each row train or test in it, or give a folder with train.csv and test.csv")
        _refuse_missing(train[split_column], split_column, where, file_rows)
        split = train[split_column].map(lambda value: SPLIT_VALUES.get(str(value).strip().casefold()))
        if bool(split.isna().any()):
            odd = train[split_column][split.isna()]
            raise DataError(f"{where}: split column {split_column!r} holds {_text(odd.iloc[0])} "
                            f"{_place(odd.index[0], file_rows)}; give train or test for each row")
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
        _refuse_missing(frame[site_column], site_column, source, file_rows)
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
        test_site_where = f"{test_where} (site {name})" if split_column is None else f"{site_where} test rows"
        rows = {part: frame_rows(frame, site_where if part == "train" else test_site_where, label_column, skip,
                                 file_rows) for part, frame in parts.items() if part == "train" or len(frame)}
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
        close = close_name(column, names)
        advice = (f"did you mean data.{what}_column={close}?" if close else
                  f"{fix} (or name the column with data.{what}_column=NAME)")
        raise DataError(f"{where} has no {what} column {column!r} (its columns: {shown}); {advice}")


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
            train_rows = frame_rows(train_frame, f"{where} training rows", label_column, file_rows=False)
            test_rows = (None if test_frame is None else
                         frame_rows(test_frame, f"{where} test rows", label_column, file_rows=False))
            sites.append(SiteRows(name, train_rows, test_rows))
        if not sites:
            raise DataError("no sites; give at least one site's DataFrame")
        return sites
    if split_column is not None and test is None and isinstance(data, pd.DataFrame) and split_column in data.columns:
        return split_sites(data, None, "the DataFrame", label_column, site_column, split_column, file_rows=False)
    return split_sites(data, test, "the DataFrame", label_column, site_column, None, test_where="the test DataFrame",
                       file_rows=False)


__all__ = ["MAX_COLUMNS", "Rows", "SiteRows", "check_frame", "close_name", "close_path", "feature_matrix",
           "frame_rows", "frames_sites", "is_table", "label_names", "name_codes", "read_csv", "read_csv_header",
           "split_sites", "table_sites"]
