"""Where FedHPro's extra client cost goes: one local epoch with and without HPCL + HPAL, and one eval pass.

On one client-sized batch of random CIFAR-shaped tensors with the default
``cnn``, interleaved (see ``harness.py``):

* ``epoch, CE``: one epoch of ``train_epochs`` (FedAvg's local work);
* ``epoch, CE + HPCL + HPAL``: the same with FedHPro's two losses (C = 10, |I| = 5);
* ``eval pass``: ``extract_features`` over the same samples (what the margin
  prototypes and the class gradients each cost once per round).

FedHPro / FedAvg for E epochs is then about
``(E * reg + passes * pass) / (E * ce)`` plus the server step (passes = 2 with
``gradient_timing=after``, the default; 1 with ``before``); the script prints it
for E = 1, 5, 10.

    python bench/fedhpro_components.py
    python bench/fedhpro_components.py --samples 1280 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics

import harness
import torch

from fedhpro import functional as HF
from fedhpro.data.federation import ClientData
from fedhpro.methods.base import TrainSettings, extract_features, train_epochs
from fedhpro.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=640)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    harness.prepare_torch(args.threads)
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = build_model("cnn", 10, (3, 32, 32), 512)
    hyper = torch.randn(10, 5, 512, generator=generator)
    data = ClientData(torch.randn(args.samples, 3, 32, 32, generator=generator),
                      torch.randint(0, 10, (args.samples,), generator=generator), 10)
    train = TrainSettings(epochs=1)
    margin = torch.tensor(0.5)

    def regularizer(z, y, logits):
        return {"hpcl": HF.hpcl_loss(z, y, hyper, margin, 0.05), "hpal": HF.hpal_loss(z, y, hyper, normalized=True)}

    variants = {
        "epoch, CE": lambda: train_epochs(model, data, train, torch.Generator().manual_seed(0)),
        "epoch, CE + HPCL + HPAL": lambda: train_epochs(model, data, train, torch.Generator().manual_seed(0),
                                                        regularizer),
        "eval pass": lambda: extract_features(model, data.x),
    }
    harness.print_header(f"FedHPro's client cost by component: cnn, {args.samples} samples, batch 64")
    times = harness.interleaved(variants, args.repeats)
    harness.report_times(times, args.samples)
    ce, reg, one_pass = (statistics.median(times[name]) for name in variants)
    print(f"  HPCL + HPAL add {100 * (reg / ce - 1):.1f}% to an epoch; one eval pass = {one_pass / ce:.2f} epochs")
    for epochs in (1, 5, 10):
        two = (epochs * reg + 2 * one_pass) / (epochs * ce)
        one = (epochs * reg + one_pass) / (epochs * ce)
        print(f"  E = {epochs:2d}: client-side FedHPro / FedAvg ~ {two:.3f} (two passes, default), "
              f"{one:.3f} (one pass, gradient_timing=before)")


if __name__ == "__main__":
    main()
