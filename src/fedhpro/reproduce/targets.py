"""The reproduce targets: ``configs/paper/NAME.yaml`` read strictly into a :class:`Target`.

Every key of a target file is known: an unknown one (a typo such as ``treshold:``, a key another layout
reads) is a one-line :class:`~fedhpro.errors.ConfigError` naming the file, where the key is, and the
keys valid there, instead of a setting that silently does nothing. The ``settings`` mappings hold run
keys (``rounds``, ``fedhpro.tau``, ``data.fraction``): those are checked by :func:`fedhpro.config.load_config`
when the runs are planned.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedhpro.bounded import MAX_YAML_CHARS, load_yaml, read_bounded
from fedhpro.command_options.reproduce import SCALES
from fedhpro.errors import ConfigError

#: layout -> the keys a part of that layout may add to the common ones (its smoke section may replace them):
#: exactly what that layout's builder reads
LAYOUT_KEYS: dict[str, tuple[str, ...]] = {
    "domains": ("delta", "pairs"),
    "scenarios": ("average_column", "delta_rows", "xlabel"),
    "convergence": ("thresholds", "speedup_at"),
    "fairness": (),
    "efficiency": (),
    "prototypes": (),
    "gm_loss": (),
    "tsne": (),
    "sweep": ("average_column", "delta_rows", "xlabel"),
    # the CPU-scale studies (once bench/ scripts): their own tables, the paper's numbers (if any) per column
    "label_skew": (),
    "gradient_matching": (),
    "robustness": ("attacks", "rules"),
    "faithfulness": (),
}
#: layouts whose runs may stop with a diverged client update (the robustness study's scaled attack): such a
#: run is kept unfinished and counted as diverged instead of stopping the reproduction
TOLERATE_DIVERGED = ("robustness",)
LAYOUTS = tuple(LAYOUT_KEYS)

TARGET_KEYS = ("name", "title", "layout", "seeds", "settings", "smoke", "variants", "parts", "notes")
SMOKE_KEYS = ("seeds", "settings")
PART_KEYS = ("name", "benchmark", "settings", "scenarios", "columns", "paper", "smoke", "variants")
PART_SMOKE_KEYS = ("settings", "scenarios")
VARIANT_KEYS = ("label", "method", "settings")
SCENARIO_KEYS = ("label", "settings")


@dataclass
class Variant:
    """One row of a table: a label, a method and its switches."""

    label: str
    method: str
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class Scenario:
    """One federation setting within a part (a column of a scenarios table, a point of a sweep)."""

    label: str
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class Part:
    """A sub-table or sub-figure: one data set (or sweep) with its columns and the paper's numbers."""

    name: str
    benchmark: str
    settings: dict[str, Any]
    scenarios: list[Scenario]
    columns: list[str]
    paper: dict[str, list[float | None]]
    extra: dict[str, Any]  # the layout's own keys (LAYOUT_KEYS)
    variants: list[Variant] = field(default_factory=list)  # the rows (the target's unless the part has its own)


@dataclass
class Target:
    name: str
    title: str
    layout: str
    seeds: list[int]
    settings: dict[str, Any]
    variants: list[Variant]
    parts: list[Part]
    notes: list[str]


#: where a wheel installs ``configs/paper`` (pyproject's ``[tool.setuptools.data-files]``), below the environment's
#: data prefix (``sysconfig.get_path("data")``: the virtualenv's folder)
INSTALLED_CONFIGS = Path("share") / "fedhpro" / "configs" / "paper"


def configs_dir() -> Path:
    """``configs/paper`` of the source tree (next to ``src/``), else of the installed wheel, else of the working
    directory."""
    for here in (Path(__file__).resolve().parents[3] / "configs" / "paper",
                 Path(sysconfig.get_path("data")) / INSTALLED_CONFIGS):
        if here.is_dir():
            return here
    return Path.cwd() / "configs" / "paper"


def available_targets() -> list[str]:
    return sorted(path.stem for path in configs_dir().glob("*.yaml"))


def _mapping(value: Any, path: Path, where: str, valid: tuple[str, ...]) -> dict[str, Any]:
    """``value`` as a mapping whose keys are all in ``valid``; otherwise a one-line ConfigError."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: {where} must be a mapping of keys, not {type(value).__name__}")
    unknown = [key for key in value if key not in valid]
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} in {where}; the keys valid there are: "
                          f"{', '.join(valid)}")
    return dict(value)


def _list(value: Any, path: Path, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"{path}: {where} must be a list, not {type(value).__name__}")
    return value


def _settings(value: Any, path: Path, where: str) -> dict[str, Any]:
    """A ``settings`` mapping (run keys, checked later by load_config)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: settings of {where} must be a mapping of run keys, not {type(value).__name__}")
    return dict(value)


def _variants(value: Any, path: Path, where: str) -> list[Variant]:
    variants = []
    for index, raw in enumerate(_list(value, path, f"{where}variants")):
        entry = _mapping(raw, path, f"{where}variants[{index}]", VARIANT_KEYS)
        for needed in ("label", "method"):
            if needed not in entry:
                raise ConfigError(f"{path}: {where}variants[{index}] has no {needed!r}; give label and method")
        variants.append(Variant(str(entry["label"]), str(entry["method"]),
                                _settings(entry.get("settings"), path, f"{where}variants[{index}]")))
    return variants


def _scenarios(value: Any, path: Path, where: str) -> list[Scenario]:
    scenarios = []
    for index, raw in enumerate(_list(value, path, f"{where}scenarios")):
        entry = _mapping(raw, path, f"{where}scenarios[{index}]", SCENARIO_KEYS)
        if "label" not in entry:
            raise ConfigError(f"{path}: {where}scenarios[{index}] has no 'label'")
        scenarios.append(Scenario(str(entry["label"]),
                                  _settings(entry.get("settings"), path, f"{where}scenarios[{index}]")))
    return scenarios


def _check_benchmark(part: dict[str, Any], settings: dict[str, Any], path: Path, where: str) -> None:
    """``benchmark`` names the data set the part reproduces: it must agree with the ``dataset`` it runs."""
    dataset = settings.get("dataset")
    if "benchmark" in part and dataset is not None and part["benchmark"] != dataset:
        raise ConfigError(f"{path}: {where} has benchmark: {part['benchmark']} but runs dataset: {dataset}; "
                          "make them the same")


def _part(raw: Any, index: int, layout: str, scale: str, target: dict[str, Any], path: Path,
          variants: list[Variant]) -> Part:
    """One entry of ``parts``, its ``smoke`` section applied at ``scale=smoke`` (settings merged; scenarios
    and the layout's keys, e.g. convergence thresholds, replaced)."""
    own = LAYOUT_KEYS[layout]
    name = str(raw.get("name", f"part{index}")) if isinstance(raw, Mapping) else f"part{index}"
    where = f"parts[{index}] ({name})"
    part = _mapping(raw, path, where, PART_KEYS + own)
    smoke = _mapping(part.get("smoke"), path, f"{where} smoke", PART_SMOKE_KEYS + own)
    settings = _settings(part.get("settings"), path, where)
    _check_benchmark(part, {**_settings(target.get("settings"), path, "the top level"), **settings}, path, where)
    if scale != "smoke":
        smoke = {}
    scenarios = (_scenarios(smoke.get("scenarios"), path, f"{where} smoke ")
                 or _scenarios(part.get("scenarios"), path, f"{where} ") or [Scenario(str(part.get("name", "all")))])
    paper = part.get("paper") or {}
    if not isinstance(paper, Mapping):
        raise ConfigError(f"{path}: {where} paper must map each row's label to its numbers")
    return Part(
        name=name,
        benchmark=str(part.get("benchmark", "digits")),
        settings={**settings, **_settings(smoke.get("settings"), path, f"{where} smoke")},
        scenarios=scenarios,
        columns=[str(c) for c in _list(part.get("columns"), path, f"{where} columns")],
        paper={str(k): list(_list(v, path, f"{where} paper row {k!r}")) for k, v in paper.items()},
        extra={**{k: part[k] for k in own if k in part}, **{k: smoke[k] for k in own if k in smoke}},
        variants=_variants(part.get("variants"), path, f"{where} ") or variants,
    )


def load_target(name: str, scale: str = "paper") -> Target:
    """Read ``configs/paper/NAME.yaml`` strictly and apply its ``smoke`` sections when ``scale=smoke``."""
    if scale not in SCALES:
        raise ConfigError(f"scale={scale!r} is not valid; use scale=paper or scale=smoke")
    path = configs_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no reproduce target {name!r}; choose one of: {', '.join(available_targets())} "
                          f"(the YAML files in {configs_dir()})")
    try:
        loaded = load_yaml(read_bounded(path, MAX_YAML_CHARS), str(path))
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from None
    raw = _mapping(loaded, path, "the top level", TARGET_KEYS)
    layout = raw.get("layout", "domains")
    if layout not in LAYOUT_KEYS:
        raise ConfigError(f"{path}: layout={layout!r} is not one of {', '.join(LAYOUTS)}")
    smoke = _mapping(raw.get("smoke"), path, "smoke", SMOKE_KEYS)  # checked at every scale, applied at smoke
    if scale != "smoke":
        smoke = {}
    variants = _variants(raw.get("variants"), path, "")
    parts = [_part(part, index, layout, scale, raw, path, variants)
             for index, part in enumerate(_list(raw.get("parts"), path, "parts"))]
    return Target(name=str(raw.get("name", name)), title=str(raw.get("title", name)), layout=layout,
                  seeds=list(_list(smoke.get("seeds", raw.get("seeds", [0, 1, 2])), path, "seeds")),
                  settings={**_settings(raw.get("settings"), path, "the top level"),
                            **_settings(smoke.get("settings"), path, "smoke")},
                  variants=variants, parts=parts, notes=[str(n) for n in _list(raw.get("notes"), path, "notes")])
