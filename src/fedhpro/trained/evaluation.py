"""A finished run's trained model(s) re-tested from the folder alone, per class (``fedhpro report ...
per_class=true``), through the run's own evaluation: the same forward passes
(:func:`fedhpro.engines.one_round.count_correct` in the run's ``amp`` precision, evaluation batch size and layout),
the same pooling of the clients' counts under the run's caps (:func:`fedhpro.engines.evaluation.pool_accuracy`), in
the run's CPU settings (denormals flushed, its thread count). Its accuracy is then the summary's to the bit unless
the data or the model files changed."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from fedhpro.bounded import read_json_file, run_file
from fedhpro.config import AggregationOptions, applied_data_options
from fedhpro.data import get_dataset
from fedhpro.data.unseen import hold_out_clients
from fedhpro.data.validation import hold_out_validation
from fedhpro.engines.evaluation import TestCount, pool_accuracy
from fedhpro.engines.one_round import count_correct
from fedhpro.errors import ConfigError, DataError
from fedhpro.methods.no_grad import no_grad_precision
from fedhpro.metrics.classification import classification_figures
from fedhpro.runtime import cpu_runtime, resolve_threads, torch_threads
from fedhpro.trained.checks import read_info, shown
from fedhpro.trained.folder import ModelFileError
from fedhpro.trained.load import load_model, run_config


class _Recorded(nn.Module):
    """``module`` as the run's evaluation calls it, keeping each batch's predicted classes and class scores
    (softmax of its outputs, float32) in order (the evaluation counts only the hits; the per-class counts,
    the confusion matrix and AUROC need the predictions)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.predicted: list[Tensor] = []
        self.scores: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        logits = self.module(x)
        self.predicted.append(logits.argmax(1).cpu())
        self.scores.append(logits.detach().float().softmax(1).cpu())
        return logits


class Tested(NamedTuple):
    """One re-test: the run's test count (``test``), ``correct`` and ``total`` per class, and the ``labels``,
    ``predicted`` classes and class ``scores`` of each tested row."""

    test: TestCount
    correct: Tensor
    total: Tensor
    labels: Tensor
    predicted: Tensor
    scores: Tensor


def _tested(module: nn.Module, name: str, x: Tensor, y: Tensor, num_classes: int, amp: str,
            batch_size: int | None) -> Tested:
    """:class:`Tested` of ``module`` (a module loaded from the folder, which applies the run's inference rule)
    on ``(x, y)``: the run's own test (:func:`~fedhpro.engines.simulator.evaluate`:
    :func:`~fedhpro.engines.one_round.count_correct` in the run's
    :func:`~fedhpro.methods.no_grad.no_grad_precision`), its predictions kept."""
    recorded = _Recorded(module)
    with no_grad_precision(amp, x.device):
        count = TestCount(name, count_correct(recorded, x, y, batch_size), int(y.shape[0]))
    # a batch the module refused in channels_last raised before it was recorded: one prediction per row
    predicted = torch.cat(recorded.predicted) if recorded.predicted else torch.zeros(0, dtype=torch.int64)
    scores = torch.cat(recorded.scores) if recorded.scores else torch.zeros(0, num_classes)
    labels = y.cpu()
    hits = labels[predicted == labels]
    correct = torch.bincount(hits, minlength=num_classes)[:num_classes]
    total = torch.bincount(labels, minlength=num_classes)[:num_classes]
    return Tested(count, correct, total, labels, predicted, scores)


def class_accuracy(run_folder: str | os.PathLike, *, model: Callable[..., nn.Module] | None = None,
                   batch_size: int | None = None) -> dict[str, Any]:
    """Per-class test accuracy of a finished run's trained model(s), recomputed from its folder alone.

    The data are rebuilt from the run's ``config.yaml`` (same data set, seed and partition: the same
    federation) and the model(s) from ``model.pt`` / ``models/`` (:func:`load_model`), and tested as the run
    tested them, through its own evaluation (the run's ``amp`` precision, evaluation batches and caps): one
    global model on each test set; personal models (or a federation that arrived split into per-client test
    sets) client by client, the counts pooled per test set under ``aggregation.max_share``. ``batch_size``:
    rows per forward pass; None (the default) is the run's own (another can change the last float digits).

    Returns a JSON-ready dict: ``classes`` (names, or None), ``train_counts`` (training samples per class summed
    over the clients), ``test_sets`` (per test set ``correct`` and ``total`` per class), ``accuracy`` (per test
    set and ``AVG``, their unweighted mean: the run's own accuracy, recomputed) and ``reported`` (summary.json's
    final accuracy, None if absent). ``reported`` differing from ``accuracy["AVG"]`` means the data or the
    model files changed since the run. ``seed``: the run's seed (what pairs it with another method's run);
    ``samples``: what its data's examples are (:func:`samples_kind`: images, rows, sequences or samples).
    """
    folder = Path(run_folder)
    info = read_info(folder)
    config = run_config(folder, info, model)
    options = config.run
    if config.federation is not None:
        raise ConfigError(f"{folder}'s data came from Python ({config.federation}); its per-class accuracy cannot "
                          "be rebuilt from the folder: test the model yourself, fedhpro.load_model(folder)")
    # the run's CPU settings: flushed denormals and its thread count change the last digits of a forward pass
    with cpu_runtime(), torch_threads(resolve_threads(options.threads)):
        federation = get_dataset(options.dataset).build(applied_data_options(config), options.clients, options.seed,
                                                        data_dir=options.data_dir, progress=False,
                                                        partition=config.partition)
        # the run's clients and training data: without its unseen clients and validation parts
        federation = hold_out_clients(federation, options.unseen_clients, options.unseen_domain, options.seed)
        federation = hold_out_validation(federation, options.validation, options.seed)
        num_classes = federation.num_classes
        per_class: dict[str, list[Tensor]] = {name: [torch.zeros(num_classes, dtype=torch.int64),
                                                     torch.zeros(num_classes, dtype=torch.int64)]
                                              for name in federation.test_sets}
        counts: list[TestCount] = []
        rows: dict[str, list[Tested]] = {}

        def test(name: str, module: nn.Module, x: Tensor, y: Tensor) -> None:
            tested = _tested(module, name, x, y, num_classes, options.amp, batch_size)
            counts.append(tested.test)
            pooled = per_class.setdefault(name, [torch.zeros_like(tested.correct), torch.zeros_like(tested.total)])
            pooled[0] += tested.correct
            pooled[1] += tested.total
            rows.setdefault(name, []).append(tested)

        global_model = None if not info.get("global") else load_model(folder, model=model, preprocess=False)
        if global_model is not None and federation.client_tests is None:
            # simulator.evaluate: each test set once, plain pooling
            for name, (x, y) in federation.test_sets.items():
                test(name, global_model, x, y)
            accuracy = pool_accuracy(counts)
        else:
            # simulator.evaluate_clients: every client, its counts pooled per test set under the run's caps
            for k in range(federation.num_clients):
                name = federation.client_test_name(k)
                x, y = federation.client_tests[k] if federation.client_tests is not None else federation.test_sets[name]
                personal = global_model if global_model is not None else load_model(folder, client=k, model=model,
                                                                                        preprocess=False)
                test(name, personal, x, y)
            aggregation = AggregationOptions(**dataclasses.asdict(config.aggregation))
            accuracy = pool_accuracy(counts, list(federation.test_sets), aggregation.max_share)
    if not any(count.total for count in counts):
        accuracy["AVG"] = 0.0  # nothing tested: no NaN in a JSON-ready result
    tested = {name: pair for name, pair in per_class.items() if int(pair[1].sum())}
    summary_path = run_file(folder, "summary.json", ModelFileError)
    reported = None
    if summary_path.is_file():
        summary = read_json_file(summary_path, DataError)
        reported = summary.get("accuracy") if isinstance(summary, dict) else None
        if reported is not None and (not isinstance(reported, (int, float)) or isinstance(reported, bool)):
            raise DataError(f"{summary_path}: accuracy is {shown(reported)}, not a number; the file is damaged: "
                            "delete it or run again")
    train_counts = sum((torch.bincount(client.y.cpu(), minlength=num_classes)[:num_classes]
                        for client in federation.clients), torch.zeros(num_classes, dtype=torch.int64))
    return {"classes": info.get("classes"),
            "train_counts": [int(v) for v in train_counts],
            "test_sets": {name: {"correct": [int(v) for v in pair[0]], "total": [int(v) for v in pair[1]]}
                          for name, pair in tested.items()},
            "accuracy": accuracy, "reported": reported, "seed": options.seed, "samples": samples_kind(info),
            "classification": _figures(rows, num_classes)}


def samples_kind(info: dict[str, Any]) -> str:
    """What one example of the run's data is, from its model.json: "images" (an image input, or a channels x
    height x width tensor), "rows" (a table's row of float features), "sequences" (integer tokens), else
    "samples"."""
    inputs = info.get("input") or {}
    shape = [int(n) for n in info.get("input_shape") or []]
    floating = str(inputs.get("dtype", "float32")).startswith("float")
    if inputs.get("kind") == "image" or (len(shape) == 3 and floating):
        return "images"
    if len(shape) == 1:
        return "rows" if floating else "sequences"
    return "samples"


def _figures(rows: dict[str, list[Tested]], num_classes: int) -> dict[str, Any]:
    """Per test set, and ``pooled`` over every tested row, :func:`classification_figures` of the re-test's
    predictions (a test set's clients' rows together)."""
    def joined(parts: list[Tested]) -> dict[str, Any]:
        return classification_figures(torch.cat([p.labels for p in parts]), torch.cat([p.predicted for p in parts]),
                                      torch.cat([p.scores for p in parts]), num_classes)

    tested = {name: parts for name, parts in rows.items() if any(p.labels.numel() for p in parts)}
    out = {name: joined(parts) for name, parts in tested.items()}
    if tested:
        out["pooled"] = joined([p for parts in tested.values() for p in parts])
    return out
