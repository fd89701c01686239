"""Privacy-utility study: final AVG accuracy against epsilon for FedAvg, FedProto, FedSA and FedHPro.

Each epsilon is one ``fedhpro compare`` folder (every method x seed a run folder of its own, so
``fedhpro report <folder>/*`` or ``fedhpro compare`` with the same settings rebuilds every number):
``<out>/<kind>/eps-<E>`` with ``privacy=<kind> privacy.target_epsilon=E`` (and, for client-level DP,
``privacy.noise=central``), and ``<out>/<kind>/eps-inf`` with privacy off. The study's own files, written
atomically from the runs' ``summary.json``: ``<out>/<kind>/utility.json``, ``utility.csv``, ``utility.md``
(mean ± std over the seeds) and ``utility.png`` (accuracy against epsilon, one line per method, the
non-private runs drawn at the right edge).

    nice -n 10 python bench/privacy_utility.py --kind client --out results/privacy-utility \\
        --settings "$(cat settings.txt)"
    python bench/privacy_utility.py --kind client --out results/privacy-utility --collect

The second form only collects finished runs (the table and plot again).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedhpro.files import write_atomic

METHODS = ("fedavg", "fedproto", "fedsa", "fedhpro")
EPSILONS = ("1", "4", "16", "inf")


def privacy_keys(kind: str, epsilon: str) -> list[str]:
    """The overrides of one epsilon (``inf``: privacy off)."""
    if epsilon == "inf":
        return []
    keys = [f"privacy={kind}", f"privacy.target_epsilon={epsilon}"]
    if kind == "client":
        keys.append("privacy.noise=central")
    return keys


def compare_command(kind: str, epsilon: str, out: Path, settings: Sequence[str], methods: Sequence[str],
                    seeds: Sequence[int], jobs: int) -> list[str]:
    return [sys.executable, "-m", "fedhpro", "compare", f"methods=[{','.join(methods)}]",
            f"seeds=[{','.join(str(s) for s in seeds)}]", f"jobs={jobs}", f"out={out / kind / f'eps-{epsilon}'}",
            *settings, *privacy_keys(kind, epsilon)]


def run_commands(commands: Sequence[list[str]]) -> None:
    """Each ``fedhpro compare`` command in turn, one thread each, echoed; a failed one is said and passed over
    (the table collects what finished)."""
    for command in commands:
        print("+ " + shlex.join(["fedhpro", *command[3:]]), flush=True)
        result = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if result.returncode != 0:
            print(f"(exit {result.returncode}; the table collects what finished)", flush=True)


def collect(folder: Path, methods: Sequence[str], seeds: Sequence[int], epsilons: Sequence[str]
            ) -> list[dict[str, Any]]:
    """One row per (method, epsilon): the seeds' final AVG (from each run's ``summary.json``), their mean and
    std, the epsilon reached when the run reports one, and the runs missing."""
    rows = []
    for epsilon in epsilons:
        for method in methods:
            values, reached, missing = [], [], []
            for seed in seeds:
                summary_path = folder / f"eps-{epsilon}" / f"{method}-seed{seed}" / "summary.json"
                if not summary_path.is_file():
                    missing.append(seed)
                    continue
                summary = json.loads(summary_path.read_text())
                if summary["accuracy"] is None:  # stopped before any round was evaluated
                    missing.append(seed)
                    continue
                values.append(float(summary["accuracy"]))
                privacy = summary.get("privacy")
                if isinstance(privacy, dict) and isinstance(privacy.get("epsilon"), (int, float)):
                    reached.append(float(privacy["epsilon"]))
            rows.append({"method": method, "epsilon": epsilon, "accuracy": values,
                         "mean": statistics.fmean(values) if values else float("nan"),
                         "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                         "epsilon_reached": max(reached) if reached else None, "missing_seeds": missing})
    return rows


def markdown(rows: Sequence[dict[str, Any]], methods: Sequence[str], epsilons: Sequence[str], caption: str) -> str:
    head = "| method | " + " | ".join(f"eps = {e}" if e != "inf" else "no DP (eps = inf)" for e in epsilons) + " |"
    lines = [caption, "", head, "|---" * (len(epsilons) + 1) + "|"]
    for method in methods:
        cells = []
        for epsilon in epsilons:
            row = next(r for r in rows if r["method"] == method and r["epsilon"] == epsilon)
            if not row["accuracy"]:
                cells.append("not run")
                continue
            cell = f"{row['mean']:.2f} ± {row['std']:.2f}"
            if row["missing_seeds"]:
                cell += f" ({len(row['accuracy'])} seeds)"
            cells.append(cell)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["method", "epsilon", "mean", "std", "seeds", "accuracy_per_seed", "epsilon_reached"])
    for row in rows:
        writer.writerow([row["method"], row["epsilon"], row["mean"], row["std"], len(row["accuracy"]),
                         " ".join(f"{v:.4f}" for v in row["accuracy"]), row["epsilon_reached"]])
    return buffer.getvalue()


def plot(rows: Sequence[dict[str, Any]], methods: Sequence[str], epsilons: Sequence[str], path: Path,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [e for e in epsilons if e != "inf"]
    positions = {e: float(e) for e in finite}
    if "inf" in epsilons:  # drawn one step right of the largest finite epsilon on the log axis
        positions["inf"] = (max(positions.values()) * 4) if positions else 1.0
    figure, axis = plt.subplots(figsize=(6, 4))
    for index, method in enumerate(methods):
        points = [(positions[r["epsilon"]], r["mean"], r["std"]) for e in epsilons for r in rows
                  if r["method"] == method and r["epsilon"] == e and r["accuracy"]]
        if points:
            xs, ys, errors = zip(*points)
            axis.errorbar(xs, ys, yerr=errors, label=method, marker="osD^v"[index % 5], capsize=3,
                          linestyle=["-", "--", "-.", ":"][index % 4])
    axis.set_xscale("log")
    axis.set_xticks(list(positions.values()))
    axis.set_xticklabels([e if e != "inf" else "∞ (no DP)" for e in positions])
    axis.set_xlabel("epsilon")
    axis.set_ylabel("final AVG accuracy (%)")
    axis.set_title(title, fontsize=9)
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, metadata={"Software": None})
    plt.close(figure)
    write_atomic(path, buffer.getvalue())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=("client", "sample"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--settings", default="", help="the runs' shared KEY=VALUE settings, one string")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--epsilons", nargs="+", default=list(EPSILONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--collect", action="store_true", help="only collect finished runs into the table")
    args = parser.parse_args(argv)
    settings = shlex.split(args.settings)
    folder = args.out / args.kind
    folder.mkdir(parents=True, exist_ok=True)
    if args.collect and not settings and (folder / "utility.json").is_file():
        settings = json.loads((folder / "utility.json").read_text()).get("settings", [])
    commands = [compare_command(args.kind, e, args.out, settings, args.methods, args.seeds, args.jobs)
                for e in args.epsilons]
    if not args.collect:
        run_commands(commands)
    rows = collect(folder, args.methods, args.seeds, args.epsilons)
    what = "client-level DP (central noise)" if args.kind == "client" else "sample-level DP-SGD"
    caption = (f"Final AVG accuracy (%) under {what}, mean ± std over seeds {args.seeds}; settings: "
               f"`{' '.join(settings)}`")
    write_atomic(folder / "utility.json", json.dumps({"kind": args.kind, "settings": settings, "rows": rows,
                                                      "commands": [shlex.join(["fedhpro", *c[3:]]) for c in commands]},
                                                     indent=1) + "\n")
    write_atomic(folder / "utility.csv", csv_text(rows))
    write_atomic(folder / "utility.md", markdown(rows, args.methods, args.epsilons, caption))
    plot(rows, args.methods, args.epsilons, folder / "utility.png", f"digits-offline, {what}")
    print(markdown(rows, args.methods, args.epsilons, caption))
    return 0 if all(not math.isnan(r["mean"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
