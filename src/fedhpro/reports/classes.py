"""Per-class accuracy tables of finished runs (``fedhpro report ... per_class=true``).

The counts come from :func:`fedhpro.trained.class_accuracy` (each run's model re-tested on its rebuilt test
sets through the run's own evaluation, so its accuracy is the summary's unless a file changed); this module
only turns them into ``per_class.md``, ``per_class.csv``, ``per_class.png``, ``classification.csv``,
``confusion.csv`` and one confusion-matrix figure per method (``confusion_<method>.png``, with its PDF and SVG).

Classes are ranked by their training samples summed over the clients. Only where there is a tail, that is
when the largest class has at least ``tail_ratio`` (default 2) times the smallest's training samples, are
they grouped as in long-tail studies: the head the largest third, the tail the smallest third, the middle the
rest (3 / 4 / 3 of 10 classes). Otherwise the classes are balanced, the tables say so in one line and show
no head, middle or tail.

Every table that compares methods shows each mean with its 95 % t-interval over the seeds and marks a method
only through :func:`fedhpro.reports.significance.verdicts` (paired t-tests over the shared seeds, Holm's
correction across the methods compared), column by column: each class, or class group, is its own test.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedhpro.bounded import read_yaml_file, run_file
from fedhpro.command_options.report import DEFAULT_TAIL_RATIO
from fedhpro.errors import ConfigError, DataError
from fedhpro.files import write_atomic
from fedhpro.reports import significance
from fedhpro.reports.captions import data_sentence, data_text
from fedhpro.reports.plots import display_label, plot_bars, plot_confusion
from fedhpro.reports.tables import csv_text, markdown_table, mean_std

#: the files this report adds beside a run report's (and a confusion-matrix figure per method:
#: :func:`confusion_name`, with its ``.pdf`` and ``.svg``)
CLASS_FILES = ("per_class.md", "per_class.csv", "per_class.png", "classification.csv", "confusion.csv")
#: the classification figures of every tested row pooled (:func:`fedhpro.metrics.classification_figures`)
FIGURES = (("balanced_accuracy", "balanced accuracy"), ("macro_f1", "macro-F1"), ("auroc", "AUROC"))
#: the confusion-matrix figures' names: ``confusion_<method>.png`` and its vector copies
CONFUSION_PREFIX = "confusion_"


def check_tail_ratio(value: Any) -> float:
    """``value`` as a tail ratio (a finite number of at least 1), else one ConfigError line naming the fix."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
        raise ConfigError(f"tail_ratio={value!r} is not a number of at least 1; use e.g. tail_ratio=2 (head and "
                          "tail classes only when the largest class has at least twice the smallest's training "
                          "samples)")
    return float(value)


def class_split(train_counts: Sequence[int], tail_ratio: float = DEFAULT_TAIL_RATIO
                ) -> tuple[list[int], list[int], list[int]] | None:
    """``(head, middle, tail)`` class indices by training samples, largest first (ties by index); the head and
    the tail are ``max(1, C // 3)`` classes each. None (balanced: no tail) when the largest count is below
    ``tail_ratio`` times the smallest, when all counts are equal, or for C < 3."""
    num_classes = len(train_counts)
    if num_classes < 3 or len(set(train_counts)) == 1 or max(train_counts) < tail_ratio * min(train_counts):
        return None
    order = sorted(range(num_classes), key=lambda c: (-train_counts[c], c))
    third = max(1, num_classes // 3)
    return order[:third], order[third:num_classes - third], order[num_classes - third:]


def per_class_accuracy(measured: Mapping[str, Any]) -> list[float | None]:
    """Accuracy (%) per class: over the test sets holding that class, the unweighted mean of its accuracy
    in each (the paper's AVG, taken per class); None for a class no test set holds."""
    sets = list(measured["test_sets"].values())
    out: list[float | None] = []
    for c in range(len(measured["train_counts"])):
        values = [s["correct"][c] / s["total"][c] * 100 for s in sets if s["total"][c]]
        out.append(sum(values) / len(values) if values else None)
    return out


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and math.isfinite(v)]
    return sum(present) / len(present) if present else None


def summarize(measured: Mapping[str, Any], tail_ratio: float = DEFAULT_TAIL_RATIO,
              grouped: bool = True) -> dict[str, float | None]:
    """One run's balanced accuracy (mean over classes) and its head / middle / tail means by its own training
    counts (None without a split: balanced classes, or ``grouped=False``)."""
    accuracy = per_class_accuracy(measured)
    split = class_split(measured["train_counts"], tail_ratio) if grouped else None
    out: dict[str, float | None] = {"balanced": _mean(accuracy)}
    for name, classes in zip(("head", "middle", "tail"), split or ((), (), ())):
        out[name] = _mean([accuracy[c] for c in classes]) if split else None
    return out


def samples_word(measured: Mapping[str, Any]) -> str:
    """What one training example of the run's data is called: "images", "rows" (tabular) or "samples" (the
    re-test's ``samples``; "samples" when it does not say)."""
    word = measured.get("samples")
    return word if word in ("images", "rows", "sequences") else "samples"


def confusion_name(label: str) -> str:
    """The confusion figure of the group ``label``: ``confusion_<label>.png``, the label's characters other
    than letters, digits, ``-``, ``_`` and ``.`` replaced by ``_``."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label).strip("._") or "run"
    return f"{CONFUSION_PREFIX}{safe}.png"


def _seed_keys(runs: Sequence[tuple[Path, Mapping[str, Any]]]) -> list[Any]:
    """Each run's seed (the re-test's ``seed``, else the ``seed<N>`` ending of its folder's name), the key that
    pairs it with the other methods' runs; its folder's name where neither says or two runs share a seed."""
    keys: list[Any] = []
    for folder, measured in runs:
        seed = measured.get("seed")
        if not isinstance(seed, int) or isinstance(seed, bool):
            ending = folder.name.rsplit("seed", 1)
            seed = int(ending[1]) if len(ending) == 2 and ending[1].isdigit() else None
        keys.append(seed)
    if None in keys or len(set(keys)) != len(keys):
        return [folder.name for folder, _ in runs]
    return keys


def _data(runs: Sequence[tuple[Path, Mapping[str, Any]]]) -> str | None:
    """The data set and partition of a group's first run in words (its ``config.yaml``), None without one."""
    folder = runs[0][0]
    path = run_file(folder, "config.yaml")
    if not path.is_file():
        return None
    config = read_yaml_file(path, DataError)
    return data_text(config, folder) if isinstance(config, Mapping) else None


class _Column:
    """One compared quantity (a class group or a class) over the methods: per method (its label) its per-seed
    values, the verdicts and each method's cell. The verdicts name the rows as the tables show them (the
    caption's baseline reads FedAvg), unless two labels would show alike."""

    def __init__(self, values: Mapping[str, Mapping[Any, float | None]], baseline: str | None):
        self.values = values
        shown = {label: display_label(label) for label in values}
        self.keys = shown if len(set(shown.values())) == len(shown) else {label: label for label in values}
        # every compared quantity here is a percentage: its intervals stop at 0 and 100
        self.verdicts = significance.verdicts({self.keys[label]: per_seed for label, per_seed in values.items()},
                                              baseline=None if baseline is None else self.keys[baseline],
                                              bounds=(0.0, 100.0))

    def mean(self, label: str) -> float | None:
        return _mean(list(self.values[label].values()))

    def interval(self, label: str) -> tuple[float, float] | None:
        return self.verdicts.intervals.get(self.keys[label])

    def mark(self, label: str) -> str:
        return self.verdicts.mark(self.keys[label])

    def error(self, label: str) -> tuple[float, float]:
        """``(below, above)`` the mean: the error bar of its interval (cut at 0 and 100), (0, 0) without one."""
        interval, mean = self.interval(label), self.mean(label)
        if interval is None or mean is None:
            return 0.0, 0.0
        return mean - interval[0], interval[1] - mean

    def cell(self, label: str, digits: int) -> str:
        text = significance.interval_cell(self.mean(label), self.interval(label), digits)
        mark = self.mark(label)
        return f"{text} {mark}" if mark and text != "–" else text


def _test_sentence(columns: Sequence[_Column], methods: int, where: str) -> str:
    """The caption's sentence on intervals and marks: :func:`significance.caption` of the columns' tests,
    and that each column (``where``: "class group", "class") is tested on its own."""
    if methods < 2:
        return ("Brackets: the 95 % t-interval of the mean over the method's seeds. One method: nothing is "
                "compared or marked.")
    text = significance.caption(columns[0].verdicts, what="methods")
    plural = f"{where}es" if where.endswith("s") else f"{where}s"
    if columns[0].verdicts.tested:
        text += (f" Each {where} is tested on its own: the correction is across the methods compared within it, "
                 f"not across the {plural}.")
    if len({tuple(column.verdicts.shared_seeds) for column in columns}) > 1:
        text += f" Some {plural} were not measured on every seed: those are tested over the seeds they share."
    return text


def write_class_report(out: str | os.PathLike, groups: Mapping[str, Sequence[tuple[Path, Mapping[str, Any]]]],
                       echo: bool = True, notes: Sequence[str] = (),
                       tail_ratio: float = DEFAULT_TAIL_RATIO) -> list[str]:
    """Write ``per_class.md`` / ``.csv`` / ``.png``, ``classification.csv``, ``confusion.csv`` and a confusion
    figure per group for ``groups`` (label -> its runs' ``(folder, counts)``, one run per group or a group's
    seeds; ``notes`` go under the first table); returns the names written. The Markdown names each group as
    the paper writes its method (FedAvg), the CSVs by its registered name (fedavg).

    Head, middle and tail classes only when the largest class has at least ``tail_ratio`` times the smallest's
    training samples (:func:`class_split`); else one line says the classes are balanced. With several groups,
    every mean carries its 95 % t-interval over seeds and the marks of
    :func:`fedhpro.reports.significance.verdicts` (the first group the baseline), per column."""
    out = Path(out)
    notes = list(notes)
    tail_ratio = check_tail_ratio(tail_ratio)
    if not groups:
        raise ConfigError("no finished run to test per class: per_class=true needs runs that wrote their model")
    first = next(iter(groups.values()))[0][1]
    counts = list(first["train_counts"])
    num_classes = len(counts)
    every = [list(m["train_counts"]) for runs in groups.values() for _, m in runs]
    # head and tail only where every run has a tail: a group mean over runs some of which have none is no group
    split = class_split(counts, tail_ratio) if all(class_split(c, tail_ratio) for c in every) else None
    names = first.get("classes") or [str(c) for c in range(num_classes)]
    noun = samples_word(first)
    labels = list(groups)
    shown = [display_label(label) for label in labels]
    baseline = labels[0] if len(labels) > 1 else None
    differ = any(c != counts for c in every)
    if differ:
        notes.append(f"the runs' training {noun} per class differ (other data or partitions): head and tail are "
                     f"taken per run, the training {noun} shown are the first run's")
    for runs in groups.values():
        for folder, m in runs:
            reported = m.get("reported")
            if reported is not None and abs(float(reported) - float(m["accuracy"]["AVG"])) > 1e-6:
                notes.append(f"{folder.name}: re-tested at {m['accuracy']['AVG']:.2f} %, its summary says "
                             f"{float(reported):.2f} %: the data or the model files changed since the run")
    ratio = f"{tail_ratio:g}"
    if split is None and num_classes < 3:
        notes.append(f"{num_classes} classes: too few for head, middle and tail groups")
    elif split is None:
        balanced = [c for c in every if not class_split(c, tail_ratio)]
        shown_counts = balanced[0] if balanced else counts
        notes.append(f"the classes are balanced{' in ' + str(len(balanced)) + ' of the runs' if differ else ''}: "
                     f"{min(shown_counts)} to {max(shown_counts)} training {noun} a class"
                     f"{' (the first such run)' if differ and len(balanced) > 1 else ''} (the largest has less "
                     f"than {ratio}x the smallest's; tail_ratio={ratio}), so no head, middle or tail classes are "
                     "formed")
    sizes = [len(part) for part in split] if split else []
    keys = ("balanced", "head", "middle", "tail") if split else ("balanced",)
    seeds = {label: _seed_keys(runs) for label, runs in groups.items()}
    summaries = {label: [summarize(m, tail_ratio, split is not None) for _, m in runs]
                 for label, runs in groups.items()}
    accuracies = {label: [per_class_accuracy(m) for _, m in runs] for label, runs in groups.items()}
    group_columns = {key: _Column({label: dict(zip(seeds[label], (s[key] for s in summaries[label])))
                                   for label in labels}, baseline) for key in keys}
    class_columns = [_Column({label: dict(zip(seeds[label], (a[c] for a in accuracies[label]))) for label in labels},
                             baseline) for c in range(num_classes)]

    # the first table: balanced accuracy and the class groups
    group_heads = ([f"head ({sizes[0]} classes)", f"middle ({sizes[1]} classes)", f"tail ({sizes[2]} classes)"]
                   if split else [])
    header = ["method", "seeds", "balanced accuracy"] + group_heads
    rows = [[name, ",".join(str(s) for s in seeds[label])]
            + [group_columns[key].cell(label, 2) for key in keys] for label, name in zip(labels, shown)]
    described = {label: _data(runs) for label, runs in groups.items()}
    data = data_sentence(described, shown)
    columns_text = ("Columns: method; seeds (each run's seed: the runs of one seed share data split, sampling and "
                    "initialisation across the methods); balanced accuracy (the mean over the classes of each "
                    "class's accuracy)")
    if split:
        columns_text += (f"; head, middle and tail: the mean accuracy of the {sizes[0]} classes with the most "
                         f"training {noun} (summed over the clients), of the {sizes[1]} after them and of the "
                         f"{sizes[2]} with the fewest (groups formed because the largest class has "
                         f"{max(counts)} training {noun}, at least {ratio}x the smallest's {min(counts)})")
    caption = ("Test accuracy (%) by class of each run's final model, re-tested on its rebuilt test sets. "
               + (f"{data} " if data else "") + columns_text + ". "
               + _test_sentence(list(group_columns.values()), len(labels), "column"))
    text = markdown_table(header, rows, caption, notes) + "\n"

    # the second table: a row per class, largest first
    ranked = sorted(range(num_classes), key=lambda c: (-counts[c], c))
    class_header = ["class", f"training {noun}"] + shown
    class_rows = [[names[c], counts[c]] + [class_columns[c].cell(label, 1) for label in labels] for c in ranked]
    class_caption = (f"Test accuracy (%) per class, classes ordered by their training {noun}. Columns: class; "
                     f"training {noun} (of that class, summed over the clients, the first run's); then per method "
                     "the mean of that class's accuracy over its seeds (a class's accuracy: over the test sets "
                     "holding it, the mean of its accuracy in each). "
                     + _test_sentence(class_columns, len(labels), "class"))
    text += markdown_table(class_header, class_rows, class_caption)

    # per_class.csv: a row per method, every number at full precision, each interval and mark
    csv_header = ["method", "seeds"]
    for key in keys:
        csv_header += [f"{key}_mean", f"{key}_std", f"{key}_low", f"{key}_high", f"{key}_mark"]
    for c in range(num_classes):
        csv_header += [f"class_{names[c]}", f"class_{names[c]}_low", f"class_{names[c]}_high",
                       f"class_{names[c]}_mark"]
    table = []
    for label in labels:
        row: list[Any] = [label, ",".join(str(s) for s in seeds[label])]
        for column in [group_columns[key] for key in keys]:
            interval = column.interval(label)
            row += [column.mean(label), mean_std(list(column.values[label].values()))[1],
                    *(interval or (None, None)), column.mark(label)]
        for column in class_columns:
            interval = column.interval(label)
            row += [column.mean(label), *(interval or (None, None)), column.mark(label)]
        table.append(row)
    write_atomic(out / "per_class.csv", csv_text(csv_header, table))

    # per_class.png: the class groups, or every class when balanced; bars: the 95 % t-intervals
    plotted = [(group_columns[key], name) for key, name in zip(keys[1:], group_heads)] if split else \
        [(class_columns[c], names[c]) for c in ranked]
    bars = {label: {name: _nan(column.mean(label)) for column, name in plotted} for label in labels}
    spread = {label: {name: column.error(label) for column, name in plotted} for label in labels}
    texts = set(described.values())
    where = texts.pop() if len(texts) == 1 and None not in texts else None
    what = ("test accuracy of the head, middle and tail classes" if split else "test accuracy per class"
            + (f" (balanced: {min(counts)}–{max(counts)} training {noun} a class)" if num_classes >= 3 else ""))
    intervals = any(any(v) for per_label in spread.values() for v in per_label.values())
    over = (" (mean over seeds; bars: 95 % t-interval)" if intervals
            else " (mean over seeds)" if any(len(runs) > 1 for runs in groups.values()) else "")
    plot_bars(bars, out / "per_class.png", errors=spread if intervals else None, ylabel="test accuracy (%)",
              xlabel=f"class group (by training {noun})" if split else f"class (by training {noun}, most first)",
              title=(f"{where}: " if where else "") + what + over)
    figures_text, confusions = _write_figures(out, groups, names, seeds, baseline, where)
    write_atomic(out / "per_class.md", text + "\n" + figures_text)
    if echo:
        print(text + "\n" + figures_text)
    return list(CLASS_FILES) + confusions


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _write_figures(out: Path, groups: Mapping[str, Sequence[tuple[Path, Mapping[str, Any]]]],
                   names: Sequence[str], seeds: Mapping[str, Sequence[Any]], baseline: str | None,
                   where: str | None) -> tuple[str, list[str]]:
    """``classification.csv`` (per group: balanced accuracy, macro-F1 and AUROC of all its test rows pooled,
    mean, std and 95 % interval over its runs, and the marks), ``confusion.csv`` (per group its confusion
    matrix summed over its runs, a row per true class) and each group's confusion figure
    (:func:`fedhpro.reports.plots.plot_confusion`); returns the markdown table of the first and the figures'
    names."""
    for stale in out.glob(f"{CONFUSION_PREFIX}*"):  # an earlier report's figures of methods no longer shown
        if stale.suffix in (".png", ".pdf", ".svg"):
            stale.unlink()
    labels = list(groups)
    header = ["method", "runs"] + [label for _, label in FIGURES]
    pooled = {label: [(seed, m.get("classification", {}).get("pooled"))
                      for seed, (_, m) in zip(seeds[label], runs)] for label, runs in groups.items()}
    columns = {key: _Column({label: {seed: (p or {}).get(key) for seed, p in pooled[label] if p is not None}
                             for label in labels}, baseline) for key, _ in FIGURES}
    markdown, table, confusion, written = [], [], [], []
    for label in labels:
        present = [p for _, p in pooled[label] if p is not None]
        markdown.append([display_label(label), str(len(present))] + [columns[key].cell(label, 2) for key, _ in FIGURES])
        row: list[Any] = [label, str(len(present))]
        for key, _ in FIGURES:
            interval = columns[key].interval(label)
            row += [columns[key].mean(label), mean_std(list(columns[key].values[label].values()))[1],
                    *(interval or (None, None)), columns[key].mark(label)]
        table.append(row)
        if present:
            summed = [[sum(p["confusion_matrix"][t][q] for p in present) for q in range(len(names))]
                      for t in range(len(names))]
            confusion += [[label, names[t], *summed[t]] for t in range(len(names))]
            runs = f"summed over {len(present)} runs" if len(present) > 1 else "one run"
            name = confusion_name(label)
            plot_confusion(summed, names, out / name,
                           title=f"{display_label(label)}: confusion matrix ({runs})" + (f"\n{where}" if where else ""))
            written += [name, name.replace(".png", ".pdf"), name.replace(".png", ".svg")]
    csv_header = ["method", "runs"]
    for key, _ in FIGURES:
        csv_header += [f"{key}_mean", f"{key}_std", f"{key}_low", f"{key}_high", f"{key}_mark"]
    write_atomic(out / "classification.csv", csv_text(csv_header, table))
    write_atomic(out / "confusion.csv", csv_text(["method", "true class"] + [f"predicted {n}" for n in names],
                                                 confusion))
    caption = ("Balanced accuracy (mean recall over the classes present), macro-F1 (over all classes) and AUROC "
               "(binary: the positive class's score; else one-vs-rest, macro) of each run's final model, every "
               "tested row pooled, from the same re-test (%). Columns: method; runs (how many were re-tested); "
               "each figure's mean over the runs. " + _test_sentence(list(columns.values()), len(labels), "column")
               + " Confusion matrices, summed over the runs: confusion.csv"
               + (f", drawn per method in {', '.join(written[::3])} (with PDF and SVG copies)." if written else "."))
    return markdown_table(header, markdown, caption), written
