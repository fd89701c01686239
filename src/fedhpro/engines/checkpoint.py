"""Checkpoints: everything a run needs to continue exactly, in files ``torch.load(weights_only=True)`` reads.

A checkpoint holds the simulator's state (the method's server state, every
client's persistent state and, with personal models, their weights), the
number of completed rounds, the metrics so far (as JSON text) and the RNG
states of Python, NumPy and torch. The simulator derives all its randomness
from (seed, round, client), so restoring these is enough for the resumed run
to produce the numbers an uninterrupted run produces.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedhpro.errors import DataError
from fedhpro.files import write_atomic_with

FORMAT_VERSION = 1
_NAME = re.compile(r"^round-(\d{6})\.pt$")


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


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


def save(run_dir: str | os.PathLike, completed_rounds: int, simulator_state: dict[str, Any],
         metrics: list[dict[str, Any]], keep: int = 2) -> Path:
    """Write ``checkpoints/round-NNNNNN.pt`` atomically and keep only the newest ``keep`` of them."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"round-{completed_rounds:06d}.pt"
    blob = {
        "format_version": FORMAT_VERSION,
        "completed_rounds": completed_rounds,
        "simulator": simulator_state,
        "metrics": json.dumps(metrics),
        "rng": _rng_states(),
    }
    write_atomic_with(path, lambda handle: torch.save(blob, handle))
    for old in sorted(p for p in folder.iterdir() if _NAME.match(p.name))[:-max(keep, 1)]:
        old.unlink()
    return path


def latest(run_dir: str | os.PathLike) -> Path | None:
    """The newest checkpoint of a run, or None."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return None
    found = sorted(p for p in folder.iterdir() if _NAME.match(p.name))
    return found[-1] if found else None


def saved_rounds(run_dir: str | os.PathLike) -> list[int]:
    """The completed rounds of the checkpoints a run keeps, oldest first (a run can go back to any of them)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    return sorted(int(match.group(1)) for match in map(_NAME.match, (p.name for p in folder.iterdir())) if match)


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint (tensors and plain containers only: ``weights_only=True``) and restore the RNGs."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file
        raise DataError(f"checkpoint {str(path)!r} cannot be read ({type(error).__name__}); "
                        "delete it to resume from the one before") from None
    if not isinstance(blob, dict) or blob.get("format_version") != FORMAT_VERSION:
        raise DataError(f"checkpoint {str(path)!r} is not a fedhpro checkpoint of format {FORMAT_VERSION}")
    _restore_rng(blob["rng"])
    blob["metrics"] = json.loads(blob["metrics"])
    return blob
