"""Table 1's layout at CPU scale: all nine methods under label and quantity skew, offline (Fidelity issue).

Real MNIST (digits-offline's ``mnist`` domain: 4,000 training and 1,000 test
images, no download) split by the paper's partitioners, one ``fedhpro compare``
per scenario into ``--out/<scenario>/`` (a finished run is reused, an
interrupted one continues), then ``label_skew.md`` / ``.csv`` there: final test
accuracy (%), mean ± std over the seeds, its difference to FedAvg, and the
paper's difference on CIFAR-10 (Table 1) beside it.

Scenarios (Section 5.1): ``NID1_0.2`` and ``NID1_0.5`` (Dirichlet label skew,
K = 10), ``NID2`` (K = 7: six single-class clients and one with all classes),
``rho=100`` (long tail, then Dirichlet 0.5 over K = 10; CIFAR10-LT's column).
Every method gets the same budget, optimiser, model and partition.

    python bench/label_skew.py --out runs/label-skew --jobs 2          # the README's table
    python bench/label_skew.py --out /tmp/ls --seeds 0 --rounds 2 --scenarios NID2
    python bench/label_skew.py --out runs/label-skew --table-only      # rebuild the table from the runs

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

from harness import add_study_arguments, study_budget

METHODS = ["fedavg", "fedprox", "moon", "fedproto", "fedtgp", "fedgmkd", "fedrcl", "fedsa", "fedhpro"]
DATA = ["dataset=digits-offline", "data.domains=[mnist]"]
SCENARIOS: dict[str, list[str]] = {
    "NID1_0.2": ["partition=dirichlet", "partition.alpha=0.2", "clients=10"],
    "NID1_0.5": ["partition=dirichlet", "partition.alpha=0.5", "clients=10"],
    "NID2": ["partition=nid2", "clients=7"],
    "rho=100": ["partition=longtail", "partition.rho=100", "clients=10"],
}
#: the paper's Table 1, CIFAR-10 columns NID1_0.2, NID1_0.5, NID2 and CIFAR10-LT rho=100 (accuracy, %)
PAPER = {
    "fedavg": (80.59, 85.60, 74.48, 60.79), "fedprox": (80.74, 85.54, 74.67, 60.86),
    "moon": (82.04, 86.95, 76.07, 60.91), "fedproto": (81.61, 86.25, 75.32, 60.37),
    "fedtgp": (84.14, 87.31, 77.95, 61.94), "fedgmkd": (83.56, 88.09, 77.29, 62.13),
    "fedrcl": (83.80, 87.76, 77.51, 62.41), "fedsa": (84.27, 87.93, 77.86, 62.48),
    "fedhpro": (85.98, 89.56, 79.70, 64.75),
}


def accuracies(folder: Path, method: str) -> list[float]:
    """The final accuracy of each finished run of ``method`` in a compare folder."""
    return [json.loads((run / "summary.json").read_text())["accuracy"] for run in sorted(folder.glob(f"{method}-seed*"))
            if (run / "summary.json").is_file()]


def table(out: Path, scenarios: list[str], methods: list[str], budget: list[str], seeds: str) -> list[str]:
    """The markdown lines of the table (and ``label_skew.csv`` beside it)."""
    columns = list(SCENARIOS)
    rows, csv_rows = [], []
    fedavg = {s: accuracies(out / s, "fedavg") for s in scenarios}
    for method in methods:
        cells, csv_row = [], [method]
        for scenario in scenarios:
            values = accuracies(out / scenario, method)
            if not values:
                cells += ["–", "–"]
                csv_row += ["", "", ""]
                continue
            mean = statistics.mean(values)
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            delta = "–" if method == "fedavg" or not fedavg[scenario] else \
                f"{mean - statistics.mean(fedavg[scenario]):+.2f}"
            column = columns.index(scenario)
            paper = "–" if method == "fedavg" else f"{PAPER[method][column] - PAPER['fedavg'][column]:+.2f}"
            cells += [f"{mean:.2f} ± {spread:.2f} ({delta})", paper]
            csv_row += [f"{mean:.4f}", f"{spread:.4f}", str(len(values))]
        rows.append(f"| {method} | " + " | ".join(cells) + " |")
        csv_rows.append(csv_row)
    header = ["Methods"] + [part for s in scenarios for part in (f"{s} (Δ)", "paper Δ")]
    with open(out / "label_skew.csv", "w", newline="") as handle:
        csv.writer(handle).writerows([["method"] + [f"{s} {part}" for s in scenarios
                                                    for part in ("mean", "std", "runs")], *csv_rows])
    return [f"Final test accuracy (%) on real MNIST (digits-offline data.domains=[mnist]), mean ± std over seeds "
            f"[{seeds}], Δ against FedAvg; {' '.join(budget)}; paper Δ: Table 1, CIFAR-10 (rho=100: CIFAR10-LT).",
            "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    add_study_arguments(parser)
    args = parser.parse_args()
    methods = args.methods.split(",")
    budget = study_budget(args)
    for scenario in [] if args.table_only else args.scenarios:
        command = [sys.executable, "-m", "fedhpro", "compare", f"methods=[{args.methods}]", f"seeds=[{args.seeds}]",
                   *DATA, *SCENARIOS[scenario], *budget, f"jobs={args.jobs}", "progress=false", "device=cpu",
                   f"out={args.out / scenario}"]
        print(" ".join(command[1:]), flush=True)
        subprocess.run(command, check=False)  # a failed run is listed by compare; the table marks it '–'
    lines = table(args.out, args.scenarios, methods, budget, args.seeds)
    (args.out / "label_skew.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
