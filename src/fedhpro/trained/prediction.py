"""``fedhpro predict``: a run's trained model on new inputs, as a CSV of the predicted class and every class's
probability."""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor, nn

from fedhpro.files import write_atomic
from fedhpro.trained.checks import read_info
from fedhpro.trained.folder import ModelFileError
from fedhpro.trained.inputs import gather_inputs, prepared
from fedhpro.trained.load import load_model


@torch.no_grad()
def class_probabilities(module: nn.Module, inputs: Tensor, batch_size: int = 256) -> Tensor:
    """Softmax of the module's logits (float64 for the CSV), in batches."""
    parts = [torch.softmax(module(inputs[i:i + batch_size]).double(), dim=1) for i in range(0, len(inputs), batch_size)]
    return torch.cat(parts)


def predict(run_folder: str | os.PathLike, paths: Iterable[str | os.PathLike], out: str | os.PathLike | None = None,
            *, client: int | None = None, model: Callable[..., nn.Module] | None = None,
            batch_size: int = 256, site: str | None = None) -> str:
    """Classify image files, folders of images or ``.pt`` / ``.npz`` tensor files with a run's trained model;
    returns the CSV text (and writes it to ``out`` atomically when given): ``path, predicted, p_<class>...``,
    the predicted class's name and the probability of every class (softmax of the model's logits).

    Every input is made as the run made its inputs: images decoded, resized and normalised as its data set
    did; tabular rows of a run trained with ``data.standardize=client`` scaled by the statistics in
    standardize.json: those of ``site`` (a site folder's name), by default all sites' training rows pooled."""
    folder = Path(run_folder)
    info = read_info(folder)
    module = load_model(folder, client=client, model=model)
    names, inputs = gather_inputs(paths, info)
    inputs = prepared(folder, info, inputs, site)
    probabilities = class_probabilities(module, inputs, batch_size)
    if not bool(torch.isfinite(probabilities).all()):  # never a CSV of NaN: whatever the cause, say it
        first = int((~torch.isfinite(probabilities)).any(dim=1).nonzero()[0])
        finite_input = bool(torch.isfinite(inputs[first]).all())
        why = ("the model's weights give NaN or infinite outputs: model file damaged, or the run diverged"
               if finite_input else "its preprocessing (model.json's input) turns it into NaN or infinite values")
        raise ModelFileError(f"{folder}: the probabilities of {names[first]} are not finite numbers ({why}); "
                             "nothing written: run again, or check the inputs and the run folder")
    classes = list(info["classes"])
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["path", "predicted"] + [f"p_{name}" for name in classes])
    for name, row in zip(names, probabilities):
        writer.writerow([name, classes[int(row.argmax())]] + [f"{float(p):.6g}" for p in row])
    text = buffer.getvalue()
    if out is not None:
        write_atomic(out, text)
    return text
