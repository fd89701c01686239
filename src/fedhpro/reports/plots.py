"""Plots of runs in one style: a run's accuracy per round, curves of several runs on one axis, grouped
bars, parameter sweeps, t-SNE.

One style for every figure fedhpro writes (a run's ``accuracy.png``, ``fedhpro compare``, ``fedhpro
report``): whole-number round ticks, curves told apart by line style and marker as well as colour, methods
named as the paper writes them (:func:`display_name`), an optional title, and beside each PNG the same
figure as SVG (vector, its text kept as text). Every file is written atomically
(:func:`fedhpro.files.write_atomic_with`).
"""

from __future__ import annotations

import math
import os
import re
import textwrap
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
        if figure.get_layout_engine() is not None:
            # the layout the first file was drawn with holds for the copies (it is in inches and points, the same
            # at any resolution): not worked out twice more
            figure.set_layout_engine("none")
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
#: whether a method is the one comparisons measure the others against (its entry's ``baseline``), likewise
_baseline: Callable[[str], bool] = lambda method: False  # noqa: E731


def set_describer(describe: Callable[[str], str | None], place: Callable[[str], int | None] | None = None,
                  baseline: Callable[[str], bool] | None = None) -> None:
    """Where :func:`display_name` reads a method's description, :func:`paper_order` its place and
    :func:`is_baseline` whether it is the baseline (``fedhpro.methods`` gives its registry's)."""
    global _describe, _place, _baseline
    _describe = describe
    if place is not None:
        _place = place
    if baseline is not None:
        _baseline = baseline


def is_baseline(method: str) -> bool:
    """Whether ``method`` is the registered baseline of comparisons (FedAvg's ``MethodSpec.baseline``)."""
    return bool(_baseline(method))


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
#: the resolution of the figures a paper prints (bar and confusion figures): 3.4 in are 1020 pixels
PRINT_DPI = 300
#: the most bars one row of a bar figure holds before the groups wrap into another row
BARS_PER_ROW = 64
#: the size (points) of the numbers on bars, the smallest that still prints readably at a column's width
VALUE_FONT = 6.5
#: an average glyph's width as a share of the font size (DejaVu Sans), to judge what fits before drawing
GLYPH_WIDTH = 0.6


def _text_inches(text: str, fontsize: float) -> float:
    """About how wide ``text`` is set at ``fontsize`` points (inches), its longest line."""
    return max((len(line) for line in text.split("\n")), default=0) * GLYPH_WIDTH * fontsize / 72


def wrap_text(text: str, inches: float, fontsize: float) -> str:
    """``text`` broken at spaces into lines that fit ``inches`` at ``fontsize`` points (existing line breaks
    kept): a title never runs past the figure's edges."""
    chars = max(8, int(inches * 72 / (GLYPH_WIDTH * fontsize)))
    return "\n".join(textwrap.fill(line, chars, break_on_hyphens=False) if line else line
                     for line in text.split("\n"))


def plot_bars(groups: Mapping[str, Mapping[str, float]], path: str | os.PathLike, *, title: str = "",
              ylabel: str = "", xlabel: str = "",
              errors: Mapping[str, Mapping[str, float | tuple[float, float]]] | None = None,
              width: float | None = None):
    """Grouped bars: one group per metric (the inner keys), one bar per entry of ``groups`` (e.g. a method),
    ``errors`` (same keys) drawn as error bars: symmetric (one number) or ``(below, above)`` (an interval cut
    to the range of its measure). Sized for a paper: ``width`` inches, default between
    a column and a page wide (:data:`COLUMN_WIDTH`, :data:`PAGE_WIDTH`) by the bars' count, at
    :data:`PRINT_DPI`; more than :data:`BARS_PER_ROW` bars wrap into rows (62 classes never make a 31-inch
    figure), each row with ``xlabel``. Nothing is cut at any width: the title and the group names wrap to fit,
    the legend goes below the axes, the layout is matplotlib's constrained one. Each bar's value stands above
    its error bar, upright where it fits the bar's width, else turned, else (bars too thin to read) left out.
    Returns the figure (closed, written to ``path``)."""
    plt = pyplot()
    labels = list(groups)
    metrics = list(next(iter(groups.values()))) if groups else []
    per_row = max(1, BARS_PER_ROW // max(len(labels), 1))
    chunks = [metrics[i:i + per_row] for i in range(0, len(metrics), per_row)] or [[]]
    inches = width if width is not None else \
        min(PAGE_WIDTH, max(COLUMN_WIDTH, 0.17 * len(chunks[0]) * max(len(labels), 1) + 1.2))
    title_font = 8 if inches < 5 else 9
    shown_title = wrap_text(title, inches - 0.2, title_font) if title else ""
    names = [display_label(label) for label in labels]
    legend_columns = max(1, min(len(labels), int((inches - 0.3) // max(0.5, _text_inches(max(names, key=len,
                                                                                          default=""), 7) + 0.45))))
    extra = (0.16 * (shown_title.count("\n") + 1) if title else 0) + 0.16 * -(-len(labels) // legend_columns)
    figure = plt.figure(figsize=(inches, 2.4 * len(chunks) + 0.5 + extra), dpi=PRINT_DPI, layout="constrained")
    axes = figure.subplots(len(chunks), 1, squeeze=False, sharey=True)
    width_share = 0.8 / max(len(labels), 1)
    axis_inches = inches - 0.75  # the y axis's label and ticks take the rest
    limits = []  # each row's (lowest, highest, axis top): every row gets one y range, to compare across rows
    for axis, chunk in zip(axes[:, 0], chunks):
        bar_inches = axis_inches / max(len(chunk), 1) * width_share
        tops = []
        for i, label in enumerate(labels):
            x = np.arange(len(chunk)) + (i - (len(labels) - 1) / 2) * width_share
            values = [float(groups[label].get(m, np.nan)) for m in chunk]
            spread = [_error_pair((errors or {}).get(label, {}).get(m)) for m in chunk]
            axis.bar(x, values, width_share, yerr=np.array(spread).T if errors and chunk else None, capsize=2,
                     error_kw={"elinewidth": 0.8, "capthick": 0.8}, label=names[i],
                     hatch=BAR_HATCHES[i % len(BAR_HATCHES)], edgecolor="white", linewidth=0.5,
                     color=plt.get_cmap("tab10")(i % 10))
            tops += [(at, value, value + above if math.isfinite(above) else value,
                      value - below if math.isfinite(below) else value)
                     for at, value, (below, above) in zip(x, values, spread) if math.isfinite(value)]
        if tops:
            limits.append(_value_labels(axis, tops, bar_inches))
        _tick_labels(axis, chunk, axis_inches)
        axis.set_ylabel(ylabel, fontsize=8)
        axis.set_xlabel(xlabel, fontsize=8)
        axis.tick_params(axis="y", labelsize=7)
        axis.grid(alpha=0.3, axis="y")
        axis.set_axisbelow(True)
    if limits:
        low, high, top = min(v[0] for v in limits), max(v[1] for v in limits), max(v[2] for v in limits)
        for axis in axes[:, 0]:
            axis.set_ylim(low, top)
            # no tick past the highest value shown (an accuracy axis reading 120 %)
            axis.set_yticks([tick for tick in axis.get_yticks() if low <= tick <= max(high, 1e-12) * 1.0001])
    if labels:
        # below the axes: above them it would meet the title, inside it would cover bars; one entry per bar
        # series (the first row's: every row holds the same series)
        handles, entries = axes[0, 0].get_legend_handles_labels()
        figure.legend(handles, entries, loc="outside lower center", ncols=legend_columns, fontsize=7,
                      frameon=False)
    if title:
        figure.suptitle(shown_title, fontsize=title_font)
    save_figure(figure, path, tight_layout=False)
    return figure


def _error_pair(error: float | tuple[float, float] | None) -> tuple[float, float]:
    """``(below, above)`` of one bar's error: a number is both, None none."""
    if isinstance(error, tuple):
        return float(error[0] or 0.0), float(error[1] or 0.0)
    return float(error or 0.0), float(error or 0.0)


def _value_labels(axis, tops: Sequence[tuple[float, float, float, float]],
                  bar_inches: float) -> tuple[float, float, float]:
    """Each bar's value (``(x, value, top of its error bar, its bottom)``) just above the top of its error bar
    (a negative bar's at zero): upright where the widest value fits the bar, else turned a quarter, else none
    (the bars are too thin to read). Returns the y range the row needs: its lowest point (zero unless a value
    is negative), its highest and the axis top that leaves every label inside the axis."""
    texts = [f"{value:.1f}" for _, value, _, _ in tops]
    wide = max(_text_inches(text, VALUE_FONT) for text in texts)
    upright = wide <= bar_inches * 1.05
    turned = not upright and VALUE_FONT / 72 * 1.25 <= bar_inches
    # the axis starts at zero when no value is negative (an interval past zero, of an accuracy, is cut there)
    low = min(bottom for _, _, _, bottom in tops) if any(value < 0 for _, value, _, _ in tops) else 0.0
    low = min(0.0, low)
    high = max(0.0, max(top for _, _, top, _ in tops))
    if not (upright or turned):
        return low, high, high * 1.05 if high > 0 else 1.0
    for (at, _, top, _), text in zip(tops, texts):
        axis.annotate(text, (at, max(top, 0.0)), xytext=(0, 2), textcoords="offset points", ha="center",
                      va="bottom", fontsize=VALUE_FONT, rotation=0 if upright else 90)
    # the labels' height as a share of the axis (about 1.9 in tall): the room added above the highest top
    label_inches = (VALUE_FONT / 72 * 1.3 if upright else wide) + 4 / 72
    share = min(0.6, label_inches / 1.6)
    return low, high, high + ((high - low) or 1.0) * share / (1 - share)


def _tick_labels(axis, chunk: Sequence[str], axis_inches: float) -> None:
    """The groups' names under their bars: broken at spaces to fit a group's width, turned a quarter when a
    word still does not (or there are many groups)."""
    fontsize = 7 if len(chunk) > 12 else 8
    group_inches = axis_inches / max(len(chunk), 1)
    # "head (3 classes)" too wide for one line breaks before its parenthesis first
    shown = [wrap_text(name if _text_inches(name, fontsize) <= group_inches * 0.95 else name.replace(" (", "\n(", 1),
                       group_inches * 0.95, fontsize) for name in chunk]
    turned = len(chunk) > 12 or any(_text_inches(name, fontsize) > group_inches * 0.95 for name in shown)
    axis.set_xticks(np.arange(len(chunk)), list(chunk) if turned else shown, fontsize=fontsize,
                    rotation=90 if turned else 0)


def plot_confusion(matrix: Sequence[Sequence[int]], names: Sequence[str], path: str | os.PathLike, *,
                   title: str = "", width: float | None = None):
    """A confusion matrix as scikit-learn's :class:`~sklearn.metrics.ConfusionMatrixDisplay` draws it (rows
    the true class, columns the predicted one, counts in the cells, a colour bar), sized for a paper:
    ``width`` inches, default a column's for up to 8 classes and growing to a page's, at :data:`PRINT_DPI`.
    The counts are written in the cells only where they fit. Returns the figure (closed, written to
    ``path``, with its PDF and SVG)."""
    from sklearn.metrics import ConfusionMatrixDisplay  # lazy: scikit-learn takes ~1.5 s to import, for one figure

    plt = pyplot()
    counts = np.asarray(matrix, dtype=np.int64)
    n = len(names)
    inches = width if width is not None else min(PAGE_WIDTH, max(COLUMN_WIDTH, 0.3 * n + 1.4))
    title_font = 8 if inches < 5 else 9
    shown_title = wrap_text(title, inches - 0.2, title_font) if title else ""
    cell = (inches - 1.5) / max(n, 1)  # the colour bar and the true-class axis take the rest
    digits = len(str(int(counts.max()))) if counts.size else 1
    fontsize = min(8.0, cell * 72 / (GLYPH_WIDTH * max(digits, 2) * 1.15))
    figure = plt.figure(figsize=(inches, inches - 0.6 + 0.16 * (shown_title.count("\n") + 1)), dpi=PRINT_DPI,
                        layout="constrained")
    axis = figure.subplots()
    tick_font = min(8.0, max(5.0, cell * 72 * 0.7))
    turned = any(_text_inches(str(name), tick_font) > cell * 0.9 for name in names)
    ConfusionMatrixDisplay(counts, display_labels=[str(name) for name in names]).plot(
        ax=axis, cmap="Blues", colorbar=True, include_values=fontsize >= 4.5, values_format="d",
        xticks_rotation="vertical" if turned else "horizontal", text_kw={"fontsize": max(fontsize, 4.5)})
    axis.set_xlabel("predicted class", fontsize=8)
    axis.set_ylabel("true class", fontsize=8)
    axis.tick_params(labelsize=tick_font)
    figure.axes[-1].tick_params(labelsize=7)  # the colour bar's counts
    if title:
        axis.set_title(shown_title, fontsize=title_font)
    save_figure(figure, path, tight_layout=False)
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
