"""Builders of the CPU-scale studies that were scripts in ``bench/`` (``label_skew``, ``gradient_matching``,
``robustness``, ``faithfulness``): the same tables and CSV columns those scripts wrote, from the runs of a
part (:class:`~fedhpro.reproduce.running.PartResult`).

Each builder sets its table's own CSV header (the columns depend on the part's scenarios or data domains).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from fedhpro.reports.run_data import RunData, run_seed
from fedhpro.reports.significance import Verdicts
from fedhpro.reproduce.running import PartResult
from fedhpro.reproduce.table import (
    Section,
    Table,
    by_seed,
    cell_columns,
    compare_rows,
    difference,
    ours,
    paper_value,
    part_note,
    signed,
    summary_accuracy,
    tested_note,
)
from fedhpro.reproduce.targets import Part, Target


def _pm(values: list[float], digits: int = 2, tested: Verdicts | None = None, row: str | None = None) -> str:
    """The mean with its 95 % t-interval (and ``row``'s marks in ``tested``), ``–`` for none
    (:func:`fedhpro.reproduce.table.ours`)."""
    return ours(values, tested, row, digits)


def _by_seed(result: PartResult, scenario: str, variant: str) -> dict[int, float]:
    """The final accuracy (summary.json) of each finished run of (scenario, variant), keyed by its seed."""
    runs = _finished(result.runs.get((scenario, variant), []))
    return {run_seed(run, index): float(run.summary["accuracy"]) for index, run in enumerate(runs)
            if run.summary is not None}


def _finished(runs: list[RunData]) -> list[RunData]:
    return [run for run in runs if run.finished and run.summary is not None]


def _accuracies(result: PartResult, scenario: str, variant: str) -> list[float]:
    """The final accuracy (summary.json) of each finished run of (scenario, variant)."""
    return [float(run.summary["accuracy"]) for run in _finished(result.runs.get((scenario, variant), []))
            if run.summary is not None]


def _budget(result: PartResult) -> str:
    """``rounds=R local_epochs=E lr=...`` of the part's runs (every run of a study has the same)."""
    run = next((r for values in result.runs.values() for r in values if r.config), None)
    if run is None:
        return ""
    keys = ("rounds", "local_epochs", "lr")
    return " ".join(f"{key}={run.config[key]}" for key in keys if key in run.config)


def _seeds(result: PartResult) -> list[int]:
    return sorted({int(r.config["seed"]) for values in result.runs.values() for r in values if "seed" in r.config})


#: the label_skew CSV's columns per setting beyond mean, std and runs: the interval, the p values of the paired
#: test against the first row (raw, Holm) and the marks
STUDY_TEST_HEADER = ("ci_low", "ci_high", "p_vs_first_row", "p_vs_first_row_holm", "mark")


# ---------------------------------------------------------------------------------------------
# label_skew: all methods under label and quantity skew, Δ against the first row, the paper's Δ beside it
# ---------------------------------------------------------------------------------------------


def _paper_column(part: Part, scenario: str) -> int | None:
    """The index of ``scenario`` among the paper's columns (``columns``), None where the paper has none."""
    return part.columns.index(scenario) if scenario in part.columns else None


def build_label_skew(target: Target, result: PartResult) -> Table:
    part = result.part
    scenarios = [s.label for s in part.scenarios]
    reference = part.variants[0].label
    base = {s: _accuracies(result, s, reference) for s in scenarios}
    tested = {s: compare_rows({variant.label: _by_seed(result, s, variant.label) for variant in part.variants})
              for s in scenarios}
    rows, csv_rows = [], []
    for variant in part.variants:
        cells: list[str] = [variant.label]
        csv_row: list[Any] = [variant.label]
        for scenario in scenarios:
            values = _accuracies(result, scenario, variant.label)
            if not values:
                cells += ["–", "–"]
                csv_row += ["", "", "", "", "", "", "", ""]
                continue
            mean = statistics.mean(values)
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            low, high, p_raw, p_holm, mark = cell_columns(values, tested[scenario], variant.label)
            delta = ("–" if variant.label == reference or not base[scenario]
                     else f"{mean - statistics.mean(base[scenario]):+.2f}")
            column = _paper_column(part, scenario)
            published = [paper_value(part, label, column) if column is not None else None
                         for label in (variant.label, reference)]
            paper = "–" if variant.label == reference else signed(difference(*published))
            cells += [f"{_pm(values, 2, tested[scenario], variant.label)} ({delta})", paper]
            csv_row += [f"{mean:.4f}", f"{spread:.4f}", str(len(values))] + [
                "" if number is None else f"{number:.6g}" for number in (low, high, p_raw, p_holm)] + [mark]
        rows.append(cells)
        csv_rows.append(csv_row)
    header = ["Methods"] + [p for s in scenarios for p in (f"{s} (Δ)", "paper Δ")]
    csv_header = ["method"] + [f"{s} {p}" for s in scenarios for p in ("mean", "std", "runs", *STUDY_TEST_HEADER)]
    notes = [f"final test accuracy (%), the mean over seeds {_seeds(result)} with its 95 % t-interval in brackets, "
             f"(Δ against {reference}); {_budget(result)}; paper Δ: the published accuracy minus the published "
             f"{reference}'s", tested_note(next(iter(tested.values())), "Each setting is tested on its own.")]
    return Table(csv_header=csv_header, sections=[Section(part.name, header, rows, notes + part_note(result.note))],
                 csv_rows=csv_rows)


# ---------------------------------------------------------------------------------------------
# gradient_matching: FedHPro with learned and frozen hyper-prototypes, server and distance measures
# ---------------------------------------------------------------------------------------------

GM_MEASURES = ["accuracy", "accuracy_last3", "gm_loss_before", "gm_loss_after", "hyper_movement", "distance_l2",
               "distance_unit", "clients_mean_unit"]
GM_HEADER = ["setting", "hyper-prototypes", "accuracy (%)", "Δ acc", "last 3 rounds", "L_GM before", "L_GM after",
             "S moved", "‖H − P*‖", "‖Ĥ − P̂*‖", "clients' mean ‖P̂ − P̂*‖"]
GM_DIGITS = {"accuracy": 2, "accuracy_last3": 2, "gm_loss_before": 3, "gm_loss_after": 3, "hyper_movement": 4,
             "distance_l2": 2, "distance_unit": 3, "clients_mean_unit": 3}


def run_measures(run: RunData) -> dict[str, float]:
    """A finished run's final accuracy, the mean of its last three evaluated rounds, and its last row's server
    values (L_GM before / after matching, how far S moved) and prototype distances (Figure 2's measure)."""
    nan = float("nan")
    server: dict[str, Any] = next((row["server"] for row in reversed(run.rows) if row.get("server")), {})
    distance: dict[str, Any] = next((row["prototype_distance"] for row in reversed(run.rows)
                                     if row.get("prototype_distance")), {})
    hyper = distance.get("server", {})
    evaluated = [row["accuracy"]["AVG"] for row in run.evaluated]
    assert run.summary is not None
    return {"accuracy": float(run.summary["accuracy"]),
            "accuracy_last3": statistics.mean(evaluated[-3:]) if evaluated else nan,
            "gm_loss_before": server.get("gm_loss_before", nan), "gm_loss_after": server.get("gm_loss_after", nan),
            "hyper_movement": server.get("hyper_movement", nan),
            "distance_l2": hyper.get("l2", nan), "distance_unit": hyper.get("l2_normalized", nan),
            "clients_mean_unit": distance.get("clients_mean", {}).get("l2_normalized", nan)}


def build_gradient_matching(target: Target, result: PartResult) -> Table:
    part = result.part
    rows, csv_rows = [], []
    tested: Verdicts | None = None
    for scenario in part.scenarios:
        means: dict[str, float] = {}
        accuracy = compare_rows({variant.label: _by_seed(result, scenario.label, variant.label)
                                 for variant in part.variants})
        tested = tested or accuracy
        for index, variant in enumerate(part.variants):
            measured = [(int(run.config.get("seed", -1)), run_measures(run))
                        for run in _finished(result.runs.get((scenario.label, variant.label), []))]
            values = {key: [m[key] for _, m in measured if not math.isnan(m[key])] for key in GM_MEASURES}
            if values["accuracy"]:
                means[variant.label] = statistics.mean(values["accuracy"])
            first = part.variants[0].label
            delta = (f"{means[variant.label] - means[first]:+.2f}"
                     if index and variant.label in means and first in means else "–")
            steps = variant.settings.get("fedhpro.match_steps", "30")
            rows.append([scenario.label.replace("|", "\\|"), f"{variant.label} (M={steps})",
                         _pm(values["accuracy"], 2, accuracy, variant.label), delta,
                         *(_pm(values[key], GM_DIGITS[key]) for key in GM_MEASURES[1:])])
            csv_rows += [[scenario.label, variant.label, seed, *(m[key] for key in GM_MEASURES)]
                         for seed, m in measured]
    notes = [f"the mean over seeds {_seeds(result)} with its 95 % t-interval in brackets; {_budget(result)}. "
             "Accuracy: final test accuracy (%), Δ "
             f"{part.variants[-1].label} − {part.variants[0].label}; last 3 rounds: the mean of the last three "
             "rounds' accuracy. L_GM: Eq. 8 summed over the classes in the last round, before and after that "
             "round's matching; S moved: ||S - S_0|| / ||S_0|| at the end; ‖H − P*‖: mean over classes of the L2 "
             "distance of the averaged hyper-prototypes to the centralized prototypes (Figure 2), ‖Ĥ − P̂*‖ the "
             "same between unit vectors (in [0, 2]); clients' mean: the same unit-vector distance for the "
             "unweighted mean of the last round's clients' class means (Eq. 4's P)."]
    if tested is not None:
        notes.append(tested_note(tested, "Tested: the accuracy column, within each setting; the other columns "
                                         "show intervals only."))
    return Table(csv_header=["setting", "variant", "seed", *GM_MEASURES],
                 sections=[Section(part.name, list(GM_HEADER), rows, notes + part_note(result.note))],
                 csv_rows=csv_rows)


# ---------------------------------------------------------------------------------------------
# robustness: final AVG per method and attack, one column per aggregation rule, diverged runs counted
# ---------------------------------------------------------------------------------------------


def robustness_cell(runs: list[RunData] | None) -> str:
    """``mean ± std`` of the finished runs, with how many diverged; ``–`` where the setting was not run."""
    if not runs:
        return "–"
    values = [float(run.summary["accuracy"]) for run in _finished(runs) if run.summary is not None]
    stopped = len(runs) - len(values)
    if not values:
        return f"diverged ({stopped}/{stopped})"
    return _pm(values) + (f" ({stopped} of {len(runs)} diverged)" if stopped else "")


def build_robustness(target: Target, result: PartResult) -> Table:
    """Scenario labels are ``ATTACK-RULE`` (``clean-mean``, ``scale-median``, ...); rows: each variant (method)
    under each of the part's ``attacks`` (``clean`` shown as ``none``), columns: the clean run with the plain
    mean, then each of its ``rules``."""
    part = result.part
    attacks = [str(a) for a in part.extra.get("attacks") or ["clean"]]
    rules = [str(r) for r in part.extra.get("rules") or ["mean"]]
    rows = []
    for variant in part.variants:
        clean = robustness_cell(result.runs.get(("clean-mean", variant.label)))
        for attack in attacks:
            rows.append([variant.label, attack if attack != "clean" else "none", clean]
                        + [robustness_cell(result.runs.get((f"{attack}-{rule}", variant.label))) for rule in rules])
    header = ["method", "attack", "clean (mean)", *rules]
    notes = [f"final AVG (%), the mean over seeds {_seeds(result)} with its 95 % t-interval in brackets (not "
             f"tested); {_budget(result)}; a diverged run is one whose "
             "every client's training went non-finite in some round (the run stops); rows none: the rule without "
             "any attacker (what robustness costs)"]
    return Table(csv_header=header, sections=[Section(part.name, header, rows, notes + part_note(result.note))],
                 csv_rows=[list(row) for row in rows])


# ---------------------------------------------------------------------------------------------
# faithfulness: FedHPro's spec-level variants, accuracy per domain and AVG, seconds per run
# ---------------------------------------------------------------------------------------------


def build_faithfulness(target: Target, result: PartResult) -> Table:
    part, scenario = result.part, result.part.scenarios[0].label
    domains = result.domains
    columns = [*domains, "AVG"]
    rows, csv_rows = [], []
    tested = {column: compare_rows({variant.label: by_seed(_finished(result.runs.get((scenario, variant.label), [])),
                                                           summary_accuracy(column))
                                    for variant in part.variants}) for column in columns}
    for variant in part.variants:
        summaries = [run.summary for run in _finished(result.runs.get((scenario, variant.label), []))
                     if run.summary is not None]
        if not summaries:
            rows.append([variant.label, *("–" for _ in columns), "–"])
            continue
        values = {d: [float(s["per_domain"][d]) for s in summaries] for d in domains}
        values["AVG"] = [float(s["accuracy"]) for s in summaries]
        seconds = statistics.mean(float(s["seconds"]) for s in summaries)
        rows.append([variant.label, *(_pm(values[c], 2, tested[c], variant.label) for c in columns),
                     f"{seconds:.0f}"])
        csv_rows += [[variant.label, s["seed"], *(f"{s['per_domain'][d]:.2f}" for d in domains),
                      f"{s['accuracy']:.2f}", f"{s['seconds']:.1f}"] for s in summaries]
    notes = [f"final test accuracy (%), the mean over seeds {_seeds(result)} with its 95 % t-interval in brackets; "
             f"{_budget(result)}; seconds/run: the mean wall time of a run", tested_note(tested["AVG"])]
    return Table(csv_header=["variant", "seed", *columns, "seconds"],
                 sections=[Section(part.name, ["variant", *columns, "seconds/run"], rows,
                                   notes + part_note(result.note))],
                 csv_rows=csv_rows)
