"""The comparison tables' statistics against independent references: the t-interval against scipy's
``t.interval`` with ``sem``, the paired test against the t statistic computed by hand, Holm's correction by
hand on three methods, and verdicts that flip with the number of shared seeds."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from fedhpro.reports.significance import (
    BEST,
    BETTER,
    WORSE,
    caption,
    holm,
    interval_cell,
    paired_p,
    t_interval,
    verdicts,
)

BASE = [80.0, 81.0, 79.0, 80.5, 80.2]
#: a gain whose sign holds on every seed but whose size varies: no test on 2 seeds, a verdict on 5
STEADY = [2.0, 1.5, 2.5, 1.8, 2.2]
#: a gain that is large on the first three seeds but not the last two
NOISY = [3.0, -1.0, 2.0, -1.5, 0.5]


def test_the_interval_is_scipys_t_interval_of_the_mean():
    values = [81.25, 79.0, 84.5, 80.75, 77.5]
    low, high = t_interval(values)
    reference = stats.t.interval(0.95, len(values) - 1, loc=sum(values) / len(values), scale=stats.sem(values))
    assert low == pytest.approx(reference[0], abs=1e-12) and high == pytest.approx(reference[1], abs=1e-12)
    assert t_interval([81.0]) is None and t_interval([81.0, None, float("nan")]) is None
    assert t_interval([5.0, 5.0, 5.0]) == (5.0, 5.0)
    # an accuracy's interval stops at 100 % (the mean cannot be above): the lower end is scipy's
    wide = [99.0, 92.0, 100.0]
    cut = t_interval(wide, bounds=(0.0, 100.0))
    open_ended = stats.t.interval(0.95, 2, loc=sum(wide) / 3, scale=stats.sem(wide))
    assert open_ended[1] > 100 and cut == (pytest.approx(open_ended[0]), 100.0)
    assert "cut to the measure's range 0..100" in caption(verdicts({"a": dict(enumerate(wide))}, bounds=(0, 100)))
    assert interval_cell(80.0, (78.5, 81.5)) == "80.00 [78.50, 81.50]" and interval_cell(80.0, None) == "80.00"


def test_the_paired_p_value_is_the_hand_computed_t_statistics():
    a = [x + g for x, g in zip(BASE, NOISY, strict=True)]
    d = [x - y for x, y in zip(a, BASE, strict=True)]
    n, mean = len(d), sum(d) / len(d)
    sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (n - 1))
    t = mean / (sd / math.sqrt(n))
    assert paired_p(a, BASE) == pytest.approx(2 * stats.t.sf(abs(t), n - 1), rel=1e-10)
    assert paired_p(BASE, BASE) == 1.0  # nothing differs
    assert paired_p([x + 1 for x in BASE], BASE) == 0.0  # the same gain on every seed


def test_holm_by_hand_on_three_methods():
    # sorted: A 0.01 x 3 = 0.03; C 0.03 x 2 = 0.06; B 0.04 x 1 = 0.04, raised to the running 0.06
    adjusted = holm({"A": 0.01, "B": 0.04, "C": 0.03})
    assert adjusted == pytest.approx({"A": 0.03, "B": 0.06, "C": 0.06})
    assert [name for name, p in adjusted.items() if p <= 0.05] == ["A"]


def test_holm_unmarks_what_each_test_alone_would_mark():
    """Three methods each at raw p < 0.05 against the baseline; Holm keeps only those it still rejects."""
    seeds = range(5)
    gains = {"A": [1.0, 1.1, 0.9, 1.05, 0.95], "B": [0.6, 0.1, 0.9, 0.2, 0.4], "C": [0.5, 0.0, 0.7, 0.3, 0.6]}
    values = {"base": dict(zip(seeds, BASE))}
    values |= {name: {s: BASE[s] + g[s] for s in seeds} for name, g in gains.items()}
    result = verdicts(values, baseline="base")
    raw = {name: stats.ttest_rel([BASE[s] + g[s] for s in seeds], BASE).pvalue for name, g in gains.items()}
    assert result.p_baseline == pytest.approx(raw)
    assert all(p < 0.05 for p in raw.values())
    ordered = sorted(raw, key=raw.get)
    by_hand, running = {}, 0.0
    for i, name in enumerate(ordered):
        running = max(running, min(1.0, (3 - i) * raw[name]))
        by_hand[name] = running
    assert result.p_baseline_holm == pytest.approx(by_hand)
    marked = {name for name, p in by_hand.items() if p <= 0.05}
    assert set(result.against_baseline) == marked and marked != set(gains)  # Holm unmarked one at least


@pytest.mark.parametrize("seeds, tested, mark", [(2, False, ""), (3, True, ""), (5, True, BETTER)])
def test_the_verdict_needs_enough_shared_seeds(seeds, tested, mark):
    """Hand-picked seeds: on 2 no test is possible, on 3 the noisy gain is not shown (p about 0.4), on 5 a
    steady one is."""
    gain = NOISY if seeds == 3 else STEADY
    values = {"FedAvg": {s: BASE[s] for s in range(seeds)}, "FedHPro": {s: BASE[s] + gain[s] for s in range(seeds)}}
    result = verdicts(values, baseline="FedAvg")
    assert result.tested is tested and result.mark("FedHPro") == (BEST + mark if mark else "")
    if tested:
        reference = stats.ttest_rel([values["FedHPro"][s] for s in range(seeds)], BASE[:seeds]).pvalue
        assert result.p_baseline["FedHPro"] == pytest.approx(reference)
    else:
        assert "No significance test is possible with 2 shared seeds" in caption(result)


def test_worse_and_best_and_only_shared_seeds_pair():
    values = {"FedAvg": dict(enumerate(BASE)),
              "Worse": {s: BASE[s] - STEADY[s] for s in range(5)},
              "Best": {s: BASE[s] + STEADY[s] for s in range(5)} | {9: 0.0}}  # seed 9 has no pair: left out
    result = verdicts(values, baseline="FedAvg")
    assert result.shared_seeds == [0, 1, 2, 3, 4]
    assert result.mark("Worse") == WORSE and result.mark("Best") == BEST + BETTER and result.best == "Best"
    text = caption(result)
    assert "5 seeds every row shares (0, 1, 2, 3, 4)" in text and "alpha = 0.05" in text and "Holm" in text
    lower = verdicts(values, baseline="FedAvg", higher_is_better=False)  # e.g. a loss: Worse is now best
    assert lower.best == "Worse" and lower.mark("Best") == WORSE
