"""A sweep of runs one at a time against ``jobs=N`` worker processes (the Throughput issue's 0.6x target).

The same ``fedhpro compare`` sweep (default: FedAvg and FedHPro, seeds 0 and 1,
3 rounds of the default digits-offline federation) is run as a subprocess with
``jobs=1`` (torch's threads = the machine's cores, one run at a time) and with
``jobs=N`` (N workers, cores / N threads each), into fresh folders, variants
interleaved over ``--repeats``; the ratio jobs=N / jobs=1 is taken within each
repeat. The two sweeps run with different thread counts, so their numbers
differ a little (float sums in another order); with the same thread count they
are byte-identical (tests/test_sweeps.py).

    python bench/sweeps.py                 # jobs=2 against jobs=1, 1 repeat (about 5 minutes on 2 cores)
    python bench/sweeps.py --jobs 2 --repeats 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import interleaved, print_header, report_ratio, report_times


def sweep(out: Path, jobs: int, rounds: int, methods: str, seeds: str) -> None:
    if out.exists():
        shutil.rmtree(out)
    command = [sys.executable, "-m", "fedhpro", "compare", f"methods=[{methods}]", f"seeds=[{seeds}]",
               f"rounds={rounds}", f"jobs={jobs}", "progress=false", "device=cpu", f"out={out}"]
    subprocess.run(command, check=True, capture_output=True, text=True)


def table(out: Path) -> list[float]:
    accuracies = [json.loads((run / "summary.json").read_text())["accuracy"] for run in sorted(out.iterdir())
                  if (run / "summary.json").is_file()]
    return [float("nan") if value is None else value for value in accuracies]  # null: no round evaluated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default="fedavg,fedhpro")
    parser.add_argument("--seeds", default="0,1")
    args = parser.parse_args()
    print_header(f"sweep of {args.methods} x seeds {args.seeds}, {args.rounds} rounds: jobs=1 vs jobs={args.jobs}")
    root = Path(tempfile.mkdtemp(prefix="fedhpro-sweep-bench-"))
    variants = {f"jobs={jobs}": (lambda jobs=jobs: sweep(root / f"jobs{jobs}", jobs, args.rounds, args.methods,
                                                         args.seeds))
                for jobs in (1, args.jobs)}
    started = time.perf_counter()
    times = interleaved(variants, repeats=args.repeats, warmup=0)
    report_times(times)
    report_ratio(times, f"jobs={args.jobs}", "jobs=1", f"sweep time jobs={args.jobs} / jobs=1", target=0.6)
    first, second = table(root / "jobs1"), table(root / f"jobs{args.jobs}")
    print(f"  final AVG per run, jobs=1: {[round(a, 2) for a in first]}; jobs={args.jobs}: "
          f"{[round(a, 2) for a in second]} (other thread counts: other sum orders, slightly other numbers)")
    print(f"  total {time.perf_counter() - started:.0f} s")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
