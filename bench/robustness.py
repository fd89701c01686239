"""Hostile but finite clients against the aggregation rules (the deployment issue's robustness table).

Runs ``fedhpro compare`` once per (attack, rule) setting on digits-offline, each
into its own folder under ``--out`` (a finished run is reused, so an
interrupted study continues), then writes ``robustness.md`` and
``robustness.csv`` there: final AVG, mean ± std over the seeds, per method and
attack, one column per rule, beside the clean run.

Attacks, as fractions of the participating clients drawn per round (seeded):
``faults.scale=0.2 faults.scale_factor=100`` (the client sends w + 100·Δ) and
``faults.sign_flip=0.2`` (it sends w − Δ). Rules: ``mean`` (plain FedAvg
weighting), ``median``, ``trimmed-mean`` (``aggregation.trim=0.2``) and
``norm-clip`` (each update clipped to ``aggregation.norm_multiple`` x the
round's median update norm).

    python bench/robustness.py --out runs/robustness                     # the README's table
    python bench/robustness.py --out /tmp/r --seeds 0 --rounds 2 --local-epochs 1   # a quick look

Every number comes from run folders that ``fedhpro report`` can rebuild.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

RULES = {"mean": [], "median": [], "trimmed-mean": ["aggregation.trim=0.2"],
         "norm-clip": ["aggregation.norm_multiple=3"]}
ATTACKS = {"clean": [], "scale": ["faults.scale=0.2", "faults.scale_factor=100"], "sign-flip": ["faults.sign_flip=0.2"]}


def settings() -> list[tuple[str, str, list[str]]]:
    """``(attack, rule, keys)``: the clean run with the plain mean and every attack under every rule."""
    out = [("clean", "mean", [])]
    for attack, keys in ATTACKS.items():
        if attack != "clean":
            out += [(attack, rule, keys + [f"aggregation={rule}"] + extra) for rule, extra in RULES.items()]
    return out


def accuracies(folder: Path, method: str) -> list[float]:
    return [json.loads((run / "summary.json").read_text())["accuracy"]
            for run in sorted(folder.glob(f"{method}-seed*")) if (run / "summary.json").is_file()]


def cell(values: list[float]) -> str:
    if not values:
        return "–"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.2f} ± {spread:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", default="fedavg,fedhpro")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    methods = args.methods.split(",")
    budget = [f"rounds={args.rounds}", f"local_epochs={args.local_epochs}"]
    for attack, rule, keys in settings():
        folder = args.out / f"{attack}-{rule}"
        command = [sys.executable, "-m", "fedhpro", "compare", f"methods=[{args.methods}]", f"seeds=[{args.seeds}]",
                   *budget, *keys, f"jobs={args.jobs}", "progress=false", "device=cpu", f"out={folder}"]
        print(" ".join(command[1:]), flush=True)
        subprocess.run(command, check=True)
    rows = []
    for method in methods:
        clean = accuracies(args.out / "clean-mean", method)
        for attack in (a for a in ATTACKS if a != "clean"):
            rows.append([method, attack, cell(clean)] + [cell(accuracies(args.out / f"{attack}-{rule}", method))
                                                         for rule in RULES])
    header = ["method", "attack", "clean (mean)"] + [f"attacked, {rule}" for rule in RULES]
    lines = [f"Final AVG (%) on digits-offline, mean ± std over seeds [{args.seeds}]; "
             f"{' '.join(budget)}; 20% of the clients hostile per round.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    (args.out / "robustness.md").write_text("\n".join(lines) + "\n")
    with open(args.out / "robustness.csv", "w", newline="") as handle:
        csv.writer(handle).writerows([header, *rows])
    print("\n".join(lines))


if __name__ == "__main__":
    main()
