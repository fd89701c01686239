"""Whole `fedhpro run`s against each other: two settings, each a fresh process, in ABBA order.

The issue's measure of what a user waits for: the whole default run (start-up, data, every round, the
evaluation, writing the folder) with setting A against setting B, as separate processes back to back, the
order alternating (A B B A A B ...) so that a drift of the machine's speed falls on both. Per pair it prints
each run's wall and CPU seconds (user + system of the child) and the load, then the ratio B / A per pair and
their median, and the final accuracies (the settings' digits may differ; the accuracy should not, much).

    python bench/whole_runs.py --a amp=off --b amp=bf16 --pairs 2                  # bf16 against float32
    python bench/whole_runs.py --a parallel_clients=1 --b parallel_clients=auto     # clients side by side
    python bench/whole_runs.py --a method=fedavg --b method=fedhpro --common rounds=5 --pairs 3

``--common`` settings go to both runs (e.g. ``rounds=5 seed=1``); the thread count is the default run's
(``threads=auto``: the cores, or ``$OMP_NUM_THREADS``) unless given there. Time it alone: a second job on a
2-core machine takes the core the second client thread needs.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import harness

from fedhpro.runtime import cpu_features


def one_run(settings: list[str], out: str) -> tuple[float, float, float | None]:
    """``(wall s, cpu s, final AVG)`` of ``fedhpro run <settings>`` in a fresh process writing to ``out``."""
    command = [sys.executable, "-m", "fedhpro", "run", *settings, "progress=false", f"out={out}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    with open(f"{out}/summary.json") as handle:
        summary = json.load(handle)
    return wall, cpu, summary.get("accuracy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", nargs="+", required=True, metavar="KEY=VALUE", help="setting A (the reference)")
    parser.add_argument("--b", nargs="+", required=True, metavar="KEY=VALUE", help="setting B")
    parser.add_argument("--common", nargs="*", default=[], metavar="KEY=VALUE", help="settings of both runs")
    parser.add_argument("--pairs", type=int, default=2, help="A/B pairs (ABBA order: 2 pairs are A B B A)")
    args = parser.parse_args()
    a, b = " ".join(args.a), " ".join(args.b)
    harness.print_header(f"whole `fedhpro run`s: A = {a}, B = {b}; common: {' '.join(args.common) or '-'}; "
                         f"{args.pairs} pairs, ABBA")
    print(f"  isa    {', '.join(name for name, present in cpu_features().isa().items() if present) or '-'}")
    wall: dict[str, list[float]] = {"A": [], "B": []}
    cpu: dict[str, list[float]] = {"A": [], "B": []}
    accuracy: dict[str, list[float | None]] = {"A": [], "B": []}
    for pair in range(args.pairs):
        for name in (("A", "B") if pair % 2 == 0 else ("B", "A")):
            settings = [*args.common, *(args.a if name == "A" else args.b)]
            with tempfile.TemporaryDirectory() as folder:
                seconds, used, final = one_run(settings, f"{folder}/run")
            wall[name].append(seconds)
            cpu[name].append(used)
            accuracy[name].append(final)
            print(f"  pair {pair} {name} wall {seconds:7.1f} s  cpu {used:7.1f} s  AVG {final}  "
                  f"({harness.machine_info()['load']})", flush=True)
        print(f"  pair {pair}: B / A wall {wall['B'][-1] / wall['A'][-1]:.3f}, cpu {cpu['B'][-1] / cpu['A'][-1]:.3f}",
              flush=True)
    harness.report_ratio(wall, "B", "A", "whole run, wall: B / A")
    harness.report_ratio(cpu, "B", "A", "whole run, cpu: B / A")
    print(f"  medians: A {statistics.median(wall['A']):.1f} s, B {statistics.median(wall['B']):.1f} s")
    print(f"  after: {harness.machine_info()['load']}")


if __name__ == "__main__":
    main()
