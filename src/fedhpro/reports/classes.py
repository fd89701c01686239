"""Per-class accuracy tables of finished runs (``fedhpro report ... per_class=true``).

The counts come from :func:`fedhpro.trained.class_accuracy` (each run's model re-tested on its rebuilt test
sets through the run's own evaluation, so its accuracy is the summary's unless a file changed); this module
only turns them into ``per_class.md``, ``per_class.csv`` and ``per_class.png``. Classes are ranked by their
training images summed over the clients: the head is the largest third, the tail the smallest third, the
middle the rest (3 / 4 / 3 of 10 classes), as in long-tail studies. When every class has as many training
images as every other, there is no head or tail and the tables say so.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fedhpro.errors import ConfigError
from fedhpro.files import write_atomic
from fedhpro.reports.plots import display_label, plot_bars
from fedhpro.reports.tables import csv_text, format_number, markdown_table, mean_pm_std, mean_std

#: the files this report adds beside a run report's
CLASS_FILES = ("per_class.md", "per_class.csv", "per_class.png", "classification.csv", "confusion.csv")
#: the classification figures of every tested row pooled (:func:`fedhpro.metrics.classification_figures`)
FIGURES = (("balanced_accuracy", "balanced accuracy"), ("macro_f1", "macro-F1"), ("auroc", "AUROC"))


def class_split(train_counts: Sequence[int]) -> tuple[list[int], list[int], list[int]] | None:
    """``(head, middle, tail)`` class indices by training images, largest first (ties by index); the head and
    the tail are ``max(1, C // 3)`` classes each. None when all classes have the same count (or C < 3)."""
    num_classes = len(train_counts)
    if num_classes < 3 or len(set(train_counts)) == 1:
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
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def summarize(measured: Mapping[str, Any]) -> dict[str, float | None]:
    """One run's balanced accuracy (mean over classes) and its head / middle / tail means (None without a
    split)."""
    accuracy = per_class_accuracy(measured)
    split = class_split(measured["train_counts"])
    out: dict[str, float | None] = {"balanced": _mean(accuracy)}
    for name, classes in zip(("head", "middle", "tail"), split or ((), (), ())):
        out[name] = _mean([accuracy[c] for c in classes]) if split else None
    return out


def write_class_report(out: str | os.PathLike, groups: Mapping[str, Sequence[tuple[Path, Mapping[str, Any]]]],
                       echo: bool = True, notes: Sequence[str] = ()) -> list[str]:
    """Write ``per_class.md`` / ``.csv`` / ``.png`` for ``groups`` (label -> its runs' ``(folder, counts)``,
    one run per group or a group's seeds; ``notes`` go under the first table); returns the names written. The
    Markdown names each group as the paper writes its method (FedAvg), the CSVs by its registered name (fedavg)."""
    out = Path(out)
    notes = list(notes)
    if not groups:
        raise ConfigError("no finished run to test per class: per_class=true needs runs that wrote their model")
    first = next(iter(groups.values()))[0][1]
    counts = first["train_counts"]
    num_classes = len(counts)
    split = class_split(counts)
    names = first.get("classes") or [str(c) for c in range(num_classes)]
    if any(list(m["train_counts"]) != list(counts) for runs in groups.values() for _, m in runs):
        notes.append("the runs' training images per class differ (other data or partitions): head and tail are "
                     "taken per run, the training images shown are the first run's")
    for runs in groups.values():
        for folder, m in runs:
            reported = m.get("reported")
            if reported is not None and abs(float(reported) - float(m["accuracy"]["AVG"])) > 1e-6:
                notes.append(f"{folder.name}: re-tested at {m['accuracy']['AVG']:.2f} %, its summary says "
                             f"{float(reported):.2f} %: the data or the model files changed since the run")
    if split is None:
        notes.append("every class has as many training images as every other: no head or tail")
    head, middle, tail = (len(part) for part in split) if split else (0, 0, 0)
    header = ["method", "seeds", "balanced"] + ([f"head {head}", f"middle {middle}", f"tail {tail}"] if split else [])
    keys = ("balanced", "head", "middle", "tail") if split else ("balanced",)
    # each group's per-class accuracy, mean over its runs: computed once, used by every table and the plot
    class_means = {label: [_mean(values) for values in zip(*(per_class_accuracy(m) for _, m in runs))]
                   for label, runs in groups.items()}
    markdown, table = [], []
    bars: dict[str, dict[str, float | None]] = {}
    spread: dict[str, dict[str, float]] = {}
    for label, runs in groups.items():
        parts = [summarize(m) for _, m in runs]
        seeds = ",".join(folder.name.rsplit("seed", 1)[-1] if "seed" in folder.name else folder.name
                         for folder, _ in runs)
        stats = {key: mean_std([p[key] for p in parts]) for key in keys}
        markdown.append([display_label(label), seeds] + [mean_pm_std([p[key] for p in parts]) for key in keys])
        table.append([label, seeds] + [stats[key][0] for key in keys] + [stats[key][1] for key in keys])
        if split:
            bars[label] = {f"{key} {n}": stats[key][0] for key, n in zip(keys[1:], (head, middle, tail))}
            spread[label] = {f"{key} {n}": stats[key][1] or 0.0 for key, n in zip(keys[1:], (head, middle, tail))}
        else:
            bars[label] = {names[c]: class_means[label][c] for c in range(num_classes)}
    ranked = sorted(range(num_classes), key=lambda c: (-counts[c], c))
    class_header = ["method"] + [names[c] for c in ranked]
    class_rows: list[list[Any]] = [["training images"] + [counts[c] for c in ranked]]
    for label, means in class_means.items():
        class_rows.append([display_label(label)] + [means[c] for c in ranked])
    caption = ("Test accuracy (%) by class of each run's final model, re-tested on its rebuilt test sets: "
               "mean ± sample std over seeds of the balanced accuracy (mean over classes) and of the head, middle "
               "and tail classes (ranked by training images summed over the clients).")
    text = (markdown_table(header, markdown, caption, notes) + "\n"
            + markdown_table(class_header, [[format_number(v, 1) if isinstance(v, float) else v for v in row]
                                            for row in class_rows],
                             "Per class (mean over seeds), classes ordered by training images."))
    csv_header = (["method", "seeds"] + [f"{k}_mean" for k in keys] + [f"{k}_std" for k in keys]
                  + [f"class_{names[c]}" for c in range(num_classes)])
    rows = [[*row, *means] for row, means in zip(table, class_means.values())]
    write_atomic(out / "per_class.csv", csv_text(csv_header, rows))
    shown = {label: {name: float("nan") if value is None else value for name, value in values.items()}
             for label, values in bars.items()}
    plot_bars(shown, out / "per_class.png", errors=spread if split else None, ylabel="test accuracy (%)",
              xlabel="class group (by training images)" if split else "class (ordered by training images)",
              title="test accuracy of the head, middle and tail classes (mean over seeds, bar: std)" if split
              else "test accuracy per class (mean over seeds)")
    figures_text = _write_figures(out, groups, names)
    write_atomic(out / "per_class.md", text + "\n" + figures_text)
    if echo:
        print(text + "\n" + figures_text)
    return list(CLASS_FILES)


def _write_figures(out: Path, groups: Mapping[str, Sequence[tuple[Path, Mapping[str, Any]]]],
                   names: Sequence[str]) -> str:
    """``classification.csv`` (per group: balanced accuracy, macro-F1 and AUROC of all its test rows pooled,
    mean and std over its runs) and ``confusion.csv`` (per group its confusion matrix summed over its runs,
    a row per true class); returns the markdown table of the first."""
    header = ["method", "runs"] + [label for _, label in FIGURES]
    markdown, table, confusion = [], [], []
    for label, runs in groups.items():
        pooled = [m.get("classification", {}).get("pooled") for _, m in runs]
        pooled = [p for p in pooled if p is not None]
        values = {key: [p[key] for p in pooled if p[key] is not None] for key, _ in FIGURES}
        seeds = str(len(pooled))
        markdown.append([display_label(label), seeds]
                        + [mean_pm_std(values[key]) if values[key] else "–" for key, _ in FIGURES])
        stats = [mean_std(values[key]) if values[key] else (None, None) for key, _ in FIGURES]
        table.append([label, seeds] + [m for m, _ in stats] + [s for _, s in stats])
        if pooled:
            summed = [[sum(p["confusion_matrix"][t][q] for p in pooled) for q in range(len(names))]
                      for t in range(len(names))]
            confusion += [[label, names[t], *summed[t]] for t in range(len(names))]
    write_atomic(out / "classification.csv", csv_text(
        ["method", "runs"] + [f"{key}_mean" for key, _ in FIGURES] + [f"{key}_std" for key, _ in FIGURES], table))
    write_atomic(out / "confusion.csv", csv_text(["method", "true class"] + [f"predicted {n}" for n in names],
                                                 confusion))
    caption = ("Balanced accuracy (mean recall over the classes present), macro-F1 (over all classes) and AUROC "
               "(binary: the positive class's score; else one-vs-rest, macro) of each run's final model, every "
               "tested row pooled, from the same re-test: mean ± sample std over the runs (%). Confusion "
               "matrices, summed over the runs: confusion.csv.")
    return markdown_table(header, markdown, caption)
