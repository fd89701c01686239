"""The observers a run's config switches on, and those that write files: TensorBoard and t-SNE.

The observer interface and the observers that only measure (FLOPs,
prototype distances) are in :mod:`fedhpro.engines.observers`; these write
into a run's folder through :mod:`fedhpro.reports` and :mod:`fedhpro.files`,
a layer above the engines.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedhpro.engines.observers import RoundObserver, measurements
from fedhpro.files import write_atomic_with
from fedhpro.metrics.embedding import tsne_embedding
from fedhpro.reports.plots import plot_tsne
from fedhpro.trackers import tracker_for

if TYPE_CHECKING:
    from fedhpro.config import OutputOptions, RunOptions
    from fedhpro.engines.interface import InProcessEngine
    from fedhpro.engines.protocol import RoundRecord


class TensorBoardLog(RoundObserver):
    """Every number of each round's ``metrics.jsonl`` row as a TensorBoard scalar at step ``round + 1``,
    in ``<out>/tensorboard`` (the writer opens at the first round, so a run refused earlier leaves no folder).
    The writer opens with ``purge_step`` at that first round's step: a resumed run redoes the rounds after
    its checkpoint, and TensorBoard then hides what the interrupted run had written for them (each round
    shows once)."""

    def __init__(self, out: Path, writer_class: Callable[..., Any]):
        self.out = Path(out)
        self.writer_class = writer_class
        self.writer: Any = None

    def on_round_end(self, record: RoundRecord) -> None:
        if self.writer is None:
            self.writer = self.writer_class(log_dir=str(self.out / "tensorboard"), purge_step=record.round + 1)
        log_scalars(self.writer, record.to_json())

    def on_run_end(self) -> None:
        if self.writer is not None:
            self.writer.close()


def log_scalars(board: Any, row: dict[str, Any]) -> None:
    """Every number of a ``metrics.jsonl`` row as a TensorBoard scalar at step ``round + 1``."""
    step = row["round"] + 1
    for group in ("accuracy", "train", "server", "fairness"):
        for name, value in (row.get(group) or {}).items():
            if isinstance(value, (int, float)):
                board.add_scalar(f"{group}/{name}", value, step)
    for name in ("bytes_up", "bytes_down", "params_up", "params_down", "flops_train", "flops_server"):
        if name in row:
            board.add_scalar(f"communication/{name}" if "flops" not in name else f"compute/{name}", row[name], step)
    board.flush()


def tensorboard_log(out: Path, warn: Callable[[str], None]) -> TensorBoardLog | None:
    """A :class:`TensorBoardLog` on ``out``, or None and one warning when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        warn("tensorboard=true but the tensorboard package is not installed; pip install tensorboard "
             "(this run continues without TensorBoard logs)")
        return None
    return TensorBoardLog(out, SummaryWriter)


class TSNEPlot(RoundObserver):
    """At the end of the run, ``tsne.png`` and ``tsne.npz`` in ``out`` (Figures 3, 6; :func:`write_tsne`)."""

    def __init__(self, out: Path, seed: int, title: str):
        self.out, self.seed, self.title = Path(out), seed, title

    def on_run_end(self) -> None:
        write_tsne(self.simulator, self.out, self.seed, self.title)


def write_tsne(simulator: InProcessEngine, out: Path, seed: int, title: str, per_test_set: int = 200) -> None:
    """``tsne.png`` and ``tsne.npz``: t-SNE of the global model's test features (colour = class, marker =
    test set), with the server's prototypes embedded alongside when the method has any (Figures 3, 6)."""
    features, labels, names = simulator.test_features(per_test_set)
    held = simulator.server_prototypes()
    points = features.numpy()
    prototype_classes = np.zeros(0, dtype=np.int64)
    kind = ""
    if held is not None:
        prototypes, mask, kind = held
        prototype_classes = mask.nonzero().squeeze(1).numpy()
        points = np.concatenate([points, prototypes[mask].cpu().numpy()])
    embedded = tsne_embedding(points, seed=seed)
    n = features.shape[0]
    plot_tsne(embedded[:n], labels.numpy(), names, out / "tsne.png", title=f"t-SNE of test features: {title}",
              prototype_points=embedded[n:], prototype_labels=prototype_classes,
              prototype_name={"hyper": "hyper-prototypes H", "global": "global prototypes"}.get(kind, "prototypes"))
    write_atomic_with(out / "tsne.npz", lambda handle: np.savez(
        handle, points=embedded[:n], labels=labels.numpy(), test_sets=np.asarray(names),
        prototype_points=embedded[n:], prototype_labels=prototype_classes))


def observers_for(options: RunOptions, out: Path, warn: Callable[[str], None], title: str,
                  config: Mapping[str, Any] | None = None) -> list[RoundObserver]:
    """The observers a run's options (:class:`~fedhpro.config.RunOptions`) switch on
    (:data:`fedhpro.config.OBSERVER_KEYS`): ``flops``, ``prototype_distance``, ``tensorboard`` (skipped
    with one warning if the package is missing) and ``tsne``, writing into ``out``; ``title`` names the run
    on the t-SNE plot; ``tracker`` (:mod:`fedhpro.trackers`) logs ``config`` (the resolved config) and the rows."""
    chosen = measurements(flops=options.flops, prototype_distance=options.prototype_distance)
    board, tracker = record_observers(options, out, warn, config)
    chosen += board
    if options.tsne:
        chosen.append(TSNEPlot(out, options.seed, title))
    return chosen + tracker


def record_observers(options: OutputOptions, out: Path, warn: Callable[[str], None],
                     config: Mapping[str, Any] | None = None) -> tuple[list[RoundObserver], list[RoundObserver]]:
    """The observers that read only the round records, so that every engine runs them (the Flower ServerApp
    too): ``tensorboard``, and ``tracker`` (:mod:`fedhpro.trackers`, logging ``config``), each a list of at most
    one."""
    board = tensorboard_log(out, warn) if options.tensorboard else None
    tracker = tracker_for(options, out, config or {}, out.name)
    return ([board] if board is not None else []), ([tracker] if tracker is not None else [])
