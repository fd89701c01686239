"""The trained model in the user's hands: written at the end of every run, rebuilt from the run folder alone,
and used to classify new inputs (``fedhpro predict``).

A finished run's folder holds

* ``model.pt``: the final global model, a plain state dict (tensors only, ``torch.save``; read with
  ``torch.load(path, weights_only=True)``), of the module the run was tested with: the network itself, or,
  with a prototype method's ``inference=nearest-prototype``, the network inside the nearest-prototype
  classifier (keys ``model.*``, ``prototypes``, ``mask``);
* ``models/client_<k>.pt``: when the clients keep their own models (``heterogeneity=``, a prototype
  method's ``protocol=proto-only``), each client's personal model as it was tested: its own weights with
  the global shared part (the classifier under ``heterogeneity=``) loaded. There is then no global model
  and no ``model.pt``;
* ``model.json``: what rebuilds them beside ``config.yaml`` (the run's settings): the model's name, the
  number and names of the classes, the input shape, the inference rule, the files and how an image becomes
  an input (the run's data set's preprocessing);
* ``standardize.json``: tabular own data trained with ``data.standardize=client``: each site's training
  mean and std per feature, and the pair pooled over every site's training rows (for a new site), with
  which :func:`predict` scales new rows as training scaled them.

:func:`load_model` rebuilds the module from ``config.yaml`` + ``model.json`` (the same model factory the run
used) and loads the weights with ``weights_only=True`` after checking every key and shape: nothing is ever
unpickled. :func:`predict` classifies image files, folders of images or ``.pt`` / ``.npz`` tensor files, each
input made as the run made its inputs (:func:`prepare_inputs`).
"""

from __future__ import annotations

import copy
import csv
import io
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fedhpro.arrays import ArrayFileError, Bound, load_npz, load_torch
from fedhpro.bounded import read_json_file, run_file
from fedhpro.config import Config, is_from_python, load_config
from fedhpro.errors import ConfigError, DataError, FedHProError
from fedhpro.files import strict_json, write_atomic, write_atomic_with

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
#: the inference rules a saved module may carry (a prototype method's ``inference=``)
HEAD, NEAREST_PROTOTYPE = "head", "nearest-prototype"
#: the data sets whose images are resized to ``data.image_size`` (any size is taken, as when training)
RESIZING_DATASETS = ("imagefolder", "clients", "huggingface")


class ModelFileError(DataError):
    """A model file that is missing, damaged or does not fit the model its run folder describes."""


def client_file(k: int) -> str:
    """``models/client_<k>.pt``: client ``k``'s personal model, relative to the run folder."""
    return f"{PERSONAL_FOLDER}/client_{k}.pt"


# ---------------------------------------------------------------------------- what a run hands over


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
            raise ConfigError(_no_client_message(self.info, k, where))
        return self.personal[k]


def personal_message(info: Mapping[str, Any], where: str) -> str:
    clients = sorted(int(k) for k in info.get("personal", {}))
    span = f"client=0..{clients[-1]}" if clients else "client=K"
    return (f"{where} has no global model: its clients keep their own models ({info.get('why_personal', '')}); "
            f"choose one with {span}: fedhpro.load_model(folder, client=K), RunResult.client_model(K), "
            "fedhpro predict --client K")


def _no_client_message(info: Mapping[str, Any], k: int, where: str) -> str:
    clients = sorted(int(c) for c in info.get("personal", {}))
    if not clients:
        return f"{where} has one global model and no personal models; leave out client={k}"
    return f"{where} has no personal model of client {k}; its clients are 0..{clients[-1]}"


def input_description(config: Config, input_shape: Sequence[int], dtype: torch.dtype,
                      partition: Mapping[str, Any] | None) -> dict[str, Any]:
    """How a new input becomes what the model takes, as the run's data set made its inputs.

    ``{"kind": "image", "size": S, "resize": bool, "mean": [...], "std": [...], "normalize": "half" | "preset"}``
    for a data set of images (``resize``: any size is resized as in training; else only S x S images fit), or
    ``{"kind": "tensor", "shape": [...], "dtype": "float32" | "int64"}`` (tabular, tokens, data from Python)."""
    shape = [int(n) for n in input_shape]
    tensor: dict[str, Any] = {"kind": "tensor", "shape": shape, "dtype": str(dtype).removeprefix("torch.")}
    standardize = getattr(config.data, "standardize", "none")
    if standardize != "none" and len(shape) == 1 and dtype.is_floating_point:
        # each client scaled its features by its own statistics: a new input has no one map, the user scales it
        tensor["standardize"] = standardize
    dataset = config.run.dataset
    if config.federation is not None or len(shape) != 3 or shape[0] != 3 or shape[1] != shape[2]:
        return tensor
    size = shape[1]
    half = {"kind": "image", "size": size, "mean": [0.5] * 3, "std": [0.5] * 3, "normalize": "half"}
    if dataset in RESIZING_DATASETS:
        record = partition or {}
        reported = record.get("clients") or [{}]  # Flower's own-data record: the kind each node reported
        kind = record.get("kind", reported[0].get("kind") if isinstance(reported[0], Mapping) else None)
        if dataset == "clients" and kind != "images":
            return tensor
        if dataset == "huggingface" and getattr(config.data, "text_column", None):
            return tensor
        image = {**half, "resize": True, "dataset": dataset}
        if dataset == "imagefolder":
            image.update(_image_scaling(record))
        bits = int(getattr(config.data, "bit_depth", 0) or 0)
        if dataset == "clients" and bits > 8:  # every site scaled its 16-bit images by the depth it was told
            image["bit_depth"] = bits
        return image
    if dataset == "digits-offline":
        return {**half, "resize": False, "dataset": dataset}
    preset = _benchmark_preset(dataset)
    if preset is None:
        return tensor
    return {"kind": "image", "size": size, "resize": False, "mean": list(preset.mean), "std": list(preset.std),
            "normalize": "preset", "dataset": dataset}


def _image_scaling(record: Mapping[str, Any]) -> dict[str, Any]:
    """What an image folder's run recorded beyond the [-1, 1] scaling (partition.json): the data set's bit
    depth (16-bit images scaled by ``2**bits - 1``) and ``data.standardize=train``'s per-channel mean and std
    (of pixels in 0..1), which a new image must get too."""
    scaling: dict[str, Any] = {}
    if isinstance(record.get("bit_depth"), int):
        scaling["bit_depth"] = int(record["bit_depth"])
    standardize = record.get("standardize")
    if isinstance(standardize, Mapping):
        scaling["standardize"] = {"mean": list(standardize.get("mean", [])), "std": list(standardize.get("std", []))}
    return scaling


def _benchmark_preset(dataset: str) -> Any:
    """The channel statistics a paper benchmark normalises with (one for all its domains), or None."""
    from fedhpro.data.benchmarks import BENCHMARKS, PRESETS

    if dataset not in BENCHMARKS:
        return None
    benchmark: Any = getattr(BENCHMARKS[dataset]().build, "__self__", None)  # the benchmark whose build it is
    sources = ([source for _, source, _ in benchmark.domains] if hasattr(benchmark, "domains")
               else [getattr(benchmark, "source", None)])
    presets = {(PRESETS[s].mean, PRESETS[s].std) for s in sources if s in PRESETS}
    if len(presets) != 1:
        return None
    return PRESETS[next(s for s in sources if s in PRESETS)]


def model_info(config: Config, num_classes: int, input_shape: Sequence[int], classes: Sequence[str] | None,
               inputs: Mapping[str, Any], inference: str, personal: Mapping[int, str] | None,
               why_personal: str = "", note: str | None = None) -> dict[str, Any]:
    """model.json: everything that rebuilds the run's models together with its config.yaml."""
    names = [str(c) for c in classes] if classes is not None and len(classes) == num_classes else \
        [str(c) for c in range(num_classes)]
    info: dict[str, Any] = {
        "format": FORMAT,
        "method": config.run.method,
        "model": config.run.model,
        "num_classes": int(num_classes),
        "classes": names,
        "input_shape": [int(n) for n in input_shape],
        "feature_dim": config.run.feature_dim,
        "inference": inference,
        "global": None if personal else MODEL_FILE,
        "personal": {str(k): {"file": client_file(k), "architecture": arch} for k, arch in (personal or {}).items()},
        "input": dict(inputs),
        "config": "config.yaml",
    }
    if personal:
        info["why_personal"] = why_personal
    if note:
        info["note"] = note
    return info


def inference_of(module: nn.Module, network: nn.Module) -> str | None:
    """The rule ``module`` (what the method's server tests ``network`` through) applies: ``head`` when it is
    the network itself, ``nearest-prototype`` for the prototype methods' nearest-prototype classifier, None
    for another module (a plug-in method's own rule, which fedhpro cannot rebuild from a folder)."""
    from fedhpro.methods.prototypes import NearestPrototypeClassifier

    if module is network:
        return HEAD
    if isinstance(module, NearestPrototypeClassifier):
        return NEAREST_PROTOTYPE
    return None


def tested_module(server: Any, network: nn.Module) -> tuple[nn.Module, str, str | None]:
    """``(module, rule, note)``: ``network`` (moved to the CPU, eval mode) through the server's inference rule
    and that rule's name. A rule fedhpro cannot rebuild (a plug-in method's own module) leaves the network
    with its own classifier, and a note saying so (the run is not stopped for it; the user is warned)."""
    network = network.cpu().eval()
    module = server.inference_model(network)
    inference = inference_of(module, network)
    if inference is not None:
        return module.cpu().eval(), inference, None
    note = (f"the method tests its model through a {type(module).__name__} (its own inference rule), which "
            "fedhpro cannot rebuild from a folder: this is the network with its own classifier, whose logits "
            "may differ from those the run was tested with")
    from fedhpro.experiment import _warn

    _warn(note)
    return network, HEAD, note


def tensors_only(module: nn.Module) -> dict[str, Tensor]:
    """The module's state dict as plain CPU tensors sharing no storage with it (what ``model.pt`` holds)."""
    return {name: tensor.detach().cpu().clone().contiguous() for name, tensor in module.state_dict().items()}


def save_state(path: Path, module: nn.Module) -> None:
    """``module``'s state dict to ``path``, atomically (:func:`fedhpro.files.write_atomic_with`)."""
    state = tensors_only(module)
    write_atomic_with(path, lambda handle: torch.save(state, handle))


def write_models(out: str | os.PathLike, models: TrainedModels) -> None:
    """``model.pt`` (or ``models/client_<k>.pt``) and ``model.json`` of ``models`` into the run folder ``out``;
    each file atomically, model.json last (it names the files, which are then all there)."""
    out = Path(out)
    if models.statistics is not None:
        write_atomic(out / STATISTICS_FILE, strict_json(models.statistics, indent=2) + "\n")
    if models.global_model is not None:
        save_state(out / MODEL_FILE, models.global_model)
    for k, module in sorted(models.personal.items()):
        save_state(out / client_file(k), module)
    write_atomic(out / MODEL_INFO, strict_json(models.info, indent=2) + "\n")


def _why_personal(config: Config) -> str:
    if config.run.heterogeneity != "none":
        return f"heterogeneity={config.run.heterogeneity}: each client has its own feature extractor"
    return f"{config.run.method}.protocol=proto-only: no weights travel"


def _classes(partition: Mapping[str, Any] | None) -> list[str] | None:
    classes = (partition or {}).get("classes")
    return [str(c) for c in classes] if isinstance(classes, list) else None


def final_models(config: Config, models: Any, server: Any, num_classes: int, input_shape: Sequence[int],
                 dtype: torch.dtype, partition: Mapping[str, Any] | None, *, on_nodes: bool = False) -> TrainedModels:
    """A finished run's models, on the CPU, for any engine: the global model loaded with the server's global
    weights, or each client's personal model with the global shared part, as the run tested them
    (``models``: the engine's :class:`~fedhpro.engines.simulator.ClientModels`, left untouched; ``partition``:
    partition.json's record, which names the classes). ``on_nodes``: the personal models live on the Flower
    nodes, which write them on their own disks (:func:`write_node_model`): model.json then only names them."""
    inputs = input_description(config, input_shape, dtype, partition)
    statistics = None if on_nodes else _statistics_of(config, inputs)
    if statistics is not None:
        inputs["statistics"] = STATISTICS_FILE
    classes = _classes(partition)
    if not models.personal:
        network = copy.deepcopy(models.global_model)
        network.load_state_dict(server.global_weights())
        module, inference, note = tested_module(server, network)
        info = model_info(config, num_classes, input_shape, classes, inputs, inference, None, note=note)
        return TrainedModels(info, global_model=module, statistics=statistics)
    count = len(models.architectures)  # one per client whenever the models are personal
    personal: dict[int, nn.Module] = {}
    inference, note = _inference_option(config), None
    if not on_nodes:
        for k in range(count):
            personal[k], inference, note = personal_module(models, server, k, models.client_weights[k])
    names = {k: _architecture(config, models.architectures, k) for k in range(count)}
    info = model_info(config, num_classes, input_shape, classes, inputs, inference, names, _why_personal(config),
                      note=note)
    if on_nodes:
        info["on_nodes"] = True  # each node wrote its clients' files on its own disk
    return TrainedModels(info, personal=personal, statistics=statistics)


def simulator_models(config: Config, simulator: Any, federation: Any) -> TrainedModels:
    """The final models of an in-process run (:func:`final_models` of the simulator's models)."""
    return final_models(config, simulator.models, simulator.server, federation.num_classes, federation.input_shape,
                        federation.clients[0].x.dtype, federation.partition)


def _statistics_of(config: Config, inputs: Mapping[str, Any]) -> dict[str, Any] | None:
    """standardize.json's content for a run whose sites scaled their features (``data.standardize=client``
    on tabular own data), rebuilt from the same files as the run's federation; else None."""
    if inputs.get("standardize") != "client" or config.run.dataset != "clients" or config.federation is not None:
        return None
    from fedhpro.data.clients import standardization_statistics

    found = standardization_statistics(config.data, config.run.data_dir)  # type: ignore[arg-type]
    if found is None:
        return None
    return {"format": STATISTICS_FORMAT, "standardize": "client", **found}


def personal_module(models: Any, server: Any, k: int,
                    weights: Mapping[str, Tensor]) -> tuple[nn.Module, str, str | None]:
    """Client ``k``'s personal model (``weights``) with the server's global shared part loaded, through the
    server's inference rule: what the run tests client ``k`` with. A copy; ``models`` is not changed."""
    from fedhpro.methods.base import load_weights

    network = copy.deepcopy(models.working_models[models.architectures[k]])
    network.load_state_dict(dict(weights))
    load_weights(network, server.global_weights())
    return tested_module(server, network)


def server_models(side: Any, partition: Mapping[str, Any] | None) -> TrainedModels:
    """Flower ServerApp: the final models of ``side`` (:class:`fedhpro.flower.engine.ServerSide`) by
    :func:`final_models`; the input shape comes from the engine's federation (partition mode) or from what the
    nodes reported (own data: ``partition["clients"]``). Personal models stay on the nodes."""
    if side.engine is not None:
        federation = side.engine.federation
        input_shape, dtype = tuple(federation.input_shape), federation.clients[0].x.dtype
    else:
        reported = (partition or {}).get("clients") or [{}]
        input_shape, dtype = tuple(int(n) for n in reported[0].get("input_shape", ())), torch.float32
    return final_models(side.config, side.models, side.server, int(side.server.num_classes), input_shape, dtype,
                        partition, on_nodes=True)


def _architecture(config: Config, architectures: Sequence[str] | None, k: int) -> str:
    """Client ``k``'s architecture name (the zoo's under ``heterogeneity=``, else the run's ``model=``; the
    engines name a personal model of the run's own architecture just "model")."""
    if config.run.heterogeneity != "none" and architectures is not None:
        return str(architectures[k])
    return str(config.run.model)


def _inference_option(config: Config) -> str:
    return str(getattr(config.method_options, "inference", HEAD))


def write_node_model(folder: str | os.PathLike, config: Config, node: Any, model: nn.Module,
                     partition: Mapping[str, Any] | None = None) -> Path:
    """Flower node: client ``node.client``'s personal model (``model``, the node's model after its evaluation
    loaded the global shared part) into ``folder`` on the node's own disk, with the run's config.yaml and a
    model.json, so that ``fedhpro.load_model(folder, client=k)`` rebuilds it there. Returns the model file."""
    from fedhpro.reports import write_yaml

    folder = Path(folder)
    k = int(node.client)
    module, inference, note = tested_module(node.server, copy.deepcopy(model))
    x = node.data.x
    inputs = input_description(config, tuple(x.shape[1:]), x.dtype, partition)
    classes = list(config.data.classes) if getattr(config.data, "classes", None) else _classes(partition)
    info = model_info(config, int(node.data.num_classes), tuple(x.shape[1:]), classes, inputs, inference,
                      {k: _architecture(config, node.models.architectures, k)}, _why_personal(config), note=note)
    save_state(folder / client_file(k), module)
    write_yaml(folder / "config.yaml", config.to_dict())
    write_atomic(folder / MODEL_INFO, strict_json(info, indent=2) + "\n")
    return folder / client_file(k)


# ---------------------------------------------------------------------------- rebuilding from the folder


def read_info(folder: Path) -> dict[str, Any]:
    """model.json of the run folder ``folder``; a one-line ModelFileError when it is not there or not ours."""
    if not folder.is_dir():
        raise ModelFileError(f"{folder}: no such folder; give the folder of a finished run (its out=)")
    path = run_file(folder, MODEL_INFO, ModelFileError)
    if not path.is_file():
        finished = (folder / "summary.json").is_file()
        why = ("it finished before fedhpro wrote models (run it again to get model.pt)" if finished
               else "it is not a finished run folder (no summary.json)")
        raise ModelFileError(f"{folder} has no {MODEL_INFO}: {why}")
    info = read_json_file(path, ModelFileError)
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise ModelFileError(f"{path} is not a fedhpro model description ({FORMAT}); it may be from another "
                             "version")
    check_info(info, folder)
    return info


#: the most classes a model.json may describe: the data sets' own limit (``data.max_classes``) times ten; the
#: module is sized by it before its weights are read
MAX_CLASSES = 1_000_000
#: the most values one input of a model.json may hold (``input_shape``'s product): 16M, a 3 x 2365 x 2365 image
MAX_INPUT_VALUES = 2**24
#: the largest side of an image input (``input.size``)
MAX_IMAGE_SIDE = 8192


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


#: the largest magnitude a float32 feature has: the mean of such features lies within it, and so does their
#: std (half their range at most)
FLOAT32_MAX = torch.finfo(torch.float32).max
#: the smallest positive std float32 features give: their smallest difference, float32's least subnormal. A
#: std below it is no data's (1e-308 turns every input into infinity and every probability into NaN)
STD_FLOOR = 2.0**-149


def _plausible(values: Any, count: int, spread: bool) -> bool:
    """Whether ``values`` is ``count`` numbers that float32 features can have as their mean (``spread``
    False: within +-:data:`FLOAT32_MAX`) or as their std (from :data:`STD_FLOOR` to :data:`FLOAT32_MAX`)."""
    low = STD_FLOOR if spread else -FLOAT32_MAX
    return (isinstance(values, list) and len(values) == count
            and all(_is_number(v) and low <= v <= FLOAT32_MAX for v in values))


def _span(part: str) -> str:
    return f" > 0, from {STD_FLOOR:.2g} to {FLOAT32_MAX:.3g}" if part == "std" else f" within +-{FLOAT32_MAX:.3g}"


def check_info(info: Mapping[str, Any], folder: Path) -> None:
    """One :class:`ModelFileError` line unless every entry of ``info`` (a run folder's model.json) that fedhpro
    reads has the type and range :func:`model_info` writes, and every file it names lies inside ``folder``
    (:func:`inside_folder`): a run folder is untrusted input."""
    path = folder / MODEL_INFO

    def bad(key: str, value: Any, expected: str) -> ModelFileError:
        return ModelFileError(f"{path}: {key} is {_shown(value)}, not {expected}; the file is damaged or was not "
                              "written by fedhpro: run again")

    for key in ("method", "model", "inference"):
        if key in info and not isinstance(info[key], str):
            raise bad(key, info[key], "a name")
    for key in ("why_personal", "note"):
        if key in info and not isinstance(info[key], str):
            raise bad(key, info[key], "text")
    if "on_nodes" in info and not isinstance(info["on_nodes"], bool):
        raise bad("on_nodes", info["on_nodes"], "true or false")
    num_classes = info.get("num_classes")
    if not _is_int(num_classes, 1, MAX_CLASSES):
        raise bad("num_classes", num_classes, f"a whole number from 1 to {MAX_CLASSES:,}")
    classes = info.get("classes")
    if not (isinstance(classes, list) and len(classes) == num_classes and all(isinstance(c, str) for c in classes)):
        raise bad("classes", classes, f"a list of {num_classes} class names")
    shape = info.get("input_shape")
    if not (isinstance(shape, list) and 1 <= len(shape) <= 4 and all(_is_int(n, 1, MAX_INPUT_VALUES) for n in shape)
            and math.prod(shape) <= MAX_INPUT_VALUES):
        raise bad("input_shape", shape, f"1 to 4 sizes >= 1 of at most {MAX_INPUT_VALUES:,} values in all")
    if "feature_dim" in info and not _is_int(info["feature_dim"], 1, MAX_INPUT_VALUES):
        raise bad("feature_dim", info["feature_dim"], "a whole number >= 1")
    inputs = info.get("input", {})
    if not isinstance(inputs, dict):
        raise bad("input", inputs, "a mapping")
    if inputs.get("kind") == "image":
        if not _is_int(inputs.get("size"), 1, MAX_IMAGE_SIDE):
            raise bad("input.size", inputs.get("size"), f"a whole number from 1 to {MAX_IMAGE_SIDE}")
        for key in ("mean", "std"):
            values = inputs.get(key)
            if not _plausible(values, 3, key == "std"):
                raise bad(f"input.{key}", values, "three finite numbers" + _span(key))
        if inputs.get("normalize", "half") not in ("half", "preset"):
            raise bad("input.normalize", inputs.get("normalize"), "half or preset")
        if not isinstance(inputs.get("resize", False), bool):
            raise bad("input.resize", inputs.get("resize"), "true or false")
        if "bit_depth" in inputs and not _is_int(inputs["bit_depth"], 8, 16):
            raise bad("input.bit_depth", inputs["bit_depth"], "a bit depth from 8 to 16")
        if "standardize" in inputs:
            channels = inputs["standardize"]
            if not isinstance(channels, dict):
                raise bad("input.standardize", channels, "a mapping with mean and std")
            for key in ("mean", "std"):
                values = channels.get(key)
                if not _plausible(values, 3, key == "std"):
                    raise bad(f"input.standardize.{key}", values, "three finite numbers" + _span(key))
    elif "dtype" in inputs and not isinstance(inputs["dtype"], str):
        raise bad("input.dtype", inputs["dtype"], "a dtype name")
    if inputs.get("kind") != "image" and "standardize" in inputs and not isinstance(inputs["standardize"], str):
        raise bad("input.standardize", inputs["standardize"], "a name")
    if "statistics" in inputs:
        inside_folder(folder, inputs["statistics"], "input.statistics", path)
    if "config" in info:
        inside_folder(folder, info["config"], "config", path)
    if info.get("global") is not None:
        inside_folder(folder, info["global"], "global", path)
    personal = info.get("personal", {})
    if not isinstance(personal, dict):
        raise bad("personal", personal, "a mapping of client numbers to files")
    for client, entry in personal.items():
        if not (isinstance(client, str) and client.isdigit() and client.isascii() and len(client) <= 9):
            raise bad("a client of personal", client, "a client number")
        if not (isinstance(entry, dict) and isinstance(entry.get("architecture"), str)):
            raise bad(f"personal.{client}", entry, "a file and an architecture name")
        inside_folder(folder, entry.get("file"), f"personal.{client}.file", path)


def inside_folder(folder: Path, name: Any, key: str, source: Path) -> Path:
    """``folder / name`` for a file a run folder's description names (``source``'s entry ``key``), refused in
    one :class:`ModelFileError` line unless it stays inside ``folder``: a relative path without ``..``, whose
    resolved location (symbolic links followed) is inside the resolved folder."""
    def refuse(why: str) -> ModelFileError:
        return ModelFileError(f"{source}: {key} is {_shown(name)}, {why}; a run folder's files are named relative "
                              "to it: the file is damaged or was not written by fedhpro")

    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise refuse("not a file name inside the run folder")
    relative = Path(name)
    if relative.is_absolute() or name.startswith(("/", "~")) or ".." in relative.parts:
        raise refuse("which points outside the run folder")
    target = folder / relative
    try:
        root, resolved = folder.resolve(), target.resolve()
    except (OSError, RuntimeError):  # a loop of symbolic links
        raise refuse("which cannot be resolved") from None
    if not resolved.is_relative_to(root):
        raise refuse(f"which leads outside the run folder (to {resolved})")
    return target


def _model_factory_of(config: Config, info: Mapping[str, Any], model: Callable[..., nn.Module] | None,
                      folder: Path) -> Callable[[str], nn.Module]:
    """The run's architecture factory (name -> module), rebuilt from its config and model.json."""
    from fedhpro.experiment import model_factories
    from fedhpro.methods import get_method

    clients = max(int(config.run.clients or 0), len(info.get("personal", {})), 1)
    _, architecture_factory, _, _, _ = model_factories(
        config, get_method(config.run.method), int(info["num_classes"]), tuple(info["input_shape"]), clients,
        user_model=model)
    return architecture_factory


def _empty_module(config: Config, info: Mapping[str, Any], architecture: str,
                  model: Callable[..., nn.Module] | None, folder: Path) -> nn.Module:
    """The module the saved state dict belongs to, freshly built (the caller's RNG left as it was)."""
    from fedhpro.methods.prototypes import NearestPrototypeClassifier

    factory = _model_factory_of(config, info, model, folder)
    with torch.random.fork_rng(devices=[]):
        network = factory(architecture)
    inference = info.get("inference", HEAD)
    if inference == HEAD:
        return network
    if inference == NEAREST_PROTOTYPE:
        from fedhpro.methods.base import classifier_of

        classes, dim = int(info["num_classes"]), classifier_of(network).in_features
        return NearestPrototypeClassifier(network, torch.zeros(classes, dim), torch.zeros(classes, dtype=torch.bool))
    raise ModelFileError(f"{folder / MODEL_INFO} names the inference rule {inference!r}, which this fedhpro does not "
                         f"know ({HEAD} or {NEAREST_PROTOTYPE})")


def read_state(path: Path) -> dict[str, Tensor]:
    """A saved state dict, read with ``weights_only=True`` (never unpickled); one line when it is not one."""
    if not path.is_file():
        raise ModelFileError(f"{path} is missing; the run folder is incomplete (run it again)")
    try:
        state = load_torch(path, Bound.state(), ModelFileError)  # its declared sizes checked first
    except ModelFileError:
        raise
    except Exception as error:  # noqa: BLE001 - anything torch.load raises is a damaged or foreign file
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
        raise ModelFileError(f"{path} is not a state dict fedhpro can read ({reason}); it is damaged or was not "
                             "written by fedhpro") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()):
        raise ModelFileError(f"{path} holds a {type(state).__name__}, not a state dict of tensors; it was not "
                             "written by fedhpro")
    return state


def check_state(state: Mapping[str, Tensor], module: nn.Module, path: Path, what: str) -> None:
    """One ModelFileError line unless ``state`` has exactly ``module``'s keys with its shapes."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    shapes = [f"{k} {tuple(state[k].shape)} instead of {tuple(v.shape)}" for k, v in expected.items()
              if k in state and tuple(state[k].shape) != tuple(v.shape)]
    problems = ([f"missing {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else "")] if missing else []) + \
        ([f"unexpected {', '.join(unexpected[:3])}" + (" ..." if len(unexpected) > 3 else "")] if unexpected else [])
    problems += [f"shape of {shapes[0]}" + (f" (and {len(shapes) - 1} more)" if len(shapes) > 1 else "")] \
        if shapes else []
    if problems:
        raise ModelFileError(f"{path} does not fit {what} ({'; '.join(problems)}); it was written by another run "
                             "or version: give the run folder it belongs to")


def run_config(folder: Path, info: Mapping[str, Any], model: Callable[..., nn.Module] | None) -> Config:
    """The run's config (its config.yaml); a model that came from Python (``model: python:<name>``) must be
    passed again as ``model`` (the same callable, by name), and only then."""
    import dataclasses

    from fedhpro.config import read_yaml
    from fedhpro.user_models import python_name

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
               model: Callable[..., nn.Module] | None = None, device: str | torch.device = "cpu") -> nn.Module:
    """The trained model of a finished run, rebuilt from its folder alone (eval mode, on ``device``).

    The folder's ``config.yaml`` and ``model.json`` rebuild the module the run tested (the same model
    factory as the run: the registered ``model=``, the method's wrapper, a projection head, the
    nearest-prototype rule); ``model.pt`` is read with ``torch.load(weights_only=True)`` and every key
    and shape is checked first (one :class:`ModelFileError` line otherwise).

    Args:
        run_folder: the run's folder (its ``out=``).
        client: a client's personal model (runs whose clients keep their own models:
            ``heterogeneity=``, ``protocol=proto-only``); those runs have no global model.
        model: the model callable, for a run whose model came from Python (``model: python:...`` in
            its config.yaml): the same callable passed to :func:`fedhpro.run`.
        device: where the module is put (default the CPU).
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
            raise ConfigError(_no_client_message(info, int(client), str(folder)))
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
    return module.eval().to(torch.device(device))


# ---------------------------------------------------------------------------- predicting


def read_statistics(folder: Path, info: Mapping[str, Any]) -> dict[str, Any]:
    """standardize.json of a run folder whose model.json names it, checked: every site's and the pooled
    ``mean`` and ``std`` are lists of the model's feature count of finite numbers that float32 features can
    have (:func:`_plausible`: ``std`` > 0). A missing, damaged or foreign file is one :class:`ModelFileError`
    line."""
    inputs = info.get("input", {})
    features = int(info["input_shape"][0])
    if "statistics" not in inputs:
        raise ModelFileError(
            f"{folder} was trained with data.standardize=client (each site scaled its features by its own mean "
            f"and std) but its folder records no {STATISTICS_FILE} to scale new rows the same way (a run of an "
            "older fedhpro or of Flower): run it again with this fedhpro (or train with data.standardize=none)")
    path = inside_folder(folder, inputs["statistics"], "input.statistics", folder / MODEL_INFO)
    if not path.is_file():
        raise ModelFileError(f"{path} is missing; the run folder is incomplete (run it again)")
    content = read_json_file(path, ModelFileError)

    def bad(key: str, value: Any, expected: str) -> ModelFileError:
        return ModelFileError(f"{path}: {key} is {_shown(value)}, not {expected}; the file is damaged or was not "
                              "written by fedhpro: run again")

    if not isinstance(content, dict) or content.get("format") != STATISTICS_FORMAT:
        raise ModelFileError(f"{path} is not a fedhpro statistics file ({STATISTICS_FORMAT}); it may be from "
                             "another version: run again")
    sites = content.get("sites")
    if not isinstance(sites, dict) or not sites:
        raise bad("sites", sites, "a mapping of site names to statistics")
    pairs = {**{f"sites.{name}": entry for name, entry in sites.items()}, POOLED: content.get(POOLED)}
    for key, entry in pairs.items():
        if not isinstance(entry, dict):
            raise bad(key, entry, "a mapping with mean and std")
        for part in ("mean", "std"):
            values = entry.get(part)
            if not _plausible(values, features, part == "std"):
                raise bad(f"{key}.{part}", values, f"{features} finite numbers{_span(part)} (what float32 "
                          f"features give as their {part})")
    return content


def prepare_inputs(run_folder: str | os.PathLike, x: Tensor, *, site: str | None = None) -> Tensor:
    """``x`` (N x the model's input shape, raw as the training files held it) made what the run's model
    takes: for tabular own data trained with ``data.standardize=client``, each feature scaled by the
    training mean and std of ``site`` (a site folder's name), by default of every site's training rows
    pooled (a new site); other runs' inputs are returned as they are. Use it with :func:`load_model`;
    :func:`predict` applies it."""
    folder = Path(run_folder)
    info = read_info(folder)
    return _prepared(folder, info, x, site)


def _prepared(folder: Path, info: Mapping[str, Any], x: Tensor, site: str | None) -> Tensor:
    inputs = info.get("input", {})
    if inputs.get("standardize", "none") == "none" or inputs.get("kind") != "tensor":
        if site is not None:
            raise ConfigError(f"{folder}'s inputs were not scaled per site (no data.standardize=client on tabular "
                              "data); leave out the site")
        return x
    if inputs["standardize"] != "client":
        raise ModelFileError(f"{folder / MODEL_INFO}: input.standardize is {_shown(inputs['standardize'])}, which "
                             "this fedhpro cannot rebuild (client or none); run again")
    statistics = read_statistics(folder, info)
    if site is None:
        entry = statistics[POOLED]
    elif site in statistics["sites"]:
        entry = statistics["sites"][site]
    else:
        names = sorted(statistics["sites"])
        raise ConfigError(f"{folder} has no site {site!r}; its sites are {', '.join(names)} (leave the site out for "
                          "a new site: every site's training rows pooled)")
    from fedhpro.data.clients import apply_statistics

    mean = torch.tensor(entry["mean"], dtype=torch.float64)
    std = torch.tensor(entry["std"], dtype=torch.float64)
    scaled = apply_statistics(x, mean, std)
    if x.is_floating_point() and bool(torch.isfinite(x).all()) and not bool(torch.isfinite(scaled).all()):
        where = [int(i) for i in (~torch.isfinite(scaled)).nonzero()[0]]
        raise ModelFileError(f"{folder / STATISTICS_FILE}: its {site or POOLED} mean and std scale the input at "
                             f"{where} beyond float32's range; they are not statistics of such data: run again, or "
                             "check the inputs' units")
    return scaled


def _image_files(folder: Path) -> list[Path]:
    """The image files in ``folder`` and below (hidden ones skipped), sorted by path."""
    from fedhpro.data.loaders import IMAGE_EXTENSIONS

    found = [p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    return sorted(found)


def _image_input(path: Path, inputs: Mapping[str, Any]) -> Tensor:
    """One image file as the run's data set made its inputs: decoded to RGB (grey replicated, alpha dropped)
    by :func:`fedhpro.data.images.decode_file`, resized to S x S where the data set resizes (else an image of
    another size is refused), normalised as the data set normalises. ``3 x S x S`` float32."""
    from PIL import Image

    from fedhpro.data.images import decode_file, open_image, to_float

    size = int(inputs["size"])
    if not inputs.get("resize", False):
        try:
            with open_image(path) as image:  # its pixel count checked before anything is decoded
                width, height = image.size
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
            reason = (str(error).splitlines() or [type(error).__name__])[0]
            raise DataError(f"cannot decode the image {path} ({reason}); give PNG/JPEG images") from None
        if (width, height) != (size, size):
            raise DataError(f"{path} is {width}x{height} pixels; this run's model takes {size}x{size} images "
                            f"({inputs.get('dataset', 'its data set')} does not resize): resize it to {size}x{size}")
    bits = inputs.get("bit_depth")
    if bits is not None:
        import numpy as np

        # as the image folder decoded its data set: 16-bit values kept, an 8-bit image as its 16-bit equivalent
        pixels = decode_file(path, size, depth=True)[None]
        if pixels.dtype != np.uint16:
            pixels = pixels.astype(np.uint16) * 257
        try:
            x = to_float(pixels, int(bits))[0]
        except DataError:
            raise DataError(f"{path} holds values above {bits} bits, the depth of this run's images; give "
                            f"{bits}-bit images") from None
    else:
        pixels = decode_file(path, size)[None]
        if inputs.get("normalize") == "preset":
            from fedhpro.data.benchmarks import to_float as preset_float
            from fedhpro.data.loaders import Preset

            preset = Preset(size, tuple(inputs["mean"]), tuple(inputs["std"]))  # type: ignore[arg-type]
            return preset_float(pixels, preset, size)[0]
        x = to_float(pixels)[0]
    channels = inputs.get("standardize")
    if isinstance(channels, Mapping):
        # recorded in 0..1 units; training scaled [-1, 1] inputs by 2 * mean - 1 and 2 * std, in float32
        mean = (2 * torch.tensor(channels["mean"], dtype=torch.float64) - 1).float().view(-1, 1, 1)
        std = (2 * torch.tensor(channels["std"], dtype=torch.float64)).float().view(-1, 1, 1)
        x = x.sub(mean).div(std)
    return x


def _read_npz(path: Path) -> Any:
    """The array ``x`` of a ``.npz`` file (a training file: ``x`` and ``y``), else its only array; every member's
    declared size and header checked before anything is read (:func:`fedhpro.arrays.load_npz`)."""
    arrays = load_npz(path)  # a damaged or foreign file: one line naming it
    if "x" in arrays:
        return arrays["x"]
    if len(arrays) == 1:
        return next(iter(arrays.values()))
    raise DataError(f"{path} holds {len(arrays)} arrays and no x; save the inputs as x: np.savez(path, x=x)")


def _tensor_inputs(path: Path, inputs: Mapping[str, Any], model_shape: Sequence[int]) -> Tensor:
    """The N inputs of a ``.pt`` or ``.npz`` tensor file, N x the model's input shape: one tensor (array), or
    a training file's ``x`` (its ``y`` is not read as an input). ``.pt`` is read with ``weights_only=True``,
    ``.npz`` without pickles: no file runs code; what either declares is checked against
    ``FEDHPRO_MAX_ARRAY_BYTES`` first (:mod:`fedhpro.arrays`)."""
    if path.suffix.lower() == ".npz":
        value: Any = _read_npz(path)
    else:
        try:
            value = load_torch(path)  # its declared sizes checked first
        except ArrayFileError:
            raise
        except Exception as error:  # noqa: BLE001 - a damaged or foreign file
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
            raise DataError(f"{path} is not a tensor file fedhpro can read ({reason}); save one with "
                            "torch.save(x, path), x an N x ... tensor") from None
        if isinstance(value, dict) and "x" in value:
            value = value["x"]
    shape = tuple(int(n) for n in model_shape)
    if not isinstance(value, Tensor):
        value = _as_input_tensor(value, path, shape)
    if tuple(value.shape) == shape:
        value = value.unsqueeze(0)
    if value.dim() != len(shape) + 1 or tuple(value.shape[1:]) != shape:
        raise DataError(f"{path} holds a tensor of shape {tuple(value.shape)}; this run's model takes N x "
                        f"{' x '.join(map(str, shape))} inputs (check the channels and the size)")
    wants_integers = inputs.get("kind") == "tensor" and not str(inputs.get("dtype", "float32")).startswith("float")
    if wants_integers:
        if value.is_floating_point() and not bool(torch.all(value == value.round())):
            raise DataError(f"{path} holds {value.dtype} values; this run's model takes integer token ids")
        return value.long()
    if not (value.is_floating_point() or value.dtype in (torch.int32, torch.int64)) or value.dtype == torch.uint8:
        raise DataError(f"{path} holds {value.dtype} values; give float inputs, preprocessed as the run's data "
                        "(uint8 pixels: save images as PNG files instead)")
    value = value.float()
    if not bool(torch.isfinite(value).all()):
        raise DataError(f"{path} holds NaN or infinite values; clean the inputs")
    return value


def _as_input_tensor(value: Any, path: Path, shape: Sequence[int]) -> Tensor:
    """A numeric array (a ``.npz`` file's, or a training file's ``x``) as a CPU tensor; anything else refused."""
    import numpy as np

    wanted = " x ".join(map(str, shape))
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        if value.dtype.kind == "u" and value.dtype.itemsize > 1:
            value = value.astype(np.int64)  # torch has no wide unsigned arithmetic
        return torch.from_numpy(np.ascontiguousarray(value))
    what = f"{value.dtype} values" if isinstance(value, np.ndarray) else f"a {type(value).__name__}"
    raise DataError(f"{path} holds {what}; save one numeric tensor, N x {wanted}")


def gather_inputs(paths: Iterable[str | os.PathLike], info: Mapping[str, Any]) -> tuple[list[str], Tensor]:
    """``(names, inputs)``: every image file given (or found in a given folder) and every row of a given
    ``.pt`` / ``.npz`` tensor file (named ``file.pt[i]``), as the model's inputs; one DataError line for a wrong
    path. Tensor rows are returned as the file holds them (:func:`prepare_inputs` scales them as training did)."""
    inputs, shape = info.get("input", {}), info["input_shape"]
    names: list[str] = []
    rows: list[Tensor] = []
    given = [Path(p) for p in paths]
    if not given:
        raise ConfigError("give at least one input: image files, folders of images or a .pt/.npz tensor file")
    for path in given:
        if not path.exists():
            raise DataError(f"{path}: no such file or folder; give image files, folders of images or a .pt/.npz "
                            "tensor file")
        if path.is_file() and path.suffix.lower() in (".pt", ".npz"):
            batch = _tensor_inputs(path, inputs, shape)
            names += [f"{path}[{i}]" for i in range(batch.shape[0])]
            rows += list(batch)
            continue
        files = _image_files(path) if path.is_dir() else [path]
        if path.is_dir() and not files:
            raise DataError(f"{path} holds no image files (.png, .jpg, ...); give a folder of images")
        if inputs.get("kind") != "image":
            raise DataError(f"{path}: this run's model takes tensors of shape {tuple(shape)}, not images; give a "
                            ".pt/.npz file of an N x ... tensor, preprocessed as the run's data")
        from fedhpro.data.loaders import IMAGE_EXTENSIONS

        for file in files:
            if file.suffix.lower() not in IMAGE_EXTENSIONS:
                raise DataError(f"{file} is not an image file ({', '.join(IMAGE_EXTENSIONS)}) or a .pt/.npz tensor "
                                "file")
            names.append(str(file))
            rows.append(_image_input(file, inputs))
    return names, torch.stack(rows)


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
    inputs = _prepared(folder, info, inputs, site)
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


__all__ = ["MODEL_FILE", "MODEL_INFO", "ModelFileError", "PERSONAL_FOLDER", "TrainedModels", "client_file",
           "input_description", "load_model", "predict", "prepare_inputs", "read_state", "read_statistics",
           "final_models", "server_models", "simulator_models", "write_models", "write_node_model"]


# ---------------------------------------------------------------------------- per-class accuracy


@torch.no_grad()
def _class_counts(module: nn.Module, x: Tensor, y: Tensor, num_classes: int,
                  batch_size: int = 256) -> tuple[Tensor, Tensor]:
    """``(correct, total)`` per true class (two length-C int64 vectors) of ``module``'s argmax on ``(x, y)``."""
    correct = torch.zeros(num_classes, dtype=torch.int64)
    for i in range(0, len(y), batch_size):
        labels = y[i:i + batch_size].cpu()
        hits = module(x[i:i + batch_size]).argmax(1).cpu() == labels
        correct += torch.bincount(labels[hits], minlength=num_classes)[:num_classes]
    return correct, torch.bincount(y.cpu(), minlength=num_classes)[:num_classes]


def class_accuracy(run_folder: str | os.PathLike, *, model: Callable[..., nn.Module] | None = None,
                   batch_size: int = 256) -> dict[str, Any]:
    """Per-class test accuracy of a finished run's trained model(s), recomputed from its folder alone.

    The data are rebuilt from the run's ``config.yaml`` (same data set, seed and partition: the same
    federation) and the model(s) from ``model.pt`` / ``models/`` (:func:`load_model`), and tested as the run
    tested them: one global model on each test set; personal models (or a federation that arrived split into
    per-client test sets) client by client, the counts pooled per test set.

    Returns a JSON-ready dict: ``classes`` (names, or None), ``train_counts`` (training images per class summed
    over the clients), ``test_sets`` (per test set ``correct`` and ``total`` per class), ``accuracy`` (per test
    set and ``AVG``, their unweighted mean: the run's own accuracy, recomputed) and ``reported`` (summary.json's
    final accuracy, None if absent). ``reported`` differing from ``accuracy["AVG"]`` means the data or the
    model files changed since the run.
    """
    from fedhpro.data import get_dataset

    folder = Path(run_folder)
    info = read_info(folder)
    config = run_config(folder, info, model)
    options = config.run
    if config.federation is not None:
        raise ConfigError(f"{folder}'s data came from Python ({config.federation}); its per-class accuracy cannot "
                          "be rebuilt from the folder: test the model yourself, fedhpro.load_model(folder)")
    federation = get_dataset(options.dataset).build(config.data, options.clients, options.seed,
                                                    data_dir=options.data_dir, progress=False,
                                                    partition=config.partition)
    num_classes = federation.num_classes
    counts: dict[str, list[Tensor]] = {name: [torch.zeros(num_classes, dtype=torch.int64),
                                              torch.zeros(num_classes, dtype=torch.int64)]
                                       for name in federation.test_sets}

    def add(name: str, module: nn.Module, x: Tensor, y: Tensor) -> None:
        correct, total = _class_counts(module, x, y, num_classes, batch_size)
        pooled = counts.setdefault(name, [torch.zeros_like(correct), torch.zeros_like(total)])
        pooled[0] += correct
        pooled[1] += total

    global_model = None if not info.get("global") else load_model(folder, model=model)
    if global_model is not None and federation.client_tests is None:
        for name, (x, y) in federation.test_sets.items():
            add(name, global_model, x, y)
    else:
        for k in range(federation.num_clients):
            name = federation.client_test_name(k)
            x, y = federation.client_tests[k] if federation.client_tests is not None else federation.test_sets[name]
            if len(y):
                add(name, global_model if global_model is not None else load_model(folder, client=k, model=model),
                    x, y)
    tested = {name: pair for name, pair in counts.items() if int(pair[1].sum())}
    accuracy = {name: float(pair[0].sum()) / float(pair[1].sum()) * 100 for name, pair in tested.items()}
    accuracy["AVG"] = sum(accuracy.values()) / len(accuracy) if accuracy else 0.0
    summary_path = run_file(folder, "summary.json", ModelFileError)
    reported = None
    if summary_path.is_file():
        summary = read_json_file(summary_path, DataError)
        reported = summary.get("accuracy") if isinstance(summary, dict) else None
        if reported is not None and (not isinstance(reported, (int, float)) or isinstance(reported, bool)):
            raise DataError(f"{summary_path}: accuracy is {_shown(reported)}, not a number; the file is damaged: "
                            "delete it or run again")
    train_counts = sum((torch.bincount(client.y.cpu(), minlength=num_classes)[:num_classes]
                        for client in federation.clients), torch.zeros(num_classes, dtype=torch.int64))
    return {"classes": info.get("classes"),
            "train_counts": [int(v) for v in train_counts],
            "test_sets": {name: {"correct": [int(v) for v in pair[0]], "total": [int(v) for v in pair[1]]}
                          for name, pair in tested.items()},
            "accuracy": accuracy, "reported": reported}
