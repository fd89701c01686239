"""A trained run as a scikit-learn-style classifier (:class:`TrainedClassifier`, ``fedhpro.load_estimator``):
``predict`` / ``predict_proba`` on a DataFrame whose columns are matched by name, with ``classes_``,
``feature_names_in_`` and ``n_features_in_`` as scikit-learn's fitted classifiers have them.

It wraps the module :func:`~fedhpro.trained.load.load_model` rebuilds with the run's preprocessing, so every
input goes through the scaling training used (standardize.json's statistics, the data set's image
normalisation): predictions by name equal ``fedhpro predict`` on a CSV of the same rows."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor, nn

from fedhpro.errors import DataError
from fedhpro.trained.checks import read_info
from fedhpro.trained.inputs import as_frame, check_tabular, frame_inputs, gathered, trained_columns, width_message
from fedhpro.trained.load import load_model
from fedhpro.trained.prediction import check_probabilities, class_probabilities


class TrainedClassifier:
    """A finished run's trained model as a scikit-learn-style classifier (already fitted: there is no ``fit``).

    ``X`` may be

    * a pandas DataFrame (or a mapping of column names to sequences), for a run on tables: the run's feature
      columns matched by name, in any order; a missing column, or one the run was not trained on, is refused
      in one line naming it (scikit-learn's rule). The rows are taken raw, as the training files held them,
      and scaled as training scaled them;
    * an array or tensor, ``N x F`` raw rows in the run's feature order (:attr:`feature_names_in_`); for an
      image run ``N x 3 x S x S`` ``uint8`` pixels (``uint16`` where the run kept 16-bit depth), prepared
      float32 images, or those flattened to ``N x`` :attr:`n_features_in_`;
    * a list of paths, as ``fedhpro predict`` takes them (image files, folders of images, ``.pt`` / ``.npz``
      tensor files, ``.csv`` files of rows).

    Attributes:
        classes_: the class names (model.json's ``classes``), in the order of :meth:`predict_proba`'s columns.
        feature_names_in_: the feature columns in the order the model takes them, for a run on tables with
            named columns; None otherwise (image runs, arrays without names), as scikit-learn leaves it
            unset for a model fitted on arrays.
        n_features_in_: the number of values one input holds (the features of a row; ``3 * S * S`` for images).
    """

    classes_: np.ndarray
    feature_names_in_: np.ndarray | None
    n_features_in_: int

    def __init__(self, run_folder: str | os.PathLike, *, client: int | None = None,
                 model: Callable[..., nn.Module] | None = None, site: str | None = None,
                 device: str | torch.device = "cpu", batch_size: int = 256):
        self.run_folder = Path(run_folder)
        self.info = read_info(self.run_folder)
        self.module = load_model(self.run_folder, client=client, model=model, device=device, site=site)
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.input_shape = tuple(int(n) for n in self.info["input_shape"])
        self.classes_ = np.asarray(self.info["classes"], dtype=object)
        columns = trained_columns(self.run_folder)
        self.feature_names_in_ = None if columns is None else np.asarray(columns, dtype=object)
        self.n_features_in_ = math.prod(self.input_shape)

    @classmethod
    def from_run(cls, run_folder: str | os.PathLike, *, client: int | None = None,
                 model: Callable[..., nn.Module] | None = None, site: str | None = None,
                 device: str | torch.device = "cpu", batch_size: int = 256) -> TrainedClassifier:
        """The classifier of the run in ``run_folder``: ``client`` (a client's personal model), ``model`` (the
        callable of a run whose model came from Python), ``site`` (the site whose training statistics scale
        tabular rows; default every site's pooled) and ``device`` as :func:`~fedhpro.trained.load.load_model`
        takes them."""
        return cls(run_folder, client=client, model=model, site=site, device=device, batch_size=batch_size)

    def predict_proba(self, X: Any) -> np.ndarray:
        """``N x C`` class probabilities (float64, the softmax of the model's logits; columns in
        :attr:`classes_`'s order)."""
        inputs, names = self._raw_inputs(X)
        probabilities = class_probabilities(self.module, inputs.to(self.device), self.batch_size).cpu()
        check_probabilities(self.run_folder, probabilities, inputs, names)
        return probabilities.numpy()

    def predict(self, X: Any) -> np.ndarray:
        """The predicted class of each input, by name (:attr:`classes_`)."""
        return self.classes_[self.predict_proba(X).argmax(axis=1)]

    def score(self, X: Any, y: Any) -> float:
        """The mean accuracy of :meth:`predict` on ``X`` against ``y`` (scikit-learn's ``score``): ``y`` holds
        class names (:attr:`classes_`), or class indices 0..C-1, one per input. A label that is neither is
        refused in one line (scored as an error it would lower the accuracy silently)."""
        predicted = self.predict(X)
        truth = self._labels(y, len(predicted))
        return float(np.mean(predicted == truth))

    def _labels(self, y: Any, count: int) -> np.ndarray:
        """``y`` as class names: names kept, whole numbers 0..C-1 as the names they index."""
        values = np.asarray(y.to_numpy() if isinstance(y, (pd.Series, pd.DataFrame)) else y, dtype=object).ravel()
        if len(values) != count:
            raise DataError(f"y has {len(values)} labels for {count} inputs; give one label per input")
        names = {str(name) for name in self.classes_}
        indices = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values)
        if indices and not all(str(v) in names for v in values):
            bad = [int(v) for v in values if not 0 <= int(v) < len(self.classes_)]
            if bad:
                raise DataError(f"y holds the class index {bad[0]}, outside 0..{len(self.classes_) - 1}; give "
                                f"class names ({', '.join(map(str, self.classes_[:5]))}...) or indices in range")
            return self.classes_[[int(v) for v in values]]
        unknown = sorted({str(v) for v in values} - names)
        if unknown:
            raise DataError(f"y holds {unknown[0]!r}, which is not one of the run's classes ("
                            f"{', '.join(map(str, self.classes_[:10]))}); give the class names the run trained on")
        return np.array([str(v) for v in values], dtype=object)

    def _raw_inputs(self, X: Any) -> tuple[Tensor, list[str]]:
        """``X`` as the tensor the wrapped module takes raw (its pre-hooks scale it), with a name per input."""
        if isinstance(X, (pd.DataFrame, Mapping)):
            where = "X" if isinstance(X, pd.DataFrame) else "the columns given"
            check_tabular(self.info, where)
            frame = X if isinstance(X, pd.DataFrame) else as_frame(X, where)
            columns = None if self.feature_names_in_ is None else list(self.feature_names_in_)
            x = frame_inputs(frame, self.info, columns, where, strict=True)
            return self._nonempty(x), [f"row {i}" for i in range(len(x))]
        if isinstance(X, (str, os.PathLike)) or (isinstance(X, Sequence) and X and all(
                isinstance(item, (str, os.PathLike)) for item in X)):
            paths = [X] if isinstance(X, (str, os.PathLike)) else list(X)
            names, x, _ = gathered(paths, self.info, trained_columns(self.run_folder))
            return x, names
        x = self._array(X)
        return self._nonempty(x), [f"input {i}" for i in range(len(x))]

    def _array(self, X: Any) -> Tensor:
        """An array-like or tensor as a CPU tensor of the model's input shape: a flat ``N x n_features_in_``
        array of image values reshaped, integer rows of a table as floats."""
        if isinstance(X, Tensor):
            x = X.detach().cpu()
        else:
            array = np.asarray(X)
            if array.dtype.kind not in "biuf":
                raise DataError(f"X holds {array.dtype} values; give numbers (a table's rows by name: a DataFrame)")
            if array.dtype.kind == "u" and array.dtype.itemsize > 2:
                array = array.astype(np.int64)  # torch has no wide unsigned arithmetic
            x = torch.from_numpy(np.array(array, order="C"))  # a copy: the caller's array may be read-only
        if x.dim() == 1:
            raise DataError(f"X is one row of {x.shape[0]} values; give a 2-D array of rows, N x "
                            f"{self.n_features_in_} (one row: x.reshape(1, -1))")
        if len(self.input_shape) > 1 and x.dim() == 2 and x.shape[1] == self.n_features_in_:
            x = x.reshape(-1, *self.input_shape)  # flattened inputs, as scikit-learn pipelines hold them
        if x.dim() != len(self.input_shape) + 1 or tuple(x.shape[1:]) != self.input_shape:
            columns = None if self.feature_names_in_ is None else list(self.feature_names_in_)
            raise DataError(width_message(self.input_shape, tuple(x.shape), columns))
        inputs = self.info.get("input", {})
        if inputs.get("kind") == "tensor" and str(inputs.get("dtype", "float32")).startswith("float"):
            x = x.float()  # raw rows of integers are features like any other
        elif x.is_floating_point():
            x = x.float()  # prepared images, as the network's float32 weights take them
        return x

    @staticmethod
    def _nonempty(x: Tensor) -> Tensor:
        if not len(x):
            raise DataError("X has no rows; give at least one row to classify")
        return x

    def __repr__(self) -> str:
        return f"TrainedClassifier.from_run({str(self.run_folder)!r})"


def load_estimator(run_folder: str | os.PathLike, *, client: int | None = None,
                   model: Callable[..., nn.Module] | None = None, site: str | None = None,
                   device: str | torch.device = "cpu", batch_size: int = 256) -> TrainedClassifier:
    """A finished run's trained model as a scikit-learn-style classifier (:class:`TrainedClassifier`):
    ``load_estimator(run).predict(dataframe)`` matches the run's feature columns by name."""
    return TrainedClassifier.from_run(run_folder, client=client, model=model, site=site, device=device,
                                      batch_size=batch_size)


__all__ = ["TrainedClassifier", "load_estimator"]
