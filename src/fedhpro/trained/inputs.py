"""Predict's inputs made as the run made its inputs: image files decoded, resized and normalised as model.json's
``input`` says (what the run's data set declared: :attr:`fedhpro.data.spec.DatasetSpec.image_input`), tensor files
read without unpickling, CSV rows read with pandas (the run's feature columns, by name), tabular rows of
``data.standardize=client`` scaled by standardize.json."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from PIL import Image
from torch import Tensor, nn

from fedhpro.arrays import ArrayFileError, load_npz, load_torch
from fedhpro.bounded import read_json_file
from fedhpro.data.benchmarks import to_float as preset_float
from fedhpro.data.client_scaling import apply_statistics
from fedhpro.data.images import decode_file, open_image, to_float
from fedhpro.data.loaders import IMAGE_EXTENSIONS, Preset
from fedhpro.data.tables import feature_matrix, read_csv
from fedhpro.errors import ConfigError, DataError
from fedhpro.trained.checks import read_info, read_statistics, shown
from fedhpro.trained.folder import MODEL_INFO, POOLED, STATISTICS_FILE, ModelFileError

#: the record of the run's data in its folder, which names the feature columns of a run on tables
PARTITION_FILE = "partition.json"
#: model.json's ``input.standardize`` of tabular runs whose rows are scaled by standardize.json's statistics
#: (each site's own, or statistics the sites share), read through :func:`read_statistics`
SCALED_BY_STATISTICS = ("client", "federated")


def prepare_inputs(run_folder: str | os.PathLike, x: Tensor, *, site: str | None = None) -> Tensor:
    """``x`` (N x the model's input shape, raw as the training files held it) made what the run's model
    takes: for tabular own data trained with ``data.standardize=client``, each feature scaled by the
    training mean and std of ``site`` (a site folder's name), by default of every site's training rows
    pooled (a new site); other runs' inputs are returned as they are. Use it with :func:`load_model`;
    :func:`predict` applies it."""
    folder = Path(run_folder)
    info = read_info(folder)
    return prepared(folder, info, x, site)


def prepared(folder: Path, info: Mapping[str, Any], x: Tensor, site: str | None) -> Tensor:
    inputs = info.get("input", {})
    if inputs.get("standardize", "none") == "none" or inputs.get("kind") != "tensor":
        if site is not None:
            raise ConfigError(f"{folder}'s inputs were not scaled per site (no data.standardize=client on tabular "
                              "data); leave out the site")
        return x
    if inputs["standardize"] not in SCALED_BY_STATISTICS:
        raise ModelFileError(f"{folder / MODEL_INFO}: input.standardize is {shown(inputs['standardize'])}, which "
                             f"this fedhpro cannot rebuild ({', '.join(SCALED_BY_STATISTICS)} or none); run again")
    statistics = read_statistics(folder, info)
    if site is None:
        entry = statistics[POOLED]
    elif site in statistics["sites"]:
        entry = statistics["sites"][site]
    else:
        names = sorted(statistics["sites"])
        raise ConfigError(f"{folder} has no site {site!r}; its sites are {', '.join(names)} (leave the site out for "
                          "a new site: every site's training rows pooled)")
    mean = torch.tensor(entry["mean"], dtype=torch.float64)
    std = torch.tensor(entry["std"], dtype=torch.float64)
    scaled = apply_statistics(x, mean, std)
    if x.is_floating_point() and bool(torch.isfinite(x).all()) and not bool(torch.isfinite(scaled).all()):
        where = [int(i) for i in (~torch.isfinite(scaled)).nonzero()[0]]
        raise ModelFileError(f"{folder / STATISTICS_FILE}: its {site or POOLED} mean and std scale the input at "
                             f"{where} beyond float32's range; they are not statistics of such data: run again, or "
                             "check the inputs' units")
    return scaled


def attach_preprocessing(module: nn.Module, folder: Path, info: Mapping[str, Any], site: str | None) -> nn.Module:
    """``module`` made to take raw inputs, as :func:`predict` does (a forward pre-hook: the module, its class
    and its state dict stay the network's). Tabular rows of a ``data.standardize=client`` run: float rows as the
    files held them, scaled by ``site``'s training statistics (default every site's pooled), as
    :func:`prepare_inputs` scales them. Images: ``uint8`` (or, where the run kept 16-bit depth, ``uint16``)
    pixel tensors ``N x 3 x S x S`` at the model's size, scaled and normalised as the run's data set did;
    float images are taken as already prepared. Other runs' inputs need nothing. A tensor of another shape
    (a row of the wrong number of features) is one DataError line naming the shape the model takes and, for a
    run on named columns, its features in order. Returns ``module``."""
    inputs = info.get("input", {})
    if inputs.get("kind") == "image":
        if site is not None:
            raise ConfigError(f"{folder}'s inputs are images, which are not scaled per site; leave out the site")
        size = int(inputs["size"])

        def prepare_images(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            x = args[0] if args else None
            if isinstance(x, Tensor) and x.is_floating_point() and tuple(x.shape[1:]) != (3, size, size):
                raise DataError(f"this model takes N x 3 x {size} x {size} pixels (uint8, or uint16 for 16-bit "
                                f"runs) or prepared float32 images; got {x.dtype} {tuple(x.shape)}")
            if not isinstance(x, Tensor) or x.is_floating_point():
                return None  # prepared floats (or not a tensor: the network says what it takes)
            if x.dtype not in (torch.uint8, torch.uint16, torch.int32, torch.int64) or x.dim() != 4 \
                    or tuple(x.shape[1:]) != (3, size, size):
                raise DataError(f"this model takes N x 3 x {size} x {size} pixels (uint8, or uint16 for 16-bit "
                                f"runs) or prepared float32 images; got {x.dtype} {tuple(x.shape)}")
            pixels = x.detach().cpu().numpy()
            if pixels.dtype not in (np.uint8, np.uint16):
                if pixels.size and (int(pixels.min()) < 0 or int(pixels.max()) > 65535):
                    raise DataError("pixel values must lie in 0..255 (uint8) or 0..65535 (uint16)")
                pixels = pixels.astype(np.uint16 if inputs.get("bit_depth") is not None else np.uint8)
            return (pixels_to_input(pixels, inputs, "the input").to(x.device), *args[1:])

        module.register_forward_pre_hook(prepare_images)
        return module
    shape = tuple(int(n) for n in info["input_shape"])
    if inputs.get("kind") == "tensor":
        columns = trained_columns(folder)

        def check_width(_: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0] if args else None
            if isinstance(x, Tensor) and (x.dim() != len(shape) + 1 or tuple(x.shape[1:]) != shape):
                raise DataError(width_message(shape, tuple(x.shape), columns))

        module.register_forward_pre_hook(check_width)  # before the scaling, which would fail in torch's words
    if inputs.get("standardize", "none") == "none" or inputs.get("kind") != "tensor":
        prepared(folder, info, torch.zeros(0), site)  # a site for a run without per-site scaling: one line
        return module
    prepared(folder, info, torch.zeros(1, *[int(n) for n in inputs["shape"]]), site)  # an unknown site: one line
    statistics = read_statistics(folder, info)
    entry = statistics[POOLED] if site is None else statistics["sites"][site]
    mean = torch.tensor(entry["mean"], dtype=torch.float64)
    std = torch.tensor(entry["std"], dtype=torch.float64)

    def standardize(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = args[0] if args else None
        if not isinstance(x, Tensor):
            return None
        if not x.is_floating_point():
            raise DataError(f"this model takes raw feature rows as floats (N x {len(entry['mean'])}); got {x.dtype}")
        return (apply_statistics(x, mean.to(x.device), std.to(x.device)), *args[1:])

    module.register_forward_pre_hook(standardize)
    return module


def _image_files(folder: Path) -> list[Path]:
    """The image files in ``folder`` and below (hidden ones skipped), sorted by path."""
    found = [p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
             and not any(part.startswith(".") for part in p.relative_to(folder).parts)]
    return sorted(found)


def _image_input(path: Path, inputs: Mapping[str, Any]) -> Tensor:
    """One image file as the run's data set made its inputs: decoded to RGB (grey replicated, alpha dropped)
    by :func:`fedhpro.data.images.decode_file`, resized to S x S where the data set resizes (else an image of
    another size is refused), normalised as the data set normalises. ``3 x S x S`` float32."""
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
    pixels = decode_file(path, size, depth=inputs.get("bit_depth") is not None)[None]
    return pixels_to_input(pixels, inputs, str(path))[0]


def pixels_to_input(pixels: np.ndarray, inputs: Mapping[str, Any], what: str = "the pixels") -> Tensor:
    """``N x 3 x S x S`` decoded pixels (``uint8``, or ``uint16`` for a run that kept 16-bit depth) made what
    the run's model takes, as model.json's ``input`` (an image input) says: scaled by the bit depth,
    normalised as the data set normalises, then by the run's channel statistics. float32."""
    size = int(inputs["size"])
    bits = inputs.get("bit_depth")
    if bits is not None:
        # as the image folder decoded its data set: 16-bit values kept, an 8-bit image as its 16-bit equivalent
        if pixels.dtype != np.uint16:
            pixels = pixels.astype(np.uint16) * 257
        try:
            x = to_float(pixels, int(bits))
        except DataError:
            raise DataError(f"{what} holds values above {bits} bits, the depth of this run's images; give "
                            f"{bits}-bit images") from None
    else:
        if inputs.get("normalize") == "preset":
            preset = Preset(size, tuple(inputs["mean"]), tuple(inputs["std"]))  # type: ignore[arg-type]
            return preset_float(pixels, preset, size)
        x = to_float(pixels)
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
    wanted = " x ".join(map(str, shape))
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        if value.dtype.kind == "u" and value.dtype.itemsize > 1:
            value = value.astype(np.int64)  # torch has no wide unsigned arithmetic
        return torch.from_numpy(np.ascontiguousarray(value))
    what = f"{value.dtype} values" if isinstance(value, np.ndarray) else f"a {type(value).__name__}"
    raise DataError(f"{path} holds {what}; save one numeric tensor, N x {wanted}")


#: the columns of a CSV of rows that are never features when the run does not name its feature columns (a run
#: on .npz/.pt files): the default label, site and split columns of own tabular data
NOT_FEATURES = ("label", "site", "split")


def csv_inputs(path: Path, info: Mapping[str, Any], columns: Sequence[str] | None) -> Tensor:
    """The rows of the CSV file ``path`` as the model's float32 inputs: the run's feature ``columns`` by name
    (any order, other columns ignored: a label column is kept out), else every column but ``label``, ``site``
    and ``split``; read by :func:`fedhpro.data.tables.read_csv` (bounded), checked as training rows are."""
    check_tabular(info, str(path))
    return frame_inputs(read_csv(path), info, columns, str(path))


def check_tabular(info: Mapping[str, Any], where: str) -> None:
    """One DataError line unless the run's model takes rows of float features (``N x F``)."""
    shape = [int(n) for n in info["input_shape"]]
    inputs = info.get("input", {})
    if inputs.get("kind") != "tensor" or len(shape) != 1 or not str(inputs.get("dtype", "float32")).startswith("float"):
        raise DataError(f"{where}: this run's model takes {'images' if inputs.get('kind') == 'image' else 'inputs'} "
                        f"of shape {tuple(shape)}, not rows of a table; give the inputs it was trained on")


def frame_inputs(frame: pd.DataFrame, info: Mapping[str, Any], columns: Sequence[str] | None, where: str, *,
                 strict: bool = False) -> Tensor:
    """The rows of ``frame`` as the model's raw float32 inputs (``N x F``, unscaled): the run's feature
    ``columns`` by name, in the run's order whatever the frame's; else (a run whose data had no column names)
    every column but ``label``, ``site`` and ``split``, in the frame's order. Other columns are ignored, or,
    ``strict`` (scikit-learn's rule), refused in one line naming them. Values checked as training rows are
    (:func:`fedhpro.data.tables.feature_matrix`)."""
    shape = [int(n) for n in info["input_shape"]]
    frame = frame.set_axis([str(c) for c in frame.columns], axis=1)
    if frame.columns.has_duplicates:
        twice = sorted({c for c in frame.columns if list(frame.columns).count(c) > 1})
        raise DataError(f"{where} has the column {', '.join(map(repr, twice[:10]))} more than once; give each "
                        "feature column once")
    if columns is not None:
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise DataError(f"{where} has no column {', '.join(map(repr, missing[:10]))} of the {len(columns)} this "
                            "run was trained on; give every feature column, named as in training")
        extra = [c for c in frame.columns if c not in columns]
        if strict and extra:
            raise DataError(f"{where} has the column {', '.join(map(repr, extra[:10]))}, which this run was not "
                            f"trained on (its {len(columns)} features: {', '.join(columns[:10])}"
                            f"{' ...' if len(columns) > 10 else ''}); drop it: X.drop(columns={extra[:10]!r})")
        features = list(columns)
    else:
        features = [c for c in frame.columns if c not in NOT_FEATURES]
    if len(features) != shape[0]:
        raise DataError(f"{where} has {len(features)} feature columns ({', '.join(features[:10])}); this run's model "
                        f"takes {shape[0]} features: give those columns only (a label, site or split column is "
                        "left out by name)")
    return torch.from_numpy(feature_matrix(frame, features, where))


def as_frame(columns: Mapping[Any, Any], where: str) -> pd.DataFrame:
    """A mapping of column names to sequences of values as a DataFrame; one DataError line when it is not one."""
    try:
        return pd.DataFrame({str(name): list(values) if not isinstance(values, (np.ndarray, Tensor)) else values
                             for name, values in columns.items()})
    except (TypeError, ValueError) as error:
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise DataError(f"{where} is not a table of columns ({reason}); give each column name a sequence of "
                        "values, all of the same length") from None


def trained_columns(folder: Path) -> list[str] | None:
    """The feature columns, in order, of a run trained on tables with named columns (its partition.json's
    ``columns``: CSV files, DataFrames), else None (the run's data had no column names)."""
    path = folder / PARTITION_FILE
    if not path.is_file():
        return None
    record = read_json_file(path, ModelFileError)
    columns = record.get("columns") if isinstance(record, dict) else None
    if columns is None:
        return None
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise ModelFileError(f"{path}: its columns are not a list of column names; run again")
    return columns


def width_message(shape: Sequence[int], got: Sequence[int], columns: Sequence[str] | None) -> str:
    """What a tensor of shape ``got`` given to a model of input shape ``shape`` is told: the shape the model
    takes and, for a run on named columns, the features in their order, and how to give rows by name."""
    if len(shape) == 1:
        named = "" if columns is None else (f" ({', '.join(columns[:20])}{' ...' if len(columns) > 20 else ''}, "
                                            "in that order)")
        by_name = "" if columns is None else (": give rows by name instead, fedhpro.load_estimator(run_folder)"
                                              ".predict(dataframe), or those columns in that order")
        return (f"this model takes N x {shape[0]} features{named}; got a tensor of shape {tuple(got)}"
                f"{by_name or ': give N x ' + str(shape[0]) + ' rows'}")
    wanted = " x ".join(map(str, shape))
    return f"this model takes N x {wanted} inputs; got a tensor of shape {tuple(got)}"


def gather_inputs(paths: Iterable[str | os.PathLike], info: Mapping[str, Any],
                  columns: Sequence[str] | None = None) -> tuple[list[str], Tensor]:
    """``(names, inputs)`` of :func:`gathered`."""
    names, inputs, _ = gathered(paths, info, columns)
    return names, inputs


def gathered(paths: Iterable[str | os.PathLike], info: Mapping[str, Any],
             columns: Sequence[str] | None = None) -> tuple[list[str], Tensor, list[int]]:
    """``(names, inputs)``: every image file given (or found in a given folder), every row of a given
    ``.pt`` / ``.npz`` tensor file (named ``file.pt[i]``) and of a ``.csv`` file of rows (``file.csv[i]``; the
    run's feature ``columns`` by name, :func:`csv_inputs`), as the model's inputs; one DataError line for a
    wrong path. Tensor rows are returned as the file holds them (:func:`prepare_inputs` scales them as
    training did). Also the number of inputs each path gave, in order."""
    inputs, shape = info.get("input", {}), info["input_shape"]
    counts: list[int] = []
    names: list[str] = []
    rows: list[Tensor] = []
    given = [Path(p) for p in paths]
    if not given:
        raise ConfigError("give at least one input: image files, folders of images, a .pt/.npz tensor file or a "
                          ".csv file of rows")
    for path in given:
        counts.append(-len(names))
        if not path.exists():
            raise DataError(f"{path}: no such file or folder; give image files, folders of images, a .pt/.npz "
                            "tensor file or a .csv file of rows")
        if path.is_file() and path.suffix.lower() == ".csv":
            batch = csv_inputs(path, info, columns)
            if not batch.shape[0]:
                raise DataError(f"{path} has no rows; give at least one row to classify")
            names += [f"{path}[{i}]" for i in range(batch.shape[0])]
            rows += list(batch)
            counts[-1] += len(names)
            continue
        if path.is_file() and path.suffix.lower() in (".pt", ".npz"):
            batch = _tensor_inputs(path, inputs, shape)
            names += [f"{path}[{i}]" for i in range(batch.shape[0])]
            rows += list(batch)
            counts[-1] += len(names)
            continue
        files = _image_files(path) if path.is_dir() else [path]
        if path.is_dir() and not files:
            raise DataError(f"{path} holds no image files (.png, .jpg, ...); give a folder of images")
        if inputs.get("kind") != "image":
            raise DataError(f"{path}: this run's model takes tensors of shape {tuple(shape)}, not images; give a "
                            ".pt/.npz file of an N x ... tensor, preprocessed as the run's data")
        for file in files:
            if file.suffix.lower() not in IMAGE_EXTENSIONS:
                raise DataError(f"{file} is not an image file ({', '.join(IMAGE_EXTENSIONS)}) or a .pt/.npz tensor "
                                "file")
            names.append(str(file))
            rows.append(_image_input(file, inputs))
        counts[-1] += len(names)
    return names, torch.stack(rows), counts
