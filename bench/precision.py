"""Mixed precision on the CPU: local training of the default ``cnn`` in float32 against ``amp=bf16``.

Both variants run fedhpro's own training loop (:func:`fedhpro.methods.base.train_epochs`) on the same first
clients of digits-offline from the same initial weights: ``float32`` is the default (``TrainSettings()``),
``bf16`` is ``amp=bf16`` with ``channels_last=auto`` (on for the ``cnn``: bfloat16 autocast in the
channels_last format); ``--channels-last`` adds float32 in channels_last. Variants run interleaved (see
``harness.py``); the ratio float32/bf16 (the speed-up) is taken within each repeat. The header names the
CPU, its bfloat16 instructions (:func:`fedhpro.runtime.cpu_features`) and the load before and after.

    python bench/precision.py                        # 4 clients, E = 1, 5 repeats, 1 thread (~1-2 min)
    python bench/precision.py --clients 8 --repeats 7 --channels-last

On a CPU without native bfloat16 (no AVX512-BF16, no AMX) ``fedhpro run`` refuses ``amp=bf16``; this benchmark
still measures it there (``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`` makes a recent Xeon behave so).
"""

from __future__ import annotations

import argparse
import copy
import os

import harness
import torch

from fedhpro import runtime
from fedhpro.methods import TrainSettings
from fedhpro.methods.base import train_epochs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_digits_arguments(parser, clients=4, epochs=1, repeats=5)
    parser.add_argument("--channels-last", action="store_true", help="also float32 in channels_last")
    parser.set_defaults(threads=1)
    args = parser.parse_args()
    harness.prepare_torch(args.threads)
    federation, _ = harness.digits_federation(args.clients, args.data_dir)
    torch.manual_seed(0)
    initial = harness.cnn_factory(federation)()
    samples = harness.sample_passes(federation, args.epochs, 64)
    settings = {"float32": TrainSettings(epochs=args.epochs),
                "bf16": TrainSettings(epochs=args.epochs, amp="bf16")}
    if args.channels_last:
        settings["float32+channels_last"] = TrainSettings(epochs=args.epochs, channels_last=True)

    def variant(train: TrainSettings):
        def run() -> None:
            generator = torch.Generator().manual_seed(0)
            for data in federation.clients:  # a fresh copy per client, as a round loads the global weights
                train_epochs(copy.deepcopy(initial), data, train, generator)
        return run

    cpu = runtime.cpu_features()
    harness.print_header(f"local training of the cnn, float32 vs amp=bf16 (channels_last=auto): first "
                         f"{args.clients} clients of digits-offline, E = {args.epochs}, {samples} sample passes "
                         f"per repeat")
    print(f"  isa    {cpu.described()}; torch capability {cpu.capability}; native bfloat16: {cpu.native_bf16}"
          + (f"; ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']}" if "ONEDNN_MAX_CPU_ISA" in os.environ
             else ""))
    times = harness.interleaved({name: variant(train) for name, train in settings.items()}, args.repeats)
    harness.report_times(times, samples)
    for name, values in times.items():
        median = sorted(values)[len(values) // 2]
        print(f"  {name:34s} {median / samples * 1e6:8.0f} us per sample (median)")
    harness.report_ratio(times, "float32", "bf16", "speed-up float32 / bf16")
    if args.channels_last:
        harness.report_ratio(times, "float32", "float32+channels_last", "speed-up float32 / channels_last")
    print(f"  after: {harness.machine_info()['load']}")


if __name__ == "__main__":
    main()
