"""What a builder makes of a part's runs (:class:`Table`: sections, CSV rows, figures to draw, checks of the
ordering against the paper) and the cells and checks every builder shares."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fedhpro.reports.runs import RunData
from fedhpro.reports.tables import mean_pm_std
from fedhpro.reproduce.targets import Part

#: CSV columns of the tables whose rows are (part, row, column) cells
CELL_HEADER = ("part", "row", "column", "ours_mean", "ours_std", "paper")
#: CSV columns of the figures' tables, whose rows are (part, row, measure) values
MEASURE_HEADER = ("part", "row", "measure", "ours_mean", "ours_std", "paper")


@dataclass
class Section:
    """One part's sub-table: its header, rows and the notes below it; a part that did not run has only
    ``skipped``, the line saying why."""

    part: str
    header: list[str] = field(default_factory=list)
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str = ""


@dataclass(frozen=True)
class Figure:
    """A plot the emitter draws into the target's folder: ``kind`` names the drawing function (see
    :data:`fedhpro.reproduce.emitter.PLOTS`), called as ``draw(*data, path, **options)``."""

    file: str
    kind: str
    data: tuple
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Table:
    """A target's (or one part's) output before it is written: the emitter renders and writes it."""

    csv_header: list[str] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    csv_rows: list[list[Any]] = field(default_factory=list)
    figures: list[Figure] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def extend(self, other: Table) -> None:
        self.sections += other.sections
        self.csv_rows += other.csv_rows
        self.figures += other.figures
        self.checks += other.checks


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-").lower() or "run"


def short_title(title: str) -> str:
    """``"Table 3"`` of ``"Table 3: ..."``: the figures' title prefix."""
    return title.split(":")[0]


def part_note(note: str) -> list[str]:
    """The part's own note (e.g. the data set it fell back to) as a table note, if any."""
    return [note] if note else []


def column_names(part: Part, domains: list[str]) -> list[str]:
    """The paper's column names with ours in brackets where the data set differs (optdigits for USPS)."""
    names = []
    for index, domain in enumerate(domains):
        paper = part.columns[index] if index < len(part.columns) else domain
        names.append(paper if paper.lower() == domain.lower() else f"{paper} (ours: {domain})")
    return names


def cell(values: Sequence[float | None], paper: float | None) -> str:
    ours = mean_pm_std(values)
    return f"{ours} / {paper:.2f}" if paper is not None else f"{ours} / –"


def paper_value(part: Part, row: str, index: int) -> float | None:
    values = part.paper.get(row)
    if values is None or index >= len(values):
        return None
    return values[index]


def signed(value: float | None, suffix: str = "") -> str:
    """``+1.23`` (two decimals, with its sign), or ``–`` for no value."""
    return "–" if value is None else f"{value:+.2f}{suffix}"


def difference(a: float | None, b: float | None) -> float | None:
    """``a - b``, or None when either is missing."""
    return None if a is None or b is None else a - b


def kendall_tau(a: list[float], b: list[float]) -> float | None:
    """Kendall's tau-a between two score lists (1: same ordering, -1: reversed)."""
    n = len(a)
    if n < 2:
        return None
    concordant = discordant = 0
    for i in range(n):
        for j in range(i + 1, n):
            s = (a[i] - a[j]) * (b[i] - b[j])
            concordant += s > 0
            discordant += s < 0
    return (concordant - discordant) / (n * (n - 1) / 2)


def ordering_check(part: str, labels: list[str], ours: list[float | None], paper: list[float | None],
                   higher_is_better: bool = True, what: str = "AVG") -> str | None:
    """One line: the best row in ours and in the paper's, and the rank correlation of the two orderings."""
    rows = [(label, o, p) for label, o, p in zip(labels, ours, paper) if o is not None and p is not None]
    if len(rows) < 2:
        return None
    sign = 1 if higher_is_better else -1
    tau = kendall_tau([o for _, o, _ in rows], [p for _, _, p in rows])
    best_ours = max(rows, key=lambda r: sign * r[1])[0]
    best_paper = max(rows, key=lambda r: sign * r[2])[0]
    verdict = "matches" if best_ours == best_paper else "does NOT match"
    return (f"{part} ({what}): best row ours = {best_ours}, paper = {best_paper} -> {verdict}; "
            f"Kendall tau of the {len(rows)} rows' ordering vs the paper's = {tau:+.2f}")


def fedhpro_row(labels: list[str]) -> str | None:
    return next((label for label in labels if label.lower().startswith("fedhpro")), None)


def best_row_check(part: str, scores: dict[str, float | None], lowest: bool, claim: str, what: str) -> list[str]:
    """The line saying whether FedHPro's row is the best of ``scores`` (lowest or highest), as the paper's
    figure ``claim``s; rows without a score (None: no finite value over the seeds) are not ranked, and
    there is no line without a scored FedHPro row."""
    ranked = {label: score for label, score in scores.items() if score is not None}
    fed = fedhpro_row(list(ranked))
    if not fed:
        return []
    best = (min if lowest else max)(ranked, key=ranked.__getitem__)
    return [f"{part}: {claim}; ours: {what} = {best} -> " + ("matches" if best == fed else "does NOT match")]


def mean_curve(runs: list[RunData]) -> tuple[list[int], list[float]]:
    """Mean AVG accuracy per evaluated round over the seeds."""
    rounds = [row["round"] + 1 for row in runs[0].evaluated]
    values = [sum(run.evaluated[i]["accuracy"]["AVG"] for run in runs) / len(runs) for i in range(len(rounds))]
    return rounds, values
