"""``fedhpro compare``: several methods on the same federation and seeds, one table in the paper's layout.

Every (method, seed) run gets its own folder under ``out``. A finished run is
reused and an interrupted one continues from its newest checkpoint, so an
interrupted comparison continues where it stopped, but only if
its ``config.yaml`` holds the settings asked for now (what decides the numbers:
the run keys but the presentational ones, the method's own options, data,
faults, partition); otherwise the comparison stops before it runs anything and
names the settings that differ, instead of mixing old numbers into a new
table. The table is written as ``table.md`` and ``table.csv``: accuracy per domain and
AVG, the mean over the seeds with its 95 % t-interval, and the difference of AVG to FedAvg (the
paper's Table A3 layout); an AVG cell is marked best, or better / worse than FedAvg, only where paired t-tests
over the shared seeds say so after Holm's correction (:func:`fedhpro.reports.significance.verdicts`; none with
fewer than 3 seeds), as its caption says. ``table.csv`` keeps the mean and std columns and adds the intervals,
the p values and the marks. Its rows are in the order the methods were given (a default comparison's: the paper's),
named in ``table.md`` as the paper writes them (FedAvg, FedHPro) and in ``table.csv`` by their registered names;
its caption names the data set and the partition with its parameters. ``compare.json`` records that order
(``runs``: the run folders, in it) and, with ``tuned=``, each method's tuned settings and how they were tuned
(``tuned``) for ``fedhpro report``.

A key given several values where it takes one (``lr=[0.01,0.05]``) is a grid:
one row per method and point, named ``fedavg lr=0.05``. ``tuned=`` (the
``tuned.yaml`` of ``fedhpro tune``) runs each method at its tuned settings, on
seeds apart from the tuning's, and the table's caption says so.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import re
import statistics
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from fedhpro import api
from fedhpro.bounded import MAX_YAML_CHARS, load_yaml, read_bounded
from fedhpro.command_options.compare import CompareOptions
from fedhpro.command_options.keys import take
from fedhpro.config import PRESENTATION_KEYS, Config, load_config, numbers_settings, parse_override
from fedhpro.engines import checkpoint
from fedhpro.errors import ConfigError, FedHProError
from fedhpro.files import claim_run_folder, spreadsheet_cell
from fedhpro.methods import declared_method, method_declarations, method_names
from fedhpro.options import fields_of
from fedhpro.reports import significance, write_atomic, write_json
from fedhpro.reports.captions import data_sentence, data_text
from fedhpro.reports.plots import display_label, display_name, paper_order
from fedhpro.reports.runs import COMPARE_RECORD
from fedhpro.reports.significance import verdicts
from fedhpro.reports.tables import TEST_COLUMNS, interval_bounds, marked_cell, verdict_fields
from fedhpro.search_space import searched
from fedhpro.sweeps import Failure, Sweep, SweepFailed, execute, make_sweep, sweep_options


def table_order(names: Iterable[str]) -> list[str]:
    """``names`` in the order of the paper's tables, as the registered methods declare it
    (:attr:`~fedhpro.methods.MethodSpec.paper_order`), the others (plug-ins, unknown names) after them by name."""
    return paper_order(names)


def baseline_method() -> str | None:
    """The registered method a comparison's gain column is measured against (``MethodSpec.baseline``)."""
    return next((name for name, declaration in method_declarations().items() if declaration.baseline), None)


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


def declared_type(config: Config, key: str) -> Any:
    """The type ``key`` (``lr``, ``fedprox.mu``, ``data.domains``) is declared with in ``config``'s option groups;
    None for a key no group declares as a field (``data.clients_per_domain.mnist``)."""
    section, _, knob = key.rpartition(".")
    if not section:
        return fields_of(type(config.run)).get(key, (None, None))[1]
    group = config.sections().get(section)
    if group is None or knob not in fields_of(type(group)):
        return None
    return fields_of(type(group))[knob][1]


def _takes_a_list(tp: Any) -> bool:
    """Whether a value of the declared type ``tp`` may be a list (a list, a tuple, or a union holding one)."""
    if tp is None:
        return True  # not a declared field: the value is passed on as it is
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_takes_a_list(arg) for arg in typing.get_args(tp) if arg is not type(None))
    return False


def grid_points(pairs: Mapping[str, Any], source: str | None = None) -> list[dict[str, Any]]:
    """Every point of the grid ``pairs`` spans: a key given a list whose declared type is not a list (``lr=[0.01,
    0.05]``) takes each value in turn; keys whose values are lists (``data.domains``, ``data.mean``) stay as they
    are. No such key: one point, ``{}``. The points' keys in the order given, the last varying fastest."""
    scalars = {key: value for key, value in pairs.items() if not isinstance(value, list)}
    config = load_config(source, scalars)
    axes = [(key, value) for key, value in pairs.items()
            if isinstance(value, list) and not _takes_a_list(declared_type(config, key))]
    for key, values in axes:
        if not values:
            raise ConfigError(f"{key}=[] is empty; give one value or a list of values to compare, e.g. {key}=[a,b]")
    return [dict(zip([key for key, _ in axes], combination))
            for combination in itertools.product(*[values for _, values in axes])]


def point_name(point: Mapping[str, Any]) -> str:
    """A grid point as the table names it: ``lr=0.05 local_epochs=2`` (empty for no grid)."""
    return " ".join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
                    for key, value in point.items())


def read_tuned(path: str | os.PathLike) -> dict[str, Any]:
    """``tuned.yaml`` as ``fedhpro tune`` wrote it (``methods``: each method's settings; ``tuning``: how they
    were found), checked."""
    data = load_yaml(read_bounded(Path(path), MAX_YAML_CHARS, what=f"tuned= {path}"), str(path))
    if not isinstance(data, dict) or not isinstance(data.get("methods"), dict) \
            or not isinstance(data.get("tuning", {}), dict):
        raise ConfigError(f"{path} is not the tuned.yaml of fedhpro tune (no methods: mapping); give the tuned.yaml "
                          "`fedhpro tune out=DIR` wrote in DIR")
    return data


def tuned_settings(tuned: Mapping[str, Any], path: str | os.PathLike, methods: Sequence[str], seeds: Sequence[int],
                   pairs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each of ``methods``' settings in ``tuned`` (:func:`read_tuned`), checked against the comparison's: every
    method tuned, only keys ``fedhpro tune`` searches (:func:`fedhpro.search_space.searched`: a file handed over
    cannot set a tracker, an output or anything else), each one value, no key set both here and there, no seed the
    tuning ran at."""
    settings: dict[str, dict[str, Any]] = {}
    for method in methods:
        found = tuned["methods"].get(method)
        if not isinstance(found, dict):
            raise ConfigError(f"{method} is not in {path} (tuned: {', '.join(tuned['methods']) or 'none'}); tune it "
                              f"(fedhpro tune methods=[{method}] ...) or leave it out of methods=")
        allowed = searched(method, declared_method(method).options)
        for key, value in found.items():
            if key not in allowed:
                raise ConfigError(f"{path} sets {key}= for {method}, which fedhpro tune does not search (a tuned file "
                                  f"holds only {', '.join(allowed)}); remove it from the file, or give it here")
            if not isinstance(value, (bool, int, float, str)):
                raise ConfigError(f"{path} gives {key}= of {method} as {type(value).__name__}, not one value; give a "
                                  "number or a choice (as fedhpro tune writes it)")
        both = sorted(set(found) & set(pairs))
        if both:
            raise ConfigError(f"{both[0]}= is set by {path} for {method}; remove it (or compare without tuned=)")
        settings[method] = dict(found)
    tuning_seed = tuned.get("tuning", {}).get("seed")
    if tuning_seed is not None and int(tuning_seed) in [int(seed) for seed in seeds]:
        raise ConfigError(f"seed {tuning_seed} is the seed {path} was tuned at; compare on other seeds (e.g. "
                          "seeds=[0,1,2]) so the test runs are apart from the tuning's")
    return settings


def run_folder_name(method: str, point: Mapping[str, Any], seed: int) -> str:
    """``<method>-seed<seed>``, with a grid point's keys between: ``fedavg-lr=0.05-seed0``."""
    named = re.sub(r"[^A-Za-z0-9._=-]+", "_", point_name(point).replace(" ", "-"))
    return f"{method}-{named}-seed{seed}" if named else f"{method}-seed{seed}"


def compare(methods: Sequence[str], seeds: Sequence[int], settings: Mapping[str, Any] | Sequence[str],
            out: str | Path, source: str | None = None, echo: bool = True, jobs: int = 1,
            executor: str = "local", ray_address: str | None = None,
            tuned: str | os.PathLike | None = None) -> dict[str, Any]:
    """Run every method for every seed with the same ``settings`` and write the table; returns it as rows.

    A setting given a list of values where its key takes one (``lr=[0.01, 0.05]``) is a grid: every method runs
    at every point, one row per (method, point), named ``fedavg lr=0.05`` (:func:`grid_points`). ``tuned``: a
    ``tuned.yaml`` of ``fedhpro tune``; each method runs at its tuned settings (:func:`tuned_settings`) and the
    table's caption names them.

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
    tuned_data = read_tuned(tuned) if tuned is not None else None
    per_method: dict[str, dict[str, Any]] = {method: {} for method in methods}
    if tuned is not None and tuned_data is not None:
        per_method = tuned_settings(tuned_data, tuned, methods, seeds, pairs)
    points = grid_points(pairs, source)
    fixed = {key: value for key, value in pairs.items() if not any(key in point for point in points)}
    out = Path(out)
    runs = [(method, point, seed, out / run_folder_name(method, point, seed))
            for method in methods for point in points for seed in seeds]
    # every config is resolved (and so validated) before any run starts
    tasks = [(load_config(source, {**fixed, **per_method[method], **point, "method": method, "seed": seed,
                                   "out": str(folder)}), folder)
             for method, point, seed, folder in runs]
    labels = [f"{row_label(method, point)} seed {seed}" for method, point, seed, _ in runs]
    caption = "" if tuned is None or tuned_data is None else tuned_caption(tuned_data, tuned, per_method)
    # the comparison's folder is this comparison's until it ends (its table is written there); each run's
    # own folder is claimed by the process that runs it (fedhpro.api.run_or_continue)
    with claim_run_folder(out):
        # written first, so that the report of a comparison cut short still lists its methods as given
        record: dict[str, Any] = {"methods": list(methods), "seeds": [int(seed) for seed in seeds],
                                  "runs": [folder.name for *_, folder in runs]}
        if tuned is not None and tuned_data is not None:  # for fedhpro report, which names the tuned settings
            record["tuned"] = tuned_record(tuned_data, tuned, per_method)
        write_json(out / COMPARE_RECORD, record)
        return _compare_claimed([(row_label(m, p), m, seed, folder) for m, p, seed, folder in runs], seeds, tasks,
                                labels, sweep, out, echo, caption)


def row_label(method: str, point: Mapping[str, Any]) -> str:
    """A table row's name: the method, and its grid point if any (``fedavg lr=0.05``)."""
    return f"{method} {point_name(point)}".strip()


#: what of a tuned file's ``tuning:`` (how the settings were found) a comparison records for its report
TUNING_RECORDED = ("trials", "seed", "validation", "objective", "chosen", "outcomes")


def tuned_record(tuned: Mapping[str, Any], path: str | os.PathLike, per_method: Mapping[str, Mapping[str, Any]]
                 ) -> dict[str, Any]:
    """The ``tuned`` entry of :data:`~fedhpro.reports.runs.COMPARE_RECORD`: the tuned file, each method's settings
    run and how they were found (:data:`TUNING_RECORDED`), as JSON values."""
    how = tuned.get("tuning", {})
    return json.loads(json.dumps({"file": str(path), "methods": {m: dict(v) for m, v in per_method.items()},
                                  "tuning": {k: how[k] for k in TUNING_RECORDED if k in how}}, default=str))


def tuned_caption(tuned: Mapping[str, Any], path: str | os.PathLike, per_method: Mapping[str, Mapping[str, Any]]
                  ) -> str:
    """The caption's line saying the methods ran at their tuned settings, which, and how they were tuned."""
    how = tuned.get("tuning", {})
    shown = "; ".join(f"{method}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                               for k, v in values.items())
                      for method, values in per_method.items())
    if isinstance(how.get("chosen"), str):  # settings a study chose by other means, which its file says
        return f"Each method at its settings from {path} (not tuned here: {how['chosen']}): {shown}.\n\n"
    return (f"Each method at its tuned settings ({path}: fedhpro tune, {how.get('trials', '?')} trials each on "
            f"validation accuracy, validation={how.get('validation', '?')}, seed {how.get('seed', '?')}): {shown}.\n\n")


def _compare_claimed(runs: list[tuple[str, str, int, Path]], seeds: Sequence[int], tasks: list[tuple[Any, Path]],
                     labels: list[str], sweep: Sweep, out: Path, echo: bool, caption: str = "") -> dict[str, Any]:
    """:func:`compare`'s runs and table, once ``out`` is claimed."""
    if sweep.sequential:  # a line as each run ends, as always
        results: Iterable[dict[str, Any] | None] = run_all(tasks)
        failures: list[Failure] = []
    else:
        results, failures = run_sweep(tasks, labels, sweep, echo=echo)
    summaries: dict[str, list[dict[str, Any]]] = {label: [] for label, *_ in runs}  # the rows in the order given
    method_of: dict[str, str] = {}
    data: dict[str, str | None] = {}
    for (label, method, seed, folder), (config, _), summary in zip(runs, tasks, results):
        if summary is None:
            continue
        if summary["accuracy"] is None:  # no round evaluated (privacy.max_epsilon before round 0): no number
            if echo:
                print(f"{display_label(label):10s} seed {seed}: no round evaluated (left out of the table)", flush=True)
            continue
        summaries[label].append({**summary, "seed": int(seed)})  # the seed that pairs it in the table's tests
        method_of[label] = method
        data.setdefault(label, data_text(config.to_dict(), folder))
        if echo:
            print(f"{display_label(label):10s} seed {seed}: AVG {summary['accuracy']:.2f}", flush=True)
    summaries = {label: found for label, found in summaries.items() if found}
    table = _table(summaries, seeds, method_of, caption, data) if summaries else {"markdown": "", "csv": ""}
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


def _table(summaries: dict[str, list[dict[str, Any]]], seeds: Sequence[int], method_of: Mapping[str, str],
           caption: str = "", data: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """The table of ``summaries`` (row name -> its runs' summaries, in the order the rows are shown: the methods as
    given, a method's grid points as run; ``method_of``: each row's method; ``data``: each row's data set and
    partition in words, :func:`fedhpro.reports.captions.data_text`), Δ to the baseline method's first row.
    ``table.md`` names the rows as the paper writes the methods (``FedAvg lr=0.05``), ``table.csv`` by the
    registered names (``fedavg lr=0.05``), what scripts select rows by.

    Each cell is the mean over the row's seeds with its 95 % t-interval; the AVG column is tested
    (:func:`fedhpro.reports.significance.verdicts` over the seeds every row shares, paired by the seed each
    summary records: a row marked best, or better / worse than the baseline row, only after Holm's correction;
    nothing marked with fewer than 3 shared seeds), the domain columns get intervals only. ``table.csv`` keeps
    the mean and std columns, then Δ, then each column's interval bounds and AVG's p values and marks."""
    first = next(iter(summaries.values()))[0]
    domains = list(first["per_domain"])
    columns = domains + ["AVG"] if len(domains) > 1 else ["AVG"]

    def values(method: str, column: str) -> list[float]:
        return [s["accuracy"] if column == "AVG" else s["per_domain"][column] for s in summaries[method]]

    def by_seed(method: str, column: str) -> dict[int, float]:
        return {int(s["seed"]): value for s, value in zip(summaries[method], values(method, column))}

    rows = list(summaries)
    reference_method = baseline_method()
    reference = next((label for label in rows if method_of[label] == reference_method), None)
    # keyed by the names table.md shows, so that the caption names the baseline as the table does
    shown = {row: display_label(row) for row in rows}
    # every column is an accuracy in percent: the intervals stop at 0 and 100
    tested = {column: verdicts({shown[row]: by_seed(row, column) for row in rows},
                               baseline=shown[reference] if column == "AVG" and reference else None,
                               bounds=(0.0, 100.0))
              for column in columns}
    baseline = statistics.mean(values(reference, "AVG")) if reference is not None else None
    header = "| Methods | " + " | ".join(columns) + " | Δ |"
    lines = [header, "|---" * (len(columns) + 2) + "|"]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow([spreadsheet_cell(name) for name in
                     ["method"] + [f"{c}_mean" for c in columns] + [f"{c}_std" for c in columns] + ["delta_avg"]
                     + [f"{c}_ci_{end}" for c in columns for end in ("low", "high")]
                     + [f"AVG_{name}" for name in TEST_COLUMNS]])
    for method in rows:
        avg = statistics.mean(values(method, "AVG"))
        gain = None if baseline is None or method == reference else avg - baseline
        delta = "–" if gain is None else f"{gain:+.2f}"
        means = [statistics.mean(values(method, c)) for c in columns]
        cells = " | ".join(marked_cell(mean, tested[c].intervals[shown[method]],
                                       tested[c].mark(shown[method]) if c == "AVG" else "")
                           for c, mean in zip(columns, means))
        lines.append(f"| {display_label(method)} | {cells} | {delta} |")
        stds = [statistics.stdev(values(method, c)) if len(values(method, c)) > 1 else 0.0 for c in columns]
        bounds = [bound for c in columns for bound in interval_bounds(tested[c], shown[method])]
        p_raw, p_holm, mark = verdict_fields(tested["AVG"], shown[method])
        writer.writerow([spreadsheet_cell(method)] + [f"{v:.4f}" for v in means + stds]
                        + ["" if gain is None else f"{gain:.4f}"]
                        + ["" if bound is None else f"{bound:.4f}" for bound in bounds]
                        + ["" if p is None else f"{p:.6g}" for p in (p_raw, p_holm)] + [mark])
    named = (display_name(reference_method) if reference == reference_method else display_label(reference)) \
        if reference else None
    described = data_sentence({row: (data or {}).get(row) for row in rows}, [display_label(row) for row in rows])
    where = "" if described else f" on {first['dataset']}"  # the data sentence names the data set
    scope = (" Tested: the AVG column; the domain columns show intervals only." if len(columns) > 1 else "")
    columns_said = (" Each domain column: the accuracy on that domain's test set; AVG: their unweighted mean."
                    if len(columns) > 1 else "")
    caption = (f"Test accuracy (%){where}, mean over seeds {list(seeds)}; "
               f"Δ = AVG minus {named or 'the baseline'}'s AVG." + columns_said
               + (f" {described}" if described else "")
               + "\n\n" + significance.caption(tested["AVG"]) + scope + "\n\n") + caption
    return {"markdown": caption + "\n".join(lines) + "\n", "csv": buffer.getvalue()}


def main(arguments: Sequence[str]) -> int:
    """CLI: ``fedhpro compare [CONFIG.yaml] methods=[a,b] seeds=[0,1,2] out=DIR [tuned=DIR/tuned.yaml] [jobs=N]
    [executor=local|ray] [ray.address=auto|HOST:PORT] KEY=VALUE ...`` (a KEY=[v1,v2] of a one-value key: a grid)."""
    items = list(arguments)
    source = items.pop(0) if items and "=" not in items[0] else None
    pairs = dict(map(parse_override, items))
    options = take(CompareOptions, pairs)
    sweep = sweep_options(pairs)  # what stays in pairs: the run keys
    methods = options.methods if options.methods is not None else table_order(method_names())  # every registered one
    compare(methods, options.seeds, pairs, options.out, source=source, jobs=sweep.jobs, executor=sweep.executor,
            ray_address=sweep.ray_address, tuned=options.tuned)
    return 0
