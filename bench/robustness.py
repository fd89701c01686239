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
    python bench/robustness.py --out /tmp/r --seeds 0 --rounds 2   # a quick look

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


def settings(clean_rules: list[str]) -> list[tuple[str, str, list[str]]]:
    """``(attack, rule, keys)``: the clean run with the plain mean, every attack under every rule, and the
    ``clean_rules`` without an attack (what a robust rule costs when nobody attacks)."""
    out = [("clean", "mean", [])]
    for attack, keys in ATTACKS.items():
        if attack != "clean":
            out += [(attack, rule, keys + [f"aggregation={rule}"] + extra) for rule, extra in RULES.items()]
    out += [("clean", rule, [f"aggregation={rule}"] + RULES[rule]) for rule in clean_rules if rule != "mean"]
    return out


def accuracies(folder: Path, method: str) -> tuple[list[float], int]:
    """The final AVG of the runs that finished, and how many runs started there but stopped (every
    client diverged); ``([], 0)`` where the setting was not run."""
    runs = sorted(folder.glob(f"{method}-seed*"))
    values = [json.loads((run / "summary.json").read_text())["accuracy"] for run in runs
              if (run / "summary.json").is_file()]
    return values, len(runs) - len(values)


def cell(result: tuple[list[float], int]) -> str:
    values, stopped = result
    if not values:
        return f"diverged ({stopped}/{stopped})" if stopped else "–"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    text = f"{statistics.mean(values):.2f} ± {spread:.2f}"
    return text + (f" ({stopped} of {stopped + len(values)} diverged)" if stopped else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", default="fedavg,fedhpro")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=1)
    # E=1 at the default lr 0.01 reaches ~20% in 10 rounds: a budget where nothing can break; 0.05 reaches ~75%
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--clean-rules", default="median", help="robust rules also run without attackers")
    parser.add_argument("--table-only", action="store_true", help="only rebuild the table from the run folders")
    args = parser.parse_args()
    methods = args.methods.split(",")
    budget = [f"rounds={args.rounds}", f"local_epochs={args.local_epochs}", f"lr={args.lr}"]
    chosen = [] if args.table_only else settings([rule for rule in args.clean_rules.split(",") if rule])
    for attack, rule, keys in chosen:
        folder = args.out / f"{attack}-{rule}"
        command = [sys.executable, "-m", "fedhpro", "compare", f"methods=[{args.methods}]", f"seeds=[{args.seeds}]",
                   *budget, *keys, f"jobs={args.jobs}", "progress=false", "device=cpu", f"out={folder}"]
        print(" ".join(command[1:]), flush=True)
        # a run whose every client diverged (NaN after a poisoned mean) stops: compare reports it and goes on
        subprocess.run(command, check=False)
    rows = []
    for method in methods:
        clean = accuracies(args.out / "clean-mean", method)
        for attack in ATTACKS:  # "clean": each rule without attackers, where it was run
            rows.append([method, attack if attack != "clean" else "none", cell(clean)] + [
                cell(accuracies(args.out / f"{attack}-{rule}", method)) for rule in RULES])
    header = ["method", "attack", "clean (mean)"] + list(RULES)
    lines = [f"Final AVG (%) on digits-offline, mean ± std over seeds [{args.seeds}]; "
             f"{' '.join(budget)}; 20% of the clients hostile per round; a diverged run is one whose every "
             "client's training went non-finite in some round (the run stops).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    (args.out / "robustness.md").write_text("\n".join(lines) + "\n")
    with open(args.out / "robustness.csv", "w", newline="") as handle:
        csv.writer(handle).writerows([header, *rows])
    print("\n".join(lines))


if __name__ == "__main__":
    main()
