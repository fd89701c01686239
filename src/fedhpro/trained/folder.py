"""What a finished run's folder holds of its trained model: the files' names, the error a damaged one gives,
and the models in memory before they are written (:class:`TrainedModels`).

A finished run's folder holds

* ``model.pt``: the final global model, a plain state dict (tensors only, ``torch.save``; read with
  ``torch.load(path, weights_only=True)``), of the module the run was tested with: the network itself, or,
  with a method's own inference rule (a prototype method's ``inference=nearest-prototype``), the module
  applying it (for the nearest-prototype classifier: keys ``model.*``, ``prototypes``, ``mask``);
* ``models/client_<k>.pt``: when the clients keep their own models (``heterogeneity=``, a prototype
  method's ``protocol=proto-only``), each client's personal model as it was tested: its own weights with
  the global shared part (the classifier under ``heterogeneity=``) loaded. There is then no global model
  and no ``model.pt``;
* ``model.json``: what rebuilds them beside ``config.yaml`` (the run's settings): the model's name, the
  number and names of the classes, the input shape, the inference rule, the files and how an image becomes
  an input (the run's data set's preprocessing, as its spec declares it);
* ``standardize.json``: tabular own data whose features the sites scaled: with ``data.standardize=federated``
  (the default) the one mean and std per feature every site used (under ``pooled`` and under each site's
  name); with ``data.standardize=client`` each site's own training mean and std, and the pair pooled over
  every site's training rows (for a new site). predict scales new rows with them as training scaled them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from fedhpro.errors import ConfigError, DataError

#: the final global model's file in a run folder
MODEL_FILE = "model.pt"
#: what rebuilds the models, beside config.yaml
MODEL_INFO = "model.json"
#: the folder of the clients' personal models
PERSONAL_FOLDER = "models"
#: the feature statistics ``data.standardize=client`` scaled each site's inputs with (tabular own data)
STATISTICS_FILE = "standardize.json"
#: its ``format``
STATISTICS_FORMAT = "fedhpro-standardize/1"
#: the statistics a new site's inputs are scaled with unless a site is named: all sites' training rows pooled
POOLED = "pooled"
#: model.json's ``format``: a later layout gets a new one
FORMAT = "fedhpro-model/1"
#: the inference rule of a saved network with its own classifier; a method's own rule is named by its
#: :class:`~fedhpro.methods.base.InferenceRule` (a prototype method's ``inference=nearest-prototype``)
HEAD = "head"


class ModelFileError(DataError):
    """A model file that is missing, damaged or does not fit the model its run folder describes."""


def client_file(k: int) -> str:
    """``models/client_<k>.pt``: client ``k``'s personal model, relative to the run folder."""
    return f"{PERSONAL_FOLDER}/client_{k}.pt"


@dataclass
class TrainedModels:
    """A finished run's models in memory (on the CPU, eval mode): the global one, or each client's own."""

    info: dict[str, Any]
    global_model: nn.Module | None = None
    personal: dict[int, nn.Module] = field(default_factory=dict)
    #: standardize.json's content (tabular own data scaled per site), or None
    statistics: dict[str, Any] | None = None

    def model(self, where: str = "this run") -> nn.Module:
        """The global model; a one-line ConfigError for a run whose clients keep their own models."""
        if self.global_model is None:
            raise ConfigError(personal_message(self.info, where))
        return self.global_model

    def client_model(self, k: int, where: str = "this run") -> nn.Module:
        """Client ``k``'s personal model; a one-line ConfigError if the run has none for ``k``."""
        if k not in self.personal:
            raise ConfigError(no_client_message(self.info, k, where))
        return self.personal[k]


def personal_message(info: Mapping[str, Any], where: str) -> str:
    clients = sorted(int(k) for k in info.get("personal", {}))
    span = f"client=0..{clients[-1]}" if clients else "client=K"
    return (f"{where} has no global model: its clients keep their own models ({info.get('why_personal', '')}); "
            f"choose one with {span}: fedhpro.load_model(folder, client=K), RunResult.client_model(K), "
            "fedhpro predict --client K")


def no_client_message(info: Mapping[str, Any], k: int, where: str) -> str:
    clients = sorted(int(c) for c in info.get("personal", {}))
    if not clients:
        return f"{where} has one global model and no personal models; leave out client={k}"
    return f"{where} has no personal model of client {k}; its clients are 0..{clients[-1]}"
