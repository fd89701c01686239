"""The runs of a part: every (scenario, row, seed), run or reused through the shared run loop
(:func:`fedhpro.compare.run_all`, or :func:`fedhpro.compare.run_sweep` with ``jobs=N`` / ``executor=ray``;
both check every kept run against its config before the first runs).

A run's folder is named by its method, a hash of the settings that decide its numbers and its seed, so
runs are shared between targets: Table A3's runs serve Table A4, A7, A8 and Figure 4.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhpro import api
from fedhpro.compare import check_stored_run, run_all, run_sweep
from fedhpro.config import PRESENTATION_KEYS, load_config, numbers_settings
from fedhpro.errors import ConfigError, DataError, FedHProError
from fedhpro.reports.runs import RunData, load_run
from fedhpro.reproduce.availability import filter_data_keys
from fedhpro.reproduce.table import slug
from fedhpro.reproduce.targets import Part
from fedhpro.sweeps import Sweep, SweepFailed


@dataclass
class PartResult:
    """A part's runs (none when it did not run: ``note`` says why; otherwise ``note`` is what the table says
    about its data, e.g. the fallback to digits-offline)."""

    part: Part
    note: str
    runs: dict[tuple[str, str], list[RunData]]  # (scenario label, variant label) -> one run per seed
    domains: list[str] = field(default_factory=list)


@dataclass
class Job:
    """One run to make: its place in the part, its config and its folder."""

    key: tuple[str, str]  # (scenario label, variant label)
    label: str  # how the progress line names it
    seed: int
    config: Any
    folder: Path


def identity(config) -> str:
    """A short hash of the settings that decide a run's numbers (every key but the presentational ones)."""
    values = {k: v for k, v in numbers_settings(config.to_dict()).items() if k not in PRESENTATION_KEYS}
    return hashlib.sha1(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:10]


def plan(part: Part, resolved: dict[str, Any], overrides: dict[str, Any], seeds: Sequence[int],
         runs_dir: Path) -> list[Job]:
    """Every run of ``part``, its config resolved (and so checked) before any of them runs."""
    jobs = []
    for scenario in part.scenarios:
        for variant in part.variants:
            settings = {**resolved, **scenario.settings, **variant.settings, **overrides, "method": variant.method}
            settings = filter_data_keys(settings, settings.get("dataset", "digits-offline"))[0]
            label = variant.label if len(part.scenarios) == 1 else f"{scenario.label} / {variant.label}"
            for seed in seeds:
                config = load_config(None, {**settings, "seed": seed, "progress": False})
                folder = runs_dir / f"{slug(config.run.method)}-{identity(config)}-seed{seed}"
                jobs.append(Job((scenario.label, variant.label), label, seed, config, folder))
    return jobs


def stopped_run(folder: Path) -> RunData:
    """A run that stopped without ``summary.json`` (its training diverged), read back as far as it got: its
    rows when it evaluated a round, else none (``finished`` is False either way)."""
    try:
        return load_run(folder)
    except ConfigError:  # no metrics.jsonl or no evaluated round yet
        return RunData(folder, {}, [], None)


def _run_tolerant(jobs: list[Job]):
    """Each job's summary in order, None for a run that stopped because its training diverged (every client
    failed in a round) instead of stopping the reproduction: the robustness study's attacked runs may stop
    that way, and the table counts them. A ConfigError or DataError still stops everything."""
    for job in jobs:
        check_stored_run(job.folder, job.config)
    for job in jobs:
        try:
            summary = api.run_or_continue(job.config, job.folder)
        except (ConfigError, DataError):
            raise  # a bad setting or data set stops the reproduction as anywhere else
        except FedHProError as error:  # "round N: every client failed; ..." (or one client's UpdateError)
            print(f"  {job.label:34s} seed {job.seed}: diverged ({error})", flush=True)
            yield None
        else:
            yield summary


def run_part(part: Part, resolved: dict[str, Any], note: str, overrides: dict[str, Any], seeds: Sequence[int],
             runs_dir: Path, echo: bool, sweep: Sweep | None = None, tolerate_diverged: bool = False) -> PartResult:
    """Run (or reuse) every run of ``part`` with its data settings ``resolved``; a line per run when ``echo``.

    ``sweep`` (default: one run after the other here) spreads the runs over worker processes or Ray
    (:mod:`fedhpro.sweeps`); a failed run there does not stop the others, and :class:`SweepFailed` lists the
    failures once all have ended. With ``tolerate_diverged`` a run whose training diverged is kept as it
    stopped (:func:`stopped_run`, not finished) and the others go on.
    """
    jobs = plan(part, resolved, overrides, seeds, runs_dir)
    sweep = sweep or Sweep()
    if sweep.sequential:
        summaries = (_run_tolerant(jobs) if tolerate_diverged
                     else run_all([(job.config, job.folder) for job in jobs]))
    else:
        reused = {job.folder for job in jobs if (job.folder / "summary.json").is_file()}
        results, failures = run_sweep([(job.config, job.folder) for job in jobs],
                                      [f"{job.label} seed {job.seed}" for job in jobs], sweep, echo=echo)
        if failures and not tolerate_diverged:
            raise SweepFailed(f"{part.name}: {len(failures)} of {len(jobs)} runs failed:\n  "
                              + "\n  ".join(failure.line() for failure in failures))
    runs: dict[tuple[str, str], list[RunData]] = {}
    for index, job in enumerate(jobs):
        summary: dict[str, Any] | None
        if sweep.sequential:
            was_reused = (job.folder / "summary.json").is_file()
            started = time.perf_counter()
            summary = next(summaries)  # continues an interrupted run from its newest checkpoint
            took = f"  ({time.perf_counter() - started:.0f} s)"
        else:
            was_reused, summary, took = job.folder in reused, results[index], ""
        if summary is None:  # diverged (tolerate_diverged; any other failure raised above)
            runs.setdefault(job.key, []).append(stopped_run(job.folder))
            continue
        if echo and was_reused:
            print(f"  {job.label:34s} seed {job.seed}: reused {job.folder}", flush=True)
        elif echo:
            shown = "no round evaluated" if summary["accuracy"] is None else f"AVG {summary['accuracy']:6.2f}"
            print(f"  {job.label:34s} seed {job.seed}: {shown}{took}", flush=True)
        runs.setdefault(job.key, []).append(load_run(job.folder))
    first = next((run for values in runs.values() for run in values if run.evaluated), None)
    domains = [d for d in first.final["accuracy"] if d != "AVG"] if first else []
    return PartResult(part, note, runs, domains)
