"""fedhpro: FedHPro (Federated Hyper-Prototype Learning via Gradient Matching) and its baselines.

``fedhpro.run(config)`` runs one federated training and returns its result, the trained model included
(``RunResult.model``); ``fedhpro.load_model(run_folder)`` rebuilds that model from the run's folder alone and
``fedhpro.predict(run_folder, paths)`` classifies new images, tensors or rows with it
(``fedhpro.load_estimator(run_folder)``: a scikit-learn-style classifier, a DataFrame's columns by name).
The paper's equations are pure functions: ``fedhpro.functional`` (Eq. 1-3, shared with the baselines)
and ``fedhpro.methods.fedhpro.equations`` (FedHPro's, Eq. 4-13). Your own data, model and
method plug in from Python: ``fedhpro.run(..., federation=Federation.from_datasets(...),
model=lambda: fedhpro.models.split(my_net, head="fc"))`` and
``fedhpro.methods.register(name, spec)`` (or a package's ``fedhpro.methods``
entry point); tables as pandas DataFrames: ``fedhpro.run(..., federation=fedhpro.from_dataframes(frames))``.
"""

import importlib
from typing import Any

from fedhpro.errors import ConfigError, DataError, FedHProError, UpdateError
from fedhpro.runtime import set_openmp_defaults

# before torch loads its OpenMP runtime, which reads the wait policy once (fedhpro.runtime)
set_openmp_defaults()
__version__ = "0.1.0"

#: names imported on first use (they pull in torch; ``import fedhpro`` stays light)
_LAZY = {"Federation": ("fedhpro.data.federation", "Federation"),
         "register_method": ("fedhpro.methods", "register"),
         "split": ("fedhpro.models.split", "split"),
         "load_model": ("fedhpro.trained", "load_model"),
         "predict": ("fedhpro.trained", "predict"),
         "load_estimator": ("fedhpro.trained", "load_estimator"),
         "TrainedClassifier": ("fedhpro.trained", "TrainedClassifier"),
         "class_accuracy": ("fedhpro.trained", "class_accuracy"),
         "from_dataframes": ("fedhpro.data.frames", "from_dataframes")}
_SUBMODULES = ("api", "config", "data", "methods", "models", "functional", "metrics", "reports", "engines",
               "trained")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"fedhpro.{name}")
    raise AttributeError(f"module 'fedhpro' has no attribute {name!r}")


def run(*args, **kwargs):
    """Run one federated training; see :func:`fedhpro.api.run`."""
    # lazy as the names above: every ``import fedhpro.<module>`` runs this file first, and the API loads it all
    from fedhpro.api import run as _run

    return _run(*args, **kwargs)


__all__ = ["run", "load_model", "load_estimator", "TrainedClassifier", "predict",
           "class_accuracy", "Federation", "from_dataframes", "register_method",
           "split", "ConfigError", "DataError", "FedHProError", "UpdateError", "__version__"]
