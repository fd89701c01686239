"""Mixed precision on the CPU: local training of the default ``cnn`` in float32 against ``amp=bf16``.

Both variants run fedhpro's own training loop (:func:`fedhpro.methods.training.train_epochs`) on the same first
clients of digits-offline from the same initial weights: ``float32`` is the default (``TrainSettings()``),
``bf16`` is ``amp=bf16`` with ``channels_last=auto`` (on for the ``cnn``: bfloat16 autocast in the
channels_last format); ``--channels-last`` adds float32 in channels_last. Variants run interleaved (see
``harness.py``); the ratio float32/bf16 (the speed-up) is taken within each repeat. The header names the
CPU, its bfloat16 instructions (:func:`fedhpro.runtime.cpu_features`) and the load before and after.

    python bench/precision.py                        # 4 clients, E = 1, 5 repeats, 1 thread (~1-2 min)
    python bench/precision.py --clients 8 --repeats 7 --channels-last
    python bench/precision.py --no-grad              # the no-grad passes instead of training

``--no-grad`` times the passes that do not train, float32 against their ``amp=bf16`` form
(:func:`fedhpro.methods.no_grad.no_grad_precision`, as ``Client.fit`` and the evaluation enter it): FedHPro's
feature pass over each client's training data (:func:`~fedhpro.methods.no_grad.extract_features`, twice a
client a round) and the evaluation of the global model on every test set
(:func:`fedhpro.engines.simulator.evaluate`), and how far bf16's features and accuracy are from float32's.

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
from fedhpro.methods.no_grad import extract_features, no_grad_precision
from fedhpro.methods.training import train_epochs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_digits_arguments(parser, clients=4, epochs=1, repeats=5)
    parser.add_argument("--channels-last", action="store_true", help="also float32 in channels_last")
    parser.add_argument("--no-grad", action="store_true",
                        help="time the no-grad passes (features, evaluation) instead of training")
    parser.set_defaults(threads=1)
    args = parser.parse_args()
    harness.prepare_torch(args.threads)
    federation, _ = harness.digits_federation(args.clients, args.data_dir)
    torch.manual_seed(0)
    initial = harness.cnn_factory(federation)()
    if args.no_grad:
        no_grad_passes(federation, initial, args.repeats)
        return
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


def no_grad_passes(federation, model: torch.nn.Module, repeats: int) -> None:
    """The feature passes over the clients' data and the evaluation on the test sets, float32 against bf16."""
    from fedhpro.engines.client_tests import evaluate

    cpu = torch.device("cpu")
    # a model that has trained a little (an untrained one's features and predictions say little)
    train_epochs(model, federation.clients[0], TrainSettings(epochs=1), torch.Generator().manual_seed(0))
    features = sum(len(data) for data in federation.clients)
    tested = sum(int(y.shape[0]) for _, y in federation.test_sets.values())

    def passes(amp: str):
        def run() -> None:
            with no_grad_precision(amp, cpu):
                for data in federation.clients:
                    extract_features(model, data.x)
        return run

    variants = {"features float32": passes("off"), "features bf16": passes("bf16"),
                "evaluation float32": lambda: evaluate(model, federation.test_sets),
                "evaluation bf16": lambda: evaluate(model, federation.test_sets, amp="bf16")}
    cpu_features = runtime.cpu_features()
    harness.print_header(f"no-grad passes of the cnn, float32 vs amp=bf16: features of the first "
                         f"{len(federation.clients)} clients of digits-offline ({features} samples), evaluation on "
                         f"the {len(federation.test_sets)} test sets ({tested} samples)")
    print(f"  isa    {cpu_features.described()}; native bfloat16: {cpu_features.native_bf16}")
    times = harness.interleaved(variants, repeats)
    harness.report_times(times)
    harness.report_ratio(times, "features float32", "features bf16", "features: speed-up float32 / bf16")
    harness.report_ratio(times, "evaluation float32", "evaluation bf16", "evaluation: speed-up float32 / bf16")
    gap, scale = 0.0, 0.0
    for data in federation.clients:
        float32 = extract_features(model, data.x)
        with no_grad_precision("bf16", cpu):
            bf16 = extract_features(model, data.x)
        gap, scale = max(gap, float((bf16 - float32).abs().max())), max(scale, float(float32.abs().max()))
    float32_accuracy, bf16_accuracy = evaluate(model, federation.test_sets), evaluate(model, federation.test_sets,
                                                                                      amp="bf16")
    print(f"  features: largest |bf16 - float32| {gap:.4f} (largest |feature| {scale:.2f}); accuracy AVG "
          f"{float32_accuracy['AVG']:.2f} % float32, {bf16_accuracy['AVG']:.2f} % bf16")
    print(f"  after: {harness.machine_info()['load']}")


if __name__ == "__main__":
    main()
