"""Tables as Markdown and CSV text (written by the callers with the atomic writers)."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from typing import Any

from fedhpro.files import spreadsheet_cell
from fedhpro.reports.significance import Verdicts, interval_cell


def dotted_keys(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as one level: ``{"fedhpro": {"tau": 0.05}}`` -> ``{"fedhpro.tau": 0.05}``."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(dotted_keys(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


#: a whole float at least this large is a count (samples, bytes, parameters: a mean over seeds of equal
#: counts), shown without decimals; accuracies (at most 100) and losses keep theirs
WHOLE_COUNT = 1000.0


def format_number(value: Any, digits: int = 2) -> str:
    """``None``/NaN -> "–"; a whole float of at least :data:`WHOLE_COUNT` as an integer (317928, never
    317928.00); other floats with ``digits`` decimals; anything else as text."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) >= WHOLE_COUNT:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = "",
                   notes: Sequence[str] = ()) -> str:
    """A GitHub-flavoured Markdown table (cells formatted with :func:`format_number`), a caption above
    and notes below."""
    lines = []
    if caption:
        lines += [caption, ""]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    for row in rows:
        lines.append("| " + " | ".join(format_number(cell) for cell in row) + " |")
    if notes:
        lines.append("")
        lines += [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def csv_text(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """CSV with full precision floats (empty cells for None/NaN); text that starts like a spreadsheet formula
    escaped (:func:`fedhpro.files.spreadsheet_cell`)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow([spreadsheet_cell(name) for name in header])
    for row in rows:
        writer.writerow(["" if cell is None or (isinstance(cell, float) and math.isnan(cell))
                         else (f"{cell:.6g}" if isinstance(cell, float) else spreadsheet_cell(cell)) for cell in row])
    return buffer.getvalue()


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (0 for one value) of the non-None values; (None, None) if none."""
    present = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not present:
        return None, None
    mean = sum(present) / len(present)
    if len(present) == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in present) / (len(present) - 1))


def mean_pm_std(values: Sequence[float | None], digits: int = 2) -> str:
    """"84.80 ± 0.31" (or "84.80" for one seed; "–" for none)."""
    mean, std = mean_std(values)
    if mean is None:
        return "–"
    count = sum(1 for v in values if v is not None)
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if count > 1 else f"{mean:.{digits}f}"


#: the CSV columns a comparison table adds for its tested column (after the interval columns of every column):
#: the raw and Holm-adjusted p value of the paired test against the baseline row, and the row's marks
TEST_COLUMNS = ("p_vs_baseline", "p_vs_baseline_holm", "mark")


def marked_cell(mean: float | None, interval: tuple[float, float] | None, mark: str = "", digits: int = 2) -> str:
    """``"81.25 [78.28, 84.22] ★▲"``: the mean, its 95 % t-interval (:func:`~fedhpro.reports.significance.
    interval_cell`) and the marks :meth:`~fedhpro.reports.significance.Verdicts.mark` gives, if any."""
    text = interval_cell(mean, interval, digits)
    return f"{text} {mark}" if mark and text != "–" else text


def interval_bounds(result: Verdicts, row: str) -> list[float | None]:
    """``[low, high]`` of ``row``'s interval in ``result`` (``[None, None]`` with fewer than 2 seeds)."""
    interval = result.intervals.get(row)
    return [None, None] if interval is None else [float(interval[0]), float(interval[1])]


def verdict_fields(result: Verdicts, row: str) -> list[Any]:
    """``row``'s :data:`TEST_COLUMNS`: its raw and Holm-adjusted p value against the baseline (None for the
    baseline itself, or when nothing was tested) and its marks ("" for none)."""
    return [result.p_baseline.get(row), result.p_baseline_holm.get(row), result.mark(row)]
