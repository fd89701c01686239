"""FedHPro vs FedAvg (and FedHPro's spec-level variants) on digits-offline over several seeds.

Writes ``<out>/faithfulness.md`` and ``.csv``: final test accuracy (%) per
domain and AVG, mean +- std over the seeds, one row per variant. Every run's
own folder (summary.json, metrics.jsonl, accuracy.png) is kept under ``<out>``.

    python bench/faithfulness.py                       # the README's table (7 variants x 3 seeds, ~1 h)
    python bench/faithfulness.py --variants fedavg fedhpro --seeds 0 1 2
    python bench/faithfulness.py --set rounds=5        # extra settings for every run
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
from pathlib import Path

from fedhpro.compare import run_all
from fedhpro.config import load_config, parse_override
from fedhpro.errors import FedHProError
from fedhpro.reports import write_atomic

#: variant name -> config overrides (the defaults are the package's defaults)
VARIANTS: dict[str, dict[str, object]] = {
    "fedavg": {"method": "fedavg"},
    "fedhpro": {"method": "fedhpro"},
    "fedhpro hpal_form=paper": {"method": "fedhpro", "fedhpro.hpal_form": "paper"},
    "fedhpro match_steps=0": {"method": "fedhpro", "fedhpro.match_steps": 0},
    "fedhpro hpal_weight=0": {"method": "fedhpro", "fedhpro.hpal_weight": 0.0},
    "fedhpro hpcl_weight=0": {"method": "fedhpro", "fedhpro.hpcl_weight": 0.0},
    "fedhpro margin=off": {"method": "fedhpro", "fedhpro.margin": "off"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="settings for every run")
    parser.add_argument("--out", default="runs/faithfulness")
    args = parser.parse_args()

    out = Path(args.out)
    settings = dict(map(parse_override, args.set))
    runs = [(variant, seed, out / f"{variant.replace(' ', '_').replace('=', '-')}-seed{seed}")
            for variant in args.variants for seed in args.seeds]
    jobs = [(load_config(None, {**settings, **VARIANTS[variant], "seed": seed, "out": str(folder),
                                "progress": False}), folder) for variant, seed, folder in runs]
    results: dict[str, list[dict]] = {}
    # an interrupted sweep continues: kept runs (checked against their settings) are read back or resumed
    for (variant, seed, _), summary in zip(runs, run_all(jobs)):
        results.setdefault(variant, []).append(summary)
        print(f"{variant:28s} seed {seed}: AVG {summary['accuracy']:.2f}  ({summary['seconds']:.0f} s)", flush=True)

    domains = list(next(iter(results.values()))[0]["per_domain"])
    columns = domains + ["AVG"]

    def cell(values: list[float]) -> str:
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.2f} ± {spread:.2f}"

    lines = ["| variant | " + " | ".join(columns) + " | seconds/run |",
             "|---|" + "---|" * (len(columns) + 1)]
    table = io.StringIO()
    writer = csv.writer(table)
    writer.writerow(["variant", "seed"] + columns + ["seconds"])
    for variant, summaries in results.items():
        values = {d: [s["per_domain"][d] for s in summaries] for d in domains}
        values["AVG"] = [s["accuracy"] for s in summaries]
        seconds = statistics.mean(s["seconds"] for s in summaries)
        lines.append(f"| {variant} | " + " | ".join(cell(values[c]) for c in columns) + f" | {seconds:.0f} |")
        for s in summaries:
            writer.writerow([variant, s["seed"]] + [f"{s['per_domain'][d]:.2f}" for d in domains]
                            + [f"{s['accuracy']:.2f}", f"{s['seconds']:.1f}"])
    markdown = (f"Final test accuracy (%) on digits-offline, mean ± std over seeds {args.seeds}"
                + (f", settings {' '.join(args.set)}" if args.set else "") + ".\n\n" + "\n".join(lines) + "\n")
    write_atomic(out / "faithfulness.md", markdown)
    write_atomic(out / "faithfulness.csv", table.getvalue())
    print(markdown)


if __name__ == "__main__":
    try:
        main()
    except FedHProError as error:  # a bad setting or a stale run folder: one line, as the CLI prints it
        raise SystemExit(f"faithfulness: error: {error}") from None
