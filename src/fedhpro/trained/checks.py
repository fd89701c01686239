"""A run folder is untrusted input: model.json, the model files and standardize.json checked before use, each
problem one :class:`~fedhpro.trained.folder.ModelFileError` line (every entry's type and range, every file it
names inside the folder, every saved tensor's key and shape, nothing unpickled)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from fedhpro.arrays import Bound, load_torch
from fedhpro.bounded import read_json_file, run_file
from fedhpro.trained.folder import FORMAT, MODEL_INFO, POOLED, STATISTICS_FILE, STATISTICS_FORMAT, ModelFileError


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


def shown(value: Any) -> str:
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


def plausible(values: Any, count: int, spread: bool) -> bool:
    """Whether ``values`` is ``count`` numbers that float32 features can have as their mean (``spread``
    False: within +-:data:`FLOAT32_MAX`) or as their std (from :data:`STD_FLOOR` to :data:`FLOAT32_MAX`)."""
    low = STD_FLOOR if spread else -FLOAT32_MAX
    return (isinstance(values, list) and len(values) == count
            and all(_is_number(v) and low <= v <= FLOAT32_MAX for v in values))


def span(part: str) -> str:
    return f" > 0, from {STD_FLOOR:.2g} to {FLOAT32_MAX:.3g}" if part == "std" else f" within +-{FLOAT32_MAX:.3g}"


def check_info(info: Mapping[str, Any], folder: Path) -> None:
    """One :class:`ModelFileError` line unless every entry of ``info`` (a run folder's model.json) that fedhpro
    reads has the type and range :func:`model_info` writes, and every file it names lies inside ``folder``
    (:func:`inside_folder`): a run folder is untrusted input."""
    path = folder / MODEL_INFO

    def bad(key: str, value: Any, expected: str) -> ModelFileError:
        return ModelFileError(f"{path}: {key} is {shown(value)}, not {expected}; the file is damaged or was not "
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
            if not plausible(values, 3, key == "std"):
                raise bad(f"input.{key}", values, "three finite numbers" + span(key))
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
                if not plausible(values, 3, key == "std"):
                    raise bad(f"input.standardize.{key}", values, "three finite numbers" + span(key))
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
        return ModelFileError(f"{source}: {key} is {shown(name)}, {why}; a run folder's files are named relative "
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


#: why a model's numbers are not finite, as ``predict`` and ``export`` say it
NOT_FINITE_WEIGHTS = "model file damaged, or the run diverged"


def check_finite_weights(module: nn.Module, folder: Path) -> None:
    """One ModelFileError line when a floating-point parameter or buffer of ``module`` holds NaN or an infinite
    value: such a model's outputs are not numbers (``predict`` refuses them), and nothing should be written."""
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            count = int((~torch.isfinite(tensor)).sum())
            raise ModelFileError(f"{folder}: the model's weights hold NaN or infinite values ({count} in {name}: "
                                 f"{NOT_FINITE_WEIGHTS}); nothing written: run again, or check the run folder")


def read_statistics(folder: Path, info: Mapping[str, Any]) -> dict[str, Any]:
    """standardize.json of a run folder whose model.json names it, checked: every site's and the pooled
    ``mean`` and ``std`` are lists of the model's feature count of finite numbers that float32 features can
    have (:func:`plausible`: ``std`` > 0). A missing, damaged or foreign file is one :class:`ModelFileError`
    line."""
    inputs = info.get("input", {})
    features = int(info["input_shape"][0])
    if "statistics" not in inputs:
        raise ModelFileError(
            f"{folder} was trained with data.standardize={inputs.get('standardize', 'client')} (its sites scaled "
            f"their features) but its folder records no {STATISTICS_FILE} to scale new rows the same way (a run of "
            "an older fedhpro, or personal models on Flower with data.standardize=client): run it again with this "
            "fedhpro and data.standardize=federated (or data.standardize=none)")
    path = inside_folder(folder, inputs["statistics"], "input.statistics", folder / MODEL_INFO)
    if not path.is_file():
        raise ModelFileError(f"{path} is missing; the run folder is incomplete (run it again)")
    content = read_json_file(path, ModelFileError)

    def bad(key: str, value: Any, expected: str) -> ModelFileError:
        return ModelFileError(f"{path}: {key} is {shown(value)}, not {expected}; the file is damaged or was not "
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
            if not plausible(values, features, part == "std"):
                raise bad(f"{key}.{part}", values, f"{features} finite numbers{span(part)} (what float32 "
                          f"features give as their {part})")
    return content
