"""Cohorts of thousands of clients in the in-process simulator: seconds per round and peak memory against K.

Each K runs in a fresh subprocess: a synthetic federation of K clients holding 16-20 random 3x32x32
samples each (sizes drawn with seed 0; every client's tensors are views of one resident tensor), FedAvg
with the default ``cnn`` (d = 512), E = 1, batch 64, ``--per-round`` clients sampled a round
(``participation = per_round / K``), no evaluation. It reports the median seconds of ``--rounds``
rounds after one warm-up round, and the process's peak resident memory (``ru_maxrss``, which includes
torch's own ~0.5 GB and the data).

The per-client overhead, as the issue defines it, is measured side by side in one more subprocess:
one round of 100 clients of 17 samples against one round of one client holding the same 1,700
samples (the same model, optimiser and settings), interleaved, median over repeats;
``(t_100 - t_1) / 100`` is what a client costs beyond its samples.

    python bench/cohorts.py                                  # K in 100 1000 5000 10000 (~2-5 min)
    python bench/cohorts.py --clients 100 1000 --rounds 3
    python bench/cohorts.py --threads 2 --parallel-clients 2 --skip-overhead   # two clients side by side

``--digits K [K ...]`` measures instead the memory of ``fedhpro run`` on digits-offline: K clients of
``--images`` syn images each (``data.syn_size = images * K``, of which the default test_fraction leaves 80%
to train: 16 training images a client at 20), ``partition=iid``, ``privacy=client``, one round,
``participation = --per-round / K``; each K twice, in a fresh process each: the first run, building the
images into an empty data folder, then the run from that cache. The peak resident memory is the process's
own ``ru_maxrss`` (``os.wait4``), what ``/usr/bin/time -v`` reports:

    python bench/cohorts.py --digits 5000                   # first run and cached run, ~5 min

``--parallel-clients N`` trains N clients at once (the simulator's ``parallel_clients``, each with
``threads // N`` threads); the per-client overhead is a one-at-a-time measure (one client of 1,700 samples
cannot be split), so it is measured only with ``--parallel-clients 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import harness

IMAGE = (3, 32, 32)


def cpu_model() -> str:
    """``lscpu``'s Model name (the CPU of /proc/cpuinfo when lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return harness.machine_info()["cpu"]


def loadavg() -> str:
    with open("/proc/loadavg") as handle:
        return handle.read().strip()


def federation_of(sizes: list[int], seed: int = 0):
    """A synthetic federation whose client ``k`` holds ``sizes[k]`` samples: views of one resident tensor."""
    import torch

    from fedhpro.data.federation import ClientData, Federation

    generator = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    x = torch.randn(total, *IMAGE, generator=generator)
    y = torch.randint(0, 10, (total,), generator=generator)
    clients, start = [], 0
    for n in sizes:
        clients.append(ClientData(x[start:start + n], y[start:start + n], 10))
        start += n
    test = (torch.randn(256, *IMAGE, generator=generator), torch.randint(0, 10, (256,), generator=generator))
    return Federation("synthetic", 10, IMAGE, clients, ["all"] * len(sizes), {"all": test})


def simulator_for(federation, participation: float, threads: int | None, parallel: int = 1):
    from fedhpro.config import load_config
    from fedhpro.engines.simulator import Simulator
    from fedhpro.methods import METHODS, TrainSettings
    from fedhpro.models import build_model

    harness.prepare_torch(threads)
    return Simulator(METHODS["fedavg"], load_config(None).methods["fedavg"], federation,
                     lambda: build_model("cnn", 10, IMAGE, 512), TrainSettings(epochs=1),
                     rounds=10 ** 9, eval_every=10 ** 9, participation=participation, parallel_clients=parallel,
                     client_threads=max(1, (threads or 1) // parallel) if parallel > 1 else None)


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_cohort(num_clients: int, per_round: int, low: int, high: int, rounds: int, threads: int | None,
                 parallel: int = 1) -> dict:
    """Run in the subprocess: one warm-up round, then ``rounds`` timed ones."""
    import torch

    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(low, high + 1, (num_clients,), generator=generator).tolist()
    started = time.perf_counter()
    federation = federation_of(sizes)
    simulator = simulator_for(federation, min(1.0, per_round / num_clients), threads, parallel)
    build_seconds = time.perf_counter() - started
    peak_built = peak_mib()
    seconds = []
    for round in range(rounds + 1):
        timer = time.perf_counter()
        simulator.run_round(round)
        if round:
            seconds.append(time.perf_counter() - timer)
    return {"K": num_clients, "samples": sum(sizes), "sampled": len(simulator.sample_clients(0)),
            "build_s": build_seconds, "round_s": statistics.median(seconds), "rounds_s": seconds,
            "peak_built_mib": peak_built, "peak_mib": peak_mib()}


def child_overhead(clients: int, per_client: int, repeats: int, threads: int | None) -> dict:
    """Run in the subprocess: ``clients`` clients of ``per_client`` samples against one client of all of them."""
    total = clients * per_client
    many = simulator_for(federation_of([per_client] * clients), 1.0, threads)
    one = simulator_for(federation_of([total]), 1.0, threads)  # the same samples (the same seed)
    counter = iter(range(10 ** 9))
    times = harness.interleaved({"many": lambda: many.run_round(next(counter)),
                                 "one": lambda: one.run_round(next(counter))}, repeats)
    many_s, one_s = statistics.median(times["many"]), statistics.median(times["one"])
    per_client_ms = [1000 * (a - b) / clients for a, b in zip(times["many"], times["one"])]
    return {"many_s": many_s, "one_s": one_s, "per_client_ms": statistics.median(per_client_ms),
            "per_client_ms_all": per_client_ms}


def digits_command(clients: int, images: int, per_round: int, data_dir: str, out: str) -> list[str]:
    """``fedhpro run`` of ``clients`` digits-offline clients of ``images`` syn images each (train and test)."""
    syn_size = images * clients  # the "20 images each": syn_size 100,000 for 5,000 clients
    return [sys.executable, "-m", "fedhpro", "run", "dataset=digits-offline", "data.domains=[syn]",
            f"data.syn_size={syn_size}", "partition=iid", f"clients={clients}",
            f"participation={min(1.0, per_round / clients)}", "rounds=1", "local_epochs=1", "feature_dim=64",
            "privacy=client", "privacy.noise_multiplier=1", "threads=1", f"data_dir={data_dir}", f"out={out}"]


def peak_of(command: list[str]) -> tuple[float, float]:
    """``(seconds, peak resident GiB)`` of ``command`` run to its end (its own ``ru_maxrss``, by ``wait4``).

    On Linux a child started by vfork (as subprocess does) begins with its parent's high-water mark in
    ``ru_maxrss``, so this reads the child's own peak only from a parent that stays below it: this script's
    process (torch imported, a few hundred MB, under the GiB runs it measures), as ``/usr/bin/time -v`` is."""
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert child.stderr is not None
    errors = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        sys.stderr.write(errors.decode(errors="replace")[-4000:])
        raise SystemExit(f"{' '.join(command)} failed")
    return time.perf_counter() - started, usage.ru_maxrss / 2 ** 20


def digits_memory(counts: list[int], images: int, per_round: int) -> None:
    """The first run and the cached run of each K: seconds and peak resident memory."""
    print(f"digits-offline memory: privacy=client, partition=iid, {images} syn images a client (80% train), "
          f"{per_round} clients a round, one round, 1 thread, one fresh process a run")
    print(f"  cpu    {cpu_model()}, {os.cpu_count()} logical cores")
    print(f"  load   {loadavg()} (/proc/loadavg, before)")
    print(f"  {'K':>7s} {'first run: s':>13s} {'peak':>10s} {'cached: s':>10s} {'peak':>10s}")
    for clients in counts:
        with tempfile.TemporaryDirectory(prefix="fedhpro-digits-") as folder:
            first = peak_of(digits_command(clients, images, per_round, folder, os.path.join(folder, "first")))
            cached = peak_of(digits_command(clients, images, per_round, folder, os.path.join(folder, "cached")))
        print(f"  {clients:7d} {first[0]:13.0f} {first[1]:6.2f} GiB {cached[0]:10.0f} {cached[1]:6.2f} GiB",
              flush=True)
    print(f"  load   {loadavg()} (/proc/loadavg, after)")


def run_child(*args: str) -> dict:
    result = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if result.returncode:
        sys.stderr.write(result.stderr)
        raise SystemExit(f"the child {' '.join(args)} failed")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", nargs="+", type=int, default=[100, 1000, 5000, 10000], help="the K to run")
    parser.add_argument("--per-round", type=int, default=100, help="clients sampled a round")
    parser.add_argument("--sizes", nargs=2, type=int, default=[16, 20], metavar=("LOW", "HIGH"),
                        help="each client's sample count, drawn uniformly from [LOW, HIGH]")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per K (after one warm-up round)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the per-client overhead pair")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--parallel-clients", type=int, default=1, help="clients trained at once (default 1)")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--digits", nargs="+", type=int, metavar="K",
                        help="measure fedhpro run's memory on digits-offline with K clients instead (see above)")
    parser.add_argument("--images", type=int, default=20, help="syn images a client with --digits (80%% train)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.digits:
        digits_memory(args.digits, args.images, args.per_round)
        return
    if args.child:
        kind, *values = args.child
        figures = (child_cohort(*(int(v) for v in values), args.threads, args.parallel_clients) if kind == "cohort"
                   else child_overhead(*(int(v) for v in values), args.threads))
        print(json.dumps(figures))
        return

    print(f"cohorts: FedAvg, cnn (d = 512), E = 1, batch 64, {args.per_round} clients a round, "
          f"{args.sizes[0]}-{args.sizes[1]} samples a client, {args.threads} torch thread(s), "
          f"{args.parallel_clients} client(s) at once, one subprocess per K")
    print(f"  cpu    {cpu_model()}, {os.cpu_count()} logical cores")
    print(f"  load   {loadavg()} (/proc/loadavg, before)")
    print(f"  {'K':>6s} {'samples':>8s} {'sampled':>8s} {'build s':>8s} {'s/round':>8s} {'[min - max]':>16s} "
          f"{'peak RSS':>10s}")
    for num_clients in args.clients:
        f = run_child("--threads", str(args.threads), "--parallel-clients", str(args.parallel_clients),
                      "--child", "cohort", str(num_clients), str(args.per_round),
                      str(args.sizes[0]), str(args.sizes[1]), str(args.rounds))
        spread = f"[{min(f['rounds_s']):.2f} - {max(f['rounds_s']):.2f}]"
        print(f"  {f['K']:6d} {f['samples']:8d} {f['sampled']:8d} {f['build_s']:8.1f} {f['round_s']:8.2f} "
              f"{spread:>16s} {f['peak_mib'] / 1024:7.2f} GiB", flush=True)
    if not args.skip_overhead and args.parallel_clients == 1:
        f = run_child("--threads", str(args.threads), "--child", "overhead", "100", "17", str(args.repeats))
        print(f"  per-client overhead: 100 clients x 17 samples {f['many_s']:.2f} s/round, one client x 1700 "
              f"samples {f['one_s']:.2f} s/round: {f['per_client_ms']:.1f} ms a client (median of the paired "
              f"repeats; [{min(f['per_client_ms_all']):.1f} - {max(f['per_client_ms_all']):.1f}])")
    print(f"  load   {loadavg()} (/proc/loadavg, after)")


if __name__ == "__main__":
    main()
