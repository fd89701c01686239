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
    python bench/server_scaling.py --path closed-form     # only the package's path (no comparison)

``--path`` (default ``both``): ``closed-form`` is the package as it runs
(Eq. 7 in closed form for the linear head, a first-order backward per
matching step); ``autograd`` forces the previous path (per-sample input
gradients by autograd, double backward through ``cross_entropy``) by handing
the bank the same ``nn.Linear`` wrapped in a module that is not one. With
``both``, all 2 x |C| x |K| cells run interleaved and the per-repeat ratios
autograd / closed-form are printed per cell.
"""

from __future__ import annotations

import argparse
import statistics

import harness
import torch

from fedhpro.methods.fedhpro.hyper import HyperPrototypeBank


class AutogradHead(torch.nn.Module):
    """The same linear head, but not an ``nn.Linear``: ``hyper_prototype_gradients`` takes its autograd path."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.linear = linear

    @property
    def weight(self) -> torch.Tensor:  # HyperPrototypeBank.update reads the head's device from it
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def make_cell(num_classes: int, num_clients: int, feature_dim: int, num_hyper: int, match_steps: int, seed: int,
              path: str = "closed-form"):
    """A closure running one server step (validate the replies, Eq. 6, M matching steps) from a fresh bank.

    ``path="autograd"`` hands the bank the same head wrapped so that Eq. 7 takes the autograd path.
    """
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
    if path == "autograd":
        classifier = AutogradHead(classifier)
    elif path != "closed-form":
        raise ValueError(f"path must be 'closed-form' or 'autograd', got {path!r}")

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
    parser.add_argument("--path", choices=["closed-form", "autograd", "both"], default="both",
                        help="Eq. 7 path(s) to time; both: interleaved side by side, with the speed-up per cell")
    args = parser.parse_args()
    harness.prepare_torch(args.threads)

    paths = ["closed-form", "autograd"] if args.path == "both" else [args.path]
    variants = {}
    for c in args.classes:
        for k in args.clients:
            for path in paths:
                variants[f"C={c} K={k} {path}"] = make_cell(c, k, args.feature_dim, args.num_hyper,
                                                            args.match_steps, seed=c * 1000 + k, path=path)
    harness.print_header(f"server step scaling: d = {args.feature_dim}, |I| = {args.num_hyper}, "
                         f"M = {args.match_steps}, {args.repeats} repeats, Eq. 7 path: {' vs '.join(paths)}")
    all_times = harness.interleaved(variants, args.repeats)
    for path in paths:
        times = {f"C={c} K={k}": all_times[f"C={c} K={k} {path}"] for c in args.classes for k in args.clients}
        print(f"\n=== Eq. 7 path: {path} ===")
        report(times, args.classes, args.clients)
    if len(paths) == 2:
        print("\nspeed-up autograd / closed-form, per-repeat paired ratios, median [min - max]:")
        print("  " + "C \\ K".ljust(8) + "".join(f"K={k}".rjust(26) for k in args.clients))
        for c in args.classes:
            cells = [harness.spread(harness.paired_ratios(all_times, f"C={c} K={k} autograd",
                                                          f"C={c} K={k} closed-form")) for k in args.clients]
            print("  " + f"C={c}".ljust(8) + "".join(cell.rjust(26) for cell in cells))
    print(f"  after: {harness.machine_info()['load']}")


def _linear_fit(median: dict[tuple[int, int], float], classes: list[int], clients: list[int]) -> None:
    print("linear in C: seconds per class (median / C), and a least-squares line t = a + b C:")
    for k in clients:
        xs = [float(c) for c in classes]
        ys = [median[(c, k)] for c in classes]
        mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        intercept = mean_y - slope * mean_x
        residual = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys))
        total = sum((y - mean_y) ** 2 for y in ys) or 1.0
        per_class = ", ".join(f"{1e3 * median[(c, k)] / c:.2f}" for c in classes)
        print(f"  K={k}: ms per class [{per_class}]; a = {intercept * 1e3:.1f} ms, b = {slope * 1e3:.2f} ms/class, "
              f"R^2 = {1 - residual / total:.4f}")


def report(times: dict[str, list[float]], classes: list[int], clients: list[int]) -> None:
    """The C x K table of seconds, the fit against C and the ratio across K, for one path."""
    median = {(c, k): statistics.median(times[f"C={c} K={k}"]) for c in classes for k in clients}
    print("seconds per server step, median [min - max]:")
    print("  " + "C \\ K".ljust(8) + "".join(f"K={k}".rjust(26) for k in clients))
    for c in classes:
        print("  " + f"C={c}".ljust(8) + "".join(harness.spread(times[f'C={c} K={k}']).rjust(26) for k in clients))

    if len(set(classes)) < 2:
        print("(no fit against C: give --classes at least two values)")
    else:
        _linear_fit(median, classes, clients)
    if len(set(classes)) >= 3:
        print("with a quadratic term, t = a + b C + q C^2 (least squares); share of q C^2 at the largest C:")
        xs = torch.tensor([float(c) for c in classes], dtype=torch.float64)
        design = torch.stack([torch.ones_like(xs), xs, xs * xs], dim=1)
        for k in clients:
            ys = torch.tensor([median[(c, k)] for c in classes], dtype=torch.float64)
            a, b, q = torch.linalg.lstsq(design, ys.unsqueeze(1)).solution.squeeze(1).tolist()
            share = q * xs[-1].item() ** 2 / ys[-1].item()
            print(f"  K={k}: a = {a * 1e3:.1f} ms, b = {b * 1e3:.3f} ms/class, q = {q * 1e6:.3f} us/class^2; "
                  f"q C^2 / t at C={classes[-1]}: {share:.2f}")
    print(f"flat in K: time at K={clients[-1]} / time at K={clients[0]} (same C):")
    for c in classes:
        print(f"  C={c}: {median[(c, clients[-1])] / median[(c, clients[0])]:.3f}")


if __name__ == "__main__":
    main()
