"""The trained model in the user's hands: written at the end of every run, rebuilt from the run folder alone,
used to classify new inputs (``fedhpro predict``) and re-tested per class (``fedhpro report per_class=true``).

One module per job:

* :mod:`~fedhpro.trained.folder`: what a run folder holds (the files, :class:`TrainedModels`, :class:`ModelFileError`);
* :mod:`~fedhpro.trained.export`: writing ``model.pt`` / ``models/client_<k>.pt``, ``model.json`` and
  ``standardize.json`` (the method's inference rule and the data set's image preprocessing, as their specs
  declare them);
* :mod:`~fedhpro.trained.checks`: model.json, the model files and standardize.json checked (a run folder is
  untrusted input);
* :mod:`~fedhpro.trained.load`: :func:`load_model`, the module rebuilt from ``config.yaml`` + ``model.json``;
* :mod:`~fedhpro.trained.inputs`: predict's inputs made as the run made its inputs (:func:`prepare_inputs`);
* :mod:`~fedhpro.trained.prediction`: :func:`predict`;
* :mod:`~fedhpro.trained.estimator`: :class:`TrainedClassifier` (:func:`load_estimator`), scikit-learn's
  ``predict`` / ``predict_proba`` on DataFrames whose columns are matched by name;
* :mod:`~fedhpro.trained.evaluation`: :func:`class_accuracy`, through the run's own evaluation.
"""

from __future__ import annotations

from fedhpro.trained.checks import read_state, read_statistics
from fedhpro.trained.estimator import TrainedClassifier, load_estimator
from fedhpro.trained.evaluation import class_accuracy
from fedhpro.trained.export import (
    final_models,
    input_description,
    server_models,
    simulator_models,
    write_models,
    write_node_model,
)
from fedhpro.trained.folder import MODEL_FILE, MODEL_INFO, PERSONAL_FOLDER, ModelFileError, TrainedModels, client_file
from fedhpro.trained.inputs import prepare_inputs
from fedhpro.trained.load import load_model
from fedhpro.trained.prediction import predict

__all__ = ["MODEL_FILE", "MODEL_INFO", "ModelFileError", "PERSONAL_FOLDER", "TrainedClassifier", "TrainedModels",
           "class_accuracy", "client_file", "final_models", "input_description", "load_estimator", "load_model",
           "predict", "prepare_inputs",
           "read_state", "read_statistics", "server_models", "simulator_models", "write_models", "write_node_model"]
