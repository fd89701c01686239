"""Plots of runs in one style: a run's accuracy per round, curves of several runs on one axis, grouped
bars, parameter sweeps, t-SNE.

One style for every figure fedhpro writes (a run's ``accuracy.png``, ``fedhpro compare``, ``fedhpro
report``): whole-number round ticks, curves told apart by line style and marker as well as colour, methods
named as the paper writes them (:func:`display_name`), an optional title, and beside each PNG the same
figure as SVG (vector, its text kept as text). Every file is written atomically
(:func:`fedhpro.files.write_atomic_with`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedhpro.files import write_atomic_with

#: one marker per domain / test set in the t-SNE plots (Figures 3 and 6: colour = class, marker = domain)
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">"]


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend, imported on first use (not at ``import fedhpro``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: settings of the SVG beside each PNG: text stays text (searchable, editable), and the same figure gives
#: the same bytes (fixed ids, no date)
SVG_SETTINGS: dict[Any, Any] = {"svg.fonttype": "none", "svg.hashsalt": "fedhpro"}


def vector_path(path: str | os.PathLike) -> Path:
    """Where the vector copy of a PNG figure goes: the same name, ``.svg``."""
    return Path(path).with_suffix(".svg")


def pdf_path(path: str | os.PathLike) -> Path:
    """Where the PDF copy of a PNG figure goes (for LaTeX): the same name, ``.pdf``."""
    return Path(path).with_suffix(".pdf")


def save_figure(figure, path: str | os.PathLike, tight_layout: bool = True, vector: bool = True) -> None:
    """Save a matplotlib figure to ``path`` atomically and close it (``tight_layout=False`` keeps a
    layout the caller arranged, e.g. room for a figure-level legend). A PNG gets its vector copies beside it,
    SVG (:func:`vector_path`) and PDF (:func:`pdf_path`, for LaTeX; no creation date, so the same figure gives
    the same bytes), unless ``vector=False``."""
    import matplotlib

    plt = pyplot()
    kind = Path(path).suffix.lstrip(".").lower() or "png"
    try:
        if tight_layout:
            figure.tight_layout()
        write_atomic_with(path, lambda handle: figure.savefig(handle, format=kind))
        if vector and kind == "png":
            with matplotlib.rc_context(SVG_SETTINGS):
                write_atomic_with(vector_path(path), lambda handle: figure.savefig(
                    handle, format="svg", metadata={"Date": None}))
            write_atomic_with(pdf_path(path), lambda handle: figure.savefig(
                handle, format="pdf", metadata={"CreationDate": None, "ModDate": None}))
    finally:
        plt.close(figure)


#: a label's leading method name: a registered name followed by the label's end, a space, ":" or "("
_LEADING_NAME = re.compile(r"^([A-Za-z][A-Za-z0-9_-]*)(?=$|[\s:(])")


#: how a method's description is looked up (its registry entry's), set by :mod:`fedhpro.methods` when it is
#: imported: the reports sit below the methods and never import them
_describe: Callable[[str], str | None] = lambda method: None  # noqa: E731
#: a method's place in the paper's tables (its registry entry's ``paper_order``), set likewise
_place: Callable[[str], int | None] = lambda method: None  # noqa: E731


def set_describer(describe: Callable[[str], str | None], place: Callable[[str], int | None] | None = None) -> None:
    """Where :func:`display_name` reads a method's description and :func:`paper_order` its place
    (``fedhpro.methods`` gives its registry's)."""
    global _describe, _place
    _describe = describe
    if place is not None:
        _place = place


def paper_order(methods: Iterable[str]) -> list[str]:
    """``methods`` in the order of the paper's tables (each registered method's ``paper_order``), the others
    (plug-ins without one, unknown names) after them by name."""
    def key(name: str) -> tuple[float, str]:
        place = _place(name)
        return (float("inf") if place is None else float(place)), name
    return sorted(methods, key=key)


def display_name(method: str) -> str:
    """A method's name as its paper writes it: the lead of its registry entry's description ("FedAvg: local
    SGD ..." gives FedAvg) where that lead is the registered name in other letter case; else the name as
    registered (a plug-in keeps its own)."""
    lead = str(_describe(method) or "").split(":", 1)[0].strip()
    return lead if lead.lower() == method.lower() and lead else method


def display_label(label: str) -> str:
    """A curve's label with its leading method name as the paper writes it (``fedhpro tau=0.1`` ->
    ``FedHPro tau=0.1``); a label that does not start with a method's name (a run folder's) is kept."""
    return _LEADING_NAME.sub(lambda match: display_name(match.group(1)), label, count=1)


#: the token that marks FedHPro's curves (a label naming it: ``fedhpro``, ``fedhpro lr=0.05``, ``fedhpro: L_GM``)
HIGHLIGHTED = "fedhpro"


def highlighted(labels: Sequence[str]) -> set[str]:
    """The labels whose curves are drawn thicker: FedHPro's, when it is compared with others (some label does
    not name it); none in a figure of FedHPro alone or of its variants only (nothing to stand out from)."""
    named = {label for label in labels if HIGHLIGHTED in label.lower()}
    return named if len(named) < len(set(labels)) else set()


#: line styles that tell curves apart without colour too (grey print, colour blindness): cycled with the colours
LINE_STYLES = ["-", "--", "-.", ":"]
#: markers on the curves, cycled likewise (a marker shows where a round was evaluated)
LINE_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]


#: hatches of the bars of a grouped bar chart, cycled: bars told apart without colour too
BAR_HATCHES = ["", "//", "..", "xx", "\\\\", "oo", "--", "++"]


def line_style(index: int) -> dict:
    """The ``index``-th curve's colour (tab10), line style and marker: no two of the first 10 curves share a
    colour, and neighbours in the legend differ in line style and marker too."""
    plt = pyplot()
    return {"color": plt.get_cmap("tab10")(index % 10), "linestyle": LINE_STYLES[index % len(LINE_STYLES)],
            "marker": LINE_MARKERS[index % len(LINE_MARKERS)]}


def integer_ticks(axis, which: str = "x") -> None:
    """Only whole numbers as ticks on ``which`` axis (rounds: a 2-round run gets 1 and 2, never 1.25)."""
    from matplotlib.ticker import MaxNLocator

    (axis.xaxis if which == "x" else axis.yaxis).set_major_locator(MaxNLocator(integer=True))


def plot_curves(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], path: str | os.PathLike, *,
                title: str = "", xlabel: str = "round", ylabel: str = "", log_y: bool = False,
                styles: Mapping[str, dict] | None = None):
    """One line per entry of ``series`` (label -> (x, y)) on one axis, each in its own colour, line style and
    marker (:func:`line_style`); FedHPro's line drawn thicker; "... before" / "... after" pairs share a colour
    and marker, "after" dashed. Rounds (``xlabel="round"``) get whole-number ticks. Returns the figure
    (closed, written to ``path``), whose axes a caller may inspect."""
    plt = pyplot()
    import re

    figure, axis = plt.subplots(figsize=(6.8, 4.2), dpi=130)
    thick = highlighted(list(series))
    pairs: dict[str, int] = {}
    for label, (x, y) in series.items():
        # "<run>: ... before" / "... after" pairs share a colour and marker; "after" is dashed
        pair = re.sub(r"(before|after)( matching)?$", "", label)
        index = pairs.setdefault(pair, len(pairs))
        style = dict(line_style(index), linewidth=2.6 if label in thick else 1.6,
                     markersize=4)
        if pair != label:
            style["linestyle"] = "--" if label.rstrip().endswith(("after", "after matching")) else "-"
        style.update((styles or {}).get(label, {}))
        axis.plot(list(x), list(y), label=display_label(label), **style)
    if log_y:
        axis.set_yscale("log")
    _finish(axis, title, xlabel, ylabel)
    if series:
        axis.legend(fontsize=8)
    save_figure(figure, path)
    return figure


def _finish(axis, title: str, xlabel: str, ylabel: str) -> None:
    """The parts every curve plot shares: whole-number ticks on a round axis, axis labels, the title (none
    when empty), a light grid."""
    if xlabel == "round":
        integer_ticks(axis)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if title:
        axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)


def plot_run_accuracy(history: Sequence[Mapping[str, Any]], path: str | os.PathLike, title: str = ""):
    """A run's ``accuracy.png``: test accuracy per round of each test set (domain) and of AVG, from its
    metrics rows (those with ``accuracy``); AVG thick, solid and black, each domain in its own colour, line
    style and marker. Nothing is written when no round was evaluated. Returns the figure (closed) or None."""
    rows = [row for row in history if "accuracy" in row]
    if not rows:
        return None
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    rounds = [int(row["round"]) + 1 for row in rows]
    names = [name for name in rows[0]["accuracy"] if name != "AVG"]
    if len(names) == 1:  # one test set: its AVG is its accuracy; one curve, named by it, not two on one line
        axis.plot(rounds, [row["accuracy"].get(names[0]) for row in rows], label=names[0], color="black",
                  linewidth=2.4, linestyle="-", marker="o", markersize=4)
        names = []
    for index, name in enumerate(names):
        # index + 1: the first style (solid, circles) is AVG's
        axis.plot(rounds, [row["accuracy"].get(name) for row in rows], label=name, linewidth=1.3, markersize=4,
                  **line_style(index + 1))
    if "AVG" in rows[0]["accuracy"] and names:
        axis.plot(rounds, [row["accuracy"].get("AVG") for row in rows], label="AVG", color="black", linewidth=2.4,
                  linestyle="-", marker="o", markersize=4)
    _finish(axis, title, "round", "test accuracy (%)")
    axis.legend(fontsize=8)
    save_figure(figure, path)
    return figure


def plot_mean_curves(groups: Mapping[str, Sequence[tuple[Sequence[float], Sequence[float]]]],
                     path: str | os.PathLike, *, title: str = "", xlabel: str = "round", ylabel: str = ""):
    """Per group (label -> one ``(x, y)`` curve per seed): the mean curve over its curves, with a shaded band
    from their minimum to their maximum, at the x every curve has. Each group in its own colour, line style
    and marker (:func:`line_style`), in the order of ``groups`` (the legend's order too), FedHPro's line
    thicker (:func:`highlighted`); whole-number round ticks. Returns the figure (closed, written to ``path``)."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6.8, 4.2), dpi=130)
    thick = highlighted(list(groups))
    for index, (label, curves) in enumerate(groups.items()):
        x, mean, low, high = mean_band(curves)
        if not x:
            continue
        style = line_style(index)
        seeds = len(curves)
        shown = display_label(label)
        axis.plot(x, mean, label=f"{shown} (mean of {seeds})" if seeds > 1 else shown,
                  linewidth=2.9 if label in thick else 1.8, markersize=4, **style)
        if seeds > 1:
            axis.fill_between(x, low, high, color=style["color"], alpha=0.18, linewidth=0)
    _finish(axis, title, xlabel, ylabel)
    if groups:
        axis.legend(fontsize=8, title="shaded: min to max over seeds", title_fontsize=7)
    save_figure(figure, path)
    return figure


def mean_band(curves: Sequence[tuple[Sequence[float], Sequence[float]]]
              ) -> tuple[list[float], list[float], list[float], list[float]]:
    """``(x, mean, min, max)`` of several ``(x, y)`` curves at the x values all of them have, in order."""
    points = [dict(zip(map(float, x), map(float, y))) for x, y in curves]
    if not points:
        return [], [], [], []
    shared = sorted(set(points[0]).intersection(*points[1:]))
    values = [[curve[at] for curve in points] for at in shared]
    return (shared, [sum(v) / len(v) for v in values], [min(v) for v in values], [max(v) for v in values])


#: figure widths a paper takes (inches): one column, and the page
COLUMN_WIDTH, PAGE_WIDTH = 3.4, 7.0
#: the most bars one row of a bar figure holds before the groups wrap into another row
BARS_PER_ROW = 64


def plot_bars(groups: Mapping[str, Mapping[str, float]], path: str | os.PathLike, *, title: str = "",
              ylabel: str = "", xlabel: str = "", errors: Mapping[str, Mapping[str, float]] | None = None):
    """Grouped bars: one group per metric (the inner keys), one bar per entry of ``groups`` (e.g. a method).
    Sized for a paper: between a column and a page wide (:data:`COLUMN_WIDTH`, :data:`PAGE_WIDTH`); more than
    :data:`BARS_PER_ROW` bars wrap into rows (62 classes never make a 31-inch figure), each row with ``xlabel``.
    Returns the figure (closed, written to ``path``)."""
    plt = pyplot()
    labels = list(groups)
    metrics = list(next(iter(groups.values()))) if groups else []
    per_row = max(1, BARS_PER_ROW // max(len(labels), 1))
    chunks = [metrics[i:i + per_row] for i in range(0, len(metrics), per_row)] or [[]]
    inches = min(PAGE_WIDTH, max(COLUMN_WIDTH, 0.17 * len(chunks[0]) * max(len(labels), 1) + 1.2))
    figure, axes = plt.subplots(len(chunks), 1, figsize=(inches, 2.6 * len(chunks) + 0.6), dpi=130, squeeze=False)
    width = 0.8 / max(len(labels), 1)
    for row, (axis, chunk) in enumerate(zip(axes[:, 0], chunks)):
        for i, label in enumerate(labels):
            x = np.arange(len(chunk)) + (i - (len(labels) - 1) / 2) * width
            values = [groups[label].get(m, np.nan) for m in chunk]
            spread = [(errors or {}).get(label, {}).get(m, 0.0) for m in chunk]
            bars = axis.bar(x, values, width, yerr=spread if errors else None, capsize=2,
                            label=display_label(label), hatch=BAR_HATCHES[i % len(BAR_HATCHES)], edgecolor="white",
                            linewidth=0.5)
            if len(chunk) * len(labels) <= 20:  # values on the bars only where they stay readable
                axis.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
        axis.set_xticks(np.arange(len(chunk)), chunk, fontsize=7 if len(chunk) > 12 else 9,
                        rotation=90 if len(chunk) > 12 else 0)
        axis.set_ylabel(ylabel, fontsize=8)
        axis.set_xlabel(xlabel, fontsize=8)
        axis.grid(alpha=0.3, axis="y")
        if row == 0:
            if title:
                axis.set_title(title, fontsize=9)
            axis.legend(fontsize=7)
    save_figure(figure, path)
    return figure


def plot_sweep(x: Sequence[float | str], series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
               path: str | os.PathLike, *, title: str = "", xlabel: str = "", ylabel: str = "test accuracy (%)",
               reference: Mapping[str, Sequence[float | None]] | None = None):
    """Accuracy against a swept setting: our mean ± std (error bars) per series, FedHPro's line thicker
    (:func:`highlighted`); the paper's values, where given in ``reference`` (label -> values aligned with
    ``x``), as dashed lines. Returns the figure (closed, written to ``path``)."""
    plt = pyplot()
    thick = highlighted(list(series))
    figure, axis = plt.subplots(figsize=(6.0, 4.0), dpi=130)
    positions = np.arange(len(x))
    colours = {}
    base = lambda label: label.replace(" (ours)", "").replace(" (paper)", "")  # noqa: E731
    for index, (label, (means, stds)) in enumerate(series.items()):
        line = axis.errorbar(positions, means, yerr=stds, marker=LINE_MARKERS[index % len(LINE_MARKERS)],
                             capsize=3, linewidth=3.2 if label in thick else 2,
                             label=display_label(label))
        colours[base(label)] = line.lines[0].get_color()
    for label, values in (reference or {}).items():
        points = [(p, v) for p, v in zip(positions, values) if v is not None]
        if points:  # the paper's values: dashed, in the colour of the same method's line
            axis.plot(*zip(*points), linestyle="--", marker="x", color=colours.get(base(label), "grey"),
                      label=display_label(label))
    axis.set_xticks(positions, [str(v) for v in x])
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if title:
        axis.set_title(title, fontsize=10)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    save_figure(figure, path)
    return figure


def plot_tsne(points: np.ndarray, labels: Sequence[int] | np.ndarray, domains: Sequence[str] | np.ndarray,
              path: str | os.PathLike, *, title: str = "", prototype_points: np.ndarray | None = None,
              prototype_labels: Sequence[int] | np.ndarray | None = None, prototype_name: str = "prototypes") -> None:
    """t-SNE scatter: colour = class, marker = domain; prototypes (if given) as large black-edged stars,
    coloured by ``prototype_labels`` (required with ``prototype_points``)."""
    with_prototypes = prototype_points is not None and len(prototype_points) > 0
    if with_prototypes and prototype_labels is None:
        raise ValueError("plot_tsne: prototype_points need prototype_labels (the class of each prototype)")
    plt = pyplot()
    label_array = np.asarray(labels)
    domain_array = np.asarray(domains)
    names = list(dict.fromkeys(domain_array.tolist()))
    colours = plt.get_cmap("tab10")
    figure, axis = plt.subplots(figsize=(6.4, 5.6), dpi=130)
    for j, name in enumerate(names):
        where = domain_array == name
        axis.scatter(points[where, 0], points[where, 1], c=[colours(int(c) % 10) for c in label_array[where]],
                     marker=MARKERS[j % len(MARKERS)], s=10, alpha=0.6, linewidths=0,
                     rasterized=True)  # thousands of points: a bitmap inside the SVG keeps it small
    if with_prototypes:
        assert prototype_points is not None and prototype_labels is not None  # checked above
        axis.scatter(prototype_points[:, 0], prototype_points[:, 1],
                     c=[colours(int(c) % 10) for c in prototype_labels], marker="*", s=260,
                     edgecolors="black", linewidths=1.0, zorder=5)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker=MARKERS[j % len(MARKERS)], color="grey", linestyle="", label=name)
               for j, name in enumerate(names)]
    handles += [Line2D([], [], marker="o", color=colours(c % 10), linestyle="", label=f"class {c}")
                for c in sorted(set(label_array.tolist()))]
    if with_prototypes:
        handles.append(Line2D([], [], marker="*", color="white", markeredgecolor="black", markersize=12,
                              linestyle="", label=prototype_name))
    axis.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    axis.set_xticks([])
    axis.set_yticks([])
    if title:
        axis.set_title(title, fontsize=10)
    save_figure(figure, path)
