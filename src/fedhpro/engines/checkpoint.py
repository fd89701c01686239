"""Checkpoints: everything a run needs to continue exactly, in files ``torch.load(weights_only=True)`` reads.

A checkpoint holds the engine's state (the method's server state, every
client's persistent state and, with personal models, their weights), the
number of completed rounds, the metrics so far (as JSON text) and the RNG
states of Python, NumPy and torch. The simulator derives all its randomness
from (seed, round, client), so restoring these is enough for the resumed run
to produce the numbers an uninterrupted run produces.
"""

from __future__ import annotations

import errno
import os
import pickle
import random
import re
from pathlib import Path
from typing import Any, BinaryIO, cast

import numpy as np
import torch

from fedhpro.arrays import ArrayFileError, Bound, load_torch
from fedhpro.bounded import check_metrics_row, load_json
from fedhpro.errors import DataError
from fedhpro.files import strict_json, write_atomic_with

FORMAT_VERSION = 1
#: a per-round file's name, ``round-NNNNNN.pt`` (a run's checkpoints, a Flower node's client state)
_NAME = re.compile(r"^round-(\d{6})\.pt$")
#: the key of the engine's state in a checkpoint (``"simulator"`` in those of fedhpro 0.x before it, still read)
STATE = "state"
#: what every checkpoint holds (a file without one of them is damaged or not a fedhpro checkpoint)
_KEYS = ("format_version", "completed_rounds", STATE, "metrics", "rng")


class CheckpointWriteError(DataError):
    """A checkpoint could not be written (disk full, file too large, folder not writable): the earlier
    checkpoints are kept as they were, the message names the newest of them and how to continue."""

    def __init__(self, message: str, path: Path, previous: Path | None, error: OSError):
        super().__init__(message)
        self.path, self.previous, self.error = path, previous, error


class _RecordingWriter:
    """The file handle torch.save writes to, keeping the first OSError: torch's zip writer turns it into an
    opaque RuntimeError ("unexpected pos ..."); :func:`save` raises the disk's own error instead."""

    def __init__(self, handle: BinaryIO):
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as error:
            self.error = self.error or error
            raise

    def flush(self) -> None:
        self.handle.flush()


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def round_file(round: int) -> str:
    """The file name of round ``round``'s file: ``round-NNNNNN.pt``."""
    return f"round-{round:06d}.pt"


def rounds_in(folder: str | os.PathLike) -> list[int]:
    """The rounds of the ``round-NNNNNN.pt`` files in ``folder``, oldest first (none: no folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(int(match.group(1)) for match in map(_NAME.match, os.listdir(folder)) if match)


def _rng_states() -> dict[str, Any]:
    version, mt_state, gauss = random.getstate()
    name, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "python": {"version": version, "state": list(mt_state), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(position),
                  "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }


def _restore_rng(states: dict[str, Any]) -> None:
    python = states["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss"]))
    numpy_state = states["numpy"]
    np.random.set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["cached"]))
    torch.set_rng_state(states["torch"])


def save(run_dir: str | os.PathLike, completed_rounds: int, state: dict[str, Any],
         metrics: list[dict[str, Any]], keep: int = 2) -> Path:
    """Write ``checkpoints/round-NNNNNN.pt`` (the engine's ``state``, the rows so far, the RNGs) atomically
    and keep only the newest ``keep`` of them."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / round_file(completed_rounds)
    blob = {
        "format_version": FORMAT_VERSION,
        "completed_rounds": completed_rounds,
        STATE: state,
        "metrics": strict_json(metrics),
        "rng": _rng_states(),
    }
    previous = latest(run_dir)

    def write(handle: BinaryIO) -> None:
        writer = _RecordingWriter(handle)
        try:
            torch.save(blob, cast(BinaryIO, writer))  # it only writes and flushes
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise

    try:
        write_atomic_with(path, write)
    except OSError as error:  # write_atomic_with removed its temporary file: the earlier checkpoints stand
        raise CheckpointWriteError(_write_failed(path, previous, run_dir, error), path, previous, error) from None
    for old in rounds_in(folder)[:-max(keep, 1)]:
        (folder / round_file(old)).unlink()
    return path


def _write_failed(path: Path, previous: Path | None, run_dir: str | os.PathLike, error: OSError) -> str:
    """One line: which checkpoint could not be written and why, what was kept, how to continue."""
    reason = error.strerror or str(error) or type(error).__name__
    hint = {errno.ENOSPC: "free space", errno.EFBIG: "raise the file size limit (ulimit -f)",
            getattr(errno, "EDQUOT", -1): "free space within your quota", errno.EROFS: "make it writable",
            errno.EACCES: "make it writable", errno.EPERM: "make it writable"}.get(error.errno, "fix the disk")
    if previous is None:
        kept = "no earlier checkpoint exists; once fixed, delete the folder and start the run again"
    else:
        round_of = _NAME.match(previous.name)
        kept = (f"the newest good checkpoint, {previous} (round {int(round_of.group(1)) if round_of else '?'}), "
                f"is kept: {hint}, then continue with resume={run_dir}")
    return f"could not write checkpoint {path} ({reason}); the run stopped; {kept}"


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint of a run, or None."""
    found = rounds_in(checkpoint_dir(run_dir))
    return checkpoint_dir(run_dir) / round_file(found[-1]) if found else None


def saved_rounds(run_dir: str | os.PathLike) -> list[int]:
    """The completed rounds of the checkpoints a run keeps, oldest first (a run can go back to any of them)."""
    return rounds_in(checkpoint_dir(run_dir))


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint (tensors and plain containers only: ``weights_only=True``, never arbitrary pickled
    objects) and restore the RNGs. A file that cannot be read, declares more than ``FEDHPRO_MAX_STATE_BYTES``
    (:func:`fedhpro.arrays.load_torch`: checked before it is loaded), holds other objects, or lacks a fedhpro
    checkpoint's keys raises a one-line DataError naming the earlier checkpoints to resume from instead."""
    path = Path(path)
    try:
        blob = load_torch(path, Bound.state())
    except ArrayFileError as error:
        raise DataError(f"{error}; {_earlier(path)}") from None
    except pickle.UnpicklingError as error:
        if "global" in str(error).lower():  # weights_only refused a global: code, objects other than tensors
            raise DataError(_not_loadable(path, "it holds objects other than tensors, which are never "
                                                "unpickled")) from None
        raise DataError(_not_loadable(path, "it is truncated or not a torch file: UnpicklingError")) from None
    except OSError as error:
        raise DataError(_not_loadable(path, f"it cannot be read: {error.strerror or type(error).__name__}")) \
            from None
    except Exception as error:  # truncated, or not a torch file at all
        raise DataError(_not_loadable(path, f"it is truncated or not a torch file: {type(error).__name__}")) \
            from None
    if not isinstance(blob, dict):
        raise DataError(_not_a_checkpoint(path, f"it holds a {type(blob).__name__}, not a dict"))
    if STATE not in blob and "simulator" in blob:  # written before the key named no engine
        blob[STATE] = blob.pop("simulator")
    missing = [key for key in _KEYS if key not in blob]
    if missing:
        raise DataError(_not_a_checkpoint(path, f"no {missing[0]!r}"))
    if blob["format_version"] != FORMAT_VERSION:
        raise DataError(_not_a_checkpoint(path, f"format {blob['format_version']!r}, not {FORMAT_VERSION}"))
    if not isinstance(blob["completed_rounds"], int) or blob["completed_rounds"] < 0:
        raise DataError(_not_a_checkpoint(path, f"completed_rounds is {blob['completed_rounds']!r}"))
    damaged = (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError, OverflowError)
    try:
        metrics = load_json(blob["metrics"], "its metrics")
    except damaged:  # a LimitError past a bound included
        metrics = None
    if not isinstance(metrics, list) or not all(isinstance(row, dict) for row in metrics):
        raise DataError(_not_a_checkpoint(path, "its 'metrics' entry is damaged"))
    for number, row in enumerate(metrics, 1):  # they become the run's metrics.jsonl: checked as a report does
        try:
            check_metrics_row(row, f"row {number}")
        except DataError as error:
            raise DataError(_not_a_checkpoint(path, f"its metrics {str(error).split(';')[0]}")) from None
    try:
        rng = _checked_rng(blob["rng"])
    except damaged:
        raise DataError(_not_a_checkpoint(path, "its 'rng' entry is damaged")) from None
    _restore_rng(rng)
    blob["metrics"] = metrics
    return blob


def _checked_rng(states: Any) -> dict[str, Any]:
    """``states`` if it restores all three generators (tried on copies: nothing is changed here)."""
    python, numpy_state = states["python"], states["numpy"]
    random.Random().setstate((python["version"], tuple(python["state"]), python["gauss"]))
    np.random.RandomState().set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32),
                                       numpy_state["pos"], numpy_state["has_gauss"], numpy_state["cached"]))
    generator = torch.Generator()
    generator.set_state(states["torch"])
    return states


def _earlier(path: Path) -> str:
    """How to resume from the checkpoint before ``path`` (or that there is none)."""
    folder = path.parent
    others = sorted(p for p in folder.iterdir() if _NAME.match(p.name) and p.name < path.name) \
        if folder.is_dir() else []
    if not others:
        return "no earlier checkpoint is kept; start the run again"
    return (f"resume from an earlier one: move {path.name} out of {folder} and resume again "
            f"(the one before is {others[-1].name})")


def _not_a_checkpoint(path: Path, reason: str) -> str:
    return f"{path} is not a fedhpro checkpoint ({reason}); it may be from another version or damaged; " \
           + _earlier(path)


def _not_loadable(path: Path, reason: str) -> str:
    return f"checkpoint {path} cannot be loaded ({reason}); " + _earlier(path)
