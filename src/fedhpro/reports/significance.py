"""Whether a difference between methods is real: 95 % t-intervals over seeds, two-sided paired t-tests over
the seeds two methods share (:func:`scipy.stats.ttest_rel`), and Holm's correction across the methods
compared. Every comparison table (compare, report, reproduce, per class, per client) marks a method best, or
better or worse than the baseline, only through :func:`verdicts`; its caption is :func:`caption`.

A seed is one paired observation: two methods run on the same seed share the data split, the sampling and the
initialisation, so their difference on that seed removes what the seed alone moves. With fewer than
:data:`MIN_SEEDS` shared seeds no test is made and nothing is marked (a t-test on 2 pairs has 1 degree of
freedom: its interval spans almost anything, and a verdict would rest on chance).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scipy import stats

#: the two-sided level of every test and the coverage of every interval is ``1 - ALPHA``
ALPHA = 0.05
#: the fewest seeds two methods must share for a paired test
MIN_SEEDS = 3
#: marks a table cell carries: better or worse than the baseline, best of all (after Holm's correction)
BETTER, WORSE, BEST = "▲", "▼", "★"


def _finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def t_interval(values: Sequence[float | None], alpha: float = ALPHA,
               bounds: tuple[float, float] | None = None) -> tuple[float, float] | None:
    """The ``1 - alpha`` t-interval ``mean ± t(1 - alpha/2, n - 1) s / sqrt(n)`` of the mean of ``values`` (the
    finite ones; ``s`` the sample std), or None for fewer than 2 values. Equal values give a zero-width
    interval. ``bounds``: the range the mean can take (0..100 for an accuracy in percent); the interval is
    cut to it, which keeps its coverage (the mean is never outside) and never shows 107 %."""
    present = _finite(values)
    n = len(present)
    if n < 2:
        return None
    mean = math.fsum(present) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in present) / (n - 1))
    half = float(stats.t.ppf(1 - alpha / 2, n - 1)) * std / math.sqrt(n)
    if bounds is not None:
        return max(mean - half, bounds[0]), min(mean + half, bounds[1])
    return mean - half, mean + half


def paired_p(a: Sequence[float], b: Sequence[float]) -> float:
    """The two-sided p value of the paired t-test of ``a`` against ``b`` (:func:`scipy.stats.ttest_rel`, same
    seeds in the same order). Differences all equal: 1.0 if they are all zero (nothing differs), else 0.0
    (the same gain on every seed: no spread leaves room for chance; scipy gives NaN there)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"a paired test needs two equally long lists of at least 2 values, got {len(a)} and "
                         f"{len(b)}")
    differences = [x - y for x, y in zip(a, b, strict=True)]
    if max(differences) - min(differences) <= 1e-12 * max(1.0, max(abs(d) for d in differences)):
        return 1.0 if all(abs(d) <= 1e-12 for d in differences) else 0.0
    return float(stats.ttest_rel(a, b).pvalue)


def holm(p_values: Mapping[str, float], alpha: float = ALPHA) -> dict[str, float]:
    """Holm's step-down adjusted p values: sorted ascending, the i-th (from 0) of ``m`` becomes
    ``max over j <= i of min(1, (m - j) p_(j))``; a hypothesis is rejected at level ``alpha`` when its adjusted
    p value is at most ``alpha``. ``alpha`` is unused but kept for symmetry with :func:`verdicts`."""
    del alpha
    ordered = sorted(p_values, key=lambda name: (p_values[name], name))
    m, running, adjusted = len(ordered), 0.0, {}
    for index, name in enumerate(ordered):
        running = max(running, min(1.0, (m - index) * p_values[name]))
        adjusted[name] = running
    return adjusted


@dataclass
class Verdicts:
    """What a comparison table may claim about its rows (each row one method, or one method's setting)."""

    #: each row's ``(low, high)`` 95 % t-interval over its own seeds (None with fewer than 2)
    intervals: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    #: the seeds every row has (the pairs of every test)
    shared_seeds: list[int] = field(default_factory=list)
    #: whether tests were made (at least MIN_SEEDS shared seeds and 2 rows)
    tested: bool = False
    #: each non-baseline row's raw and Holm-adjusted p value against the baseline row
    p_baseline: dict[str, float] = field(default_factory=dict)
    p_baseline_holm: dict[str, float] = field(default_factory=dict)
    #: the rows better (BETTER) or worse (WORSE) than the baseline after Holm's correction
    against_baseline: dict[str, str] = field(default_factory=dict)
    #: the row with the highest mean, when it beats every other row after Holm's correction; else None
    best: str | None = None
    #: the top row's Holm-adjusted p value against each other row
    p_best_holm: dict[str, float] = field(default_factory=dict)
    baseline: str | None = None
    alpha: float = ALPHA
    #: the range the intervals are cut to (None: not cut)
    bounds: tuple[float, float] | None = None

    def mark(self, row: str) -> str:
        """The marks of ``row``'s cell: BEST and/or BETTER/WORSE, or ""."""
        return (BEST if row == self.best else "") + self.against_baseline.get(row, "")


def verdicts(values: Mapping[str, Mapping[int, float | None]], baseline: str | None = None,
             alpha: float = ALPHA, higher_is_better: bool = True,
             bounds: tuple[float, float] | None = None) -> Verdicts:
    """The :class:`Verdicts` of rows measured on seeds (``values[row][seed]``; None or NaN counts as not
    measured). Intervals per row over its own seeds. Tests only over the seeds every row has, and only
    with at least :data:`MIN_SEEDS` of them: each row against ``baseline`` (Holm across those rows), and
    the row of the highest mean (lowest, ``higher_is_better=False``) against each other row (Holm across
    them), marked best only when it beats every one. ``bounds``: the range of the measure, which the
    intervals are cut to (:func:`t_interval`)."""
    result = Verdicts(baseline=baseline if baseline in values else None, alpha=alpha, bounds=bounds)
    clean = {row: {seed: float(v) for seed, v in per_seed.items() if v is not None and math.isfinite(float(v))}
             for row, per_seed in values.items()}
    result.intervals = {row: t_interval(list(per_seed.values()), alpha, bounds) for row, per_seed in clean.items()}
    if not clean:
        return result
    shared = set.intersection(*(set(per_seed) for per_seed in clean.values()))
    result.shared_seeds = sorted(shared)
    if len(clean) < 2 or len(shared) < MIN_SEEDS:
        return result
    result.tested = True
    seeds = result.shared_seeds
    paired = {row: [per_seed[s] for s in seeds] for row, per_seed in clean.items()}
    sign = 1.0 if higher_is_better else -1.0
    if result.baseline is not None:
        base = paired[result.baseline]
        raw = {row: paired_p(numbers, base) for row, numbers in paired.items() if row != result.baseline}
        result.p_baseline, result.p_baseline_holm = raw, holm(raw)
        for row, p in result.p_baseline_holm.items():
            if p <= alpha:
                gain = sign * (math.fsum(paired[row]) - math.fsum(base))
                result.against_baseline[row] = BETTER if gain > 0 else WORSE
    means = {row: math.fsum(numbers) / len(numbers) for row, numbers in paired.items()}
    top = max(means, key=lambda row: sign * means[row])
    raw = {row: paired_p(paired[top], numbers) for row, numbers in paired.items() if row != top}
    result.p_best_holm = holm(raw)
    if all(p <= alpha and sign * (means[top] - means[row]) > 0 for row, p in result.p_best_holm.items()):
        result.best = top
    return result


def interval_cell(mean: float | None, interval: tuple[float, float] | None, digits: int = 2) -> str:
    """``"81.25 [78.28, 84.22]"`` (mean and its 95 % interval), ``"81.25"`` for one seed, "–" for none."""
    if mean is None or not math.isfinite(mean):
        return "–"
    if interval is None:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"


def caption(result: Verdicts, what: str = "methods") -> str:
    """The sentence a table's caption carries: the interval, the test, alpha, the shared seeds, the correction
    and the marks, or why nothing is marked."""
    level = f"{100 * (1 - result.alpha):g} %"
    cut = (f", cut to the measure's range {result.bounds[0]:g}..{result.bounds[1]:g}"
           if result.bounds is not None else "")
    text = f"Brackets: the {level} t-interval of the mean over each row's seeds{cut}."
    if not result.tested:
        n = len(result.shared_seeds)
        return (text + f" No significance test is possible with {n} shared seed{'s' if n != 1 else ''} (a paired "
                f"t-test needs at least {MIN_SEEDS}): no {what[:-1] if what.endswith('s') else what} is marked "
                "best or better.")
    seeds = ", ".join(str(s) for s in result.shared_seeds)
    text += (f" Marks: two-sided paired t-tests (scipy.stats.ttest_rel) over the {len(result.shared_seeds)} seeds "
             f"every row shares ({seeds}), alpha = {result.alpha:g}, Holm's correction across the {what} compared; ")
    marks = [f"{BEST} beats every other row"]
    if result.baseline is not None:
        marks.append(f"{BETTER}/{WORSE} better/worse than {result.baseline}")
    text += ", ".join(marks) + "; unmarked: no difference shown at that level."
    return text


__all__ = ["ALPHA", "BEST", "BETTER", "MIN_SEEDS", "Verdicts", "WORSE", "caption", "holm", "interval_cell",
           "paired_p", "t_interval", "verdicts"]
