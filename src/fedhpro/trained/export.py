"""A finished run's trained models written into its folder: ``model.pt`` (or ``models/client_<k>.pt``),
``model.json`` and ``standardize.json`` (:mod:`fedhpro.trained.folder` says what each holds).

The models are saved as the run tested them: the network through the method's inference rule (declared on its
:attr:`~fedhpro.methods.base.MethodSpec.inference_rule`, so that :func:`fedhpro.load_model` rebuilds it), and
model.json records how a new image becomes an input as the run's data set declares it
(:attr:`~fedhpro.data.spec.DatasetSpec.image_input`): nothing here names a data set or a method."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fedhpro.config import Config
from fedhpro.data import get_dataset
from fedhpro.data.clients import standardization_statistics
from fedhpro.engines.printout import warn_line
from fedhpro.files import strict_json, write_atomic, write_atomic_with
from fedhpro.methods import get_method
from fedhpro.methods.base import InferenceRule, load_weights
from fedhpro.reports import write_yaml
from fedhpro.trained.folder import (
    FORMAT,
    HEAD,
    MODEL_FILE,
    MODEL_INFO,
    POOLED,
    STATISTICS_FILE,
    STATISTICS_FORMAT,
    TrainedModels,
    client_file,
)

try:  # the optional extra fedhpro[export]: model.safetensors beside model.pt where it is installed
    from safetensors.torch import save as save_safetensors
except ImportError:  # pragma: no cover - the extra is missing
    save_safetensors = None  # type: ignore[assignment]


#: the suffix of the safetensors copy of each model file (model.safetensors, models/client_<k>.safetensors)
SAFETENSORS_SUFFIX = ".safetensors"


def input_description(config: Config, input_shape: Sequence[int], dtype: torch.dtype,
                      partition: Mapping[str, Any] | None) -> dict[str, Any]:
    """How a new input becomes what the model takes, as the run's data set made its inputs.

    For a data set whose spec declares its images (:attr:`~fedhpro.data.spec.DatasetSpec.image_input`) and a
    ``3 x S x S`` input, what the spec says: ``{"kind": "image", "size": S, "resize": bool, "mean": [...],
    "std": [...], "normalize": "half" | "preset", ...}`` (``resize``: any size is resized as in training; else
    only S x S images fit); otherwise ``{"kind": "tensor", "shape": [...], "dtype": "float32" | "int64"}``
    (tabular, tokens, data from Python)."""
    shape = [int(n) for n in input_shape]
    tensor: dict[str, Any] = {"kind": "tensor", "shape": shape, "dtype": str(dtype).removeprefix("torch.")}
    # the mode the run applied (partition.json records it: data.standardize=auto resolved), else the config's
    standardize = (partition or {}).get("standardize", getattr(config.data, "standardize", "none"))
    if standardize in ("client", "federated") and len(shape) == 1 and dtype.is_floating_point:
        # the sites scaled their features: standardize.json says how, so that a new input is scaled alike
        tensor["standardize"] = standardize
    if config.federation is not None or len(shape) != 3 or shape[0] != 3 or shape[1] != shape[2]:
        return tensor
    image_input = get_dataset(config.run.dataset).image_input
    image = None if image_input is None else image_input(config.data, partition or {}, shape[1])
    return tensor if image is None else image


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


def _kept_by(rule: InferenceRule, module: nn.Module, network: nn.Module, num_classes: int) -> bool:
    """Whether ``module`` (what the server tests ``network`` through) is what the method's ``rule`` rebuilds
    from a folder: a module of the same type, keys and shapes as the rule's empty one (built on the meta
    device: no memory)."""
    if rule.name == HEAD:
        return False
    with torch.device("meta"):
        empty = rule.build(network, num_classes)
    if type(empty) is not type(module):
        return False
    expected = {name: tuple(t.shape) for name, t in empty.state_dict().items()}
    return expected == {name: tuple(t.shape) for name, t in module.state_dict().items()}


def tested_module(server: Any, network: nn.Module, rule: InferenceRule | None,
                  num_classes: int) -> tuple[nn.Module, str, str | None]:
    """``(module, rule name, note)``: ``network`` (moved to the CPU, eval mode) through the server's inference
    rule and that rule's name: ``head`` for the network itself, else the method's declared ``rule``. A module
    the method's rule does not rebuild (a plug-in method that declares none) leaves the network with its own
    classifier, and a note saying so (the run is not stopped for it; the user is warned)."""
    network = network.cpu().eval()
    module = server.inference_model(network)
    if module is network:
        return module.cpu().eval(), HEAD, None
    if rule is not None and _kept_by(rule, module, network, num_classes):
        return module.cpu().eval(), rule.name, None
    why = ("the method declares no MethodSpec.inference_rule" if rule is None
           else f"not what its MethodSpec.inference_rule {rule.name!r} builds")
    note = (f"the method tests its model through a {type(module).__name__} (its own inference rule), which "
            f"fedhpro cannot rebuild from a folder ({why}): this is the network with its own classifier, whose "
            "logits may differ from those the run was tested with")
    warn_line(note)
    return network, HEAD, note


def tensors_only(module: nn.Module) -> dict[str, Tensor]:
    """The module's state dict as plain CPU tensors sharing no storage with it (what ``model.pt`` holds)."""
    return {name: tensor.detach().cpu().clone().contiguous() for name, tensor in module.state_dict().items()}


def save_state(path: Path, module: nn.Module) -> None:
    """``module``'s state dict to ``path``, atomically (:func:`fedhpro.files.write_atomic_with`), and, where
    safetensors is installed (``pip install fedhpro[export]``), the same tensors beside it as
    ``<name>.safetensors``, which other tools load without torch's pickle format."""
    state = tensors_only(module)
    write_atomic_with(path, lambda handle: torch.save(state, handle))
    if save_safetensors is not None:
        write_atomic(path.with_suffix(SAFETENSORS_SUFFIX), save_safetensors(state))


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
    statistics = _shared_statistics(inputs, partition) or (None if on_nodes else _statistics_of(config, inputs))
    if statistics is not None:
        inputs["statistics"] = STATISTICS_FILE
    classes = _classes(partition)
    rule = get_method(config.run.method).inference_rule
    if not models.personal:
        network = copy.deepcopy(models.global_model)
        network.load_state_dict(server.global_weights())
        module, inference, note = tested_module(server, network, rule, num_classes)
        info = model_info(config, num_classes, input_shape, classes, inputs, inference, None, note=note)
        return TrainedModels(info, global_model=module, statistics=statistics)
    count = len(models.architectures)  # one per client whenever the models are personal
    personal: dict[int, nn.Module] = {}
    inference, note = _inference_option(config), None
    if not on_nodes:
        for k in range(count):
            personal[k], inference, note = personal_module(models, server, k, models.client_weights[k], rule,
                                                           num_classes)
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


def _shared_statistics(inputs: Mapping[str, Any], partition: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """standardize.json's content for a run whose sites scaled their features by one shared scaling
    (``data.standardize=federated``: partition.json's ``scaling``, the server's on Flower): that scaling for
    every site and for a new one; else None."""
    scaling = (partition or {}).get("scaling")
    if inputs.get("standardize") != "federated" or not isinstance(scaling, Mapping) or scaling.get("mean") is None:
        return None
    shared = {"mean": [float(v) for v in scaling["mean"]], "std": [float(v) for v in scaling["std"]]}
    names = [str(client.get("name", client.get("client"))) for client in (partition or {}).get("clients", [])
             if isinstance(client, Mapping)]
    return {"format": STATISTICS_FORMAT, "standardize": "federated",
            "sites": {name: shared for name in names} or {"all": shared}, POOLED: shared}


def _statistics_of(config: Config, inputs: Mapping[str, Any]) -> dict[str, Any] | None:
    """standardize.json's content for a run whose sites scaled their features (``data.standardize=client``
    on tabular own data), rebuilt from the same files as the run's federation; else None."""
    if inputs.get("standardize") != "client" or config.run.dataset != "clients" or config.federation is not None:
        return None
    found = standardization_statistics(config.data, config.run.data_dir)  # type: ignore[arg-type]
    if found is None:
        return None
    return {"format": STATISTICS_FORMAT, "standardize": "client", **found}


def personal_module(models: Any, server: Any, k: int, weights: Mapping[str, Tensor], rule: InferenceRule | None,
                    num_classes: int) -> tuple[nn.Module, str, str | None]:
    """Client ``k``'s personal model (``weights``) with the server's global shared part loaded, through the
    server's inference rule: what the run tests client ``k`` with. A copy; ``models`` is not changed."""
    network = copy.deepcopy(models.working_models[models.architectures[k]])
    network.load_state_dict(dict(weights))
    load_weights(network, server.global_weights())
    return tested_module(server, network, rule, num_classes)


def server_models(side: Any, partition: Mapping[str, Any] | None) -> TrainedModels:
    """Flower ServerApp: the final models of ``side`` (:class:`fedhpro.flower.engine.ServerSide`) by
    :func:`final_models`; the input shape comes from the engine's federation (partition mode) or from what the
    nodes reported (own data: ``partition["clients"]``). Personal models stay on the nodes."""
    if side.federation is not None:
        federation = side.federation
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
    folder = Path(folder)
    k = int(node.client)
    module, inference, note = tested_module(node.server, copy.deepcopy(model),
                                            get_method(config.run.method).inference_rule, int(node.data.num_classes))
    x = node.data.x
    inputs = input_description(config, tuple(x.shape[1:]), x.dtype, partition)
    classes = list(config.data.classes) if getattr(config.data, "classes", None) else _classes(partition)
    info = model_info(config, int(node.data.num_classes), tuple(x.shape[1:]), classes, inputs, inference,
                      {k: _architecture(config, node.models.architectures, k)}, _why_personal(config), note=note)
    save_state(folder / client_file(k), module)
    write_yaml(folder / "config.yaml", config.to_dict())
    write_atomic(folder / MODEL_INFO, strict_json(info, indent=2) + "\n")
    return folder / client_file(k)
