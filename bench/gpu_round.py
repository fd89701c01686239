"""GPU fast path: samples/s of local training and the time of one full-scale round, on one CUDA device.

CIFAR-10 with ResNet-10, K = 10 clients, batch 64 (the paper's setting). If
CIFAR-10 is not in the data folder (``--data-dir``, default the package's
cache), random tensors of CIFAR's shape stand in for it (10 x 5000 training
images of 3 x 32 x 32, 10 classes, 10000 test images); the output says which.

1. Throughput: one client's local training (``train_epochs``, ``--throughput-epochs``
   epochs on 5000 samples) under each setting, interleaved over
   ``--repeats`` repeats after a warm-up (which also compiles):
   ``fp32`` (the default path), ``bf16+channels_last``, and
   ``bf16+channels_last+compile``.
2. One full-scale round in the simulator (E = ``--epochs``, default 10: 500k
   sample passes) with the fastest setting, for FedAvg and then FedHPro,
   split into clients / server / evaluation. The FedHPro round is skipped if
   less than ``--budget`` seconds remain.

    bash bench/gpu.sh                       # the whole check, under 8 minutes on one GPU
    python bench/gpu_round.py --epochs 1    # a quicker look
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import harness
import torch

from fedhpro.config import load_config
from fedhpro.data import get_dataset
from fedhpro.data.federation import ClientData, Federation
from fedhpro.engines.simulator import Simulator
from fedhpro.errors import DataError
from fedhpro.methods import METHODS, TrainSettings
from fedhpro.methods.training import train_epochs
from fedhpro.models import build_model

SETTINGS = {
    "fp32": {},
    "bf16+channels_last": {"amp": "bf16", "channels_last": True},
    "bf16+channels_last+compile": {"amp": "bf16", "channels_last": True, "compile": True},
}


def cifar_federation(num_clients: int, data_dir: str | None, device: torch.device,
                     per_client: int = 5000) -> tuple[Federation, str]:
    """CIFAR-10 split over the clients (the benchmark's default Dirichlet partition), or random stand-ins."""
    config = load_config(None, ["dataset=cifar10"] + ([f"data_dir={data_dir}"] if data_dir else []))
    try:
        federation = get_dataset("cifar10").build(config.data, num_clients, 0, data_dir=config.run.data_dir,
                                                  progress=False)
        source = "CIFAR-10"
    except DataError as error:
        generator = torch.Generator().manual_seed(0)
        clients = [ClientData(torch.randn(per_client, 3, 32, 32, generator=generator),
                              torch.randint(0, 10, (per_client,), generator=generator), 10)
                   for _ in range(num_clients)]
        test_size = min(10000, 2 * per_client)  # CIFAR-10's 10000 test images at full scale
        test = (torch.randn(test_size, 3, 32, 32, generator=generator),
                torch.randint(0, 10, (test_size,), generator=generator))
        federation = Federation("random-cifar-shape", 10, (3, 32, 32), clients, ["all"] * num_clients, {"all": test})
        source = f"RANDOM TENSORS of CIFAR-10's shape (CIFAR-10 not found: {str(error).splitlines()[0][:100]})"
    return federation.to(device), source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=10, help="E of the full-scale round")
    parser.add_argument("--throughput-epochs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--budget", type=float, default=420.0, help="seconds this script may take in all")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--device", default="cuda", help="cpu runs the same code on tiny sizes (a dry run)")
    parser.add_argument("--samples-per-client", type=int, default=5000, help="of the random stand-in data")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_round.py needs a CUDA device (torch.cuda.is_available() is False)")
    torch.backends.cudnn.benchmark = True  # fixed shapes: let cuDNN pick its fastest convolution once
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    federation, source = cifar_federation(args.clients, args.data_dir, device, args.samples_per_client)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (dry run)"
    harness.print_header(f"GPU fast path: {name}, ResNet-10, batch 64")
    print(f"  data   {source}; {federation.num_clients} clients, {sum(len(c) for c in federation.clients)} "
          "training samples, resident on the device")

    def factory() -> torch.nn.Module:
        return build_model("resnet10", federation.num_classes, federation.input_shape, 512)

    # 1. throughput of one client's local training under each setting
    torch.manual_seed(0)
    template = factory().to(device)
    client = federation.clients[0]
    models = {name: build_model("resnet10", federation.num_classes, federation.input_shape, 512).to(device)
              for name in args.settings}
    trains = {name: TrainSettings(epochs=args.throughput_epochs, **SETTINGS[name]) for name in args.settings}

    def local_training(name: str) -> None:
        models[name].load_state_dict(template.state_dict())
        train_epochs(models[name], client, trains[name], torch.Generator().manual_seed(0))
        synchronize()

    compile_start = time.perf_counter()
    times = harness.interleaved({name: (lambda name=name: local_training(name)) for name in args.settings},
                                args.repeats, warmup=1)
    samples = harness.sample_passes(Federation("one", 10, (3, 32, 32), [client], ["all"], {}),
                                    args.throughput_epochs, 64)
    print(f"local training throughput ({samples} sample passes per repeat, median [min - max] over "
          f"{args.repeats}; warm-up incl. compilation took {time.perf_counter() - compile_start:.0f} s in all):")
    harness.report_times(times, samples)
    best = min(args.settings, key=lambda name: statistics.median(times[name]))
    for name in args.settings:
        if name != "fp32" and "fp32" in times:
            harness.report_ratio(times, "fp32", name, f"speed-up of {name} over fp32")

    # 2. one full-scale round with the fastest setting
    config = load_config(None)
    round_train = TrainSettings(epochs=args.epochs, **SETTINGS[best])
    round_samples = harness.sample_passes(federation, args.epochs, 64)
    print(f"one full-scale round with {best}: K = {federation.num_clients}, E = {args.epochs}, batch 64, "
          f"{round_samples} sample passes")
    for method in ("fedavg", "fedhpro"):
        remaining = args.budget - (time.perf_counter() - started)
        estimate = round_samples / (samples / statistics.median(times[best])) * (1.3 if method == "fedhpro" else 1.1)
        if remaining < estimate:
            print(f"  {method}: skipped ({remaining:.0f} s left of the budget, the round needs ~{estimate:.0f} s)")
            continue
        simulator = Simulator(METHODS[method], config.methods[method], federation, factory,
                              dataclasses.replace(round_train), rounds=1, eval_every=1, device=device)
        synchronize()
        start = time.perf_counter()
        record = simulator.run_round(0)
        synchronize()
        total = time.perf_counter() - start
        seconds = record.seconds
        print(f"  {method}: {total:.1f} s per round (clients {seconds['clients']:.1f} s, server "
              f"{seconds['server']:.2f} s, evaluation {seconds['eval']:.2f} s), "
              f"{round_samples / seconds['clients']:.0f} samples/s; accuracy {record.accuracy['AVG']:.2f}% "
              f"(includes the first call's compilation when compile is on)")
    peak = (f"; peak GPU memory {torch.cuda.max_memory_allocated(device) / 2 ** 30:.2f} GiB"
            if device.type == "cuda" else "")
    print(f"total {time.perf_counter() - started:.0f} s{peak}")


if __name__ == "__main__":
    main()
