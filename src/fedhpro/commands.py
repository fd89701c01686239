"""What each ``fedhpro`` command does, given its parsed arguments; :mod:`fedhpro.cli` parses the command line
and imports this module only when a command runs (``fedhpro --help`` and usage errors answer without it).

Each command imports what it runs inside its handler: ``fedhpro predict`` does not load Optuna, the sweeps or
the reports, ``fedhpro config`` not the engines (start-up time: every command paid for all of them)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from fedhpro.config import SECTIONS, RunOptions, load_config, parse_override
from fedhpro.errors import ConfigError
from fedhpro.methods import all_methods


def _cmd_run(args: argparse.Namespace) -> int:
    from fedhpro import api  # per command: start-up time (module docstring)

    source = None
    overrides = list(args.settings)
    if overrides and "=" not in overrides[0]:
        source = overrides.pop(0)
    api.run(source, overrides, echo=True)
    return 0


def _shown(value: object) -> str:
    """A default as it is typed on the command line: ``true``, ``null``, ``0.01``, ``[1, 2]``, ``cnn``."""
    return value if isinstance(value, str) else json.dumps(value)


def key_lines(dataset: str) -> list[str]:
    """``key [choices]: help (default: value)`` for every config key: the run's, every method's, the data
    set's (its ``data.*`` keys), ``faults.*``, ``partition`` / ``partition.*`` and ``aggregation`` /
    ``aggregation.*``. Defaults are the
    values a run of ``dataset`` gets when the key is not set (a data set's own run settings included);
    an unset (null) default whose help already says what it means is not repeated."""
    defaults = load_config(None, {"dataset": dataset})
    groups: list[tuple[str, type[Any], Any]] = [("", RunOptions, defaults.run)]
    groups += [(f"{name}.", spec.options, defaults.methods[name]) for name, spec in all_methods().items()]
    groups += [(f"{section.name}.", section.options_for(dataset), getattr(defaults, section.name))
               for section in SECTIONS]
    lines = []
    for prefix, cls, values in groups:
        for field in dataclasses.fields(cls):
            choices = field.metadata.get("choices")
            extra = f" [{'|'.join(map(str, choices))}]" if choices else ""
            text, value = field.metadata.get("help", ""), getattr(values, field.name)
            if not (value is None and "default" in text):  # else the help says what an unset key means
                text += f" (default: {_shown(value)})"
            lines.append(f"{prefix}{field.name}{extra}: {text}")
    for section in SECTIONS:
        if section.shorthand:
            value = getattr(getattr(defaults, section.name), section.shorthand)
            lines.append(f"{section.name}: short for {section.name}.{section.shorthand} (default: {_shown(value)})")
    return lines


def _cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config, or (``--keys``) every key with its choices, help and default."""
    overrides = list(args.settings)
    source = overrides.pop(0) if overrides and "=" not in overrides[0] else None
    config = load_config(source, overrides)
    if args.keys:
        print("\n".join(key_lines(config.run.dataset)))
        return 0
    print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    """Print every registered model with its parameter count and forward FLOPs at its usual input size."""
    from fedhpro.models import MODELS  # per command: start-up time (module docstring)
    from fedhpro.models.summary import describe_models, format_model_table

    unknown = [name for name in args.names if name not in MODELS]
    if unknown:
        raise ConfigError(f"unknown model {unknown[0]!r}; choose from: {', '.join(MODELS)}")
    print(format_model_table(describe_models(args.names or None)))
    return 0


def _cmd_data_describe(args: argparse.Namespace) -> int:
    """Build the configured federation and print who holds what; write partition.png and partition.json."""
    from fedhpro import reports  # per command: start-up time (module docstring)
    from fedhpro.data import get_dataset
    from fedhpro.data.describe import plot_heatmap, table

    overrides = list(args.settings)
    source = overrides.pop(0) if overrides and "=" not in overrides[0] else None
    config = load_config(source, overrides)
    options = config.run
    federation = get_dataset(options.dataset).build(config.data, options.clients, options.seed,
                                                    data_dir=options.data_dir, progress=options.progress,
                                                    partition=config.partition)
    out = Path(options.out) if options.out else Path("runs") / f"data-{options.dataset}"
    print(table(federation))
    reports.write_json(out / "partition.json", federation.partition)
    plot_heatmap(federation, out / "partition.png")
    print(f"heat map: {out / 'partition.png'}; partition: {out / 'partition.json'}")
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    """Classify images or tensors with a finished run's model; the CSV to --out or stdout."""
    from fedhpro.trained import predict  # per command: start-up time (module docstring)

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be at least 1")
    text = predict(args.run_folder, args.paths, args.out, client=args.client, batch_size=args.batch_size,
                   site=args.site)
    if args.out is None:
        print(text, end="")
    else:
        rows = text.count("\n") - 1
        print(f"{rows} prediction{'s' if rows != 1 else ''} written to {args.out}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    from fedhpro.compare import main  # per command: start-up time (module docstring)

    return main(args.settings)


def _cmd_tune(args: argparse.Namespace) -> int:
    from fedhpro.tune import main  # per command: start-up time (module docstring)

    return main(args.settings)


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from fedhpro.reproduce import main  # per command: start-up time (module docstring)

    return main(args.settings)


def _cmd_report(args: argparse.Namespace) -> int:
    from fedhpro.reports.runs import report  # per command: start-up time (module docstring)
    from fedhpro.trained import class_accuracy

    folders = [item for item in args.settings if "=" not in item]
    pairs = dict(parse_override(item) for item in args.settings if "=" in item)
    unknown = set(pairs) - {"out", "force", "per_class"}
    if unknown:
        raise ConfigError(f"fedhpro report takes run folders, out=DIR, force=true and per_class=true only, not "
                          f"{', '.join(sorted(unknown))}")
    flags = {}
    for name, why in (("force", "to replace an earlier report"), ("per_class", "to add per-class accuracy")):
        flags[name] = pairs.get(name, False)
        if not isinstance(flags[name], bool):
            raise ConfigError(f"{name}={flags[name]!r} is not a boolean; use {name}=true {why}")
    report(folders, pairs.get("out"), force=flags["force"],
           class_accuracy=class_accuracy if flags["per_class"] else None)
    return 0


#: the handler of each command (``fedhpro.cli`` sets its name as the parser's ``handler``)
HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _cmd_run, "config": _cmd_config, "compare": _cmd_compare, "tune": _cmd_tune, "reproduce": _cmd_reproduce,
    "report": _cmd_report, "predict": _cmd_predict, "models": _cmd_models, "data describe": _cmd_data_describe}
