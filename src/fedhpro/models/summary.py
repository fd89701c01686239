"""Parameter and FLOP counts of the model zoo (what ``fedhpro models`` prints)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from fedhpro.models import MODELS, build_model

#: the input each model is usually run at (CIFAR-size images; MobileNetV2 at TinyImageNet's 64x64; AG News text;
#: tabular rows for mlp)
USUAL_INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "cnn": (3, 32, 32),
    "cnn4": (3, 32, 32),
    "resnet10": (3, 32, 32),
    "resnet18": (3, 32, 32),
    "resnet34": (3, 32, 32),
    "resnet50": (3, 32, 32),
    "resnet101": (3, 32, 32),
    "resnet10-authors": (3, 32, 32),
    "googlenet": (3, 32, 32),
    "mobilenetv2": (3, 64, 64),
    "textcnn": (256,),
    "mlp": (32,),  # 32 tabular features
}
DEFAULT_IMAGE_SHAPE = (3, 32, 32)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def forward_flops(model: nn.Module, example: torch.Tensor) -> int:
    """FLOPs of ``model(example)`` as :class:`torch.utils.flop_counter.FlopCounterMode` counts them:
    2 x multiply-accumulates of matrix products and convolutions (biases, normalisation, activations,
    pooling and embedding look-ups are not counted). Run in eval mode without gradients."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(example)
    finally:
        model.train(was_training)
    return int(counter.get_total_flops())


def example_input(model: nn.Module, input_shape: Sequence[int], batch: int = 1) -> torch.Tensor:
    """A deterministic input of ``input_shape`` for ``model`` (token ids for text models, images otherwise)."""
    generator = torch.Generator().manual_seed(0)
    if getattr(model, "input_kind", "image") == "tokens":
        vocab = getattr(model, "vocab_size", 2)
        return torch.randint(1, vocab, (batch, *input_shape), generator=generator)
    return torch.randn(batch, *input_shape, generator=generator)


def describe_models(names: Iterable[str] | None = None, *, num_classes: int = 10,
                    feature_dim: int = 512) -> list[dict[str, Any]]:
    """One row per model (all registered ones by default), built at its usual input size
    (:data:`USUAL_INPUT_SHAPES`) for ``num_classes`` classes and ``d = feature_dim``:
    ``name``, ``input_shape``, ``params`` (all trainable parameters), ``classifier_params``,
    ``flops`` (one sample's forward, see :func:`forward_flops`), ``feature_dim``, ``num_classes``.
    The global random state is left as it was."""
    rows = []
    for name in (list(MODELS) if names is None else list(names)):
        if name not in MODELS:
            raise KeyError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
        shape = USUAL_INPUT_SHAPES.get(name, DEFAULT_IMAGE_SHAPE)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = build_model(name, num_classes, shape, feature_dim)
        classifier = model.classifier
        assert isinstance(classifier, nn.Module), f"{name}: every zoo model has a classifier layer"
        rows.append({
            "name": name,
            "input_shape": tuple(shape),
            "params": count_parameters(model),
            "classifier_params": count_parameters(classifier),
            "flops": forward_flops(model, example_input(model, shape)),
            "feature_dim": model.feature_dim,
            "num_classes": model.num_classes,
        })
    return rows


def format_model_table(rows: Sequence[dict[str, Any]]) -> str:
    """An aligned text table of :func:`describe_models` rows: name, input, params (M), forward GFLOPs, d."""
    header = ("model", "input", "params (M)", "fwd GFLOPs", "feature dim")
    body = [(row["name"],
             "x".join(str(s) for s in row["input_shape"]) if len(row["input_shape"]) > 1
             else (f"L={row['input_shape'][0]}" if row["name"] == "textcnn" else f"F={row['input_shape'][0]}"),
             f"{row['params'] / 1e6:.3f}",
             f"{row['flops'] / 1e9:.4f}",
             str(row["feature_dim"])) for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    right = (False, False, True, True, True)

    def render(line: Sequence[str]) -> str:
        return "  ".join(cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(line, widths, right)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([render(header), rule, *(render(line) for line in body)])
