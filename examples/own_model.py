"""Your own model: a torchvision ResNet-18, split into fedhpro's features and classifier.

fedhpro's methods need the network in two parts, ``features`` (x -> B x d)
and ``classifier`` (``nn.Linear(d, C)``). ``fedhpro.models.split(net,
head="fc")`` turns any torchvision-style model into that form (the head is
taken out, the rest is the feature extractor; the output is unchanged), and
``fedhpro.run(model=<callable>)`` trains it; the callable receives
``num_classes`` (and ``input_shape`` / ``feature_dim`` if it asks for them).
To start from pretrained weights, build ``resnet18(weights="DEFAULT")`` and
give ``split(..., num_classes=num_classes)`` a new head.

Kept cheap on a CPU: scikit-learn's bundled digits as tiny 3 x 16 x 16 images,
three clients of a few dozen samples, one round of FedHPro (about 10 s on
2 CPU cores).

    python examples/own_model.py
    python examples/own_model.py --rounds 3 --samples 200 --out runs/own-model
"""

from __future__ import annotations

import argparse

import torch
import torchvision
from sklearn.datasets import load_digits

import fedhpro
from fedhpro.data.federation import Federation


def resnet18(num_classes: int) -> torch.nn.Module:
    """A torchvision ResNet-18 (random weights: nothing is downloaded) in fedhpro's form."""
    net = torchvision.models.resnet18(weights=None, num_classes=num_classes)
    return fedhpro.models.split(net, head="fc")


def tiny_digits(samples_per_client: int, clients: int = 3, test_size: int = 300) -> Federation:
    """Digits as 3 x 16 x 16 images in [-1, 1]: ``clients`` IID clients and one shared test set."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 8.0 - 1.0
    images = images.repeat_interleave(2, 1).repeat_interleave(2, 2).unsqueeze(1).expand(-1, 3, -1, -1)
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train = [(images[part], labels[part])
             for part in order[:clients * samples_per_client].split(samples_per_client)]
    test = order[-test_size:]
    return Federation.from_tensors(train, {"all": (images[test], labels[test])}, num_classes=10, name="tiny-digits")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--samples", type=int, default=64, help="training samples per client")
    parser.add_argument("--out", default=None, help="run folder (default runs/fedhpro-tiny-digits-<time>)")
    args = parser.parse_args()

    model = resnet18(10)
    print(f"ResNet-18 split: features -> {model.feature_dim}-d, classifier {model.classifier}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
    result = fedhpro.run(method="fedhpro", model=resnet18, federation=tiny_digits(args.samples),
                         rounds=args.rounds, local_epochs=1, batch_size=32, progress=False, device="cpu",
                         out=args.out)
    print(f"fedhpro with a ResNet-18: test accuracy {result.accuracy:.2f}% after {args.rounds} round(s) "
          f"({result.out}; config.yaml records model: {result.config.run.model})")


if __name__ == "__main__":
    main()
