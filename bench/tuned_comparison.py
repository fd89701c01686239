"""FedAvg, FedProx and FedHPro each tuned with the same budget, then compared on the test set over 3 seeds, beside
the same comparison at their defaults: one label-skew and one domain-skew setting.

Per setting, under ``--root``:

* ``<setting>/tune``: ``fedhpro tune methods=[fedavg,fedprox,fedhpro] trials=T`` (validation accuracy only,
  ``validation=0.2``, tuning seed 1000; TPE and the median pruner, Optuna's storage in the folder: running this
  again resumes it);
* ``<setting>/tuned``: ``fedhpro compare tuned=<setting>/tune/tuned.yaml seeds=[0,1,2]`` (the test set);
* ``<setting>/defaults``: ``fedhpro compare seeds=[0,1,2]`` at every method's defaults, with the same
  ``validation=0.2`` so that both comparisons train on the same data;

then ``table`` prints, per setting and method, the test AVG at the defaults and tuned (mean ± std over the
seeds), the difference, and the tuned settings; ``fedhpro report <setting>/tuned`` rebuilds each table.

    python bench/tuned_comparison.py run --root runs/tuned-comparison --trials 12
    python bench/tuned_comparison.py table --root runs/tuned-comparison
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

METHODS = "[fedavg,fedprox,fedhpro]"
COMMON = ["device=cpu", "progress=false", "threads=1", "checkpoint_every=0", "rounds=10", "validation=0.2"]
SETTINGS = {
    # label skew: real MNIST, Dirichlet 0.2 over 10 clients (configs/paper/label_skew.yaml's NID1_0.2, cnn d=512)
    "label-skew": ["dataset=digits-offline", "data.domains=[mnist]", "partition=dirichlet", "partition.alpha=0.2",
                   "clients=10", "model=cnn", "feature_dim=512"],
    # domain skew: the default digits-offline federation (4 domains, 20 clients) at half its data
    "domain-skew": ["dataset=digits-offline", "data.fraction=0.05"],
}


def call(command: list[str], log: Path) -> int:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as handle:
        handle.write(" ".join(command) + "\n")
        handle.flush()
        return subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))


def run(root: Path, trials: int, jobs: int, settings: Sequence[str]) -> int:
    code = 0
    for setting in settings:
        keys = [*COMMON, *SETTINGS[setting]]
        folder = root / setting
        steps = [
            (["fedhpro", "tune", f"methods={METHODS}", f"trials={trials}", f"jobs={jobs}", *keys,
              f"out={folder / 'tune'}"], folder / "tune.log"),
            (["fedhpro", "compare", f"tuned={folder / 'tune' / 'tuned.yaml'}", f"methods={METHODS}", "seeds=[0,1,2]",
              f"jobs={jobs}", *keys, f"out={folder / 'tuned'}"], folder / "tuned.log"),
            (["fedhpro", "compare", f"methods={METHODS}", "seeds=[0,1,2]", f"jobs={jobs}", *keys,
              f"out={folder / 'defaults'}"], folder / "defaults.log"),
        ]
        for command, log in steps:
            status = call(command, log)
            print(f"{setting}: {command[1]} -> exit {status}", flush=True)
            code = max(code, status)
    return code


def finals(folder: Path) -> dict[str, list[float]]:
    """Final test AVG of every finished run under a compare folder, by method."""
    out: dict[str, list[float]] = {}
    for summary in sorted(folder.glob("*/summary.json")):
        data = json.loads(summary.read_text())
        out.setdefault(data["method"], []).append(float(data["accuracy"]))
    return out


def shown(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def table(root: Path) -> str:
    lines = []
    for setting in SETTINGS:
        folder = root / setting
        tuned_file = folder / "tune" / "tuned.yaml"
        if not tuned_file.is_file():
            continue
        tuned = yaml.safe_load(tuned_file.read_text())["methods"]
        defaults, after = finals(folder / "defaults"), finals(folder / "tuned")
        lines += [f"### {setting}", "", "| method | defaults: test AVG | tuned: test AVG | tuned - defaults | "
                  "tuned settings |", "|---|---|---|---|---|"]
        for method, settings in tuned.items():
            before, now = defaults.get(method, []), after.get(method, [])
            delta = (f"{statistics.mean(now) - statistics.mean(before):+.2f}" if before and now else "–")
            chosen = ", ".join(f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}"
                               for key, value in settings.items())
            lines.append(f"| {method} | {shown(before)} | {shown(now)} | {delta} | {chosen} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("run", "table"))
    parser.add_argument("--root", type=Path, default=Path("runs/tuned-comparison"))
    parser.add_argument("--trials", type=int, default=12, help="the trial budget of every method")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    args = parser.parse_args(argv)
    if args.action == "run":
        return run(args.root, args.trials, args.jobs, args.settings)
    print(table(args.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
