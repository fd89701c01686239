"""``reproduce()``: a target's runs, table and figures; ``main()``: its command line."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedhpro.command_options.keys import take
from fedhpro.command_options.reproduce import ReproduceOptions
from fedhpro.config import parse_override
from fedhpro.errors import ConfigError
from fedhpro.files import claim_run_folder
from fedhpro.reproduce import targets
from fedhpro.reproduce.availability import resolve_data
from fedhpro.reproduce.builders import build_table
from fedhpro.reproduce.emitter import emit
from fedhpro.reproduce.running import PartResult, run_part
from fedhpro.sweeps import make_sweep, sweep_options


def reproduce(name: str, scale: str = "paper", seeds: Sequence[int] | None = None, out: str | Path | None = None,
              overrides: dict[str, Any] | None = None, echo: bool = True, jobs: int = 1, executor: str = "local",
              ray_address: str | None = None) -> Path:
    """Run target ``name`` and write its table (Markdown, CSV) and figures (PNG) to ``out/<name>``; the runs
    go to ``out/runs`` (default ``out``: ``runs/reproduce/<scale>``). ``jobs`` runs at a time in worker
    processes, or as Ray tasks with ``executor="ray"`` (:mod:`fedhpro.sweeps`)."""
    sweep = make_sweep(jobs, executor, ray_address)
    target = targets.load_target(name, scale)
    seeds = list(seeds) if seeds is not None else target.seeds
    overrides = dict(overrides or {})
    for forbidden in ("method", "seed", "out", "resume"):
        if forbidden in overrides:
            raise ConfigError(f"{forbidden}= is set by reproduce for each run; remove it")
    root = Path(out) if out else Path("runs") / "reproduce" / scale
    started = time.perf_counter()
    if echo:
        print(f"{target.title} -- scale={scale}, seeds {seeds}", flush=True)
    folder = root / target.name
    with claim_run_folder(folder):  # its table and figures are this reproduce's until it ends
        results: list[PartResult] = []
        for part in target.parts:
            resolved, note = resolve_data(part.name, {**target.settings, **part.settings, **overrides}, scale)
            if resolved is None:
                print(f"fedhpro reproduce {target.name}: {note}", flush=True)
                results.append(PartResult(part, note, {}))
                continue
            if note and echo:
                print(f"  {part.name}: {note}", flush=True)
            results.append(run_part(part, resolved, note, overrides, seeds, root / "runs", echo, sweep,
                                    tolerate_diverged=target.layout in targets.TOLERATE_DIVERGED))
        emit(target, build_table(target, results), folder, scale=scale, seeds=seeds,
             notes=[r.note for r in results if r.note], started=started, echo=echo)
    return folder


def _list() -> int:
    print("reproduce targets (configs/paper/*.yaml):")
    for name in targets.available_targets():
        target = targets.load_target(name)
        data = sorted({p.settings.get("dataset", target.settings.get("dataset", "?")) for p in target.parts})
        print(f"  {name:10s} {target.title}  [data: {', '.join(data)}]")
    print("run: fedhpro reproduce NAME [scale=smoke] [seeds=[0,1,2]] [out=DIR] [jobs=N] [executor=ray] "
          "[KEY=VALUE ...]; NAME=all runs all")
    return 0


def main(arguments: Sequence[str]) -> int:
    """``fedhpro reproduce NAME|all|list [scale=paper|smoke] [seeds=[..]] [out=DIR] [jobs=N] [executor=local|ray]
    [ray.address=auto|HOST:PORT] [KEY=VALUE ...]`` (the command's keys:
    :class:`~fedhpro.command_options.reproduce.ReproduceOptions` and the sweep's)."""
    items = list(arguments)
    if not items or items[0] in ("list", "--list"):
        return _list()
    name = items.pop(0)
    pairs = dict(map(parse_override, items))
    options = take(ReproduceOptions, pairs)
    sweep = sweep_options(pairs)  # what stays in pairs: the run keys
    available = targets.available_targets()
    if name != "all" and name not in available:
        raise ConfigError(f"no reproduce target {name!r}; choose one of: {', '.join(available)}, all, list")
    for target in available if name == "all" else [name]:
        started = time.perf_counter()
        reproduce(target, options.scale, options.seeds, options.out, pairs, jobs=sweep.jobs,
                  executor=sweep.executor, ray_address=sweep.ray_address)
        print(f"fedhpro reproduce {target} scale={options.scale}: {time.perf_counter() - started:.0f} s",
              flush=True)
    return 0
