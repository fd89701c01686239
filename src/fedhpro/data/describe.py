"""``fedhpro data describe``: who holds what in a federation, as a table and a client x class heat map.

In the spirit of the paper's Figure A1: one row per client (its domain,
sample count and the classes it holds), one heat-map cell per client and
class with that client's sample count.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fedhpro.data.federation import Federation


def class_counts(federation: Federation) -> np.ndarray:
    """K x C matrix: training samples of class c held by client k."""
    counts = np.zeros((federation.num_clients, federation.num_classes), dtype=np.int64)
    for k, client in enumerate(federation.clients):
        counts[k] = np.bincount(client.y.cpu().numpy(), minlength=federation.num_classes)[:federation.num_classes]
    return counts


def _classes_text(present: np.ndarray, num_classes: int) -> str:
    """``"all 10"``, or the class ids as ranges (``"0-3,7"``) when short, else a count."""
    ids = np.flatnonzero(present).tolist()
    if len(ids) == num_classes:
        return f"all {num_classes}"
    ranges, start = [], None
    for i, c in enumerate(ids):
        if start is None:
            start = c
        if i + 1 == len(ids) or ids[i + 1] != c + 1:
            ranges.append(str(start) if start == c else f"{start}-{c}")
            start = None
    text = ",".join(ranges)
    return text if len(text) <= 24 else f"{len(ids)} of {num_classes}"


def table(federation: Federation) -> str:
    """A text table: client, domain, samples, number of classes present, which classes."""
    counts = class_counts(federation)
    domains = [d or "-" for d in (federation.client_domains or [""] * federation.num_clients)]
    rows = [(str(k), domains[k], str(int(counts[k].sum())), str(int((counts[k] > 0).sum())),
             _classes_text(counts[k] > 0, federation.num_classes)) for k in range(federation.num_clients)]
    header = ("client", "domain", "samples", "classes", "which")
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    align = [str.rjust, str.ljust, str.rjust, str.rjust, str.ljust]
    lines = ["  ".join(a(h, w) for a, h, w in zip(align, header, widths))]
    lines += ["  ".join(a(v, w) for a, v, w in zip(align, row, widths)) for row in rows]
    total = int(counts.sum())
    tests = ", ".join(f"{name} {int(y.shape[0])}" for name, (_, y) in federation.test_sets.items())
    lines.append(f"{federation.num_clients} clients, {total} training samples, {federation.num_classes} classes; "
                 f"test sets: {tests}")
    return "\n".join(lines)


def plot_heatmap(federation: Federation, path: str | os.PathLike, title: str | None = None) -> Path:
    """PNG heat map of client x class sample counts (numbers in the cells when they fit), written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedhpro.files import write_atomic_with

    counts = class_counts(federation)
    k, c = counts.shape
    width = min(max(6.0, 0.45 * c + 2.5), 14.0)  # many classes: narrower cells, not a banner
    height = min(max(4.0, 0.35 * k + 1.8), 14.0)
    figure, axes = plt.subplots(figsize=(width, height), dpi=110)
    shown = np.where(counts > 0, counts, np.nan)  # empty cells stay white
    image = axes.imshow(shown, aspect="auto", cmap="viridis", interpolation="nearest")
    figure.colorbar(image, ax=axes, label="training samples")
    domains = federation.client_domains or [""] * k
    labels = [f"{i} ({d})" if d else str(i) for i, d in enumerate(domains)]
    axes.set_yticks(range(k) if k <= 60 else np.linspace(0, k - 1, 20, dtype=int))
    axes.set_yticklabels(labels if k <= 60 else [labels[i] for i in np.linspace(0, k - 1, 20, dtype=int)])
    step = 1 if c <= 40 else int(np.ceil(c / 40))
    axes.set_xticks(range(0, c, step))
    axes.set_xlabel("class")
    axes.set_ylabel("client (domain)" if any(domains) else "client")
    if k * c <= 400:
        high = np.nanmax(shown) if np.isfinite(shown).any() else 1
        for i in range(k):
            for j in range(c):
                if counts[i, j]:
                    axes.text(j, i, str(counts[i, j]), ha="center", va="center", fontsize=7,
                              color="black" if counts[i, j] > 0.6 * high else "white")
    scheme = federation.partition.get("scheme", "")
    axes.set_title(title or f"{federation.name}: samples per client and class"
                   + (f" ({scheme} partition)" if scheme else ""))
    figure.tight_layout()
    path = Path(path)
    write_atomic_with(path, lambda handle: figure.savefig(handle, format="png"))
    plt.close(figure)
    return path


__all__ = ["class_counts", "plot_heatmap", "table"]
