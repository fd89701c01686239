"""Engine overhead and FedHPro's cost, as ratios measured side by side in one process.

For the same federation (digits-offline, the default layout) and the same
number of sample passes, it times, interleaved over ``--repeats`` rounds:

* ``bare``: a plain PyTorch loop training one model per client (load the
  global weights, E epochs of SGD on index-sliced resident tensors, copy the
  state dict), then averaging the state dicts, with no fedhpro code at all;
* ``fedavg``: one round of our simulator running FedAvg;
* ``fedhpro``: one round of our simulator running FedHPro.

and prints the median seconds and the ratios fedavg/bare (our engine's
overhead) and fedhpro/fedavg (the method's extra cost: two feature passes,
HPCL/HPAL terms and the server's gradient matching).

    python bench/round_overhead.py                  # E = 5, as the default run
    python bench/round_overhead.py --epochs 1 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from fedhpro.config import load_config
from fedhpro.data import get_dataset
from fedhpro.engines.simulator import Simulator
from fedhpro.methods import METHODS, TrainSettings
from fedhpro.models import build_model


def bare_round(model, global_state, clients, train: TrainSettings, seed: int) -> dict:
    states, sizes = [], []
    generator = torch.Generator().manual_seed(seed)
    for data in clients:
        model.load_state_dict(global_state)
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=train.lr, momentum=train.momentum,
                                    weight_decay=train.weight_decay)
        n = data.y.shape[0]
        for _ in range(train.epochs):
            order = torch.randperm(n, generator=generator)
            for start in range(0, n, train.batch_size):
                index = order[start:start + train.batch_size]
                loss = F.cross_entropy(model(data.x[index]), data.y[index])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        sizes.append(n)
    total = sum(sizes)
    return {k: sum(s[k] * (n / total) for s, n in zip(states, sizes)) for k in states[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    torch.set_flush_denormal(True)

    config = load_config(None, [f"local_epochs={args.epochs}"] + ([f"data_dir={args.data_dir}"] if args.data_dir else []))
    federation = get_dataset("digits-offline").build(config.data, None, 0, data_dir=config.run.data_dir)
    train = TrainSettings(epochs=args.epochs)

    def factory():
        return build_model("cnn", 10, (3, 32, 32), 512)

    simulators = {name: Simulator(METHODS[name], config.methods[name], federation, factory, train, rounds=10 ** 6,
                                  eval_every=10 ** 6) for name in ("fedavg", "fedhpro")}
    bare_model = factory()
    global_state = {k: v.clone() for k, v in bare_model.state_dict().items()}
    samples = sum(len(c) for c in federation.clients) * args.epochs
    times: dict[str, list[float]] = {"bare": [], "fedavg": [], "fedhpro": []}
    for repeat in range(args.repeats + 1):  # the first repeat warms up (oneDNN primitives), not counted
        for name in times:
            start = time.perf_counter()
            if name == "bare":
                bare_round(bare_model, global_state, federation.clients, train, repeat)
            else:
                simulators[name].run_round(repeat)
            if repeat > 0:
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"digits-offline, {federation.num_clients} clients, E = {args.epochs}, {samples} sample passes per round, "
          f"{torch.get_num_threads()} threads, median of {args.repeats} rounds")
    for name, seconds in median.items():
        print(f"  {name:8s} {seconds:7.2f} s/round  {samples / seconds:7.0f} samples/s")
    print(f"  fedavg / bare    = {median['fedavg'] / median['bare']:.3f}  (engine overhead)")
    print(f"  fedhpro / fedavg = {median['fedhpro'] / median['fedavg']:.3f}  (FedHPro's extra cost)")


if __name__ == "__main__":
    main()
