"""FedHPro's server step against the number of classes C and of clients K.

The server step is what ``FedHProServer.aggregate`` adds to FedAvg: stack and
check the K uploaded class gradients (K x C x d), average them per class
(Eq. 6), then M steps of gradient matching on the C x |I| x d
hyper-prototypes (Eq. 7-9). The paper's claim: linear in C, independent of K
(the matching sees only the C x d average). Inputs are random (each client
holds a random half of the classes), d = 512, |I| = 5, M = 30 as the
defaults. All (C, K) cells run interleaved, one cell after another within a
repeat, the order rotating between repeats.

    python bench/server_scaling.py                        # C in 10 100 200 397, K in 10 50 100, 3 repeats
    python bench/server_scaling.py --repeats 5 --match-steps 30
"""

from __future__ import annotations

import argparse
import statistics

import torch

import harness
from fedhpro.methods.hyper import HyperPrototypeBank


def make_cell(num_classes: int, num_clients: int, feature_dim: int, num_hyper: int, match_steps: int, seed: int):
    """A closure running one server step (validate the replies, Eq. 6, M matching steps) from a fresh bank."""
    generator = torch.Generator().manual_seed(seed)
    classifier = torch.nn.Linear(feature_dim, num_classes)
    replies = []
    for _ in range(num_clients):
        counts = torch.randint(1, 50, (num_classes,), generator=generator)
        counts[torch.rand(num_classes, generator=generator) < 0.5] = 0
        replies.append({"class_gradients": torch.randn(num_classes, feature_dim, generator=generator) * 1e-2,
                        "class_counts": counts})
    bank = HyperPrototypeBank(num_classes, feature_dim, seed, num_hyper=num_hyper, match_steps=match_steps)
    start = bank.hyper.clone()

    def step() -> None:
        bank.hyper = start.clone()  # every repeat matches from the same S
        gradients, present = bank.validate(replies)
        bank.update(gradients, present, classifier)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--classes", nargs="+", type=int, default=[10, 100, 200, 397])
    parser.add_argument("--clients", nargs="+", type=int, default=[10, 50, 100])
    parser.add_argument("--feature-dim", type=int, default=512)
    parser.add_argument("--num-hyper", type=int, default=5)
    parser.add_argument("--match-steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3, help="counted repeats (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)

    cells = {(c, k): make_cell(c, k, args.feature_dim, args.num_hyper, args.match_steps, seed=c * 1000 + k)
             for c in args.classes for k in args.clients}
    harness.print_header(f"server step scaling: d = {args.feature_dim}, |I| = {args.num_hyper}, "
                         f"M = {args.match_steps}, {args.repeats} repeats")
    times = harness.interleaved({f"C={c} K={k}": cell for (c, k), cell in cells.items()}, args.repeats)
    median = {(c, k): statistics.median(times[f"C={c} K={k}"]) for c, k in cells}

    print("seconds per server step, median [min - max]:")
    print("  " + "C \\ K".ljust(8) + "".join(f"K={k}".rjust(26) for k in args.clients))
    for c in args.classes:
        print("  " + f"C={c}".ljust(8) + "".join(harness.spread(times[f'C={c} K={k}']).rjust(26) for k in args.clients))

    print("linear in C: seconds per class (median / C), and a least-squares line t = a + b C:")
    for k in args.clients:
        xs = [float(c) for c in args.classes]
        ys = [median[(c, k)] for c in args.classes]
        mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        intercept = mean_y - slope * mean_x
        residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
        total = sum((y - mean_y) ** 2 for y in ys) or 1.0
        per_class = ", ".join(f"{1e3 * median[(c, k)] / c:.2f}" for c in args.classes)
        print(f"  K={k}: ms per class [{per_class}]; a = {intercept * 1e3:.1f} ms, b = {slope * 1e3:.2f} ms/class, "
              f"R^2 = {1 - residual / total:.4f}")
    print(f"flat in K: time at K={args.clients[-1]} / time at K={args.clients[0]} (same C):")
    for c in args.classes:
        print(f"  C={c}: {median[(c, args.clients[-1])] / median[(c, args.clients[0])]:.3f}")
    print(f"  after: {harness.machine_info()['load']}")


if __name__ == "__main__":
    main()
