"""Peak memory of one simulator round against the number of clients K.

Each (method, K) runs in a fresh subprocess: it builds a synthetic federation
of random CIFAR-shaped tensors (a fixed total of ``--samples`` samples split
evenly over K clients, so the data's memory does not depend on K), the
simulator with the default ``cnn``, then runs one round of E = 1. It reports
the resident memory before the round and the peak during it (the process's
``ru_maxrss``); their difference, in copies of the model's weights, says how
many models the round held at once. One working model at a time would be a
handful of copies whatever K; one per client grows with K.

    python bench/memory.py                                  # K in 10 100 500, fedavg and fedhpro
    python bench/memory.py --clients 10 100 500 1000 --methods fedavg
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

import harness


def child(method: str, num_clients: int, samples: int) -> dict:
    """Run in the subprocess: one round, return the memory figures in MiB."""
    import torch

    from fedhpro.config import load_config
    from fedhpro.data.federation import ClientData, Federation
    from fedhpro.engines.simulator import Simulator
    from fedhpro.methods import METHODS, TrainSettings
    from fedhpro.models import build_model

    harness.prepare_torch(None)  # the process settings fedhpro.run uses on the CPU
    generator = torch.Generator().manual_seed(0)
    per_client = max(2, samples // num_clients)
    clients = [ClientData(torch.randn(per_client, 3, 32, 32, generator=generator),
                          torch.randint(0, 10, (per_client,), generator=generator), 10) for _ in range(num_clients)]
    test = (torch.randn(256, 3, 32, 32, generator=generator), torch.randint(0, 10, (256,), generator=generator))
    federation = Federation("synthetic", 10, (3, 32, 32), clients, ["all"] * num_clients, {"all": test})

    def factory() -> torch.nn.Module:
        return build_model("cnn", 10, (3, 32, 32), 512)

    config = load_config(None)
    simulator = Simulator(METHODS[method], config.methods[method], federation, factory, TrainSettings(epochs=1),
                          rounds=1, eval_every=1)
    model_mib = sum(v.numel() * v.element_size() for v in simulator.working_model.state_dict().values()) / 2 ** 20
    with open(f"/proc/{os.getpid()}/statm") as handle:
        rss_before = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    simulator.run_round(0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"model_mib": model_mib, "rss_before": rss_before, "peak_before": peak_before, "peak": peak,
            "data_mib": sum(c.x.numel() * 4 for c in clients) / 2 ** 20, "per_client": per_client}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 100, 500])
    parser.add_argument("--methods", nargs="+", default=["fedavg", "fedhpro"])
    parser.add_argument("--samples", type=int, default=2000, help="total training samples, split over the K clients")
    parser.add_argument("--child", nargs=3, metavar=("METHOD", "K", "SAMPLES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return

    harness.print_header(f"peak memory of one round: synthetic 3x32x32, {args.samples} samples split over K clients, "
                         "cnn, E = 1, one subprocess per cell")
    print(f"  {'method':8s} {'K':>5s} {'samples/client':>14s} {'RSS before':>11s} {'peak':>9s} "
          f"{'round adds':>11s} {'= model copies':>15s}")
    for method in args.methods:
        for num_clients in args.clients:
            result = subprocess.run([sys.executable, __file__, "--child", method, str(num_clients), str(args.samples)],
                                    capture_output=True, text=True, check=True)
            figures = json.loads(result.stdout.strip().splitlines()[-1])
            added = figures["peak"] - max(figures["rss_before"], 0.0)
            print(f"  {method:8s} {num_clients:5d} {figures['per_client']:14d} {figures['rss_before']:9.0f} MiB "
                  f"{figures['peak']:6.0f} MiB {added:7.0f} MiB {added / figures['model_mib']:15.1f}", flush=True)
    print(f"  (one model's weights: {figures['model_mib']:.2f} MiB; data: {figures['data_mib']:.0f} MiB)")


if __name__ == "__main__":
    main()
