"""``fedhpro predict``: a run's trained model on new inputs, as a CSV of the predicted class and every class's
probability; a CSV of rows gets its predictions beside its own columns."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn

from fedhpro.bounded import read_json_file
from fedhpro.data.tables import read_csv
from fedhpro.errors import DataError
from fedhpro.files import spreadsheet_cell, write_atomic
from fedhpro.trained.checks import NOT_FINITE_WEIGHTS, read_info
from fedhpro.trained.folder import ModelFileError
from fedhpro.trained.inputs import (
    PARTITION_FILE,
    as_frame,
    check_tabular,
    frame_inputs,
    gathered,
    prepared,
    trained_columns,
)
from fedhpro.trained.load import load_model

#: what a CSV of rows' predictions is called beside it: ``rows.csv`` -> ``rows.predictions.csv``
PREDICTIONS_SUFFIX = ".predictions.csv"


@torch.no_grad()
def class_probabilities(module: nn.Module, inputs: Tensor, batch_size: int = 256) -> Tensor:
    """Softmax of the module's logits (float64 for the CSV), in batches."""
    parts = [torch.softmax(module(inputs[i:i + batch_size]).double(), dim=1) for i in range(0, len(inputs), batch_size)]
    return torch.cat(parts)


def predict(run_folder: str | os.PathLike,
            paths: Iterable[str | os.PathLike] | pd.DataFrame | Mapping[str, Sequence[Any]],
            out: str | os.PathLike | None = None, *, client: int | None = None,
            model: Callable[..., nn.Module] | None = None, batch_size: int = 256, site: str | None = None) -> str:
    """Classify image files, folders of images, ``.pt`` / ``.npz`` tensor files or ``.csv`` files of rows with a
    run's trained model; returns the CSV text (and writes it to ``out`` atomically when given): ``path,
    predicted, p_<class>...``, the predicted class's name and the probability of every class (softmax of the
    model's logits).

    Every input is made as the run made its inputs: images decoded, resized and normalised as its data set
    did; tabular rows of a run trained with ``data.standardize=client`` scaled by the statistics in
    standardize.json: those of ``site`` (a site folder's name), by default all sites' training rows pooled.

    A ``.csv`` file of rows (the run's feature columns, found by name; a label or any other column is kept
    but not used) gets its predictions beside its rows: the file's own columns, then ``predicted`` and the
    ``p_<class>`` columns, written atomically to ``<file>.predictions.csv`` next to it (``rows.csv`` ->
    ``rows.predictions.csv``), or to ``out`` when it is the only input; that table is then what is returned.

    A pandas DataFrame of rows (or a mapping of column names to sequences of values), given in place of the
    paths, is predicted as a ``.csv`` file of the same rows: its feature columns found by name, in any order,
    and the same table returned (written to ``out`` when given). For numbers and classes as arrays, and
    scikit-learn's rules (columns beyond the features refused), use :func:`fedhpro.load_estimator`."""
    folder = Path(run_folder)
    info = read_info(folder)
    module = load_model(folder, client=client, model=model, preprocess=False)  # its inputs are prepared here
    classes = list(info["classes"])
    if isinstance(paths, (pd.DataFrame, Mapping)):
        where = "the DataFrame" if isinstance(paths, pd.DataFrame) else "the columns given"
        check_tabular(info, where)
        frame = paths if isinstance(paths, pd.DataFrame) else as_frame(paths, where)
        if not len(frame):
            raise DataError(f"{where} has no rows; give at least one row to classify")
        inputs = prepared(folder, info, frame_inputs(frame, info, trained_columns(folder), where), site)
        probabilities = class_probabilities(module, inputs, batch_size)
        check_probabilities(folder, probabilities, inputs, [f"row {i}" for i in range(len(frame))])
        text = _rows_with_predictions(frame.copy(), probabilities, classes, where)
        if out is not None:
            write_atomic(out, text)
        return text
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]  # one path, not its characters
    given = [Path(p) for p in paths]
    names, inputs, counts = gathered(given, info, trained_columns(folder))
    inputs = prepared(folder, info, inputs, site)
    probabilities = class_probabilities(module, inputs, batch_size)
    check_probabilities(folder, probabilities, inputs, names)
    tables = [path for path in given if path.is_file() and path.suffix.lower() == ".csv"]
    only_table = len(given) == 1 and len(tables) == 1
    start = 0
    text = ""
    for path, count in zip(given, counts):
        if path in tables:
            target = Path(out) if only_table and out is not None else predictions_path(path)
            text = _rows_with_predictions(read_csv(path), probabilities[start:start + count], classes, str(path))
            write_atomic(target, text)
        start += count
    if only_table:
        return text
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["path", "predicted"] + [spreadsheet_cell(f"p_{name}") for name in classes])
    for name, row in zip(names, probabilities):
        writer.writerow([spreadsheet_cell(name), spreadsheet_cell(classes[int(row.argmax())])]
                        + [f"{float(p):.6g}" for p in row])
    text = buffer.getvalue()
    if out is not None:
        write_atomic(out, text)
    return text


def check_probabilities(folder: Path, probabilities: Tensor, inputs: Tensor, names: Sequence[str]) -> None:
    """One ModelFileError line when a probability is not a finite number (never a table of NaN): whatever the
    cause, the weights or the preprocessing, it is said, naming the first such input."""
    if bool(torch.isfinite(probabilities).all()):
        return
    first = int((~torch.isfinite(probabilities)).any(dim=1).nonzero()[0])
    finite_input = bool(torch.isfinite(inputs[first]).all())
    why = (f"the model's weights give NaN or infinite outputs: {NOT_FINITE_WEIGHTS}"
           if finite_input else "its preprocessing (model.json's input) turns it into NaN or infinite values")
    raise ModelFileError(f"{folder}: the probabilities of {names[first]} are not finite numbers ({why}); "
                         "nothing written: run again, or check the inputs and the run folder")


def labelled_accuracy(run_folder: str | os.PathLike, text: str) -> tuple[int, int] | None:
    """``(correct, rows)`` of :func:`predict`'s table of a CSV whose rows carry their class in the run's label
    column (partition.json's ``label_column``, else ``label``): rows whose label, as text, is the predicted
    class's name (class indices match the names ``"0"``... of a run trained on indices); None when the table
    has no such column or no labelled row."""
    folder = Path(run_folder)
    label = "label"
    path = folder / PARTITION_FILE
    if path.is_file():
        record = read_json_file(path, ModelFileError)
        if isinstance(record, dict) and isinstance(record.get("label_column"), str):
            label = record["label_column"]
    rows = list(csv.DictReader(io.StringIO(text)))
    if not rows or label not in rows[0] or "predicted" not in rows[0]:
        return None
    labelled = [row for row in rows if (row[label] or "").strip()]
    if not labelled:
        return None
    correct = sum(_label_text(row[label]) == row["predicted"] for row in labelled)
    return correct, len(labelled)


def _label_text(value: str) -> str:
    """A label cell as a class name: ``"2.0"`` (a column of indices pandas wrote as floats) is ``"2"``."""
    value = value.strip()
    try:
        number = float(value)
    except ValueError:
        return value
    return str(int(number)) if number.is_integer() else value


def predictions_path(path: str | os.PathLike) -> Path:
    """Where the predictions of the CSV of rows ``path`` go by default: ``rows.csv`` -> ``rows.predictions.csv``."""
    path = Path(path)
    return path.with_name(path.stem + PREDICTIONS_SUFFIX)


def _rows_with_predictions(frame: pd.DataFrame, probabilities: Tensor, classes: Sequence[str], where: str) -> str:
    """The rows of ``frame`` (every column as read) with ``predicted`` and one ``p_<class>`` column each; text
    that starts like a spreadsheet formula, in any cell or column name, escaped (``'=...``:
    :func:`fedhpro.files.spreadsheet_cell`), numbers as they are."""
    added = ["predicted"] + [f"p_{name}" for name in classes]
    taken = [name for name in added if name in [str(c) for c in frame.columns]]
    if taken:
        raise DataError(f"{where} already has the column {taken[0]!r}, which predict adds; rename or drop it")
    frame["predicted"] = [classes[int(i)] for i in probabilities.argmax(dim=1).tolist()]
    for k, name in enumerate(classes):
        frame[f"p_{name}"] = [float(f"{float(p):.6g}") for p in probabilities[:, k].tolist()]
    for column in frame.columns:
        # only a column with a cell to escape is replaced (the others keep their dtype, and their bytes)
        if any(spreadsheet_cell(value) is not value for value in frame[column]):
            frame[column] = frame[column].map(spreadsheet_cell)
    frame.columns = [spreadsheet_cell(str(name)) for name in frame.columns]
    return frame.to_csv(index=False, lineterminator="\n")
