"""The ``fedhpro`` command line: ``fedhpro run [CONFIG.yaml] [KEY=VALUE ...]``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from fedhpro.errors import ConfigError, FedHProError


def _cmd_run(args: argparse.Namespace) -> int:
    from fedhpro.api import run

    source = None
    overrides = list(args.settings)
    if overrides and "=" not in overrides[0]:
        source = overrides.pop(0)
    run(source, overrides, echo=True)
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
    from fedhpro.config import SECTIONS, RunOptions, load_config
    from fedhpro.methods import all_methods

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
    import yaml

    from fedhpro.config import load_config

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
    from fedhpro.models import MODELS
    from fedhpro.models.summary import describe_models, format_model_table

    unknown = [name for name in args.names if name not in MODELS]
    if unknown:
        raise ConfigError(f"unknown model {unknown[0]!r}; choose from: {', '.join(MODELS)}")
    print(format_model_table(describe_models(args.names or None)))
    return 0


def _cmd_data_describe(args: argparse.Namespace) -> int:
    """Build the configured federation and print who holds what; write partition.png and partition.json."""
    from pathlib import Path

    from fedhpro import reports
    from fedhpro.config import load_config
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
    from fedhpro.trained import predict

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
    from fedhpro.compare import main as compare_main

    return compare_main(args.settings)


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from fedhpro.reproduce import main as reproduce_main

    return reproduce_main(args.settings)


def _cmd_report(args: argparse.Namespace) -> int:
    from fedhpro.config import parse_override
    from fedhpro.reports.runs import report

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
    from fedhpro.trained import class_accuracy

    report(folders, pairs.get("out"), force=flags["force"],
           class_accuracy=class_accuracy if flags["per_class"] else None)
    return 0


#: how compare and reproduce run their runs in parallel (fedhpro.sweeps), in both commands' help
_SWEEP_HELP = ("Parallel: jobs=N runs N at a time in worker processes here (jobs=4), each pinned to threads=auto "
               "(this machine's cores / N; or threads=2); results are the same bytes as a sequential sweep with "
               "that thread count. executor=ray makes each run a Ray task on a local Ray (executor=ray jobs=8) "
               "or on a cluster (`ray start --head` on one machine, `ray start --address=HEAD:6379` on the "
               "others, then executor=ray ray.address=HEAD:6379, or ray.address=auto on a cluster node; "
               'needs pip install "fedhpro[flower]"). A failed run is reported and the others finish; the '
               "command then exits non-zero listing the failures.")


_COMPARE_DESCRIPTION = (
    "Run methods=[...] for seeds=[...] (default: all nine methods, seeds 0,1,2) with the same settings; writes "
    "<out>/table.md and table.csv (default out=runs/compare). Finished runs in <out> are reused (interrupted ones "
    "continue from their checkpoint) if their config.yaml holds the same settings; one that does not stops the "
    "comparison with the settings that differ. ")
_REPRODUCE_DESCRIPTION = (
    "fedhpro reproduce NAME [scale=paper|smoke] [seeds=[0,1,2]] [out=DIR] [KEY=VALUE ...]: runs the target's "
    "methods x seeds (finished runs are reused) and writes table.md, table.csv and PNG figures with the paper's "
    "numbers beside ours (default out=runs/reproduce/<scale>). NAME=list lists the targets, NAME=all runs them "
    "all. scale=smoke runs in minutes on a CPU (Digits tables fall back to digits-offline when the real data are "
    "absent). ")


def _settings_command(commands, name: str, handler, *, help: str, description: str | None = None,
                      metavar: str = "[CONFIG.yaml] KEY=VALUE") -> argparse.ArgumentParser:
    """A subcommand that takes free ``settings`` (a YAML path and KEY=VALUE pairs, or names) and a handler."""
    parser = commands.add_parser(name, help=help, description=description)
    parser.add_argument("settings", nargs="*", metavar=metavar)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedhpro",
        description="FedHPro and federated-learning baselines on heterogeneous clients.")
    from fedhpro import __version__

    parser.add_argument("--version", action="version", version=f"fedhpro {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _settings_command(
        commands, "run", _cmd_run, help="train one method on one federation",
        description="Train one method on one federation. With no arguments: FedHPro on digits-offline. "
                    "Settings: an optional CONFIG.yaml, then KEY=VALUE pairs (see `fedhpro config --keys`).")
    config_parser = _settings_command(commands, "config", _cmd_config,
                                      help="print the resolved config (or --keys: every key)")
    config_parser.add_argument("--keys", action="store_true",
                               help="list every key with its choices, help and default (the data.* keys of "
                                    "the dataset= given)")
    _settings_command(commands, "compare", _cmd_compare, description=_COMPARE_DESCRIPTION + _SWEEP_HELP,
                      help="several methods on the same federation and seeds: a table like the paper's Table A3")
    _settings_command(commands, "reproduce", _cmd_reproduce, metavar="NAME [KEY=VALUE]",
                      help="run a table or figure of the paper (configs/paper/NAME.yaml): tables and PNGs",
                      description=_REPRODUCE_DESCRIPTION + _SWEEP_HELP)
    _settings_command(
        commands, "report", _cmd_report, metavar="RUN_DIR",
        help="tables and plots from finished runs or a comparison (accuracy curves, L_GM, fairness)",
        description="fedhpro report RUN_DIR [RUN_DIR ...] [out=DIR] [force=true] [per_class=true]: table.md/table.csv "
                    "(final "
                    "accuracy, fairness, communication, FLOPs) and accuracy.png, gm_loss.png, fairness.png, "
                    "prototype_distance.png (default out=<first run's parent>/report). The out= folder of "
                    "`fedhpro compare` gives the report over seeds instead: per method the mean ± std table and "
                    "the mean accuracy curve with a min-max band over the seeds (default out=<that folder>/report). "
                    "A run without summary.json is marked unfinished (4/10 rounds). An out= holding a report of "
                    "other runs is refused unless force=true; a report of the same runs is refreshed. per_class=true "
                    "re-tests each run's saved model on its rebuilt test sets and adds per_class.md/.csv/.png: the "
                    "balanced accuracy, the head / middle / tail classes (ranked by training images) and every "
                    "class's accuracy. Comparison folders at two precisions (amp=off and amp=bf16, the other "
                    "settings the same) also give parity.md/.csv/.json: per setting the float32 and bf16 mean ± "
                    "std, the difference of means, the larger seed std and whether the difference lies within it "
                    "(default out=<the folder they share>/report); folders that differ in anything else are "
                    "refused. A folder holding comparison folders (study/<setting>/<precision>/) stands for them.")
    predict_parser = commands.add_parser(
        "predict", help="classify images or tensors with a finished run's trained model: a CSV",
        description="fedhpro predict RUN_FOLDER PATH... [--out FILE.csv]: the run's trained model (model.pt, "
                    "rebuilt from the folder) classifies image files, folders of images (read recursively) and "
                    ".pt files of an N x ... tensor (the model's inputs, preprocessed as the run's data). Images "
                    "are preprocessed as the run's data set does (RGB, size, normalisation). The CSV has one row "
                    "per input: path, predicted class, then p_<class> for every class (softmax of the logits); "
                    "it goes to stdout unless --out is given.")
    predict_parser.add_argument("run_folder", metavar="RUN_FOLDER", help="the folder of a finished run (its out=)")
    predict_parser.add_argument("paths", nargs="+", metavar="PATH",
                                help="image files, folders of images, .pt/.npz files (or a training file's x)")
    predict_parser.add_argument("--out", metavar="FILE.csv", help="write the CSV here (atomically) instead of stdout")
    predict_parser.add_argument("--client", type=int, metavar="K",
                                help="client K's personal model (runs whose clients keep their own models)")
    predict_parser.add_argument("--site", metavar="NAME",
                                help="tabular runs with data.standardize=client: scale the rows by this site's "
                                     "training statistics (default: all sites' training rows pooled, for a new site)")
    predict_parser.add_argument("--batch-size", type=int, default=256, metavar="N",
                                help="inputs per forward pass (default 256)")
    predict_parser.set_defaults(handler=_cmd_predict)
    models_parser = commands.add_parser(
        "models", help="list the model zoo: parameters and forward FLOPs (torch.utils.flop_counter)")
    models_parser.add_argument("names", nargs="*", help="only these models")
    models_parser.set_defaults(handler=_cmd_models)
    data_parser = commands.add_parser("data", help="inspect data sets and federations (data describe)")
    data_commands = data_parser.add_subparsers(dest="data_command", metavar="COMMAND")
    data_parser.set_defaults(handler=lambda _args: _usage(data_parser))
    _settings_command(
        data_commands, "describe", _cmd_data_describe,
        help="per-client table (samples, classes, domain) and a client x class heat map",
        description="Build the federation of the given settings (same keys as `fedhpro run`) and print one row "
                    "per client; writes partition.png (client x class counts) and partition.json to out= "
                    "(default runs/data-<dataset>).")
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    """Print ``parser``'s help for a command given without its subcommand; exit status 2."""
    parser.print_help()
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        return _usage(parser)
    try:
        code = args.handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit where it could not be caught
        return code
    except FedHProError as error:
        print(f"fedhpro: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedhpro: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_went_away()


def _reader_went_away() -> int:
    """The reader of stdout closed it (``fedhpro config --keys | head``): stop quietly. As Python's
    documentation recommends (the note on SIGPIPE in the signal module), stdout is pointed at devnull
    so that flushing the rest at exit cannot raise again; exit status 1."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1


if __name__ == "__main__":
    sys.exit(main())
