"""How much of a tuning's budget diverges: the share of diverged trials of ``fedhpro tune`` under one shared
learning-rate range, per method, on a small digits-offline federation.

The range's upper end is ``--lr-high`` (the shared ``lr`` space becomes log-uniform [0.001, lr-high] for this
process only); everything else is the tuning as ``fedhpro tune`` runs it (TPE, ``validation=0.2``, seed 1000),
with the pruner off so that no trial is stopped before it can diverge. A trial counts as diverged as ``fedhpro
tune`` records it (``diverged`` in trials.csv). Run it once per range, in its own ``--out``:

    python bench/tune_divergence.py --lr-high 0.5 --out runs/tune-divergence/0.5
    python bench/tune_divergence.py --lr-high 0.1 --out runs/tune-divergence/0.1
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from pathlib import Path

from fedhpro import search_space
from fedhpro.data.digits_offline import build_digits_offline
from fedhpro.tune import parse, tune

#: the built-in federation (digits-offline's four domains) scaled to minutes on a shared CPU: one client a domain,
#: a tenth of each domain, small synthetic and test sets (the test suite's build), 3 rounds
SETTINGS = ["rounds=3", "clients=4", "data.fraction=0.1", "data.syn_size=200", "data.test_fraction=0.05",
            "feature_dim=64", "device=cpu", "threads=1", "pruner=none"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr-high", type=float, required=True, help="the shared lr range's upper end")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--methods", default="fedavg,fedsa,fedhpro")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--data-dir", type=Path, default=Path("runs/tune-divergence/data"))
    arguments = parser.parse_args()
    build_digits_offline(arguments.data_dir, seed=0, test_fraction=0.05, syn_size=200)  # cached after the first
    search_space.SHARED["lr"] = search_space.LogUniform(search_space.SHARED["lr"].low, arguments.lr_high)
    started = time.perf_counter()
    tune(parse([f"methods=[{arguments.methods}]", f"trials={arguments.trials}", f"out={arguments.out}",
                f"data_dir={arguments.data_dir}", *SETTINGS]), echo=False)
    seconds = time.perf_counter() - started
    print(f"lr log-uniform [{search_space.SHARED['lr'].low:g}, {arguments.lr_high:g}], {arguments.trials} trials a "
          f"method, {seconds / 60:.1f} min, load {os.getloadavg()[0]:.1f}")
    total = diverged_total = 0
    for method in arguments.methods.split(","):
        rows = list(csv.DictReader((arguments.out / method / "trials.csv").open()))
        diverged = [row for row in rows if row["state"] == "diverged"]
        total, diverged_total = total + len(rows), diverged_total + len(diverged)
        lrs = ", ".join(f"{float(row['lr']):.3g}" for row in diverged)
        complete = [float(row["validation"]) for row in rows if row["state"] == "complete"]
        print(f"  {method}: {len(diverged)}/{len(rows)} diverged" + (f" (lr {lrs})" if lrs else "")
              + (f"; best complete validation {max(complete):.2f}" if complete else ""))
    print(f"  all: {diverged_total}/{total} diverged ({100 * diverged_total / max(total, 1):.0f} %)")


if __name__ == "__main__":
    main()
