"""``dataset=huggingface data.path=...``: a Hugging Face ``datasets`` data set, split among K clients.

``data.path`` is a folder written by ``save_to_disk`` (read with
``datasets.load_from_disk``) or a hub name (``datasets.load_dataset(path,
name=data.config_name)``, which needs the network). A ``DatasetDict`` gives
its ``data.train_split`` and ``data.test_split``; a single ``Dataset`` (or a
dict without the test split) is split per class with a seeded
``data.test_fraction``.

The columns are found from their feature types: the images are the one
column of type ``datasets.Image``, the labels the one ``datasets.ClassLabel``
column (else the columns ``image`` and ``label``; several of a type, or
none, is a one-line error asking for ``data.image_column`` /
``data.label_column``, which always win); a note says which were taken.

Inputs are ``data.image_column`` (PIL images or ``uint8`` H x W (x C)
arrays, decoded, scaled by their bit depth, resized to ``data.image_size``
and normalised to ``[-1, 1]`` as :mod:`fedhpro.data.images` does for
files), or, when
``data.text_column`` is set, texts tokenised as AG News is
(:func:`~fedhpro.data.loaders.tokenize`, a vocabulary of the training split,
``data.max_length`` token ids; use ``model=textcnn``). Labels come from
``data.label_column``: a ``ClassLabel`` keeps its names; integers are the
labels; strings are mapped to the index of their sorted set. The training
set is split by ``partition=dirichlet`` (default), ``nid2``, ``iid`` or
``longtail`` among ``clients=K`` (default 10); the test set is shared
(``all``).

``datasets`` is an optional dependency: ``pip install "fedhpro[hf]"``.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedhpro.data.federation import Federation
from fedhpro.data.huggingface_options import DECLARATION, HuggingFaceOptions
from fedhpro.data.images import open_image, rgb_pixels, to_float
from fedhpro.data.loaders import build_vocab, encode, split_indices
from fedhpro.data.partition import PartitionError, PartitionOptions, chosen_scheme, label_partition
from fedhpro.data.spec import DatasetSpec, half_range_image
from fedhpro.errors import ConfigError, DataError

SCHEMES = ("dirichlet", "nid2", "iid", "longtail")
DEFAULT_CLIENTS = 10
MISSING_PACKAGE = 'dataset=huggingface needs the datasets package: pip install "fedhpro[hf]"'


# --------------------------------------------------------------------------- reading


def _is_local(path: str) -> bool:
    """A path meant as a folder on this machine (absolute, ``./``, ``~``, or existing), not a hub name."""
    return path.startswith((".", "~", "/")) or Path(path).is_absolute() or Path(path).exists()


def open_dataset(options: HuggingFaceOptions) -> Any:
    """The ``Dataset`` or ``DatasetDict`` of ``data.path``; one-line errors for a missing package, folder or name."""
    if not options.path:
        raise ConfigError("dataset=huggingface needs data.path=FOLDER (saved with save_to_disk) or a hub name")
    try:
        import datasets
    except ImportError:
        raise DataError(MISSING_PACKAGE) from None
    path = options.path
    local = _is_local(path)
    if local and not Path(path).expanduser().is_dir():
        raise DataError(f"data.path={path}: no such folder; give a folder written by save_to_disk (or a hub name)")
    try:
        if local:
            return datasets.load_from_disk(str(Path(path).expanduser()))
        return datasets.load_dataset(path, name=options.config_name)
    except Exception as error:  # noqa: BLE001 - datasets and the hub raise many types; the user gets one line
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        how = ("a folder written by save_to_disk" if local
               else "a hub name (needs the network; set data.config_name if it has several)")
        raise DataError(f"cannot load data.path={path} ({type(error).__name__}: {reason}); give {how}") from None


def _splits(data: Any, options: HuggingFaceOptions) -> tuple[Any, Any | None]:
    """``(train, test)`` datasets of a ``DatasetDict`` (a dict) or a ``Dataset``; test None: hold it out of train."""
    if not isinstance(data, dict):
        return data, None
    splits = list(data)
    if options.train_split not in splits:
        raise ConfigError(f"data.train_split={options.train_split!r} is not a split of {options.path}; its "
                          f"splits are: {', '.join(splits)}")
    return data[options.train_split], data[options.test_split] if options.test_split in splits else None


def _typed_columns(dataset: Any, kind: str) -> list[str]:
    """The columns of ``dataset`` whose feature type is ``datasets.<kind>`` (``Image``, ``ClassLabel``)."""
    import datasets

    feature = getattr(datasets, kind)
    return [name for name, value in (getattr(dataset, "features", None) or {}).items() if isinstance(value, feature)]


def _detected(dataset: Any, given: str | None, kind: str, fallback: str, what: str,
              options: HuggingFaceOptions) -> tuple[str, str | None]:
    """``(column, how it was found)`` for ``data.<what>_column``: the one given, else the one column of
    feature type ``datasets.<kind>``, else ``fallback``; several such columns and none given, or no column
    at all, is a one-line ConfigError naming ``data.<what>_column``."""
    if given is not None:
        return given, None
    typed = _typed_columns(dataset, kind)
    if len(typed) > 1:
        raise ConfigError(f"{options.path} has several {kind} columns ({', '.join(typed)}); say which holds the "
                          f"{what}s with data.{what}_column")
    if typed:
        return typed[0], f"its {kind} feature"
    if fallback in dataset.column_names:
        return fallback, None
    raise ConfigError(f"{options.path} has no {kind} column and no column {fallback!r} for the {what}s; its columns "
                      f"are: {', '.join(dataset.column_names)} (set data.{what}_column)")


def _column(dataset: Any, name: str, what: str, options: HuggingFaceOptions) -> None:
    if name not in dataset.column_names:
        raise ConfigError(f"{options.path} has no column {name!r} for the {what}; its columns are: "
                          f"{', '.join(dataset.column_names)} (set data.{what}_column)")


def _values(dataset: Any, column: str) -> list[Any]:
    return list(dataset[column])


def _label_names(dataset: Any, options: HuggingFaceOptions) -> list[str] | None:
    """The names of a ``ClassLabel`` label column, else None."""
    names = getattr(dataset.features.get(options.label_column), "names", None)
    return [str(n) for n in names] if names else None


def _labels(raw_train: list[Any], raw_test: list[Any], names: list[str] | None,
            options: HuggingFaceOptions) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Integer labels of both splits and the class names (see the module docstring).

    Every bound is checked on the values before an array of that size is
    made: at most ``data.max_classes`` classes (a label, ClassLabel names or
    distinct names), no negative, empty or non-integer label.
    """
    limit = int(options.max_classes)
    where = f"{options.path}: the {options.label_column!r} column"
    fix = "fix the labels, or raise data.max_classes if the data really has that many classes"
    values = raw_train + raw_test
    if any(v is None for v in values):
        raise DataError(f"{where} has empty labels; drop those rows")
    if names is not None and len(names) > limit:
        raise DataError(f"{where} is a ClassLabel of {len(names)} names, above data.max_classes={limit}; raise "
                        "data.max_classes if the data really has that many classes")
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in values):
        low, high = (int(min(values)), int(max(values))) if values else (0, 0)
        if low < 0:
            raise DataError(f"{where} has label {low}, which is negative; labels are class indices 0..C-1 (an "
                            "unlabelled test split: set data.test_split to a labelled one)")
        if high >= limit:
            raise DataError(f"{where} has label {high}, not below data.max_classes={limit}; {fix}")
        count = len(names) if names else high + 1
        if high >= count:
            raise DataError(f"{where} has label {high}, out of range for its {count} class names; fix the labels or "
                            "the ClassLabel names")
        train, test = np.asarray(raw_train, dtype=np.int64), np.asarray(raw_test, dtype=np.int64)
        return train, test, names or [str(c) for c in range(count)]
    if all(isinstance(v, str) for v in values):
        classes = sorted(set(values))
        if len(classes) > limit:
            raise DataError(f"{where} holds {len(classes)} distinct class names, above data.max_classes={limit}; "
                            f"{fix}")
        index = {name: i for i, name in enumerate(classes)}
        return (np.asarray([index[v] for v in raw_train], dtype=np.int64),
                np.asarray([index[v] for v in raw_test], dtype=np.int64), classes)
    kinds = sorted({type(v).__name__ for v in values})
    raise DataError(f"{where} holds {kinds}; labels must be integers or class names (whole numbers as int, not "
                    "float)")


def _image_pixels(value: Any, size: int, row: int, options: HuggingFaceOptions) -> np.ndarray:
    """One cell of the image column -> ``uint8`` ``3 x size x size`` (as :func:`rgb_pixels`)."""
    from PIL import Image

    where = f"{options.path}: row {row} of column {options.image_column!r}"
    try:
        if isinstance(value, Image.Image):
            return rgb_pixels(value, size)
        if isinstance(value, dict) and (value.get("bytes") or value.get("path")):  # an undecoded Image feature
            source = io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"]
            with open_image(source, where) as image:  # its pixel count checked before it is decoded
                return rgb_pixels(image, size)
        array = np.asarray(value)
    except (OSError, ValueError, SyntaxError) as error:
        raise DataError(f"{where}: cannot decode the image ({error}); fix or drop that row") from None
    if array.dtype.kind in "iu" and array.size and 0 <= array.min() and array.max() <= 255:
        array = array.astype(np.uint8)  # a Sequence feature gives back lists of ints
    if array.dtype != np.uint8 or array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[2] not in (1, 3, 4)):
        raise DataError(f"{where} is {array.dtype} {array.shape}; give PIL images or 0..255 H x W (x C) arrays")
    return rgb_pixels(Image.fromarray(array[:, :, 0] if array.ndim == 3 and array.shape[2] == 1 else array), size)


def _images(dataset: Any, options: HuggingFaceOptions, progress: bool) -> Tensor:
    size = int(options.image_size)
    out = np.empty((len(dataset), 3, size, size), dtype=np.uint8)
    batches: Any = dataset.select_columns([options.image_column]).iter(batch_size=256)
    if progress and len(dataset) > 1000:
        from tqdm.auto import tqdm

        batches = tqdm(batches, total=-(-len(dataset) // 256), desc=f"decoding images to {size}px", leave=False)
    row = 0
    for batch in batches:
        for value in batch[options.image_column]:
            out[row] = _image_pixels(value, size, row, options)
            row += 1
    return to_float(out)


# --------------------------------------------------------------------------- the federation


def build(options: HuggingFaceOptions, clients: int | None, seed: int, data_dir: Any = None,
          progress: bool = False, partition: PartitionOptions | None = None) -> Federation:
    """The federation: the training split divided among K clients by a label partition; one shared test set."""
    partition = partition or PartitionOptions()
    scheme = chosen_scheme(partition, "dirichlet", SCHEMES, "dataset=huggingface")
    if partition.load:
        raise ConfigError("partition.load does not apply to dataset=huggingface; set partition.seed to redraw the "
                          "same partition")
    train, test = _splits(open_dataset(options), options)
    label_column, label_how = _detected(train, options.label_column, "ClassLabel", "label", "label", options)
    image_column, image_how = (options.image_column, None) if options.text_column else _detected(
        train, options.image_column, "Image", "image", "image", options)
    options = dataclasses.replace(options, label_column=label_column, image_column=image_column)
    _column(train, label_column, "label", options)
    inputs = options.text_column or image_column or "image"
    _column(train, inputs, "text" if options.text_column else "image", options)
    if test is not None:
        for name in (label_column, inputs):
            if name not in test.column_names:
                raise ConfigError(f"the {options.test_split!r} split of {options.path} has no column {name!r}")
    if len(train) == 0:
        raise DataError(f"the {options.train_split!r} split of {options.path} is empty; give it samples")
    train_y, test_y, classes = _labels(_values(train, label_column),
                                       _values(test, label_column) if test is not None else [],
                                       _label_names(train, options), options)
    held_out = test is None
    if held_out:
        keep, held = split_indices(train_y, options.test_fraction, options.split_seed)
        if len(held) == 0:
            raise DataError(f"{options.path}: data.test_fraction={options.test_fraction} holds out no sample of so "
                            "small a data set; raise it or give a test split")
        train, test = train.select(keep.tolist()), train.select(held.tolist())
        train_y, test_y = train_y[keep], train_y[held]

    notes = [f"huggingface: {what}s from the column {column!r} ({how})" for what, column, how in
             (("image", image_column, image_how), ("label", label_column, label_how)) if how is not None]
    if options.text_column:
        train_texts = [str(t) for t in _values(train, options.text_column)]
        vocab = build_vocab(train_texts, options.vocab_size)
        train_x = encode(train_texts, vocab, options.max_length)
        test_x = encode([str(t) for t in _values(test, options.text_column)], vocab, options.max_length)
        notes.append(f"huggingface: text column {options.text_column!r}, {len(vocab) + 2} token ids, "
                     f"{options.max_length} tokens a text (model=textcnn)")
    else:
        train_x, test_x = _images(train, options, progress), _images(test, options, progress)
    num_classes = len(classes)
    k = clients if clients is not None else DEFAULT_CLIENTS
    rng = np.random.default_rng(seed if partition.seed is None else partition.seed)
    try:
        split = label_partition(partition, scheme, train_y, k, rng, num_classes)
    except PartitionError as error:
        raise ConfigError(f"dataset=huggingface: {error}") from None
    client_data = [(train_x[torch.from_numpy(ix)], torch.from_numpy(train_y[ix]).clone())
                   for ix in split.client_indices]
    record = {"dataset": "huggingface", **split.to_json(train_y, num_classes,
                                                        partition.seed if partition.seed is not None else seed),
              "path": options.path, "classes": classes, "test_size": int(len(test_y))}
    if held_out:  # the indices are then rows of what the held-out split left for training
        record["held_out"] = {"test_fraction": options.test_fraction, "split_seed": options.split_seed}
    if options.text_column:
        record["vocab_size"] = len(vocab) + 2
    notes.insert(0, f"huggingface: {options.path}, {split.scheme} partition over {split.num_clients} clients, "
                    f"{num_classes} classes" + (f", test held out ({options.test_fraction:g})" if held_out else ""))
    return Federation.from_tensors(client_data, {"all": (test_x, torch.from_numpy(test_y).clone())},
                                   num_classes=num_classes, name="huggingface", partition=record, notes=notes)


def image_input(options: HuggingFaceOptions, partition: Mapping[str, Any], size: int) -> dict[str, Any] | None:
    """A new image as this data set's input: resized to ``size``, scaled to [-1, 1]; None for texts."""
    if options.text_column:
        return None
    return half_range_image("huggingface", size, resize=True)


DATASET = DatasetSpec.of(DECLARATION, build, image_input)

__all__ = ["DATASET", "HuggingFaceOptions", "build", "open_dataset"]
