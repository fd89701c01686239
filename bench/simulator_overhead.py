"""Simulator overhead: one FedAvg round of the simulator against a bare PyTorch loop doing the same work.

Both sides train the same model (the default ``cnn``) on the same clients'
resident tensors with the same sample passes (E epochs, batch 64, a trailing
batch of one sample skipped), the same optimiser (SGD, lr 0.01, momentum
0.9, weight decay 1e-5, a new optimiser per client) and then average the
weights by sample count. The bare loop has no fedhpro code at all. Variants
run interleaved (see ``harness.py``); the ratio simulator/bare is taken
within each repeat. Evaluation is not part of either side, unless ``--eval``: then both sides test the
averaged model on every test set after each round (the simulator with ``eval_every = 1``, the bare loop
with a plain batched forward pass of 1,024 samples in eval mode).

    python bench/simulator_overhead.py                       # 8 clients, E = 1, 5 repeats (~2-5 min)
    python bench/simulator_overhead.py --eval                # with per-round evaluation
    python bench/simulator_overhead.py --clients 20 --epochs 5 --repeats 5
"""

from __future__ import annotations

import argparse

import harness
import torch
import torch.nn.functional as F

from fedhpro.engines.simulator import Simulator
from fedhpro.methods import METHODS, TrainSettings

TARGET = 1.05  # the target, with and without per-round evaluation


def bare_round(model: torch.nn.Module, global_state: dict, clients, train: TrainSettings, seed: int) -> dict:
    """Plain PyTorch: for each client load the global weights, E epochs of SGD, copy the weights; average."""
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
                if index.numel() < 2:  # the same rule as the simulator (BatchNorm cannot train on one sample)
                    continue
                loss = F.cross_entropy(model(data.x[index]), data.y[index])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        sizes.append(n)
    total = sum(sizes)
    return {k: sum(s[k] * (n / total) for s, n in zip(states, sizes)) for k in states[0]}


@torch.no_grad()
def bare_eval(model: torch.nn.Module, state: dict, test_sets: dict) -> dict:
    """Plain PyTorch: the averaged weights loaded, accuracy on each test set in batches of 1,024."""
    model.load_state_dict(state)
    model.eval()
    accuracy = {}
    for name, (x, y) in test_sets.items():
        correct = sum(int((model(x[i:i + 1024]).argmax(1) == y[i:i + 1024]).sum()) for i in range(0, len(y), 1024))
        accuracy[name] = 100.0 * correct / max(len(y), 1)
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_digits_arguments(parser, clients=8, epochs=1, repeats=5)
    parser.add_argument("--eval", action="store_true", help="both sides evaluate on the test sets every round")
    args = parser.parse_args()
    harness.prepare_torch(args.threads)

    federation, config = harness.digits_federation(args.clients, args.data_dir)
    train = TrainSettings(epochs=args.epochs)
    factory = harness.cnn_factory(federation)

    simulator = Simulator(METHODS["fedavg"], config.methods["fedavg"], federation, factory, train,
                          rounds=10 ** 9, eval_every=1 if args.eval else 10 ** 9)
    bare_model = factory()
    global_state = {k: v.clone() for k, v in simulator.server.global_weights().items()}
    counter = iter(range(10 ** 9))

    def bare() -> None:
        averaged = bare_round(bare_model, global_state, federation.clients, train, next(counter))
        if args.eval:
            bare_eval(bare_model, averaged, federation.test_sets)

    variants = {"bare PyTorch loop": bare, "simulator, FedAvg": lambda: simulator.run_round(next(counter))}
    samples = harness.sample_passes(federation, args.epochs, train.batch_size)
    harness.print_header(f"simulator overhead: digits-offline, first {federation.num_clients} clients, "
                         f"E = {args.epochs}, batch {train.batch_size}, {samples} sample passes per round"
                         + (", evaluation every round" if args.eval else ""))
    times = harness.interleaved(variants, args.repeats,
                                on_repeat=lambda r, s: print(f"  repeat {r}: " + ", ".join(
                                    f"{k} {v:.2f} s" for k, v in s.items()), flush=True))
    print("seconds per round, median [min - max]:")
    harness.report_times(times, samples)
    harness.report_ratio(times, "simulator, FedAvg", "bare PyTorch loop", "simulator / bare", TARGET)
    print(f"  after: {harness.machine_info()['load']}")


if __name__ == "__main__":
    main()
