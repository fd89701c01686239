"""The trained model as an MLflow model (the ``python_function`` flavour), so that
``mlflow.pyfunc.load_model(uri).predict(rows)`` classifies as ``fedhpro predict`` does (:func:`save_mlflow_model`,
which the MLflow tracker logs as the artifact ``model``).

The MLflow model holds the run folder's files that rebuild the model (model.json, config.yaml, model.pt,
standardize.json, partition.json) and a :class:`RunFolderModel`, which loads them with
:func:`fedhpro.load_estimator`: the same preprocessing, the same classes. Its signature names the inputs: a
run on tables with named columns takes a DataFrame of those columns (by name, in any order), an image run
``uint8`` pixels ``N x 3 x S x S``; the output is ``predicted`` (the class's name) and ``p_<class>`` per class,
the columns ``fedhpro predict`` adds. Loading it needs fedhpro installed (the model's requirements say so).

This module imports MLflow (an optional extra, ``pip install fedhpro[mlflow]``): import it only where MLflow
is wanted."""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
import torch
from mlflow.models import ModelSignature
from mlflow.pyfunc import PythonModel
from mlflow.types import ColSpec, Schema, TensorSpec

from fedhpro.config import is_from_python, read_yaml
from fedhpro.trained.checks import read_info
from fedhpro.trained.estimator import TrainedClassifier, load_estimator
from fedhpro.trained.folder import MODEL_INFO
from fedhpro.trained.inputs import PARTITION_FILE, trained_columns

#: the name of the run folder's copy among the MLflow model's artifacts
RUN_ARTIFACT = "run"


class RunFolderModel(PythonModel):  # type: ignore[misc]  # MLflow's class, without type information
    """A run folder's trained model as an MLflow ``python_function`` model: :func:`fedhpro.load_estimator` on
    the copy of the folder the MLflow model holds; ``predict`` answers a DataFrame of ``predicted`` and
    ``p_<class>`` per input."""

    def load_context(self, context: Any) -> None:
        self.estimator: TrainedClassifier = load_estimator(context.artifacts[RUN_ARTIFACT])

    # model_input unannotated: MLflow reads a type hint there as the model's input schema, which the signature
    # states
    def predict(self, context: Any, model_input, params: dict[str, Any] | None = None) -> pd.DataFrame:
        probabilities = self.estimator.predict_proba(model_input)
        classes = list(self.estimator.classes_)
        answer = pd.DataFrame({"predicted": [classes[int(k)] for k in probabilities.argmax(axis=1)]})
        for k, name in enumerate(classes):
            answer[f"p_{name}"] = probabilities[:, k]
        return answer


def mlflow_signature(folder: Path, info: dict[str, Any]) -> ModelSignature:
    """The model's inputs and outputs as MLflow states them: the feature columns by name (float64: MLflow
    converts float32 columns, not integer ones) or a tensor of the input's shape and dtype; ``predicted`` and
    ``p_<class>``."""
    shape = [int(n) for n in info["input_shape"]]
    inputs = info.get("input", {})
    columns = trained_columns(folder) if inputs.get("kind") == "tensor" else None
    if columns is not None:
        schema = Schema([ColSpec("double", name) for name in columns])
    elif inputs.get("kind") == "image":
        pixels = np.dtype(np.uint16 if inputs.get("bit_depth") is not None else np.uint8)
        schema = Schema([TensorSpec(pixels, (-1, *shape))])
    else:
        dtype = np.dtype(np.int64 if str(inputs.get("dtype", "float32")) == "int64" else np.float32)
        schema = Schema([TensorSpec(dtype, (-1, *shape))])
    outputs = Schema([ColSpec("string", "predicted"), *[ColSpec("double", f"p_{name}") for name in info["classes"]]])
    return ModelSignature(inputs=schema, outputs=outputs)


def mlflow_model_note(run_folder: str | os.PathLike) -> str | None:
    """Why the run in ``run_folder`` cannot be an MLflow model, or None when it can: a run whose clients keep
    their own models has no one model; a model that came from Python needs its callable, which the MLflow
    model does not carry."""
    folder = Path(run_folder)
    info = read_info(folder)
    if not info.get("global"):
        return "its clients keep their own models (models/client_<k>.pt): there is no one model to log"
    config = read_yaml(folder / str(info.get("config", "config.yaml")))
    if isinstance(config, dict) and is_from_python(config.get("model")):
        return (f"its model came from Python ({config['model']}); rebuild it with fedhpro.load_model(folder, "
                "model=...)")
    return None


def save_mlflow_model(run_folder: str | os.PathLike, path: str | os.PathLike) -> Path:
    """The run's trained model written as an MLflow model to the new folder ``path`` (module doc); the run
    folder's model files are copied into it. Returns ``path``."""
    folder = Path(run_folder)
    info = read_info(folder)
    load_estimator(folder)  # the model rebuilds from those files: a damaged folder is one line here, not at load
    names = [MODEL_INFO, str(info.get("config", "config.yaml")), str(info["global"]),
             str(info.get("input", {}).get("statistics", "")), PARTITION_FILE]
    with tempfile.TemporaryDirectory(prefix="fedhpro-mlflow-") as scratch:
        copy = Path(scratch) / RUN_ARTIFACT
        for name in names:
            if name and (folder / name).is_file():
                (copy / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(folder / name, copy / name)
        # stated, not inferred: MLflow would otherwise load the model in a subprocess to find its imports
        requirements = [f"fedhpro=={version('fedhpro')}", f"torch=={torch.__version__.split('+')[0]}",
                        f"pandas=={pd.__version__}"]
        with warnings.catch_warnings():
            # its advice on type hints and input examples: the signature states the inputs
            warnings.filterwarnings("ignore", category=UserWarning, module=r"mlflow\.")
            mlflow.pyfunc.save_model(str(path), python_model=RunFolderModel(), artifacts={RUN_ARTIFACT: str(copy)},
                                     signature=mlflow_signature(folder, info), pip_requirements=requirements)
    return Path(path)


__all__ = ["RUN_ARTIFACT", "RunFolderModel", "mlflow_model_note", "mlflow_signature", "save_mlflow_model"]
