"""summary.json of a finished run (:func:`run_summary`): its settings, the final and best accuracy, the
validation, unseen-client and per-site blocks, the privacy block (:func:`privacy_summary`), the machine and the
totals of the per-round measurements."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fedhpro import runtime
from fedhpro.config import RunOptions, channels_last_setting
from fedhpro.engines.interface import SIMULATOR, EngineKind


def privacy_summary(settings: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """summary.json's ``privacy``: the ledger's ``settings`` and the epsilon and delta of the last row (0 before
    any round)."""
    last = next((row["privacy"] for row in reversed(rows) if "privacy" in row), None)
    out = dict(settings)
    out["epsilon"] = float(last["epsilon"]) if last is not None else 0.0
    if last is not None:
        out["delta"] = float(last["delta"])
    out["rounds_run"] = len(rows)
    return out



def final_accuracy(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The accuracy of the last evaluated row; ``{"AVG": None}`` when no round had one (every evaluation lost,
    or ``privacy.max_epsilon`` stopped the run before its first round): summary.json stays strict JSON, which
    has no NaN."""
    return next((row["accuracy"] for row in reversed(rows) if "accuracy" in row), {"AVG": None})


def validation_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's ``validation`` (runs with ``validation=``; ``{}`` otherwise): the last evaluated round's
    accuracy on the clients' validation parts, and the model selection made on them: the round (0-based, as
    ``metrics.jsonl``) with the best validation AVG (the earliest of equals) and the test accuracy there,
    the figure to report when the best round is chosen (never the best test accuracy, which is chosen on the
    test set)."""
    validated = [row for row in rows if "validation" in row and "accuracy" in row]
    if not validated:
        return {}
    final = validated[-1]
    finite = [row for row in validated if _finite(row["validation"]["AVG"]) is not None]
    out: dict[str, Any] = {"accuracy": _finite(final["validation"]["AVG"]),
                           "per_domain": {k: v for k, v in final["validation"].items() if k != "AVG"}}
    if finite:
        best = max(finite, key=lambda row: row["validation"]["AVG"])  # max keeps the first of equals
        out.update({"best_round": best["round"], "best_accuracy": best["validation"]["AVG"],
                    "test_at_best": _finite(best["accuracy"]["AVG"])})
    return {"validation": out}


def unseen_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's ``unseen`` (runs with clients that never trained; ``{}`` otherwise): the last evaluated
    round's accuracy of the global model on them (``accuracy``: per test set and AVG) and, when they
    fine-tuned, ``finetuned``."""
    final = next((row for row in reversed(rows) if "unseen" in row), None)
    if final is None:
        return {}
    out: dict[str, Any] = {"accuracy": {k: _finite(v) for k, v in final["unseen"].items()}}
    if "unseen_finetuned" in final:
        out["finetuned"] = {k: _finite(v) for k, v in final["unseen_finetuned"].items()}
    return {"unseen": out}


def _finite(value: float | None) -> float | None:
    """``value``, or None for NaN and infinities (a round whose every client was untested has AVG NaN), which
    strict JSON cannot hold."""
    return value if value is not None and math.isfinite(value) else None


def site_accuracy(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """summary.json's ``site_accuracy``: the last evaluated round's ``client_accuracy`` (each client's accuracy
    on its own test distribution, in percent; None: a client not tested) as ``per_client``, and the unweighted
    ``mean`` and ``median`` over the ``tested`` clients (None when none was). The pooled ``accuracy`` weights
    every client by its test-set size, a size a client declares; these weight every tested client alike, so
    one client claiming a huge test set cannot carry them."""
    final: Mapping[str, Any] = next((row for row in reversed(rows) if "accuracy" in row), {})
    per_client = list(final.get("client_accuracy") or [])
    tested = [float(value) for value in per_client if value is not None]
    return {"mean": statistics.fmean(tested) if tested else None,
            "median": float(statistics.median(tested)) if tested else None,
            "tested": len(tested), "per_client": per_client}


def summary_measurements(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's share of the per-round measurements: final fairness (Table A8), parameters
    sent (Table 4's Upload) and, when counted, training FLOPs (Table 4)."""
    final: dict[str, Any] = next((row for row in reversed(rows) if "accuracy" in row), {})
    out: dict[str, Any] = {}
    if "fairness" in final:
        out["fairness"] = final["fairness"]
        out["client_accuracy"] = final["client_accuracy"]
    if all("params_up" in row for row in rows):
        out["params_up"] = sum(row["params_up"] for row in rows)
        out["params_down"] = sum(row["params_down"] for row in rows)
    if all("flops_train" in row for row in rows):
        out["flops_train"] = sum(row["flops_train"] for row in rows)
        out["flops_server"] = sum(row["flops_server"] for row in rows)
    return out


def run_summary(options: RunOptions, data_name: str, clients: int, device: torch.device | str,
                rows: list[dict[str, Any]], seconds: float, notes: list[str], from_python: bool = False,
                engine: EngineKind = SIMULATOR, models: Sequence[nn.Module] = ()) -> dict[str, Any]:
    """``summary.json`` of a finished run (``options``: its RunOptions): its settings, the final and best AVG
    (None when no round was evaluated), the final per-domain accuracy, the final per-client accuracies with
    their unweighted mean and median (:func:`site_accuracy`), the wall time, the machine and the totals of the
    per-round measurements; ``engine``: the kind of engine that ran it (one whose clients train outside this
    process is named in ``engine``), ``from_python`` data given from Python.

    ``machine`` (:func:`fedhpro.runtime.machine_record`): this process's CPU and its instruction sets, the GPU
    of a CUDA ``device``, torch's thread count now (call it inside the run's thread setting), the precision
    local training ran in on ``device`` and its memory format, resolved for ``models``, the models the clients
    train (``channels_last=auto`` with amp on depends on whether they have a Conv2d; without models it reads
    ``"auto"``). It describes the machine, not the result."""
    amp = str(getattr(options, "amp", "off"))
    machine = runtime.machine_record(
        device, runtime.amp_precision(amp, torch.device(device)),
        runtime.memory_format(channels_last_setting(getattr(options, "channels_last", "auto")), amp, models),
        # clients side by side: the in-process simulator's (a Flower node trains its own one at a time)
        parallel_clients=getattr(options, "parallel_clients", 1) if engine.in_process else 1)
    final = final_accuracy(rows)
    return {
        "method": options.method,
        "dataset": data_name,
        **({"data_source": "python"} if from_python else {}),
        "seed": options.seed,
        "rounds": options.rounds,
        "clients": clients,
        "accuracy": _finite(final["AVG"]),
        "per_domain": {name: value for name, value in final.items() if name != "AVG"},
        "best_accuracy": max((row["accuracy"]["AVG"] for row in rows
                              if "accuracy" in row and _finite(row["accuracy"]["AVG"]) is not None), default=None),
        **validation_summary(rows),
        **unseen_summary(rows),
        "site_accuracy": site_accuracy(rows),
        "seconds": seconds,
        "device": str(device),
        **({"engine": engine.name} if not engine.in_process else {}),
        "machine": machine,
        "bytes_up": sum(row["bytes_up"] for row in rows),
        "bytes_down": sum(row["bytes_down"] for row in rows),
        "notes": notes,
        **summary_measurements(rows),
    }
