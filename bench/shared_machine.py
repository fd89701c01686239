"""What a ``fedhpro run`` round costs when another process shares the machine, per OpenMP wait policy.

torch's CPU kernels run on an OpenMP thread team (libgomp). Between two
parallel regions libgomp's idle threads spin (300,000 iterations by default)
before they sleep. On an idle machine that saves a wake-up; when another busy
process shares the cores, a spinning thread burns the time slice the thread
it waits for needs, and a 2-thread run slows down several times. This script
runs one round of the default ``fedhpro run`` (or ``--set`` keys) as a fresh
subprocess for each wait policy, on the idle machine and beside ``--busy``
processes that spin (``python -c "while True: pass"``), variants interleaved,
and reports the round's client time (``timing.jsonl``) and the slowdown
busy / idle of each policy.

    python bench/shared_machine.py                      # 4 policies x idle / 1 busy, 2 repeats (~10 min)
    python bench/shared_machine.py --busy 1 2 --repeats 3
    python bench/shared_machine.py --set rounds=2 local_epochs=1

The policies (environment variables read once, when torch loads libgomp):
``spin 300000`` is libgomp's default when nothing is set (torch's, and
fedhpro's before it set one), ``spin N`` spins N iterations before sleeping,
``passive`` sleeps at once, ``1 thread`` is ``OMP_NUM_THREADS=1``; the one
``fedhpro`` sets when the user sets neither variable
(``fedhpro.runtime.OPENMP_DEFAULTS``) is marked. The wait policy does not
change the numbers (same thread count, same work split): the script checks
that every variant with 2 threads writes the same ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import print_header

from fedhpro.runtime import OPENMP_DEFAULTS

POLICIES: dict[str, dict[str, str]] = {
    "spin 300000 (before)": {"GOMP_SPINCOUNT": "300000"},
    "spin 10000": {"GOMP_SPINCOUNT": "10000"},
    "spin 3000": {"GOMP_SPINCOUNT": "3000"},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread": {"OMP_NUM_THREADS": "1"},
}
_OPENMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")


def one_round(folder: Path, env: dict[str, str], settings: list[str]) -> tuple[float, bytes]:
    """The client seconds of each round of a fresh ``fedhpro run`` (summed) and its metrics.jsonl bytes."""
    if folder.exists():
        shutil.rmtree(folder)
    environment = {key: value for key, value in os.environ.items() if key not in _OPENMP_KEYS}
    environment.update(env)
    command = [sys.executable, "-m", "fedhpro", "run", "rounds=1", "progress=false", "device=cpu",
               f"out={folder}", *settings]
    subprocess.run(command, check=True, capture_output=True, text=True, env=environment)
    rows = [json.loads(line) for line in (folder / "timing.jsonl").read_text().splitlines()]
    return sum(row["clients"] for row in rows), (folder / "metrics.jsonl").read_bytes()


def busy_processes(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", nargs="+", type=int, default=[1], help="busy background processes to measure")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="settings of the run")
    args = parser.parse_args()
    print_header(f"one round of fedhpro run {' '.join(args.set)} per OpenMP wait policy, idle and beside "
                 f"{' / '.join(map(str, args.busy))} busy process(es)")
    root = Path(tempfile.mkdtemp(prefix="fedhpro-shared-bench-"))
    loads = [0, *args.busy]
    seconds: dict[tuple[str, int], list[float]] = {}
    metrics: dict[str, bytes] = {}
    for repeat in range(args.repeats):
        shift = repeat % len(args.policies)
        order = args.policies[shift:] + args.policies[:shift]
        for busy in loads:
            background = busy_processes(busy)
            try:
                for policy in order:
                    elapsed, rows = one_round(root / "run", POLICIES[policy], args.set)
                    seconds.setdefault((policy, busy), []).append(elapsed)
                    if "OMP_NUM_THREADS" not in POLICIES[policy]:
                        metrics[policy] = rows
                    print(f"  repeat {repeat}, {busy} busy, {policy:22s} {elapsed:7.2f} s", flush=True)
            finally:
                for process in background:
                    process.kill()
                    process.wait()
    print("\nclient seconds of the round, median [min - max]; slowdown = busy / idle (medians)")
    header = "".join(f"{f'{busy} busy':>24s}{'slowdown':>10s}" if busy else f"{'idle':>24s}" for busy in loads)
    print(f"  {'policy':22s}{header}")
    for policy in args.policies:
        idle = statistics.median(seconds[(policy, 0)])
        label = f"{policy} *" if POLICIES[policy] == OPENMP_DEFAULTS else policy
        cells = []
        for busy in loads:
            values = seconds[(policy, busy)]
            cell = f"{statistics.median(values):7.2f} [{min(values):.2f} - {max(values):.2f}]"
            cells.append(f"{cell:>24s}" + (f"{statistics.median(values) / idle:>10.2f}" if busy else ""))
        print(f"  {label:22s}{''.join(cells)}")
    same = len(set(metrics.values())) == 1
    print("  * fedhpro's default (fedhpro.runtime.OPENMP_DEFAULTS)")
    print(f"\n  2-thread policies wrote the same metrics.jsonl: {'yes' if same else 'NO'}")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
