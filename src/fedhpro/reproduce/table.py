"""What a builder makes of a part's runs (:class:`Table`: sections, CSV rows, figures to draw, checks of the
ordering against the paper) and the cells and checks every builder shares."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fedhpro.reports import significance
from fedhpro.reports.run_data import RunData, run_seed
from fedhpro.reports.significance import Verdicts, t_interval, verdicts
from fedhpro.reports.tables import interval_bounds, marked_cell, mean_std, verdict_fields
from fedhpro.reproduce.targets import Part

#: what a cell's row adds to its CSV row: ours' 95 % t-interval over the seeds, the raw and Holm-adjusted p value
#: of the paired t-test against the table's first row, and the row's marks (empty where not tested)
TEST_HEADER = ("ours_ci_low", "ours_ci_high", "p_vs_first_row", "p_vs_first_row_holm", "mark")
#: CSV columns of the tables whose rows are (part, row, column) cells
CELL_HEADER = ("part", "row", "column", "ours_mean", "ours_std", "paper", *TEST_HEADER)
#: CSV columns of the figures' tables, whose rows are (part, row, measure) values
MEASURE_HEADER = ("part", "row", "measure", "ours_mean", "ours_std", "paper", *TEST_HEADER)


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


def by_seed(runs: Sequence[RunData], value: Callable[[RunData], float | None]) -> dict[int, float | None]:
    """``value`` of each of ``runs`` (one per seed) keyed by the seed it ran at
    (:func:`fedhpro.reports.run_data.run_seed`)."""
    return {run_seed(run, index): value(run) for index, run in enumerate(runs)}


def final_value(section: str, key: str) -> Callable[[RunData], float | None]:
    """A run's ``key`` in its last evaluated row's ``section`` (``final_value("accuracy", "AVG")``,
    ``final_value("fairness", "worst_10")``), None where it has none."""
    def value(run: RunData) -> float | None:
        return run.final.get(section, {}).get(key)
    return value


def summary_accuracy(name: str) -> Callable[[RunData], float | None]:
    """A finished run's final accuracy on ``name`` (a domain, or AVG) as its summary.json says."""
    def value(run: RunData) -> float | None:
        if run.summary is None:
            return None
        return float(run.summary["accuracy"] if name == "AVG" else run.summary["per_domain"][name])
    return value


def compare_rows(per_row: Mapping[str, Mapping[int, float | None]], higher_is_better: bool = True) -> Verdicts:
    """The verdicts of one column of a table that compares its rows (methods, variants) over seeds
    (``per_row[row][seed]``): paired t-tests over the shared seeds against the first row, which the paper's
    tables measure the others against, Holm's correction across the rows
    (:func:`fedhpro.reports.significance.verdicts`)."""
    first = next(iter(per_row), None)
    return verdicts(per_row, baseline=first, higher_is_better=higher_is_better)


def tested_note(result: Verdicts, scope: str = "Each column is tested on its own.") -> str:
    """The note a table's section carries about its brackets and marks (``result``: one of its columns'
    verdicts; every column of a part shares its seeds)."""
    return significance.caption(result, what="rows") + (f" {scope}" if scope else "")


def ours(values: Sequence[float | None], tested: Verdicts | None = None, row: str | None = None,
         digits: int = 2) -> str:
    """Our cell: the mean of ``values`` (one per seed) with its 95 % t-interval, and ``row``'s marks in
    ``tested`` when given ("50.00 [48.10, 51.90] ▲"; "50.00" for one seed; "–" for none)."""
    mean = mean_std(values)[0]
    if tested is not None and row is not None:
        return marked_cell(mean, tested.intervals.get(row), tested.mark(row), digits)
    return marked_cell(mean, t_interval(values), "", digits)


def cell(values: Sequence[float | None], paper: float | None, tested: Verdicts | None = None,
         row: str | None = None) -> str:
    """``ours / the paper's number`` (:func:`ours`)."""
    mine = ours(values, tested, row)
    return f"{mine} / {paper:.2f}" if paper is not None else f"{mine} / –"


def cell_columns(values: Sequence[float | None], tested: Verdicts | None = None, row: str | None = None
                 ) -> list[Any]:
    """A CSV row's :data:`TEST_HEADER` values: the interval of ``values`` and, with ``tested``, ``row``'s p values
    and marks."""
    if tested is None or row is None:
        interval = t_interval(values)
        return [*(interval if interval is not None else (None, None)), None, None, ""]
    return [*interval_bounds(tested, row), *verdict_fields(tested, row)]


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
    """One line: the best row in ours (by mean: whether the seeds show the difference is the table's marks') and
    in the paper's, and the rank correlation of the two orderings."""
    rows = [(label, o, p) for label, o, p in zip(labels, ours, paper) if o is not None and p is not None]
    if len(rows) < 2:
        return None
    sign = 1 if higher_is_better else -1
    tau = kendall_tau([o for _, o, _ in rows], [p for _, _, p in rows])
    best_ours = max(rows, key=lambda r: sign * r[1])[0]
    best_paper = max(rows, key=lambda r: sign * r[2])[0]
    verdict = "matches" if best_ours == best_paper else "does NOT match"
    return (f"{part} ({what}): best row by mean ours = {best_ours}, paper = {best_paper} -> {verdict}; "
            f"Kendall tau of the {len(rows)} rows' ordering vs the paper's = {tau:+.2f} (orderings of means; the "
            "table's marks say which differences the seeds show)")


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
