"""Convergence rates (the paper's Table A4): R_acc and the speed-up of rounds versus FedAvg."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def rounds_to_accuracy(rows: Iterable[dict[str, Any]], target: float, key: str = "AVG") -> int | None:
    """R_acc: the first round (1-based, as the paper counts) whose evaluated ``accuracy[key]`` is
    at least ``target`` percent; None if no evaluated round reaches it. ``rows`` are
    ``metrics.jsonl`` rows (rounds without evaluation are skipped)."""
    for row in rows:
        accuracy = row.get("accuracy")
        if accuracy is not None and accuracy[key] >= target:
            return int(row["round"]) + 1
    return None


def speedup(rounds: int | None, baseline_rounds: int | None) -> float | None:
    """Table A4's Delta_acc: ``(R_FedAvg - R_method) / R_FedAvg``, as a fraction (0.481 = 48.1 %
    fewer rounds; negative = slower). None when either never reached the accuracy."""
    if rounds is None or baseline_rounds is None or baseline_rounds <= 0:
        return None
    return (baseline_rounds - rounds) / baseline_rounds
