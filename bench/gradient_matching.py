"""When does gradient matching matter? Learned against frozen hyper-prototypes (Fidelity issue, item 4).

For each setting, FedHPro runs with gradient matching (``fedhpro.match_steps=30``,
the default) and with the random hyper-prototypes frozen
(``fedhpro.match_steps=0``), same seeds, budget and partition, each pair one
``fedhpro compare`` folder per variant under ``--out/<setting>/`` (finished runs
are reused). The settings are the ones where the paper's argument says
matching should matter most: strong label skew with classes missing on many
clients (NID1_0.1), few clients per class (NID2), partial participation, one
and many hyper-prototypes per class (|I| = 1, 20), Adam as the matching
optimiser, and the authors' recipe with its server step
(``fedhpro.recipe=authors``, which includes ``classifier_step=synthetic``: a
classifier retrained on synthetic features matched to the clients'
classifier gradients). Data: real MNIST
(digits-offline's ``mnist`` domain), offline.

Writes ``gradient_matching.md`` / ``.csv`` in ``--out``: per setting and variant,
final accuracy (and its mean over the last three rounds), L_GM before/after
matching in the last round (Eq. 8 summed over the classes), how far S moved
from its initial draw (``||S - S_0|| / ||S_0||``), and Figure 2's measure:
the L2 distance between the averaged hyper-prototypes H and the centralized
prototypes (class means of all training data under the global model), raw
and between unit vectors, beside the same distance for the mean of the
clients' own class means (Eq. 4's P, what FedProto averages); each mean ± std
over the seeds.

    python bench/gradient_matching.py --out runs/gradient-matching --jobs 2   # the README's table (~40 min on 2 cores)
    python bench/gradient_matching.py --out /tmp/gm --seeds 0 --rounds 2 --settings NID2
    python bench/gradient_matching.py --out runs/gradient-matching --table-only

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

DATA = ["dataset=digits-offline", "data.domains=[mnist]", "prototype_distance=true"]
NID1 = ["partition=dirichlet", "partition.alpha=0.1", "clients=10"]
SETTINGS: dict[str, list[str]] = {
    "NID1_0.1": NID1,
    "NID2": ["partition=nid2", "clients=7"],
    "NID1_0.1, K=20, 25% participate": ["partition=dirichlet", "partition.alpha=0.1", "clients=20",
                                        "participation=0.25"],
    "NID1_0.1, |I|=1": [*NID1, "fedhpro.num_hyper=1"],
    "NID1_0.1, |I|=20": [*NID1, "fedhpro.num_hyper=20"],
    "NID1_0.1, adam": [*NID1, "fedhpro.hyper_optimizer=adam"],
    "NID1_0.1, recipe=authors": [*NID1, "fedhpro.recipe=authors"],
}
VARIANTS = {"learned": ["fedhpro.match_steps=30"], "frozen": ["fedhpro.match_steps=0"]}
#: settings whose frozen variant is another setting's run: without matching steps the matching optimiser is
#: never used (the runs are byte-identical), so those runs are not repeated
FROZEN_AS = {"NID1_0.1, adam": "NID1_0.1"}
MEASURES = ["accuracy", "accuracy_last3", "gm_loss_before", "gm_loss_after", "hyper_movement", "distance_l2",
            "distance_unit", "clients_mean_unit"]


def folder_name(setting: str, variant: str) -> str:
    if variant == "frozen":
        setting = FROZEN_AS.get(setting, setting)
    keep = "".join(ch if ch.isalnum() or ch in "._=" else "-" for ch in f"{setting}--{variant}")
    return "-".join(part for part in keep.split("-") if part)


def run_measures(run: Path) -> dict[str, float] | None:
    """The measures of one finished run: its final accuracy and its last row's server and distance values."""
    if not (run / "summary.json").is_file():
        return None
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    server = next((row["server"] for row in reversed(rows) if row.get("server")), {})
    distance = next((row["prototype_distance"] for row in reversed(rows) if row.get("prototype_distance")), {})
    hyper = distance.get("server", {})
    evaluated = [row["accuracy"]["AVG"] for row in rows if row.get("accuracy")]
    return {"accuracy": json.loads((run / "summary.json").read_text())["accuracy"],
            "accuracy_last3": statistics.mean(evaluated[-3:]) if evaluated else float("nan"),
            "gm_loss_before": server.get("gm_loss_before", float("nan")),
            "gm_loss_after": server.get("gm_loss_after", float("nan")),
            "hyper_movement": server.get("hyper_movement", float("nan")),
            "distance_l2": hyper.get("l2", float("nan")), "distance_unit": hyper.get("l2_normalized", float("nan")),
            "clients_mean_unit": distance.get("clients_mean", {}).get("l2_normalized", float("nan"))}


def cell(values: list[float], digits: int) -> str:
    if not values:
        return "–"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.{digits}f} ± {spread:.{digits}f}"


def table(out: Path, settings: list[str], budget: list[str], seeds: str) -> list[str]:
    header = ["setting", "hyper-prototypes", "accuracy (%)", "Δ acc", "last 3 rounds", "L_GM before", "L_GM after",
              "S moved", "‖H − P*‖", "‖Ĥ − P̂*‖", "clients' mean ‖P̂ − P̂*‖"]
    rows, csv_rows = [], []
    for setting in settings:
        means: dict[str, float] = {}
        for variant in VARIANTS:
            runs = sorted((out / folder_name(setting, variant)).glob("fedhpro-seed*"))
            measured = [(run.name.rsplit("seed", 1)[-1], m) for run in runs if (m := run_measures(run)) is not None]
            found = [m for _, m in measured]
            values = {key: [m[key] for m in found] for key in MEASURES}
            if values["accuracy"]:
                means[variant] = statistics.mean(values["accuracy"])
            delta = (f"{means[variant] - means['learned']:+.2f}"
                     if variant != "learned" and variant in means and "learned" in means else "–")
            label = f"{variant} (M={'0' if variant == 'frozen' else '30'})"
            name = setting.replace("|", "\\|")  # |I| would split the markdown row
            rows.append(f"| {name} | {label} | {cell(values['accuracy'], 2)} | {delta} | "
                        f"{cell(values['accuracy_last3'], 2)} | "
                        f"{cell(values['gm_loss_before'], 3)} | {cell(values['gm_loss_after'], 3)} | "
                        f"{cell(values['hyper_movement'], 4)} | {cell(values['distance_l2'], 2)} | "
                        f"{cell(values['distance_unit'], 3)} | {cell(values['clients_mean_unit'], 3)} |")
            csv_rows += [[setting, variant, seed, *(m[key] for key in MEASURES)] for seed, m in measured]
    with open(out / "gradient_matching.csv", "w", newline="") as handle:
        csv.writer(handle).writerows([["setting", "variant", "seed", *MEASURES], *csv_rows])
    return [f"FedHPro with learned (M = 30 matching steps) and frozen random (M = 0) hyper-prototypes on real "
            f"MNIST, mean ± std over seeds [{seeds}]; {' '.join(budget)}. Accuracy: final test accuracy (%), "
            "Δ frozen − learned; last 3 rounds: the mean of the last three rounds' accuracy (the global model "
            "swings from round to round under strong label skew). L_GM: Eq. 8 summed over the classes in the last "
            "round, before and after that round's matching; S moved: ||S - S_0|| / ||S_0|| at the end; "
            "‖H − P*‖: mean over classes of the L2 distance of the averaged hyper-prototypes to the centralized "
            "prototypes (Figure 2), ‖Ĥ − P̂*‖ the same between unit vectors (in [0, 2]); clients' mean: the same "
            "unit-vector distance for the unweighted mean of the last round's clients' class means (Eq. 4's P).",
            "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header), *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="run only these (two scripts, one per variant, keep 2 cores busy with jobs=1 each)")
    add_study_arguments(parser)
    args = parser.parse_args()
    budget = study_budget(args)
    for setting in [] if args.table_only else args.settings:
        for variant in args.variants:
            if variant == "frozen" and setting in FROZEN_AS:
                continue  # the same runs as FROZEN_AS[setting]'s
            keys = VARIANTS[variant]
            command = [sys.executable, "-m", "fedhpro", "compare", "methods=[fedhpro]", f"seeds=[{args.seeds}]",
                       *DATA, *SETTINGS[setting], *keys, *budget, f"jobs={args.jobs}", "progress=false",
                       "device=cpu", f"out={args.out / folder_name(setting, variant)}"]
            print(" ".join(command[1:]), flush=True)
            subprocess.run(command, check=False)
    lines = table(args.out, args.settings, budget, args.seeds)
    (args.out / "gradient_matching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
