"""``fedhpro compare``: several methods on the same federation and seeds, one table in the paper's layout.

Every (method, seed) run gets its own folder under ``out``. A finished run is
reused and an interrupted one continues from its newest checkpoint, so an
interrupted comparison continues where it stopped, but only if
its ``config.yaml`` holds the settings asked for now (what decides the numbers:
the run keys but the presentational ones, the method's own options, data,
faults, partition); otherwise the comparison stops before it runs anything and
names the settings that differ, instead of mixing old numbers into a new
table. The table is written as ``table.md`` and ``table.csv``: accuracy per domain and
AVG, mean ± std over the seeds, and the difference of AVG to FedAvg (the
paper's Table A3 layout).
"""

from __future__ import annotations

import csv
import io
import json
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from fedhpro import api
from fedhpro.bounded import MAX_YAML_CHARS, load_yaml, read_bounded
from fedhpro.config import PRESENTATION_KEYS, load_config, numbers_settings, parse_override
from fedhpro.engines import checkpoint
from fedhpro.errors import ConfigError, FedHProError
from fedhpro.files import claim_run_folder
from fedhpro.methods import METHODS, method_names
from fedhpro.reports import write_atomic
from fedhpro.reports.plots import display_name
from fedhpro.sweeps import Failure, Sweep, SweepFailed, execute, make_sweep, sweep_options


def table_order(names: Iterable[str]) -> list[str]:
    """``names`` in the order of the paper's tables, as the registered methods declare it
    (:attr:`~fedhpro.methods.MethodSpec.paper_order`), the others (plug-ins, unknown names) after them by name."""
    def place(name: str) -> tuple[float, str]:
        spec = METHODS.get(name)
        order = spec.paper_order if spec is not None and spec.paper_order is not None else float("inf")
        return order, name
    return sorted(names, key=place)


def baseline_method() -> str | None:
    """The registered method a comparison's gain column is measured against (``MethodSpec.baseline``)."""
    return next((name for name, spec in METHODS.items() if spec.baseline), None)


def as_list(value: Any, key: str) -> list[str]:
    """A list-valued ``key=`` setting as strings: ``"a,b"``, ``"[a,b]"`` or a YAML list; a ConfigError if empty."""
    if isinstance(value, str):
        items = [item.strip() for item in value.strip("[]").split(",") if item.strip()]
    elif isinstance(value, (list, tuple)):
        items = [str(item) for item in value]
    else:
        items = [str(value)]
    if not items:
        raise ConfigError(f"{key} is empty; give e.g. {key}=[a,b]")
    return items


def run_settings(config: Mapping[str, Any], method: str) -> dict[str, Any]:
    """The part of a nested config (``Config.to_dict()`` / ``config.yaml``) that decides ``method``'s numbers.

    Presentational keys (``out``, ``progress``, ``device``, ...) and the other methods' sections are left out;
    equivalent values are spelt one way (:func:`fedhpro.config.numbers_settings`).
    """
    others = set(method_names())
    return {key: value for key, value in numbers_settings(config).items()
            if key not in PRESENTATION_KEYS and (key not in others or key == method)}


def _flat(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            # JSON's view: a tuple and the list YAML reads back are the same setting
            flat[f"{prefix}{key}"] = json.loads(json.dumps(value, default=str))
    return flat


_MISSING = object()


def setting_differences(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """``["rounds: 10 there, 20 asked", ...]`` for every dotted key whose values differ (or one side lacks)."""
    there, asked = _flat(stored), _flat(wanted)
    lines = []
    for key in sorted(set(there) | set(asked)):
        old, new = there.get(key, _MISSING), asked.get(key, _MISSING)
        if old != new:
            lines.append(f"{key}: {'not recorded' if old is _MISSING else repr(old)} there, "
                         f"{'not set' if new is _MISSING else repr(new)} asked")
    return lines


def check_stored_run(folder: Path, config) -> None:
    """Raise unless the run kept in ``folder`` (finished, or interrupted after a checkpoint) has
    ``config``'s settings."""
    finished = (folder / "summary.json").is_file()
    if not finished and checkpoint.latest(folder) is None:
        return  # nothing worth keeping: run_or_continue starts it again
    what = "a finished run" if finished else "an unfinished run"

    saved = folder / "config.yaml"
    try:
        stored = load_yaml(read_bounded(saved, MAX_YAML_CHARS, what="config.yaml"), "config.yaml")
        reason = None if isinstance(stored, dict) else "not a mapping of settings"
    except FedHProError as error:  # missing, unreadable, too large, past a bound of the YAML reader
        reason = str(error)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        reason = f"{getattr(error, 'problem', None) or 'invalid YAML'}" + (f" at line {mark.line + 1}" if mark else "")
    except (ValueError, OverflowError, TypeError) as error:  # a number past Python's digit limit
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:80]
    if reason is not None:
        raise ConfigError(f"{folder} holds {what} but its config.yaml cannot be read ({reason}); "
                          "delete that folder to run it again")
    method = config.run.method
    differences = setting_differences(run_settings(stored, method), run_settings(config.to_dict(), method))
    if differences:
        shown = "; ".join(differences[:4]) + (f"; and {len(differences) - 4} more" if len(differences) > 4 else "")
        raise ConfigError(f"{folder} holds {what} with other settings ({shown}); give another out= "
                          "or delete that folder to run it again")


def run_all(jobs: Sequence[tuple[Any, Path]]) -> Iterator[dict[str, Any]]:
    """The summary of each ``(config, folder)`` job, in order: read back, continued or run (``run_or_continue``).

    Every kept run is checked against its config before the first job runs, so a stale folder stops the
    whole sweep at once instead of after hours.
    """
    for config, folder in jobs:
        check_stored_run(folder, config)
    for config, folder in jobs:
        yield api.run_or_continue(config, folder)


def run_sweep(jobs: Sequence[tuple[Any, Path]], labels: Sequence[str], sweep: Sweep | None = None,
              echo: bool = True) -> tuple[list[dict[str, Any] | None], list[Failure]]:
    """Every ``(config, folder)`` job's summary (None where it failed) and the failures, run as ``sweep`` says.

    Sequential (``jobs=1``, the default): :func:`run_all`, one run after the other here, an error stops the
    sweep as it always did. Otherwise :func:`fedhpro.sweeps.execute`: the runs in workers, a failed run
    reported and the others finished. Kept runs are checked against their configs first in both.
    """
    sweep = sweep or Sweep()
    if sweep.sequential:
        return list(run_all(jobs)), []
    for config, folder in jobs:
        check_stored_run(folder, config)
    return execute(jobs, labels, sweep, api.run_or_continue, echo=echo)


def compare(methods: Sequence[str], seeds: Sequence[int], settings: Mapping[str, Any] | Sequence[str],
            out: str | Path, source: str | None = None, echo: bool = True, jobs: int = 1,
            executor: str = "local", ray_address: str | None = None) -> dict[str, Any]:
    """Run every method for every seed with the same ``settings`` and write the table; returns it as rows.

    ``jobs`` runs at a time in worker processes, or as Ray tasks with ``executor="ray"`` (``ray_address``:
    ``"auto"`` or ``"HOST:PORT"`` of a running cluster; None starts a local Ray); see :mod:`fedhpro.sweeps`.
    When runs fail, the table of those that finished is written and :class:`~fedhpro.sweeps.SweepFailed`
    lists the failed ones.
    """
    sweep = make_sweep(jobs, executor, ray_address)
    unknown = [m for m in methods if m not in method_names()]
    if unknown:
        raise ConfigError(f"unknown method {unknown[0]!r}; choose from: {', '.join(method_names())}")
    pairs = dict(settings) if isinstance(settings, Mapping) else dict(map(parse_override, settings))
    for forbidden in ("method", "seed", "out", "resume"):
        if forbidden in pairs:
            raise ConfigError(f"{forbidden}= is set by compare for each run; remove it")
    out = Path(out)
    runs = [(method, seed, out / f"{method}-seed{seed}") for method in methods for seed in seeds]
    # every config is resolved (and so validated) before any run starts
    tasks = [(load_config(source, {**pairs, "method": method, "seed": seed, "out": str(folder)}), folder)
             for method, seed, folder in runs]
    labels = [f"{method} seed {seed}" for method, seed, _ in runs]
    # the comparison's folder is this comparison's until it ends (its table is written there); each run's
    # own folder is claimed by the process that runs it (fedhpro.api.run_or_continue)
    with claim_run_folder(out):
        return _compare_claimed(runs, seeds, tasks, labels, sweep, out, echo)


def _compare_claimed(runs: list[tuple[str, int, Path]], seeds: Sequence[int], tasks: list[tuple[Any, Path]],
                     labels: list[str], sweep: Sweep, out: Path, echo: bool) -> dict[str, Any]:
    """:func:`compare`'s runs and table, once ``out`` is claimed."""
    if sweep.sequential:  # a line as each run ends, as always
        results: Iterable[dict[str, Any] | None] = run_all(tasks)
        failures: list[Failure] = []
    else:
        results, failures = run_sweep(tasks, labels, sweep, echo=echo)
    summaries: dict[str, list[dict[str, Any]]] = {}
    for (method, seed, _), summary in zip(runs, results):
        if summary is None:
            continue
        if summary["accuracy"] is None:  # no round evaluated (privacy.max_epsilon before round 0): no number
            if echo:
                print(f"{method:10s} seed {seed}: no round evaluated (left out of the table)", flush=True)
            continue
        summaries.setdefault(method, []).append(summary)
        if echo:
            print(f"{method:10s} seed {seed}: AVG {summary['accuracy']:.2f}", flush=True)
    table = _table(summaries, seeds) if summaries else {"markdown": "", "csv": ""}
    if summaries:
        write_atomic(out / "table.md", table["markdown"])
        write_atomic(out / "table.csv", table["csv"])
        if echo:
            print(table["markdown"])
            print(f"written: {out / 'table.md'}, {out / 'table.csv'}")
    if failures:
        raise SweepFailed(f"{len(failures)} of {len(runs)} runs failed"
                          + (" (the table holds those that finished)" if summaries else "") + ":\n  "
                          + "\n  ".join(failure.line() for failure in failures))
    return table


def _table(summaries: dict[str, list[dict[str, Any]]], seeds: Sequence[int]) -> dict[str, Any]:
    first = next(iter(summaries.values()))[0]
    domains = list(first["per_domain"])
    columns = domains + ["AVG"] if len(domains) > 1 else ["AVG"]

    def values(method: str, column: str) -> list[float]:
        return [s["accuracy"] if column == "AVG" else s["per_domain"][column] for s in summaries[method]]

    def cell(numbers: list[float]) -> str:
        spread = statistics.stdev(numbers) if len(numbers) > 1 else 0.0
        return f"{statistics.mean(numbers):.2f} ± {spread:.2f}"

    reference = baseline_method()
    baseline = statistics.mean(values(reference, "AVG")) if reference in summaries else None
    header = "| Methods | " + " | ".join(columns) + " | Δ |"
    lines = [header, "|---" * (len(columns) + 2) + "|"]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["method"] + [f"{c}_mean" for c in columns] + [f"{c}_std" for c in columns] + ["delta_avg"])
    for method in table_order(summaries):
        avg = statistics.mean(values(method, "AVG"))
        gain = None if baseline is None or method == reference else avg - baseline
        delta = "–" if gain is None else f"{gain:+.2f}"
        lines.append(f"| {method} | " + " | ".join(cell(values(method, c)) for c in columns) + f" | {delta} |")
        means = [statistics.mean(values(method, c)) for c in columns]
        stds = [statistics.stdev(values(method, c)) if len(values(method, c)) > 1 else 0.0 for c in columns]
        writer.writerow([method] + [f"{v:.4f}" for v in means + stds] + ["" if gain is None else f"{gain:.4f}"])
    caption = (f"Test accuracy (%) on {first['dataset']}, mean ± std over seeds {list(seeds)}; "
               f"Δ = AVG minus {display_name(reference) if reference else 'the baseline'}'s AVG.\n\n")
    return {"markdown": caption + "\n".join(lines) + "\n", "csv": buffer.getvalue()}


def main(arguments: Sequence[str]) -> int:
    """CLI: ``fedhpro compare [CONFIG.yaml] methods=[a,b] seeds=[0,1,2] out=DIR [jobs=N] [executor=local|ray]
    [ray.address=auto|HOST:PORT] KEY=VALUE ...``."""
    items = list(arguments)
    source = items.pop(0) if items and "=" not in items[0] else None
    pairs = dict(map(parse_override, items))
    methods = as_list(pairs.pop("methods", ",".join(table_order(METHODS))), "methods")  # every registered one
    seeds_raw = as_list(pairs.pop("seeds", "0,1,2"), "seeds")
    try:
        seeds = [int(s) for s in seeds_raw]
    except ValueError:
        raise ConfigError(f"seeds={seeds_raw} must be integers, e.g. seeds=[0,1,2]") from None
    out = pairs.pop("out", "runs/compare")
    sweep = sweep_options(pairs)
    compare(methods, seeds, pairs, out, source=source, jobs=sweep.jobs, executor=sweep.executor,
            ray_address=sweep.ray_address)
    return 0
