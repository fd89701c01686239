"""A run folder read back (:class:`RunData`, :func:`load_run`) and how runs are told apart (:func:`run_labels`,
:data:`NOT_A_SETTING`): what the seed table and the parity table both build on."""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedhpro.bounded import check_metrics_row, read_json_file, read_yaml_file, run_file
from fedhpro.errors import ConfigError, DataError
from fedhpro.reports import read_jsonl
from fedhpro.reports.tables import dotted_keys

#: run settings that do not tell two runs of a comparison apart (each seed's run differs in them only; the
#: presentational ones)
NOT_A_SETTING = frozenset({"seed", "out", "resume", "progress", "threads", "parallel_clients", "device", "tensorboard",
                           "checkpoint_every", "checkpoint_minutes", "keep_checkpoints", "tracker", "tracker_uri",
                           "tracker_project"})


@dataclass
class RunData:
    """One finished (or running) run read back from its folder."""

    path: Path
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    summary: dict[str, Any] | None

    @property
    def method(self) -> str:
        return str(self.config.get("method", "?"))

    @property
    def evaluated(self) -> list[dict[str, Any]]:
        return [row for row in self.rows if "accuracy" in row]

    @property
    def final(self) -> dict[str, Any]:
        """The last evaluated row."""
        return self.evaluated[-1]

    @property
    def validated(self) -> bool:
        """Whether the run tested on validation parts held out of training (``validation=``)."""
        return any("validation" in row for row in self.evaluated)

    def test_at_best_validation(self) -> float | None:
        """The test AVG of the evaluated round with the best validation AVG (the earliest of equals): the
        model selected without looking at the test set; None without validation."""
        rows = [row for row in self.evaluated if "validation" in row and row["validation"]["AVG"] == row[
            "validation"]["AVG"]]  # NaN (no client validated) is never the best
        if not rows:
            return None
        return float(max(rows, key=lambda row: row["validation"]["AVG"])["accuracy"]["AVG"])

    @property
    def finished(self) -> bool:
        """Whether the run ended (it wrote ``summary.json``)."""
        return self.summary is not None

    @property
    def progress(self) -> str:
        """``"4/10 rounds, unfinished"`` for a run without ``summary.json`` (the planned rounds from its
        config.yaml, when there), ``""`` for a finished one."""
        if self.finished:
            return ""
        planned = self.config.get("rounds")
        return f"{len(self.rows)}/{planned if planned is not None else '?'} rounds, unfinished"


def load_run(path: str | Path) -> RunData:
    """Read ``config.yaml``, ``metrics.jsonl`` and (if there) ``summary.json`` of a run folder; one that is a
    symbolic link leading outside the folder is refused in one line (:func:`fedhpro.bounded.run_file`)."""
    path = Path(path)
    metrics = run_file(path, "metrics.jsonl")
    if not metrics.is_file():
        raise ConfigError(f"{str(path)!r} is not a run folder (no metrics.jsonl); give folders written by "
                          "`fedhpro run` (out=) or the out= folder of `fedhpro compare`")
    rows = read_jsonl(metrics)
    for number, row in enumerate(rows, 1):
        check_metrics_row(row, f"{metrics} row {number}")
    if not any("accuracy" in row for row in rows):
        raise ConfigError(f"{str(path)!r} has no evaluated round yet; wait for its first evaluation")
    config_path = run_file(path, "config.yaml")
    config = read_yaml_file(config_path, DataError) if config_path.is_file() else {}
    if config is not None and not isinstance(config, dict):
        raise DataError(f"{config_path} holds a YAML {type(config).__name__}, not a mapping of settings; it is "
                        "damaged: replace it or delete the run folder")
    summary_path = run_file(path, "summary.json")
    summary = read_json_file(summary_path, DataError) if summary_path.is_file() else None
    if summary is not None and not isinstance(summary, dict):
        raise DataError(f"{summary_path} holds a JSON {type(summary).__name__}, not an object; it is damaged: "
                        "delete it or the run folder")
    return RunData(path, config or {}, rows, summary)


def run_seed(run: RunData, index: int = 0) -> int:
    """The seed ``run`` ran at (its config.yaml's ``seed``), what pairs it with the other rows' runs in a paired
    test. A run that records none (a folder not written by fedhpro) gets a negative key from its folder's path,
    paired with no other run. ``index`` is unused (kept for callers that number their runs)."""
    del index
    seed = run.config.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:
        return seed
    return -1 - zlib.crc32(str(run.path.resolve()).encode())


def _strict_mode(values: Sequence[str]) -> str | None:
    """The value more of ``values`` hold than any other; None on a tie."""
    ranked = sorted(((values.count(v), v) for v in set(values)), reverse=True)
    return ranked[0][1] if len(ranked) == 1 or ranked[0][0] > ranked[1][0] else None


def run_labels(runs: Sequence[RunData]) -> list[str]:
    """The method names if they tell the runs apart, else the method plus the settings that differ
    between the runs (``fedhpro hpal_weight=0.0``); the folder names as the last resort.

    A setting's value held by most runs of the same method (more than any other value: among an
    ablation's variants, the unchanged one) is left out of their labels, so each variant is labelled by what
    it changes (``fedhpro``, ``fedhpro match_steps=0``); on a tie every run shows it."""
    methods = [run.method for run in runs]
    if len(set(methods)) == len(methods):
        return methods
    flats = [dotted_keys(run.config) for run in runs]
    keys = sorted({key for flat in flats for key in flat})
    shown = [{key: json.dumps(flat.get(key), default=str) for key in keys} for flat in flats]
    differing = [key for key in keys if key not in ("method", "out") and len({values[key] for values in shown}) > 1]
    labels = []
    for run, flat, values in zip(runs, flats, shown):
        peers = [other for other, peer in zip(shown, runs) if peer.method == run.method]
        own = [key for key in differing if ("." not in key or key.split(".")[0] in (run.method, "data", "partition"))
               and values[key] != _strict_mode([peer[key] for peer in peers])]
        labels.append(" ".join([run.method] + [f"{key.split('.', 1)[-1] if key.startswith(run.method + '.') else key}"
                                               f"={flat.get(key)}" for key in own]))
    return labels if len(set(labels)) == len(labels) else [run.path.name for run in runs]
