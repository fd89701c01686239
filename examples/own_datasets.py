"""Your own data: a federation of three sites built from per-site torch Datasets.

Shows ``Federation.from_datasets``: each site is an ordinary
``torch.utils.data.Dataset`` returning ``(image tensor, class index)``; here
scikit-learn's bundled handwritten digits (1,797 8x8 images, no download) are
dealt to three sites that hold different, overlapping class sets (label skew),
and each site keeps 20% of its samples as its own test split, so evaluation
is federated (every site tests on its own data). FedHPro and FedAvg then train
on the same federation and their test accuracy is printed.

Run (about 20 s on 2 CPU cores with the defaults):

    python examples/own_datasets.py
    python examples/own_datasets.py --rounds 10 --out runs/own-datasets
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset

import fedhpro
from fedhpro.data.federation import Federation

#: the classes each site holds (label skew: no site sees all ten)
SITE_CLASSES = {"clinic-a": [0, 1, 2, 3, 4, 5], "clinic-b": [3, 4, 5, 6, 7, 8], "clinic-c": [6, 7, 8, 9, 0, 1]}


class DigitsSite(Dataset):
    """One site's digits: item ``i`` is a 1 x 16 x 16 float image in [-1, 1] and its class index."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = self.images[i] / 8.0 - 1.0  # pixel values 0..16 -> [-1, 1]
        image = image.repeat_interleave(2, 0).repeat_interleave(2, 1)  # 8x8 -> 16x16: the cnn's smallest input
        return image.unsqueeze(0), int(self.labels[i])


def site_datasets(seed: int = 0) -> tuple[dict[str, DigitsSite], dict[str, DigitsSite]]:
    """Train and test datasets per site: each sample goes to one site holding its class, then 80/20."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)
    labels = torch.tensor(digits.target, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    owners: dict[str, list[int]] = {site: [] for site in SITE_CLASSES}
    for i in torch.randperm(len(labels), generator=generator).tolist():
        holders = [site for site, classes in SITE_CLASSES.items() if int(labels[i]) in classes]
        owners[holders[i % len(holders)]].append(i)
    train, test = {}, {}
    for site, indices in owners.items():
        cut = int(0.8 * len(indices))
        train[site] = DigitsSite(images[indices[:cut]], labels[indices[:cut]])
        test[site] = DigitsSite(images[indices[cut:]], labels[indices[cut:]])
    return train, test


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="folder of the runs (default runs/<method>-...)")
    args = parser.parse_args()

    train, test = site_datasets()
    federation = Federation.from_datasets(list(train.values()), list(test.values()), names=list(train),
                                          num_classes=10, name="digits-3-sites")
    for site, data in zip(train, federation.clients):
        print(f"{site}: {len(data)} training images, classes {sorted(set(data.y.tolist()))}")
    for method in ("fedhpro", "fedavg"):
        out = str(args.out / method) if args.out else None
        result = fedhpro.run(method=method, federation=federation, rounds=args.rounds, local_epochs=2,
                             feature_dim=64, lr=0.05, progress=False, device="cpu", seed=0, out=out)
        print(f"{method}: test accuracy {result.accuracy:.2f}% after {args.rounds} rounds ({result.out})")


if __name__ == "__main__":
    main()
