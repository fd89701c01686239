"""The one place a reproduced table is written: its figures (PNG), ``table.md``, ``table.csv`` and
``reproduce.json``, every file through the atomic writers of :mod:`fedhpro.reports`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedhpro.arrays import load_npz
from fedhpro.reports import write_atomic, write_json
from fedhpro.reports.plots import MARKERS, plot_bars, plot_curves, plot_sweep, pyplot, save_figure
from fedhpro.reports.tables import csv_text, markdown_table
from fedhpro.reproduce.table import Figure, Section, Table
from fedhpro.reproduce.targets import Target

SMOKE_WARNING = ("**scale=smoke**: a few rounds of a small model on a few clients, to check that everything runs; "
                 "the numbers are NOT comparable with the paper's (R=100, E=10, ResNet-10).")


def plot_tsne_panels(panels: Sequence[tuple[str, Path]], path: Path, *, title: str) -> None:
    """Figures 3 and 6: one t-SNE panel per row (its ``tsne.npz``), colour = class, marker = domain, stars =
    prototypes, with one legend for all. Each ``tsne.npz`` is read within fedhpro's array bounds
    (:func:`fedhpro.arrays.load_npz`)."""
    from matplotlib.lines import Line2D  # lazy as in fedhpro.reports.plots: matplotlib loads with the first figure

    plt = pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 5.4), dpi=130, squeeze=False)
    colours = plt.get_cmap("tab10")
    for axis, (label, npz) in zip(axes[0], panels):
        data = load_npz(npz)
        points, labels, names = data["points"], data["labels"], data["test_sets"].astype(str)
        for j, name in enumerate(dict.fromkeys(names.tolist())):
            where = names == name
            axis.scatter(points[where, 0], points[where, 1], c=[colours(int(c) % 10) for c in labels[where]],
                         marker=MARKERS[j % len(MARKERS)], s=7, alpha=0.6, linewidths=0, label=name)
        if len(data["prototype_points"]):
            axis.scatter(data["prototype_points"][:, 0], data["prototype_points"][:, 1], marker="*", s=220,
                         c=[colours(int(c) % 10) for c in data["prototype_labels"]], edgecolors="black", zorder=5)
        axis.set_title(label, fontsize=10)
        axis.set_xticks([])
        axis.set_yticks([])
    domains = axes[0][0].get_legend_handles_labels()[1]
    handles = [Line2D([], [], marker=MARKERS[j % len(MARKERS)], color="dimgrey", linestyle="", label=name)
               for j, name in enumerate(domains)]
    handles += [Line2D([], [], marker="o", color=colours(c), linestyle="", label=f"class {c}") for c in range(10)]
    handles.append(Line2D([], [], marker="*", color="white", markeredgecolor="black", markersize=11,
                          linestyle="", label="prototypes"))
    figure.legend(handles=handles, loc="lower center", ncol=8, fontsize=8, frameon=False)
    figure.suptitle(title, fontsize=10)
    figure.subplots_adjust(left=0.02, right=0.98, top=0.86, bottom=0.2, wspace=0.05)
    save_figure(figure, path, tight_layout=False)


def _plots() -> dict[str, Any]:
    """Figure kind -> the function that draws it, called as ``draw(*figure.data, path, **figure.options)``."""
    return {"curves": plot_curves, "bars": plot_bars, "sweep": plot_sweep, "tsne_panels": plot_tsne_panels}


def draw_figures(figures: Sequence[Figure], folder: Path) -> list[Path]:
    """Draw every figure into ``folder``; returns their paths, in order."""
    plots, paths = _plots(), []
    for figure in figures:
        path = folder / figure.file
        plots[figure.kind](*figure.data, path, **figure.options)
        paths.append(path)
    return paths


def section_markdown(section: Section) -> str:
    """One part's sub-table under its heading, or the line saying why it did not run."""
    if section.skipped or not section.header:
        return f"## {section.part}\n\nnot run: {section.skipped}\n"
    return f"## {section.part}\n\n" + markdown_table(section.header, section.rows, notes=section.notes)


def markdown(target: Target, table: Table, scale: str, seeds: Sequence[int], seconds: float) -> str:
    """``table.md``: the title, how it was made, the target's notes, one section per part and the checks of
    the ordering against the paper."""
    header = [f"# {target.title}", "",
              f"Reproduced with `fedhpro reproduce {target.name} scale={scale}` (seeds {list(seeds)}); "
              f"ours: the mean over seeds with its 95 % t-interval in brackets (table.csv: also the std, the "
              f"p values and the marks); paper: the published number. Wall time {seconds:.0f} s.", ""]
    if scale == "smoke":
        header += [SMOKE_WARNING, ""]
    header += [f"- {note}" for note in target.notes]
    text = "\n".join(header) + "\n\n" + "\n".join(section_markdown(s) for s in table.sections)
    if table.checks:
        text += "\n## Ordering against the paper\n\n" + "\n".join(f"- {line}" for line in table.checks) + "\n"
    return text


def emit(target: Target, table: Table, folder: Path, *, scale: str, seeds: Sequence[int], notes: Sequence[str],
         started: float, echo: bool = True) -> list[Path]:
    """Write the target's figures, ``table.md``, ``table.csv`` and ``reproduce.json`` into ``folder`` (the wall
    time counted from ``started``, a :func:`time.perf_counter` reading); returns the files written."""
    figures = draw_figures(table.figures, folder)
    seconds = time.perf_counter() - started
    text = markdown(target, table, scale, seeds, seconds)
    write_atomic(folder / "table.md", text)
    write_atomic(folder / "table.csv", csv_text(table.csv_header, table.csv_rows))
    write_json(folder / "reproduce.json", {"target": target.name, "scale": scale, "seeds": list(seeds),
                                           "seconds": seconds, "checks": table.checks, "notes": list(notes),
                                           "figures": [str(f) for f in figures]})
    written = [folder / "table.md", folder / "table.csv"] + figures
    if echo:
        print(text)
        print(f"written: {', '.join(str(path) for path in written)}")
    return written
