"""What each ``fedhpro`` command does, given its parsed arguments; :mod:`fedhpro.cli` parses the command line
and imports this module only when a command runs (``fedhpro --help`` and usage errors answer without it;
``fedhpro config`` is :mod:`fedhpro.config_command`, which loads the config's modules only)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from fedhpro import api, reports
from fedhpro.command_options.keys import key_of, take
from fedhpro.command_options.report import ReportOptions
from fedhpro.compare import main as compare_main
from fedhpro.config import applied_data_options, load_config, parse_override, read_yaml
from fedhpro.data import get_dataset
from fedhpro.data.describe import plot_heatmap, table
from fedhpro.engines.lifecycle import RUN_FILES
from fedhpro.errors import ConfigError
from fedhpro.models import MODELS
from fedhpro.models.summary import describe_models, format_model_table
from fedhpro.reports.runs import report
from fedhpro.reproduce import main as reproduce_main
from fedhpro.trained import class_accuracy, predict
from fedhpro.trained.onnx_export import export_onnx
from fedhpro.trained.prediction import labelled_accuracy
from fedhpro.tune import main as tune_main


def _cmd_run(args: argparse.Namespace) -> int:
    source = None
    overrides = list(args.settings)
    if overrides and "=" not in overrides[0]:
        source = overrides.pop(0)
        overrides += _fresh_out(source, overrides)
    api.run(source, overrides, echo=True)
    return 0


def _fresh_out(source: str, overrides: list[str]) -> list[str]:
    """``fedhpro run runs/x/config.yaml`` runs that configuration again: when the file's ``out=`` holds a run
    (the one that wrote it) and no ``out=`` is given, the ``out=`` of a fresh folder beside it (``runs/x-2``,
    ``-3``, ...), said in one line; else nothing."""
    if any(item.split("=", 1)[0].strip() == "out" for item in overrides) or not Path(source).is_file():
        return []
    try:
        named = read_yaml(Path(source)).get("out")
    except (ConfigError, OSError, AttributeError):
        return []  # the run's own loading says what is wrong with the file
    if not isinstance(named, str) or not named:
        return []
    taken = Path(named)
    if not any((taken / name).exists() for name in RUN_FILES):
        return []
    number = 2
    while Path(f"{named}-{number}").exists():
        number += 1
    fresh = f"{named}-{number}"
    unfinished = "" if (taken / "summary.json").exists() else f", or resume={named} to continue that one"
    print(f"note: {source} names out={named}, which holds a run; this run writes to {fresh} (give out= to choose "
          f"another{unfinished})")
    return [f"out={fresh}"]


def _cmd_models(args: argparse.Namespace) -> int:
    """Print every registered model with its parameter count and forward FLOPs at its usual input size."""
    unknown = [name for name in args.names if name not in MODELS]
    if unknown:
        raise ConfigError(f"unknown model {unknown[0]!r}; choose from: {', '.join(MODELS)}")
    print(format_model_table(describe_models(args.names or None)))
    return 0


def _cmd_data_describe(args: argparse.Namespace) -> int:
    """Build the configured federation and print who holds what; write partition.png and partition.json."""
    overrides = list(args.settings)
    source = overrides.pop(0) if overrides and "=" not in overrides[0] else None
    config = load_config(source, overrides)
    options = config.run
    federation = get_dataset(options.dataset).build(applied_data_options(config), options.clients, options.seed,
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
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be at least 1")
    text = predict(args.run_folder, args.paths, args.out, client=args.client, batch_size=args.batch_size,
                   site=args.site)
    if args.out is None:
        print(text, end="")
    else:
        rows = text.count("\n") - 1
        print(f"{rows} prediction{'s' if rows != 1 else ''} written to {args.out}")
    labelled = labelled_accuracy(args.run_folder, text)  # CSV rows that carry their class
    if labelled is not None:
        print(f"accuracy {100 * labelled[0] / labelled[1]:.1f} % on {labelled[1]} labelled rows", file=sys.stderr)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    """The run's model as ONNX with its preprocessing."""
    exported = export_onnx(args.run_folder, args.out, client=args.client, site=args.site)
    print(f"wrote {exported.path}: input {exported.input}, shape {exported.shape}")
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    return compare_main(args.settings)


def _cmd_tune(args: argparse.Namespace) -> int:
    return tune_main(args.settings)


def _cmd_reproduce(args: argparse.Namespace) -> int:
    return reproduce_main(args.settings)


def _cmd_report(args: argparse.Namespace) -> int:
    folders = [item for item in args.settings if "=" not in item]
    pairs = dict(parse_override(item) for item in args.settings if "=" in item)
    tail_ratio_given = "tail_ratio" in pairs
    options = take(ReportOptions, pairs)
    if pairs:
        keys = [key_of(field) for field in dataclasses.fields(ReportOptions)]
        raise ConfigError(f"fedhpro report takes run folders and {', '.join(f'{key}=' for key in keys)} only, not "
                          f"{', '.join(sorted(pairs))}")
    if tail_ratio_given and not options.per_class:
        raise ConfigError("tail_ratio= shapes the per-class report only; add per_class=true")
    report(folders, options.out, force=options.force,
           class_accuracy=class_accuracy if options.per_class else None,
           class_options={"tail_ratio": options.tail_ratio} if tail_ratio_given else {})
    return 0


#: the handler of each command (``fedhpro.cli`` sets its name as the parser's ``handler``)
HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": _cmd_run, "compare": _cmd_compare, "tune": _cmd_tune, "reproduce": _cmd_reproduce,
    "report": _cmd_report, "predict": _cmd_predict, "export": _cmd_export, "models": _cmd_models,
    "data describe": _cmd_data_describe}
