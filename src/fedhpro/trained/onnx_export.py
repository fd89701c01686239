"""The trained model as ONNX, with its input preprocessing, for runtimes other than PyTorch
(:func:`export_onnx`, ``fedhpro export``).

The graph is the module :func:`~fedhpro.trained.load.load_model` rebuilds (the network, or the method's
inference rule), preceded by the run's preprocessing where it is a few tensor operations: tabular rows of a
``data.standardize=client`` run scaled by the pooled (or one site's) training statistics in float64, as
:func:`~fedhpro.trained.inputs.prepare_inputs` does; ``uint8`` images of the default normalisation (to [-1, 1],
then the run's channel statistics) converted as the run converted them. Images normalised by a preset (resized
and scaled in NumPy) or kept at 16 bits are exported on prepared float32 inputs; :class:`OnnxModel` says which.
The batch dimension is dynamic. Written with torch's ONNX exporter (``pip install fedhpro[export]``).

The file says what it is in its ``metadata_props`` (JSON strings, :data:`METADATA_KEYS`; onnxruntime's
``session.get_modelmeta().custom_metadata_map``): the class names in the order of the scores, the input and its
shape, the feature columns in the order the graph takes them (a run on tables with named columns), and the
preprocessing: what the graph applies itself, with the statistics, or what the caller must apply first."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fedhpro.errors import ConfigError
from fedhpro.files import write_atomic
from fedhpro.trained.checks import check_finite_weights, read_info, read_statistics
from fedhpro.trained.folder import POOLED, client_file
from fedhpro.trained.inputs import prepared, trained_columns
from fedhpro.trained.load import load_model

#: the ONNX opset the graphs are written in
OPSET = 18
#: the keys of the graph's ``metadata_props``, each value a JSON string: the class names (``scores``'s columns),
#: what the input is (``raw rows``, ``uint8 pixels``, ``prepared float32``, ``int64 tokens``) and its shape, the
#: feature columns in order (a list, or null for data without column names), the preprocessing
CLASSES_KEY, INPUT_KEY, SHAPE_KEY, FEATURES_KEY, PREPROCESSING_KEY = (
    "fedhpro.classes", "fedhpro.input", "fedhpro.input_shape", "fedhpro.features", "fedhpro.preprocessing")
METADATA_KEYS = (CLASSES_KEY, INPUT_KEY, SHAPE_KEY, FEATURES_KEY, PREPROCESSING_KEY)


class TabularInput(nn.Module):
    """Raw feature rows scaled by training statistics in float64, then the network (``prepare_inputs``'s map)."""

    mean: Tensor
    std: Tensor

    def __init__(self, network: nn.Module, mean: Tensor, std: Tensor):
        super().__init__()
        self.network = network
        self.register_buffer("mean", mean.to(torch.float64))
        self.register_buffer("std", std.to(torch.float64))

    def forward(self, rows: Tensor) -> Tensor:
        return self.network(((rows.to(torch.float64) - self.mean) / self.std).to(torch.float32))


class PixelInput(nn.Module):
    """``uint8`` pixels to [-1, 1] (``normalize_images``), then the run's channel statistics, then the network."""

    mean: Tensor
    std: Tensor

    def __init__(self, network: nn.Module, channels: Mapping[str, Any] | None):
        super().__init__()
        self.network = network
        self.standardize = channels is not None
        mean = torch.zeros(3) if channels is None else (2 * torch.tensor(channels["mean"], dtype=torch.float64) - 1)
        std = torch.ones(3) if channels is None else (2 * torch.tensor(channels["std"], dtype=torch.float64))
        self.register_buffer("mean", mean.float().view(1, -1, 1, 1))
        self.register_buffer("std", std.float().view(1, -1, 1, 1))

    def forward(self, pixels: Tensor) -> Tensor:
        x = pixels.to(torch.float32) / 127.5 - 1.0
        if self.standardize:
            x = (x - self.mean) / self.std
        return self.network(x)


@dataclass(frozen=True)
class OnnxModel:
    """An exported model: its file, and what its one input is (``raw rows``, ``uint8 pixels`` or ``prepared
    float32``) with its shape (``batch`` first)."""

    path: Path
    input: str
    shape: tuple[Any, ...]
    #: the graph's ``metadata_props`` (:data:`METADATA_KEYS`), JSON strings
    metadata: dict[str, str] = field(default_factory=dict)


def export_onnx(run_folder: str | os.PathLike, path: str | os.PathLike | None = None, *, client: int | None = None,
                site: str | None = None) -> OnnxModel:
    """Write the run's trained model (``client=k``: client k's personal model) as ONNX with its preprocessing
    (module doc) to ``path`` (default ``<run>/model.onnx``, or ``<run>/models/client_<k>.onnx``), atomically.
    ``site``: tabular ``data.standardize=client`` runs, the site whose statistics scale the rows (default every
    site's pooled). A model the exporter cannot trace, or whose weights are not finite numbers (a graph that
    would answer NaN, which ``predict`` refuses), is refused in one line."""
    folder = Path(run_folder)
    info = read_info(folder)
    network = load_model(folder, client=client, preprocess=False)
    check_finite_weights(network, folder)
    shape = [int(n) for n in info["input_shape"]]
    inputs = info.get("input", {})
    module: nn.Module = network
    kind = "prepared float32"
    example = torch.zeros(2, *shape)
    # what the graph does to its input before the network (in_graph), else what the caller does first
    preprocessing: dict[str, Any] = {"in_graph": False, "input": inputs}
    if inputs.get("kind") == "tensor" and inputs.get("standardize", "none") != "none":
        prepared(folder, info, torch.zeros(1, *shape), site)  # an unknown site: one line
        statistics = read_statistics(folder, info)
        entry = statistics[POOLED] if site is None else statistics["sites"][site]
        module = TabularInput(network, torch.tensor(entry["mean"]), torch.tensor(entry["std"]))
        kind = "raw rows"
        preprocessing = {"in_graph": True, "scaling": "(x - mean) / std in float64, then float32",
                         "statistics": site or POOLED, "mean": entry["mean"], "std": entry["std"]}
    elif site is not None:
        raise ConfigError(f"{folder}'s inputs are not scaled per site; leave out the site")
    elif inputs.get("kind") == "tensor" and len(shape) == 1 and inputs.get("dtype", "float32") == "float32":
        kind = "raw rows"  # rows the run did not scale: the network takes them as the files held them
        preprocessing = {"in_graph": True, "scaling": "none"}
    elif (inputs.get("kind") == "image" and inputs.get("bit_depth") is None
          and inputs.get("normalize", "half") != "preset"):
        standardize = inputs.get("standardize")
        module = PixelInput(network, standardize if isinstance(standardize, Mapping) else None)
        kind = "uint8 pixels"
        preprocessing = {"in_graph": True, "input": inputs}
        example = torch.zeros(2, *shape, dtype=torch.uint8)
    elif inputs.get("kind") == "tensor" and inputs.get("dtype") == "int64":
        example = torch.zeros(2, *shape, dtype=torch.int64)
        kind = "int64 tokens"
    module = module.eval()
    target = Path(path) if path is not None else folder / (
        "model.onnx" if client is None else str(Path(client_file(client)).with_suffix(".onnx")))
    try:
        program = torch.onnx.export(module, (example,), dynamo=True, input_names=["input"], output_names=["scores"],
                                    dynamic_shapes=({0: torch.export.Dim("batch")},), opset_version=OPSET,
                                    verbose=False)
    except ImportError as error:
        raise ConfigError(f"ONNX export needs onnx and onnxscript ({error}); pip install 'fedhpro[export]'") from None
    except Exception as error:  # noqa: BLE001 - the exporter's many errors: one line naming the model
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ConfigError(f"{folder}'s model cannot be exported to ONNX ({type(error).__name__}: {first}); use "
                          "fedhpro.load_model in PyTorch") from None
    if program is None:
        raise ConfigError(f"{folder}'s model cannot be exported to ONNX (the exporter returned nothing)")
    metadata = {CLASSES_KEY: json.dumps(list(info["classes"])), INPUT_KEY: json.dumps(kind),
                SHAPE_KEY: json.dumps(["batch", *shape]),
                FEATURES_KEY: json.dumps(trained_columns(folder) if inputs.get("kind") == "tensor" else None),
                PREPROCESSING_KEY: json.dumps(preprocessing)}
    proto = program.model_proto
    for key, value in metadata.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(target, proto.SerializeToString())
    return OnnxModel(target, kind, ("batch", *shape), metadata)


__all__ = ["CLASSES_KEY", "FEATURES_KEY", "INPUT_KEY", "METADATA_KEYS", "OPSET", "OnnxModel", "PREPROCESSING_KEY",
           "SHAPE_KEY", "PixelInput", "TabularInput", "export_onnx"]
