"""FedHPro's round cost against FedAvg's on the same federation (the paper's Table 4: 35.16 s / 23.11 s = 1.52).

Variants, run interleaved in one process on the same clients (see ``harness.py``):

* ``fedavg``: a FedAvg round;
* ``fedhpro``: a FedHPro round with the defaults (Algorithm 1: margin
  prototypes from the received model before training, class gradients from
  the trained model after it: two extra eval-mode passes over the local data);
* ``fedhpro gradient_timing=before``: the authors' code, class gradients
  before training, so one pass gives both the margin's prototypes and the
  class gradients;
* ``fedhpro margin=off``: no margin pass (what the margin pass costs);
* ``fedhpro gradient_timing=before, two passes``: the client as it was before
  the one-pass change (a separate margin pass), for the before/after record;
  only on request (``--variants``).
* ``fedhpro, old eval passes``: the default client with the eval-mode passes
  as they were before the no-grad max pool, the channels_last eval layout and
  the CPU eval batch of 64 (torch's ``nn.MaxPool2d``, NCHW, batches of 1024),
  for the before/after record; only on request.

Per variant it prints the median seconds per round, the server's share
(aggregation + gradient matching) and the ratios to FedAvg within each
repeat. Evaluation is not timed.

    python bench/fedhpro_vs_fedavg.py                      # 3 clients, E = 5, 3 repeats
    python bench/fedhpro_vs_fedavg.py --clients 20 --epochs 10 --repeats 5

``--whole-run SEEDS``: the whole default ``fedhpro run`` instead (all clients,
evaluation every round, start-up and writing included), ``--rounds`` rounds,
each seed's FedHPro and FedAvg runs back to back as fresh subprocesses (the
order alternating from seed to seed); per seed the wall-time ratio and the
ratio of the runs' CPU seconds (user + system, steadier on a loaded machine),
then their medians:

    OMP_NUM_THREADS=1 python bench/fedhpro_vs_fedavg.py --whole-run 0 1 2 --rounds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

import harness
import torch

from fedhpro.engines.simulator import Simulator
from fedhpro.methods import METHODS, TrainSettings, no_grad
from fedhpro.methods.fedhpro.client import FedHProClient
from fedhpro.methods.no_grad import extract_features

TARGET = 1.15

#: variant name -> (method, option overrides)
VARIANTS = {
    "fedavg": ("fedavg", {}),
    "fedhpro": ("fedhpro", {}),
    "fedhpro gradient_timing=before": ("fedhpro", {"gradient_timing": "before"}),
    "fedhpro margin=off": ("fedhpro", {"margin": "off"}),
    "fedhpro gradient_timing=before, two passes": ("fedhpro-two-passes", {"gradient_timing": "before"}),
    "fedhpro, old eval passes": ("fedhpro", {}),
}
OLD_EVAL_PASSES = "fedhpro, old eval passes"
DEFAULT_VARIANTS = list(VARIANTS)[:4]


class TwoPassClient(FedHProClient):
    """FedHPro's client as it was before the margin reused the class-statistics pass: one more eval
    pass over the local data (its result discarded; the margin comes out the same either way)."""

    def prepare(self, round):
        if self.options.margin != "off" and self.options.hpcl_weight > 0:
            extract_features(round.model, round.data.x)  # fit has loaded the weights already
        super().prepare(round)


METHOD_SPECS = {**METHODS, "fedhpro-two-passes": dataclasses.replace(METHODS["fedhpro"], client=TwoPassClient)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_digits_arguments(parser, clients=3, epochs=5, repeats=3)  # E = 5: the package default (paper: 10)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS), metavar="VARIANT",
                        help=f"of {list(VARIANTS)}")
    parser.add_argument("--whole-run", nargs="+", type=int, default=None, metavar="SEED",
                        help="time the whole default `fedhpro run` per seed instead (see above)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each --whole-run run")
    args = parser.parse_args()
    if args.whole_run is not None:
        whole_runs(args.whole_run, args.rounds, args.data_dir)
        return
    harness.prepare_torch(args.threads)

    federation, config = harness.digits_federation(args.clients, args.data_dir)
    train = TrainSettings(epochs=args.epochs)
    factory = harness.cnn_factory(federation)

    def torch_pool_factory() -> torch.nn.Module:
        model = factory()
        for index, layer in enumerate(model.features):
            if isinstance(layer, torch.nn.MaxPool2d):
                model.features[index] = torch.nn.MaxPool2d(layer.kernel_size)  # torch's kernel, also under no_grad
        return model

    names = ["fedavg"] + [name for name in args.variants if name != "fedavg"]
    simulators = {}
    for name in names:
        method, overrides = VARIANTS[name]
        options = dataclasses.replace(config.methods[METHOD_SPECS[method].name], **overrides)
        simulators[name] = Simulator(METHOD_SPECS[method], options, federation,
                                     torch_pool_factory if name == OLD_EVAL_PASSES else factory, train,
                                     rounds=10 ** 9, eval_every=10 ** 9)
    rounds = {name: 0 for name in names}
    server_seconds: dict[str, list[float]] = {name: [] for name in names}

    def one_round(name: str) -> None:
        if name == OLD_EVAL_PASSES:  # the eval batch (1024) and layout (NCHW) as they were, for this round only
            with mock.patch.object(no_grad, "eval_batch_size", lambda device: 1024), \
                    mock.patch.object(no_grad, "eval_layout", lambda batch: batch):
                record = simulators[name].run_round(rounds[name])
        else:
            record = simulators[name].run_round(rounds[name])
        rounds[name] += 1
        server_seconds[name].append(record.seconds["server"])

    samples = harness.sample_passes(federation, args.epochs, train.batch_size)
    harness.print_header(f"FedHPro vs FedAvg: digits-offline, first {federation.num_clients} clients, "
                         f"E = {args.epochs}, batch {train.batch_size}, {samples} sample passes per round")
    times = harness.interleaved({name: (lambda name=name: one_round(name)) for name in names}, args.repeats,
                                on_repeat=lambda r, s: print(f"  repeat {r}: " + ", ".join(
                                    f"{k} {v:.2f} s" for k, v in s.items()), flush=True))
    print("seconds per round, median [min - max]:")
    harness.report_times(times, samples)
    for name in names[1:]:
        server = statistics.median(server_seconds[name][1:])  # the first round was the warm-up
        print(f"  {name}: server step (aggregation + matching) {server:.3f} s "
              f"= {server / statistics.median(times['fedavg']):.3f} of a FedAvg round")
    print("ratios to FedAvg (within each repeat):")
    for name in names[1:]:
        harness.report_ratio(times, name, "fedavg", f"{name} / fedavg", TARGET if name == "fedhpro" else None)
    old, new = "fedhpro gradient_timing=before, two passes", "fedhpro gradient_timing=before"
    if old in times and new in times:
        harness.report_ratio(times, old, new, "before/after the one-pass change")
    if OLD_EVAL_PASSES in times and "fedhpro" in times:
        harness.report_ratio(times, OLD_EVAL_PASSES, "fedhpro", "before/after the faster eval passes")
    print(f"  after: {harness.machine_info()['load']}")


def whole_runs(seeds: list[int], rounds: int, data_dir: str | None) -> None:
    """The whole default run per seed, FedHPro and FedAvg back to back (alternating which goes first)."""
    harness.print_header(f"FedHPro vs FedAvg, the whole default `fedhpro run`: rounds={rounds}, seeds {seeds}, "
                         f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    wall: dict[str, list[float]] = {"fedhpro": [], "fedavg": []}
    cpu: dict[str, list[float]] = {"fedhpro": [], "fedavg": []}
    for index, seed in enumerate(seeds):
        for method in (("fedhpro", "fedavg") if index % 2 == 0 else ("fedavg", "fedhpro")):
            with tempfile.TemporaryDirectory() as out:
                command = [sys.executable, "-m", "fedhpro", "run", f"method={method}", f"seed={seed}",
                           f"rounds={rounds}", "progress=false", f"out={out}/run"]
                if data_dir:
                    command.append(f"data_dir={data_dir}")
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                start = time.perf_counter()
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
                wall[method].append(time.perf_counter() - start)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu[method].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
            print(f"  seed {seed} {method:8s} wall {wall[method][-1]:7.1f} s  cpu {cpu[method][-1]:7.1f} s  "
                  f"({harness.machine_info()['load']})", flush=True)
        print(f"  seed {seed}: fedhpro / fedavg wall {wall['fedhpro'][-1] / wall['fedavg'][-1]:.3f}, "
              f"cpu {cpu['fedhpro'][-1] / cpu['fedavg'][-1]:.3f}", flush=True)
    harness.report_ratio(wall, "fedhpro", "fedavg", "whole run, wall: fedhpro / fedavg")
    harness.report_ratio(cpu, "fedhpro", "fedavg", "whole run, cpu: fedhpro / fedavg")
    print(f"  after: {harness.machine_info()['load']}")


if __name__ == "__main__":
    main()
