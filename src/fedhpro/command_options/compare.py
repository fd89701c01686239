"""The keys of ``fedhpro compare`` (:mod:`fedhpro.compare`), besides the sweep's (:class:`~.sweep.Sweep`) and the
run keys it hands to every run. Torch-free, as every option declaration."""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.command_options.keys import command_option

#: the seeds of a comparison when ``seeds=`` is not given (a tuning's seed is apart from them)
COMPARE_SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class CompareOptions:
    """What ``fedhpro compare`` compares and where it writes the table."""

    methods: list[str] | None = command_option(
        None, help="the methods to compare, one row each in this order (registered names, fedhpro config --keys "
                   "lists them under method); unset: every registered method, in the paper's order")
    seeds: list[int] = command_option(
        default_factory=lambda: list(COMPARE_SEEDS), refuse="must be integers, e.g. seeds=[0,1,2]",
        help="the seeds every method runs at; the table shows the mean over them with its 95 % t-interval, "
             "and marks a difference only with at least 3")
    out: str = command_option("runs/compare", help="the comparison's folder: a run folder per (method, seed), "
                                                    "table.md, table.csv and compare.json")
    tuned: str | None = command_option(
        None, help="the tuned.yaml of fedhpro tune: each method runs at its tuned settings, on seeds apart from "
                   "the tuning's; unset: every method at the settings given")
