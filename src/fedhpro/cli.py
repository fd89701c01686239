"""The ``fedhpro`` command line: ``fedhpro run [CONFIG.yaml] [KEY=VALUE ...]``."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from types import ModuleType

from fedhpro import __version__
from fedhpro.errors import FedHProError, RunInterrupted


def _config_command() -> ModuleType:
    """:mod:`fedhpro.config_command`, what ``fedhpro config`` does."""
    # lazy, as below: `fedhpro config` loads the config's modules, not the engines, sweeps and reports
    from fedhpro import config_command

    return config_command


def _commands() -> ModuleType:
    """:mod:`fedhpro.commands`, what the other commands do."""
    # lazy: --help, --version and usage errors answer in ~0.05 s without loading torch (~1-3 s)
    from fedhpro import commands

    return commands


def key_lines(dataset: str) -> list[str]:
    """Every config key with its choices, help and default: :func:`fedhpro.config_command.key_lines`."""
    return _config_command().key_lines(dataset)


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
    "comparison with the settings that differ. A list for a key that takes one value (lr=[0.01,0.05]) is a grid: "
    "one row per method and point, named in the table (fedavg lr=0.05). tuned=DIR/tuned.yaml (fedhpro tune) runs "
    "each method at its tuned settings, on seeds apart from the tuning's, and the table's caption names them. ")
_TUNE_DESCRIPTION = (
    "fedhpro tune [CONFIG.yaml] methods=[fedavg,fedprox] trials=20 out=DIR [jobs=N] [storage=URL] "
    "[pruner=median|none] [lr_range=[0.001,0.1]] KEY=VALUE ...: per method an Optuna study (TPE sampler, median "
    "pruner on each round's validation AVG) of trials= runs over lr (log-uniform in lr_range), local_epochs and the "
    "knobs the method declares (a key given here is fixed), on validation= (default 0.2; never test accuracy) at "
    "seed= (default 1000). Resumable: the studies live in DIR/study.db (storage= any RDB URL Optuna accepts); "
    "jobs=N workers share them, the total staying trials=. Writes DIR/<method>/trials.csv (each trial complete, "
    "diverged, pruned or failed) and best.yaml, DIR/tuning.md (the counts, the best trials, the diverged ones "
    "apart) and DIR/tuned.yaml for `fedhpro compare tuned=DIR/tuned.yaml`. `fedhpro config --keys` lists every "
    "key of this command.")
_REPRODUCE_DESCRIPTION = (
    "fedhpro reproduce NAME [scale=paper|smoke] [seeds=[0,1,2]] [out=DIR] [KEY=VALUE ...]: runs the target's "
    "methods x seeds (finished runs are reused) and writes table.md, table.csv and PNG figures with the paper's "
    "numbers beside ours (default out=runs/reproduce/<scale>). NAME=list lists the targets, NAME=all runs them "
    "all. scale=smoke runs in minutes on a CPU (Digits tables fall back to digits-offline when the real data are "
    "absent). ")


def _settings_command(commands, name: str, handler: str, *, help: str, description: str | None = None,
                      metavar: str = "[CONFIG.yaml] KEY=VALUE") -> argparse.ArgumentParser:
    """A subcommand that takes free ``settings`` (a YAML path and KEY=VALUE pairs, or names) and a handler (its
    name in :data:`fedhpro.commands.HANDLERS`, or ``config``: :func:`fedhpro.config_command.cmd_config`)."""
    parser = commands.add_parser(name, help=help, description=description)
    parser.add_argument("settings", nargs="*", metavar=metavar)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedhpro",
        description="FedHPro and federated-learning baselines on heterogeneous clients.")
    parser.add_argument("--version", action="version", version=f"fedhpro {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _settings_command(
        commands, "run", "run", help="train one method on one federation",
        description="Train one method on one federation. With no arguments: FedHPro on digits-offline. "
                    "Settings: an optional CONFIG.yaml, then KEY=VALUE pairs (see `fedhpro config --keys`). "
                    "Ctrl-C stops it and says how to go on: `fedhpro run resume=<out>` continues from the newest "
                    "checkpoint (written every checkpoint_every= rounds), which the resumed run names.")
    config_parser = _settings_command(commands, "config", "config",
                                      help="print the resolved config (or --keys: every key)")
    config_parser.add_argument("--keys", action="store_true",
                               help="list every key with its choices, help and default (the data.* keys of "
                                    "the dataset= given)")
    _settings_command(commands, "compare", "compare", description=_COMPARE_DESCRIPTION + _SWEEP_HELP,
                      help="several methods on the same federation and seeds: a table like the paper's Table A3")
    _settings_command(commands, "tune", "tune", help="each method's hyperparameters tuned by Optuna on validation "
                      "accuracy, the same trial budget each: tuned.yaml for compare", description=_TUNE_DESCRIPTION)
    _settings_command(commands, "reproduce", "reproduce", metavar="NAME [KEY=VALUE]",
                      help="run a table or figure of the paper (configs/paper/NAME.yaml): tables and PNGs",
                      description=_REPRODUCE_DESCRIPTION + _SWEEP_HELP)
    _settings_command(
        commands, "report", "report", metavar="RUN_DIR",
        help="tables and plots from finished runs or a comparison (accuracy curves, L_GM, fairness)",
        description="fedhpro report RUN_DIR [RUN_DIR ...] [out=DIR] [force=true] [per_class=true [tail_ratio=R]]: "
                    "table.md/table.csv (final accuracy, fairness, communication, FLOPs) and accuracy.png, "
                    "gm_loss.png, fairness.png, "
                    "prototype_distance.png (default out=<first run's parent>/report). The out= folder of "
                    "`fedhpro compare` gives the report over seeds instead: per method the mean ± std table and "
                    "the mean accuracy curve with a min-max band over the seeds (default out=<that folder>/report). "
                    "A run without summary.json is marked unfinished (4/10 rounds). An out= holding a report of "
                    "other runs is refused unless force=true; a report of the same runs is refreshed. per_class=true "
                    "re-tests each run's saved model on its rebuilt test sets and adds per_class.md/.csv/.png, "
                    "classification.csv, confusion.csv and a confusion-matrix figure per method "
                    "(confusion_<method>.png/.pdf): the balanced accuracy, every class's accuracy and, only when "
                    "the largest class has at least tail_ratio (default 2) times the smallest's training samples, "
                    "the head / middle / tail classes (else one line says the classes are balanced); with several "
                    "methods each mean has its 95 % t-interval over seeds and a method is marked only by paired "
                    "t-tests over the shared seeds with Holm's correction. Comparison folders at two precisions "
                    "(amp=off and amp=bf16, the other "
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
                                help="image files, folders of images, .pt/.npz files (or a training file's x), "
                                     ".csv files of rows (written with their predictions to FILE.predictions.csv; "
                                     "rows that carry their label also give an accuracy line)")
    predict_parser.add_argument("--out", metavar="FILE.csv", help="write the CSV here (atomically) instead of stdout")
    predict_parser.add_argument("--client", type=int, metavar="K",
                                help="client K's personal model (runs whose clients keep their own models)")
    predict_parser.add_argument("--site", metavar="NAME",
                                help="tabular runs with data.standardize=client: scale the rows by this site's "
                                     "training statistics (default: all sites' training rows pooled, for a new site)")
    predict_parser.add_argument("--batch-size", type=int, default=256, metavar="N",
                                help="inputs per forward pass (default 256)")
    predict_parser.set_defaults(handler="predict")
    export_parser = commands.add_parser(
        "export", help="write a finished run's model as ONNX, with its input preprocessing",
        description="Write the run's trained model as ONNX (opset 18, a dynamic batch), preceded by the run's "
                    "input preprocessing where it is a few tensor operations: tabular rows taken raw and scaled "
                    "by the training statistics; uint8 images converted as the run converted them. Check it with "
                    "onnxruntime. model.safetensors, beside model.pt in every run folder where safetensors is "
                    "installed, holds the weights for other tools. Needs pip install 'fedhpro[export]'.")
    export_parser.add_argument("run_folder", metavar="RUN_FOLDER", help="the folder of a finished run (its out=)")
    export_parser.add_argument("--out", metavar="FILE.onnx", help="where to write it (default RUN_FOLDER/model.onnx)")
    export_parser.add_argument("--client", type=int, metavar="K", help="client K's personal model")
    export_parser.add_argument("--site", metavar="NAME", help="tabular runs: scale by this site's statistics "
                                                              "(default: every site's training rows pooled)")
    export_parser.set_defaults(handler="export")
    models_parser = commands.add_parser(
        "models", help="list the model zoo: parameters and forward FLOPs (torch.utils.flop_counter)")
    models_parser.add_argument("names", nargs="*", help="only these models")
    models_parser.set_defaults(handler="models")
    data_parser = commands.add_parser("data", help="inspect data sets and federations (data describe)")
    data_commands = data_parser.add_subparsers(dest="data_command", metavar="COMMAND")
    data_parser.set_defaults(handler=None, usage=data_parser)  # `fedhpro data` alone: its help
    _settings_command(
        data_commands, "describe", "data describe",
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
        return _usage(getattr(args, "usage", parser))
    try:
        if args.handler in ("run", "compare", "tune", "report", "reproduce"):  # refused before torch loads
            _config_command().check_command_keys(args.handler, list(args.settings))
        handler = _config_command().cmd_config if args.handler == "config" else _commands().HANDLERS[args.handler]
        code = handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit where it could not be caught
        return code
    except FedHProError as error:
        print(f"fedhpro: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:
        print(f"fedhpro: interrupted{_how_to_continue(interrupt) if args.handler == 'run' else ''}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return _reader_went_away()


def _how_to_continue(interrupt: KeyboardInterrupt) -> str:
    """The rest of ``fedhpro run``'s interrupted line: the command that continues the run from its newest
    checkpoint, or that none was written yet; nothing when the run had not started (no folder known)."""
    if not isinstance(interrupt, RunInterrupted):
        return ""
    if interrupt.completed_rounds is None:
        return f"; no checkpoint in {interrupt.out} yet, nothing to resume: run it again"
    return (f"; its checkpoint after round {interrupt.completed_rounds} is kept, continue with: "
            f"fedhpro run resume={shlex.quote(interrupt.out)}")


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
