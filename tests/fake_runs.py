"""Finished run folders without training: what ``api.run_or_continue`` writes, with set final accuracies, for
the tests of tables (compare, report) that only read run folders."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml


def finished_run_writer(accuracy: Mapping[str, Sequence[float]]) -> Callable[[Any, Any], dict]:
    """A stand-in for ``api.run_or_continue``: a run of method ``m`` at seed ``s`` ends at ``accuracy[m][s]``
    on its one domain (mnist), 10 points above its first round; its metrics.jsonl, config.yaml and
    summary.json as the engine writes them."""

    def fake_run(config, folder) -> dict:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        final = accuracy[config.run.method][config.run.seed]
        rows = [{"round": r, "accuracy": {"mnist": value, "AVG": value}}
                for r, value in enumerate([final - 10.0, final])]
        (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (folder / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        summary = {"method": config.run.method, "dataset": config.run.dataset, "seed": config.run.seed,
                   "accuracy": final, "per_domain": {"mnist": final}}
        (folder / "summary.json").write_text(json.dumps(summary))
        return summary

    return fake_run
