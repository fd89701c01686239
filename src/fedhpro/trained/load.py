"""The trained model rebuilt from a run folder alone (:func:`load_model`, ``fedhpro.load_model``).

The folder's ``config.yaml`` and ``model.json`` rebuild the module the run tested with the run's own model
factory (the registered ``model=``, the method's wrapper, a projection head) and the method's inference rule
(:attr:`fedhpro.methods.base.MethodSpec.inference_rule`); the weights are read with ``weights_only=True`` after
every key and shape is checked (:mod:`fedhpro.trained.checks`): nothing is ever unpickled."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedhpro.config import Config, is_from_python, load_config, read_yaml
from fedhpro.errors import ConfigError, FedHProError
from fedhpro.experiment import model_factories
from fedhpro.methods import get_method
from fedhpro.trained.checks import check_state, inside_folder, read_info, read_state
from fedhpro.trained.folder import HEAD, MODEL_INFO, ModelFileError, no_client_message, personal_message
from fedhpro.trained.inputs import attach_preprocessing
from fedhpro.user_models import python_name


def _model_factory_of(config: Config, info: Mapping[str, Any], model: Callable[..., nn.Module] | None,
                      folder: Path) -> Callable[[str], nn.Module]:
    """The run's architecture factory (name -> module), rebuilt from its config and model.json."""
    clients = max(int(config.run.clients or 0), len(info.get("personal", {})), 1)
    _, architecture_factory, _, _, _ = model_factories(
        config, get_method(config.run.method), int(info["num_classes"]), tuple(info["input_shape"]), clients,
        user_model=model)
    return architecture_factory


def _empty_module(config: Config, info: Mapping[str, Any], architecture: str,
                  model: Callable[..., nn.Module] | None, folder: Path) -> nn.Module:
    """The module the saved state dict belongs to, freshly built (the caller's RNG left as it was): the
    network, or the method's inference rule applied to it, empty (:class:`~fedhpro.methods.base.InferenceRule`)."""
    factory = _model_factory_of(config, info, model, folder)
    with torch.random.fork_rng(devices=[]):
        network = factory(architecture)
    inference = info.get("inference", HEAD)
    if inference == HEAD:
        return network
    rule = get_method(config.run.method).inference_rule
    if rule is not None and rule.name == inference:
        return rule.build(network, int(info["num_classes"]))
    known = HEAD if rule is None else f"{HEAD} or {rule.name}"
    raise ModelFileError(f"{folder / MODEL_INFO} names the inference rule {inference!r}, which the method "
                         f"{config.run.method!r} does not declare ({known})")


def run_config(folder: Path, info: Mapping[str, Any], model: Callable[..., nn.Module] | None) -> Config:
    """The run's config (its config.yaml); a model that came from Python (``model: python:<name>``) must be
    passed again as ``model`` (the same callable, by name), and only then."""
    path = inside_folder(folder, info.get("config", "config.yaml"), "config", folder / MODEL_INFO)
    if not path.is_file():
        raise ModelFileError(f"{folder} has no config.yaml; the run folder is incomplete")
    stored = read_yaml(path)
    recorded = stored.pop("model", None) if is_from_python(stored.get("model")) else None
    config = load_config(stored)
    if recorded is None:
        if model is not None:
            raise ConfigError(f"{folder}'s model is the registered {config.run.model!r}, not a callable; leave out "
                              "model=")
        return config
    name = str(recorded).removeprefix("python:")
    if model is None:
        raise ConfigError(f"{folder}'s model came from Python ({name}); pass the same callable: "
                          f"fedhpro.load_model({str(folder)!r}, model={name.rsplit('.', 1)[-1]})")
    if python_name(model) != recorded:
        raise ConfigError(f"{folder}'s model was {name}, this call passes {python_name(model).removeprefix('python:')}"
                          "; pass the same callable")
    return dataclasses.replace(config, run=dataclasses.replace(config.run, model=recorded))


def load_model(run_folder: str | os.PathLike, *, client: int | None = None,
               model: Callable[..., nn.Module] | None = None, device: str | torch.device = "cpu",
               preprocess: bool = True, site: str | None = None) -> nn.Module:
    """The trained model of a finished run, rebuilt from its folder alone (eval mode, on ``device``), taking
    raw inputs as :func:`~fedhpro.trained.prediction.predict` does.

    The folder's ``config.yaml`` and ``model.json`` rebuild the module the run tested (the same model
    factory as the run: the registered ``model=``, the method's wrapper, a projection head, the
    nearest-prototype rule); ``model.pt`` is read with ``torch.load(weights_only=True)`` and every key
    and shape is checked first (one :class:`ModelFileError` line otherwise).

    With ``preprocess`` (the default) the module applies the run's input preprocessing first
    (:func:`~fedhpro.trained.inputs.attach_preprocessing`, a forward pre-hook; its class and state dict are the
    network's): tabular rows of a ``data.standardize=client`` run are taken raw, as the files held them, and
    scaled by ``site``'s training statistics (default: every site's training rows pooled, for a new site);
    images are taken as ``uint8`` pixel tensors (``uint16`` for a run that kept 16-bit depth) at the model's
    size, or as float images already prepared. ``preprocess=False`` gives the bare network, for inputs
    prepared by :func:`~fedhpro.trained.inputs.prepare_inputs` (or as the run's data set made them).

    Args:
        run_folder: the run's folder (its ``out=``).
        client: a client's personal model (runs whose clients keep their own models:
            ``heterogeneity=``, ``protocol=proto-only``); those runs have no global model.
        model: the model callable, for a run whose model came from Python (``model: python:...`` in
            its config.yaml): the same callable passed to :func:`fedhpro.run`.
        device: where the module is put (default the CPU).
        preprocess: apply the run's input preprocessing (default); False: the bare network.
        site: tabular ``data.standardize=client`` runs: the site whose training statistics scale the rows.
    """
    folder = Path(run_folder)
    info = read_info(folder)
    config = run_config(folder, info, model)
    if client is None:
        if not info.get("global"):
            raise ConfigError(personal_message(info, str(folder)))
        path = inside_folder(folder, info["global"], "global", folder / MODEL_INFO)
        architecture = config.run.model
    else:
        entry = info.get("personal", {}).get(str(int(client)))
        if entry is None:
            raise ConfigError(no_client_message(info, int(client), str(folder)))
        path = inside_folder(folder, entry["file"], f"personal.{int(client)}.file", folder / MODEL_INFO)
        architecture = str(entry["architecture"])
        if info.get("on_nodes") and not path.is_file():
            raise ModelFileError(f"{folder} is a Flower run whose clients keep their own models: client {client}'s "
                                 "was written on its node's own disk; load it there, "
                                 f"fedhpro.load_model(<that node's model folder>, client={client})")
    # first without memory (the meta device): the sizes model.json and config.yaml give are checked against
    # the weights on disk before a module of those sizes is allocated
    try:
        with torch.device("meta"):
            shaped: nn.Module | None = _empty_module(config, info, architecture, model, folder)
    except FedHProError:
        raise
    except Exception:  # noqa: BLE001 - a model that cannot be built without memory (a user's callable)
        shaped = None  # checked once built, as before
    state = read_state(path)
    what = (f"the model {folder / MODEL_INFO} describes ({architecture}, {info['num_classes']} classes, inputs "
            f"{tuple(info['input_shape'])})")
    if shaped is not None:
        check_state(state, shaped, path, what)
    module = _empty_module(config, info, architecture, model, folder)
    check_state(state, module, path, what)
    module.load_state_dict(state)
    module = module.eval().to(torch.device(device))
    if preprocess:
        attach_preprocessing(module, folder, info, site)
    elif site is not None:
        raise ConfigError("site= chooses the statistics of the preprocessing; with preprocess=False scale the "
                          "inputs yourself: fedhpro.trained.prepare_inputs(run_folder, x, site=...)")
    return module
