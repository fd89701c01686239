"""``fedhpro report RUN_DIR...``: tables and plots from finished runs (their ``metrics.jsonl``), or from the folder
of a comparison (``fedhpro compare``'s ``out``, a folder of run folders): see :func:`report_seeds`.

Written to ``out`` (default: the first run's parent folder, ``report/``): ``table.md`` and
``table.csv`` (final accuracy per domain and AVG, best AVG, fairness of Table A8, bytes and
parameters sent per round, FLOPs if counted), ``accuracy.png`` (AVG per round, one line per
run), ``gm_loss.png`` (FedHPro's L_GM before and after matching, Figure 4), ``fairness.png``
(Table A8 as bars) and ``prototype_distance.png`` (Figure 2) when the runs hold those metrics,
and ``report.json`` (the runs it was built from). A run without ``summary.json`` (interrupted, or
still running) is marked in its label ("4/10 rounds, unfinished") and in a note under the table. An
``out`` that holds a report of other runs is not overwritten unless ``force`` is given.

Comparison folders whose runs were trained at more than one precision (``amp=off`` and ``amp=bf16``) also give
the float32-against-bf16 parity table (``parity.md``, ``.csv``, ``.json``: :mod:`fedhpro.reports.parity`), and
a folder of such folders (``study/<setting>/<precision>/``) stands for all the comparison folders below it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedhpro.bounded import (
    MAX_JSON_CHARS,
    parse_json,
    read_bounded,
    read_json_file,
    read_yaml_file,
    run_file,
)
from fedhpro.errors import ConfigError, DataError, FedHProError
from fedhpro.reports import significance, write_atomic, write_json
from fedhpro.reports.captions import data_sentence, data_text
from fedhpro.reports.classes import CLASS_FILES, write_class_report
from fedhpro.reports.parity import PARITY_FILES, mixes_precisions, pair_precisions, write_parity
from fedhpro.reports.plots import (
    display_label,
    display_name,
    is_baseline,
    mean_band,
    paper_order,
    plot_bars,
    plot_curves,
    plot_mean_curves,
)
from fedhpro.reports.run_data import NOT_A_SETTING, RunData, load_run, run_labels, run_seed
from fedhpro.reports.significance import Verdicts, verdicts
from fedhpro.reports.tables import (
    TEST_COLUMNS,
    csv_text,
    dotted_keys,
    interval_bounds,
    markdown_table,
    marked_cell,
    mean_std,
    verdict_fields,
)


def accuracy_series(run: RunData, key: str = "AVG") -> tuple[list[int], list[float]]:
    rows = run.evaluated
    return [row["round"] + 1 for row in rows], [row["accuracy"][key] for row in rows]


def avg_title(runs: Sequence[RunData]) -> str:
    """What the report's curves show: "AVG over domains" where the runs have several test sets, else the one
    test set's name (a single-domain run's AVG is that domain's accuracy)."""
    names = {name for run in runs for row in run.evaluated[:1] for name in row["accuracy"] if name != "AVG"}
    if len(names) == 1:
        return f"test accuracy ({next(iter(names))})"
    return "test accuracy (AVG over domains)"


def gm_series(run: RunData) -> dict[str, tuple[list[int], list[float]]]:
    """L_GM before and after the M matching steps per round (Figure 4); empty if the run has none."""
    rows = [row for row in run.rows if "gm_loss_before" in row.get("server", {})]
    if not rows:
        return {}
    rounds = [row["round"] + 1 for row in rows]
    return {"before": (rounds, [row["server"]["gm_loss_before"] for row in rows]),
            "after": (rounds, [row["server"]["gm_loss_after"] for row in rows])}


def prototype_series(run: RunData) -> dict[str, tuple[list[int], list[float]]]:
    """Figure 2: L2 distance to the centralized prototypes per evaluated round, by source."""
    rows = [row for row in run.rows if "prototype_distance" in row]
    out: dict[str, tuple[list[int], list[float]]] = {}
    for source in ("server", "clients_mean"):
        points = [(row["round"] + 1, row["prototype_distance"][source]["l2"])
                  for row in rows if source in row["prototype_distance"]]
        if points:
            kind = rows[0]["prototype_distance"].get("server", {}).get("kind", "") if source == "server" else ""
            name = {"hyper": "hyper-prototypes H",
                    "global": "global prototypes P"}.get(kind, "mean of client class means")
            out[name] = ([p[0] for p in points], [p[1] for p in points])
    return out


#: the files a report writes (``report.json`` names its runs)
REPORT_FILES = ("table.md", "table.csv", "accuracy.png", "gm_loss.png", "fairness.png", "prototype_distance.png",
                "report.json", *CLASS_FILES, *PARITY_FILES)


def _report_sources(runs: Sequence[RunData]) -> list[str]:
    """The runs of a report as ``report.json`` records them: their resolved folders, sorted."""
    return sorted(str(run.path.resolve()) for run in runs)


def prepare_report_folder(out: Path, runs: Sequence[RunData], force: bool = False) -> None:
    """Make ``out`` ready for the report of ``runs``: its earlier report files are removed if that report
    was of the same runs (a refresh) or ``force`` is given; a one-line ConfigError naming the fix if it
    holds a report of other runs (or one that does not say which), or is a run folder."""
    if (out / "metrics.jsonl").exists() or (out / "summary.json").exists():
        raise ConfigError(f"out={out} is a run folder; give the report another out=DIR")
    held = [name for name in REPORT_FILES if (out / name).exists()]
    if not held:
        return
    record = out / "report.json"
    try:
        earlier = sorted(parse_json(read_bounded(record, MAX_JSON_CHARS), str(record)).get("runs", [])) \
            if record.is_file() else None
    except (FedHProError, ValueError, AttributeError, TypeError):  # not a report's record: another report
        earlier = None
    if earlier != _report_sources(runs) and not force:
        what = (f"the report of {', '.join(Path(path).name for path in earlier[:3])}"
                f"{' and more' if len(earlier) > 3 else ''}" if earlier else f"another report ({held[0]})")
        raise ConfigError(f"out={out} already holds {what}; give another out=DIR, or force=true to replace it")
    for name in held:
        (out / name).unlink()


def is_run_folder(path: Path) -> bool:
    """Whether ``path`` is a run's folder (it has ``metrics.jsonl``)."""
    return (path / "metrics.jsonl").is_file()


def runs_in(folder: Path) -> list[Path]:
    """The run folders directly in ``folder`` (a comparison's ``out``: ``<method>-seed<seed>/``), sorted by name;
    hidden folders and others (``report/``) are passed by."""
    if not folder.is_dir() or is_run_folder(folder):
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".") and is_run_folder(p))


#: the record ``fedhpro compare`` leaves in its folder: its methods, seeds and run folders in the order given
COMPARE_RECORD = "compare.json"


def recorded_order(comparison: Path) -> list[str] | None:
    """The run folders of ``comparison`` in the order its ``fedhpro compare`` was given the methods (its
    :data:`COMPARE_RECORD`); None when it has none (a comparison of an older fedhpro, a folder made by hand)."""
    path = run_file(comparison, COMPARE_RECORD)
    if not path.is_file():
        return None
    record = read_json_file(path, DataError)
    names = record.get("runs") if isinstance(record, dict) else None
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise DataError(f"{path} is not the record of fedhpro compare (no runs: list of folder names); delete it, "
                        "and the report lists the methods in the paper's order")
    return names


#: the most methods, settings per method and characters per value a report names from a tuning's record (it is
#: read within fedhpro's bounds; what it shows stays a caption's length)
MAX_TUNED_METHODS, MAX_TUNED_KEYS, MAX_TUNED_TEXT = 32, 16, 60
#: the most characters of the tuned file's path a report shows
MAX_PATH_TEXT = 300


def _short_text(value: Any, limit: int = MAX_TUNED_TEXT) -> str:
    """A recorded value as a caption shows it: a float with 4 significant digits, anything else as one line of
    at most ``limit`` characters."""
    if isinstance(value, float):
        return f"{value:.4g}"
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _tuned_record(record: Mapping[str, Any], where: Path) -> tuple[Any, Any, str]:
    """``(methods, tuning, file)`` of a comparison record's ``tuned`` entry; the settings read from the tuned
    file it names when the record holds none (a DataError line when that file cannot be read)."""
    entry = record["tuned"]
    file = _short_text(entry.get("file", "?"), MAX_PATH_TEXT) if isinstance(entry, dict) else "?"
    if isinstance(entry, dict) and isinstance(entry.get("methods"), dict):
        return entry["methods"], entry.get("tuning"), file
    named = entry.get("file") if isinstance(entry, dict) else None
    if not isinstance(named, str):
        raise DataError(f"{where} records tuned runs but neither their settings nor their tuned file")
    data = read_yaml_file(Path(named), DataError)
    if not isinstance(data, dict) or not isinstance(data.get("methods"), dict):
        raise DataError(f"{named} is not the tuned.yaml of fedhpro tune (no methods: mapping)")
    return data["methods"], data.get("tuning"), file


def _tuned_note(folder: Path, members: Sequence[RunData]) -> str | None:
    """The line naming the tuned settings of ``members`` (runs of the comparison in ``folder``), from its
    :data:`COMPARE_RECORD`; None when that comparison ran no tuned settings."""
    try:
        path = run_file(folder, COMPARE_RECORD)
        if not path.is_file():
            return None
        record = read_json_file(path, DataError)
        if not isinstance(record, dict) or "tuned" not in record:
            return None
        methods, tuning, file = _tuned_record(record, path)
    except (FedHProError, OSError, ValueError, TypeError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        return f"Tuned settings not named: {reason}."
    tuning = tuning if isinstance(tuning, dict) else {}
    names = list(dict.fromkeys(run.method for run in members))[:MAX_TUNED_METHODS]
    shown = []
    for method in names:
        values = methods.get(method)
        if not isinstance(values, dict):
            shown.append(f"{display_name(method)}: not recorded")
            continue
        pairs = list(values.items())
        text = ", ".join(f"{_short_text(key)}={_short_text(value)}" for key, value in pairs[:MAX_TUNED_KEYS])
        outcome = (tuning.get("outcomes") or {}).get(method) if isinstance(tuning.get("outcomes"), dict) else None
        summary = outcome.get("summary") if isinstance(outcome, dict) else None  # "5 trials: 3 complete, 2 diverged"
        shown.append(f"{display_name(method)}: {text or 'the defaults'}"
                     + (f" and {len(pairs) - MAX_TUNED_KEYS} more" if len(pairs) > MAX_TUNED_KEYS else "")
                     + (f" (of {_short_text(summary)})" if isinstance(summary, str) else ""))
    if isinstance(tuning.get("chosen"), str):  # settings chosen by other means, as the file says
        return (f"Tuned settings: each method at its settings from {file} (not tuned by fedhpro tune: "
                f"{_short_text(tuning['chosen'])}): {'; '.join(shown)}.")
    budget = [f"{_short_text(tuning['trials'])} trials per method" if "trials" in tuning else "trials not recorded",
              f"objective: {_short_text(tuning['objective'])}" if "objective" in tuning else None,
              f"validation={_short_text(tuning['validation'])}" if "validation" in tuning else None,
              f"tuning seed {_short_text(tuning['seed'])}" if "seed" in tuning else "tuning seed not recorded"]
    return (f"Tuned settings: each method ran at the settings fedhpro tune chose on the clients' validation parts "
            f"({file}: {', '.join(part for part in budget if part)}), on seeds apart from the tuning's: "
            f"{'; '.join(shown)}.")


def tuned_notes(runs: Sequence[RunData]) -> list[str]:
    """One line per comparison among ``runs``' folders that ran tuned settings (``fedhpro compare tuned=``): each
    method's tuned settings, the tuning budget and seed, as the comparison recorded them; a record that cannot
    be read is one line saying so (never an error: the table does not depend on it)."""
    lines = []
    for folder in dict.fromkeys(run.path.parent for run in runs):
        note = _tuned_note(folder, [run for run in runs if run.path.parent == folder])
        if note:
            lines.append(note)
    return lines


def in_given_order(comparison: Path, runs: Sequence[RunData]) -> list[RunData]:
    """The runs of ``comparison`` in the order its methods were given (:func:`recorded_order`); runs it does not
    record (all of them, without a record) after those, in the paper's order of their methods, then by folder."""
    place = {name: index for index, name in enumerate(recorded_order(comparison) or [])}
    paper = {method: index for index, method in enumerate(paper_order(list(dict.fromkeys(run.method
                                                                                         for run in runs))))}
    return sorted(runs, key=lambda run: (place.get(run.path.name, len(place)), paper[run.method], run.path.name))


def data_title(title: str, described: Mapping[str, str | None]) -> str:
    """A figure's ``title``, and below it the data set and partition when every curve shares them (the caption
    of ``table.md`` says each where they differ)."""
    texts = set(described.values())
    return f"{title}\n{texts.pop()}" if len(texts) == 1 and None not in texts else title


#: how deep below a given folder :func:`comparisons_below` looks (``study/<setting>/<precision>/`` is 2)
STUDY_DEPTH = 3


def comparisons_below(folder: Path, depth: int = STUDY_DEPTH) -> list[Path]:
    """The comparison folders (folders of run folders) below ``folder``, at most ``depth`` levels down, sorted;
    run folders and hidden folders are not entered. ``[]`` for a folder that holds runs itself."""
    if depth <= 0 or not folder.is_dir() or is_run_folder(folder) or runs_in(folder):
        return []
    found: list[Path] = []
    for child in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if is_run_folder(child):
            continue
        found += [child] if runs_in(child) else comparisons_below(child, depth - 1)
    return found


def report(run_dirs: Sequence[str | Path], out: str | Path | None = None, echo: bool = True,
           force: bool = False, class_accuracy: Callable[[Path], Mapping[str, Any]] | None = None,
           class_options: Mapping[str, Any] | None = None) -> Path:
    """Build the table and the plots of ``run_dirs``; returns the output folder.

    A folder of run folders (``fedhpro compare``'s ``out``) among ``run_dirs`` gives the report over seeds
    (:func:`report_seeds`) of all the runs given; run folders alone, one line per run. A folder holding
    comparison folders below it (:func:`comparisons_below`) stands for them.

    One naming and one order in every table and figure: the methods as the paper writes them (FedAvg, FedHPro;
    ``table.csv`` keeps the registered names, what scripts select rows by), in the order given: the run folders
    as ``run_dirs`` lists them, a comparison's runs as its methods were given (:func:`in_given_order`). The
    captions name the data set and the partition with its parameters
    (:func:`fedhpro.reports.captions.data_sentence`), each where the runs differ in them.

    When the comparisons' runs were trained at more than one precision (``amp``), the report also pairs each
    setting's float32 and mixed-precision runs (:func:`fedhpro.reports.parity.pair_precisions`: refused in one
    line when folders differ besides the precision) and writes ``parity.md``, ``.csv`` and ``.json``; its
    default ``out`` is then ``<the folder the given ones share>/report``.

    ``out`` (default ``<first run's parent>/report``, or ``<comparison folder>/report``) may hold an earlier
    report of the same runs (it is replaced); one of other runs is refused unless
    ``force`` (:func:`prepare_report_folder`). Unfinished runs are marked.

    ``class_accuracy`` (``fedhpro report ... per_class=true`` passes :func:`fedhpro.trained.class_accuracy`):
    each run's per-class test counts, from its folder; with it the report adds ``per_class.md``, ``.csv`` and
    ``.png`` (:func:`fedhpro.reports.classes.write_class_report`): head / middle / tail and per-class accuracy;
    ``class_options``: that function's keyword options (``fedhpro report``'s keys for it).

    Runs of a comparison made with ``tuned=`` (``fedhpro compare tuned=...``): ``table.md`` and ``per_class.md``
    name each method's tuned settings, the tuning budget and seed (:func:`tuned_notes`).
    """
    if not run_dirs:
        raise ConfigError("give at least one run folder: fedhpro report RUN_DIR [RUN_DIR ...] [out=DIR]")
    groups: list[Path] = []
    runs: list[RunData] = []
    for given in map(Path, run_dirs):  # the runs in the order given, a comparison's as its methods were
        for comparison in comparisons_below(given) or [given]:
            inside = runs_in(comparison)
            if inside:
                groups.append(comparison)
                runs += in_given_order(comparison, [load_run(path) for path in inside])
            else:
                runs.append(load_run(comparison))  # it says what is wrong with a folder that is not a run's
    # refused (one line) before anything is written when the folders differ besides the precision
    parity = pair_precisions(runs) if groups and mixes_precisions(runs) else None
    # an unfinished run has no saved model yet: left out of the per-class tables (and named there)
    measured = ({run.path: class_accuracy(run.path) for run in runs if run.finished}
                if class_accuracy is not None else None)
    if groups:
        first = Path(run_dirs[0])
        if out is None and parity is not None:  # the report of several settings: beside them, not in one
            out = Path(os.path.commonpath([str(Path(given).resolve()) for given in run_dirs])) / "report"
        home = first if first in groups or comparisons_below(first) else first.parent
        written = report_seeds(runs, Path(out) if out else home / "report", echo=echo, force=force)
        if parity is not None:
            write_parity(written, parity, echo=echo)
        by_label = seed_groups(runs)
    else:
        written = _report_runs(runs, out, echo, force)
        by_label = {label: [run] for label, run in zip(run_labels(runs), runs)}
    if measured is not None:
        left_out = [run.path.name for run in runs if run.path not in measured]
        tested = {label: [(run.path, measured[run.path]) for run in members if run.path in measured]
                  for label, members in by_label.items()}
        notes = [f"left out, unfinished (no saved model yet): {', '.join(left_out)}"] if left_out else []
        files = write_class_report(written, {label: members for label, members in tested.items() if members},
                                   echo=echo, notes=notes + tuned_notes(runs), **dict(class_options or {}))
        if echo:
            print(f"written to {written}/: {', '.join(files)}")
    return written


#: what the single-run table's columns beyond the splits (:func:`splits_caption`) hold
RUN_COLUMNS_CAPTION = ("run: the run's method (and the settings that tell the runs apart); rounds: the rounds it "
                       "logged; accuracy across its clients at the last evaluated round: worst 10% / best 10%, the "
                       "mean accuracy of the tenth of clients with the lowest / highest accuracy (at least one "
                       "client), client mean, their mean, variance, their population variance (%²); MB up/round: "
                       "megabytes (10^6 bytes) all clients sent to the server per round; params up/round: the "
                       "model parameters they sent per round; GFLOPs train/round: 10^9 floating-point "
                       "operations of all clients' local training per round (– where not counted).")


def _report_runs(runs: list[RunData], out: str | Path | None, echo: bool, force: bool) -> Path:
    """:func:`report` of run folders: one table row and one curve per run."""
    labels = [f"{label} ({run.progress})" if run.progress else label for label, run in zip(run_labels(runs), runs)]
    out = Path(out) if out else runs[0].path.parent / "report"
    prepare_report_folder(out, runs, force)
    domains = [name for name in runs[0].final["accuracy"] if name != "AVG"]
    validated = any(run.validated for run in runs)
    header = ["run"] + domains + ["AVG", "best AVG", "rounds", "worst 10%", "best 10%", "client mean",
                                  "variance", "MB up/round", "params up/round", "GFLOPs train/round"]
    if validated:
        header[len(domains) + 3:len(domains) + 3] = VALIDATION_COLUMNS
    rows = []
    for label, run in zip(labels, runs):
        final = run.final
        fairness = final.get("fairness", {})
        rounds = len(run.rows)
        flops = [row["flops_train"] for row in run.rows if "flops_train" in row]
        chosen = ([final.get("validation", {}).get("AVG"), run.test_at_best_validation()] if validated else [])
        rows.append([display_label(label)] + [final["accuracy"].get(d) for d in domains] + [
            final["accuracy"]["AVG"], max(row["accuracy"]["AVG"] for row in run.evaluated), *chosen, rounds,
            fairness.get("worst_10"), fairness.get("best_10"), fairness.get("mean"), fairness.get("variance"),
            sum(row.get("bytes_up", 0) for row in run.rows) / rounds / 1e6,
            (sum(row.get("params_up", 0) for row in run.rows) / rounds) if "params_up" in run.rows[0] else None,
            (sum(flops) / len(flops) / 1e9) if flops else None])
    described = {label: data_text(run.config, run.path) for label, run in zip(labels, runs)}
    data = data_sentence(described, [display_label(label) for label in labels])
    caption = (f"Final test accuracy (%) of {len(runs)} run(s), one row each (no seeds pooled, so no interval or "
               "test). " + (f"{data} " if data else "")
               + splits_caption(validated, any(run.config.get("client_test") == "matched" for run in runs))
               + " " + RUN_COLUMNS_CAPTION + "".join(f"\n\n{line}" for line in tuned_notes(runs)))
    notes = [f"{display_label(label)}: no summary.json, the numbers are those of its last evaluated round (round "
             f"{run.final['round'] + 1})" for label, run in zip(labels, runs) if not run.finished]
    write_atomic(out / "table.md", markdown_table(header, rows, caption, notes))
    # the CSV names each run by its registered method, what scripts select rows by
    write_atomic(out / "table.csv", csv_text(header, [[label, *row[1:]] for label, row in zip(labels, rows)]))
    written = ["table.md", "table.csv"]
    plot_curves({label: accuracy_series(run) for label, run in zip(labels, runs)}, out / "accuracy.png",
                title=data_title(f"{avg_title(runs)} per round", described), ylabel="test accuracy (%)")
    written.append("accuracy.png")
    gm = {f"{label}: L_GM {when}": series for label, run in zip(labels, runs)
          for when, series in gm_series(run).items()}
    if gm:
        plot_curves(gm, out / "gm_loss.png", title="gradient-matching loss L_GM (Eq. 8) before / after matching",
                    ylabel="L_GM", log_y=all(min(y) > 0 for _, y in gm.values()))
        written.append("gm_loss.png")
    fair = {label: {"worst 10%": run.final["fairness"]["worst_10"], "average": run.final["fairness"]["mean"],
                    "best 10%": run.final["fairness"]["best_10"], "std": run.final["fairness"]["std"]}
            for label, run in zip(labels, runs) if "fairness" in run.final}
    if fair:
        plot_bars(fair, out / "fairness.png", title="accuracy across clients", ylabel="test accuracy (%)")
        written.append("fairness.png")
    distances = {f"{label}: {name}": series for label, run in zip(labels, runs)
                 for name, series in prototype_series(run).items()}
    if distances:
        plot_curves(distances, out / "prototype_distance.png", ylabel="L2 distance",
                    title="distance to the centralized prototypes")
        written.append("prototype_distance.png")
    write_json(out / "report.json", {"runs": _report_sources(runs)})
    written.append("report.json")
    if echo:
        print(markdown_table(header, rows, caption, notes))
        print(f"written to {out}/: {', '.join(written)}")
    return out


def seed_groups(runs: Sequence[RunData]) -> dict[str, list[RunData]]:
    """The runs grouped by their settings but the seed (and the presentational keys), in the order of their
    first run; each group labelled by :func:`run_labels` of one run per group (the method, or the method and
    the settings that differ between the groups)."""
    keyed: dict[str, list[RunData]] = {}
    for run in runs:
        flat = {k: v for k, v in dotted_keys(run.config).items() if k not in NOT_A_SETTING}
        keyed.setdefault(json.dumps(flat, sort_keys=True, default=str), []).append(run)
    firsts = [RunData(members[0].path, {k: v for k, v in members[0].config.items() if k not in NOT_A_SETTING},
                      members[0].rows, members[0].summary) for members in keyed.values()]
    return dict(zip(run_labels(firsts), keyed.values()))


#: the seed table's column of FedHPro's hyper-prototype movement (shown when a run logged it)
MOVEMENT = "S moved %"
#: the columns of runs with validation parts (``validation=``): the final validation AVG, and the test AVG of
#: the round chosen on validation (:meth:`~fedhpro.reports.run_data.RunData.test_at_best_validation`)
VALIDATION_COLUMNS = ["val AVG", "test AVG at best val"]


def splits_caption(validated: bool, matched: bool = False) -> str:
    """Which split each accuracy column comes from, for a table's caption (``matched``: some run measured its
    clients on test sets that follow their training labels, ``client_test=matched``)."""
    text = ("Domains, AVG, best AVG and the client figures: the test set; best AVG is the best round chosen on "
            "the test set itself, an upper bound, not a selected model's accuracy.")
    if matched:
        text += (" Client figures (worst/best 10%, client mean, variance) of runs with client_test=matched: each "
                 "client on test samples drawn to follow its training labels; domains and AVG: the shared test "
                 "sets.")
    if validated:
        text += (" val AVG: the clients' validation parts (held out of their training data); test AVG at best val: "
                 "the test AVG of the round with the best val AVG, the model selected without the test set.")
    return text


def hyper_movement(run: RunData) -> float | None:
    """FedHPro's ``||S_r - S_0|| / ||S_0||`` in percent at the last round that logged it (gradient matching's
    total movement of the hyper-prototypes); None for a run without it (other methods)."""
    moved = [row["server"]["hyper_movement"] for row in run.rows if "hyper_movement" in row.get("server", {})]
    return float(moved[-1]) * 100 if moved else None


def seed_values(run: RunData, column: str) -> float | None:
    """``run``'s number in the seed table's ``column`` (None where it has none)."""
    if column == "best AVG":
        return max(row["accuracy"]["AVG"] for row in run.evaluated)
    if column == VALIDATION_COLUMNS[0]:
        return run.final.get("validation", {}).get("AVG")
    if column == VALIDATION_COLUMNS[1]:
        return run.test_at_best_validation()
    if column == "worst 10%":
        return run.final.get("fairness", {}).get("worst_10")
    if column == MOVEMENT:
        return hyper_movement(run)
    return run.final["accuracy"].get(column)


def baseline_group(groups: Mapping[str, Sequence[RunData]]) -> str | None:
    """The group the seed table tests the others against: the first of the baseline method
    (``MethodSpec.baseline``: FedAvg), None when no group runs it."""
    return next((label for label, members in groups.items() if is_baseline(members[0].method)), None)


#: the seed table's column its marks test (each group's final test AVG over its seeds)
TESTED_COLUMN = "AVG"


def seed_table(groups: dict[str, list[RunData]]) -> tuple[list[str], list[list[Any]], list[list[Any]], Verdicts]:
    """``(header, markdown rows, csv rows, verdicts)`` of a report over seeds (the markdown naming each group as
    the paper writes its method, the CSV by its registered name): per group its seeds, then per final
    accuracy (each domain, AVG), best AVG and worst 10% the mean over its runs (their last evaluated round:
    summary.json's numbers for a finished run) with its 95 % t-interval; when some run logged it, also how far
    gradient matching moved FedHPro's hyper-prototypes (:func:`hyper_movement`, "–" for other methods).

    The AVG column is tested (:func:`fedhpro.reports.significance.verdicts`, the returned verdicts: paired
    t-tests over the seeds every group shares, Holm's correction, against the baseline method's group,
    :func:`baseline_group`): its cells carry the marks. The CSV rows: the means, the sample stds, the rounds,
    then each column's interval bounds and AVG's raw and Holm-adjusted p value against the baseline and marks."""
    first = next(iter(groups.values()))[0]
    domains = [name for name in first.final["accuracy"] if name != "AVG"]
    columns = domains + ["AVG", "best AVG", "worst 10%"]
    if any(run.validated for members in groups.values() for run in members):
        columns[len(domains) + 2:len(domains) + 2] = VALIDATION_COLUMNS
    if any(hyper_movement(run) is not None for members in groups.values() for run in members):
        columns.append(MOVEMENT)
    shown = {label: display_label(label) for label in groups}
    reference = baseline_group(groups)
    tested = {column: verdicts({shown[label]: {run_seed(run, index): seed_values(run, column)
                                               for index, run in enumerate(members)}
                                for label, members in groups.items()},
                               baseline=shown[reference] if column == TESTED_COLUMN and reference else None,
                               # accuracies in percent stop at 0 and 100; S moved % has no top
                               bounds=None if column == MOVEMENT else (0.0, 100.0))
              for column in columns}
    header = ["method", "seeds"] + columns + ["rounds"]
    markdown, table = [], []
    for label, members in groups.items():
        seeds = ",".join(str(run.config.get("seed", "?")) for run in members)
        numbers = {column: [seed_values(run, column) for run in members] for column in columns}
        rounds = sorted({len(run.rows) for run in members})
        shown_rounds = str(rounds[0]) if len(rounds) == 1 else f"{rounds[0]}-{rounds[-1]}"
        stats = [mean_std(numbers[c]) for c in columns]
        markdown.append([display_label(label), seeds]
                        + [marked_cell(mean, tested[c].intervals.get(shown[label]),
                                       tested[c].mark(shown[label]) if c == TESTED_COLUMN else "")
                           for c, (mean, _) in zip(columns, stats)] + [shown_rounds])
        table.append([label, seeds] + [m for m, _ in stats] + [s for _, s in stats] + [shown_rounds]
                     + [bound for c in columns for bound in interval_bounds(tested[c], shown[label])]
                     + verdict_fields(tested[TESTED_COLUMN], shown[label]))
    return header, markdown, table, tested[TESTED_COLUMN]


def seed_columns_caption(columns: Sequence[str]) -> str:
    """What the seed table's columns beyond the splits (:func:`splits_caption`) hold."""
    text = ("method: the group's method (and the settings that tell groups apart); seeds: the seeds its runs ran "
            "at; worst 10%: the mean accuracy of the tenth of clients with the lowest accuracy (at least one "
            "client) at the last evaluated round")
    if MOVEMENT in columns:
        text += ("; S moved %: how far gradient matching moved FedHPro's hyper-prototypes S over the run, "
                 "100 ||S_last - S_0|| / ||S_0|| (– for methods without them)")
    return text + "; rounds: the rounds each run logged."


def report_seeds(runs: Sequence[RunData], out: Path, echo: bool = True, force: bool = False) -> Path:
    """The report over seeds (a comparison: ``fedhpro report <compare out>``): the runs grouped by their
    settings but the seed (:func:`seed_groups`), written to ``out``:

    * ``table.md`` / ``table.csv``: per group (method) its seeds and the mean over them of the final accuracy
      per domain and AVG, the best AVG and the worst 10% of clients, each with its 95 % t-interval; the AVG
      cells marked best, or better / worse than FedAvg's group, only where paired t-tests over the shared seeds
      say so after Holm's correction (:func:`seed_table`); the CSV with the sample stds, the interval bounds
      and the p values; the caption names the tuned settings of runs compared with ``tuned=``
      (:func:`tuned_notes`);
    * ``accuracy.png``: per group the mean AVG curve over its seeds with a shaded band from the lowest to the
      highest seed (min-max), each group in its own colour, line style and marker, whole-number round ticks;
    * ``report.json``: the runs it was built from.
    """
    runs = list(runs)
    prepare_report_folder(out, runs, force)
    groups = seed_groups(runs)
    header, markdown, table, tested = seed_table(groups)
    columns = header[2:-1]
    csv_header = (["method", "seeds"] + [f"{c}_mean" for c in columns] + [f"{c}_std" for c in columns] + ["rounds"]
                  + [f"{c}_ci_{end}" for c in columns for end in ("low", "high")]
                  + [f"{TESTED_COLUMN}_{name}" for name in TEST_COLUMNS])
    described = {label: data_text(members[0].config, members[0].path) for label, members in groups.items()}
    data = data_sentence(described, [display_label(label) for label in groups])
    caption = (f"Final test accuracy (%) of {len(runs)} runs in {len(groups)} groups: the mean over each group's "
               "seeds (one seed: its value) at the last evaluated round. "
               + (f"{data} " if data else "") + splits_caption(any(run.validated for run in runs),
                                any(run.config.get("client_test") == "matched" for run in runs))
               + " " + seed_columns_caption(columns) + "\n\n" + significance.caption(tested, what="groups")
               + f" Tested: the {TESTED_COLUMN} column; the other columns show intervals only."
               + "".join(f"\n\n{line}" for line in tuned_notes(runs)))
    notes = [f"{display_label(label)}: {run.path.name} is unfinished ({run.progress}), its numbers are those of "
             "its last evaluated round" for label, members in groups.items() for run in members if not run.finished]
    curves = {label: [accuracy_series(run) for run in members] for label, members in groups.items()}
    cut = [label for label, series in curves.items()
           if len(mean_band(series)[0]) < max(len(x) for x, _ in series)]
    if cut:
        notes.append(f"{', '.join(map(display_label, cut))}: the curve ends at the last round every seed evaluated")
    write_atomic(out / "table.md", markdown_table(header, markdown, caption, notes))
    write_atomic(out / "table.csv", csv_text(csv_header, table))
    plot_mean_curves(curves, out / "accuracy.png", ylabel="test accuracy (%)",
                     title=data_title(f"{avg_title(runs)}: mean over seeds, band min-max", described))
    write_json(out / "report.json", {"runs": _report_sources(runs)})
    if echo:
        print(markdown_table(header, markdown, caption, notes))
        print(f"written to {out}/: table.md, table.csv, accuracy.png, report.json")
    return out
