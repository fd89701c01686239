"""One builder per layout: a part's runs -> its rows, CSV rows, figures to draw and checks against the paper.

A builder only computes (:class:`~fedhpro.reproduce.table.Table` of one part); the emitter renders and
writes everything. :func:`build_table` runs a target's builder over its parts, a part that did not run
getting the line saying why instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedhpro.arrays import load_npz
from fedhpro.bounded import run_file
from fedhpro.errors import DataError
from fedhpro.metrics import rounds_to_accuracy, speedup
from fedhpro.reports import read_jsonl
from fedhpro.reports.runs import RunData, gm_series
from fedhpro.reports.significance import Verdicts
from fedhpro.reports.tables import mean_std
from fedhpro.reproduce.running import PartResult
from fedhpro.reproduce.studies import build_faithfulness, build_gradient_matching, build_label_skew, build_robustness
from fedhpro.reproduce.table import (
    CELL_HEADER,
    MEASURE_HEADER,
    Figure,
    Section,
    Table,
    best_row_check,
    by_seed,
    cell,
    cell_columns,
    column_names,
    compare_rows,
    difference,
    fedhpro_row,
    final_value,
    mean_curve,
    ordering_check,
    ours,
    paper_value,
    part_note,
    short_title,
    signed,
    slug,
    tested_note,
)
from fedhpro.reproduce.targets import Part, Target

# ---------------------------------------------------------------------------------------------
# domains: accuracy per domain and AVG (Tables 2, 3, 5, A3, A7)
# ---------------------------------------------------------------------------------------------


def _pair_checks(part: Part, labels: list[str], ours: list[float | None], paper: list[float | None]) -> list[str]:
    """Table 3: for each (without, with) hyper-prototypes pair, whether the sign of the AVG gain matches
    (unknown when either row has no AVG of ours)."""
    checks = []
    for without, with_hp in part.extra.get("pairs") or []:
        i, j = labels.index(without), labels.index(with_hp)
        gain, paper_gain = difference(ours[j], ours[i]), difference(paper[j], paper[i])
        if gain is None:
            agree = "unknown"
        elif paper_gain is None or (gain > 0) == (paper_gain > 0):
            agree = "matches"
        else:
            agree = "does NOT match"
        checks.append(f"{part.name}: {with_hp} vs {without}: AVG {signed(gain)} (paper {signed(paper_gain)}) "
                      f"-> sign {agree}")
    return checks


def build_domains(target: Target, result: PartResult) -> Table:
    part, scenario = result.part, result.part.scenarios[0].label
    columns = column_names(part, result.domains) + ["AVG"]
    delta = bool(part.extra.get("delta", True))
    rows, csv_rows = [], []
    ours_avg: list[float | None] = []
    paper_avg: list[float | None] = []
    tested = {domain: compare_rows({variant.label: by_seed(result.runs[(scenario, variant.label)],
                                                           final_value("accuracy", domain))
                                    for variant in part.variants})
              for domain in result.domains + ["AVG"]}
    for variant in part.variants:
        runs = result.runs[(scenario, variant.label)]
        row = [variant.label]
        for c, domain in enumerate(result.domains + ["AVG"]):
            values = [run.final["accuracy"][domain] for run in runs]
            row.append(cell(values, paper_value(part, variant.label, c), tested[domain], variant.label))
            csv_rows.append([part.name, variant.label, columns[c], *mean_std(values),
                             paper_value(part, variant.label, c), *cell_columns(values, tested[domain],
                                                                                variant.label)])
        ours_avg.append(mean_std([run.final["accuracy"]["AVG"] for run in runs])[0])
        paper_avg.append(paper_value(part, variant.label, len(result.domains)))
        if delta:  # the first row's AVG is the reference
            row.append("–" if len(ours_avg) == 1 else f"{signed(difference(ours_avg[-1], ours_avg[0]))} / "
                                                      f"{signed(difference(paper_avg[-1], paper_avg[0]))}")
        rows.append(row)
    notes = ["each cell: ours (the mean over seeds, its 95 % t-interval in brackets) / the paper's published "
             "number", tested_note(tested["AVG"])]
    if delta:
        notes.append(f"Δ = AVG minus the first row's ({part.variants[0].label}) AVG")
    labels = [v.label for v in part.variants]
    checks = [line for line in [ordering_check(part.name, labels, ours_avg, paper_avg)] if line]
    curves = {variant.label: mean_curve(result.runs[(scenario, variant.label)]) for variant in part.variants}
    figure = Figure(f"accuracy_{slug(part.name)}.png", "curves", (curves,), {
        "title": f"{short_title(target.title)} -- {part.name}: AVG test accuracy per round",
        "ylabel": "test accuracy (%)"})
    return Table(sections=[Section(part.name, ["Methods"] + columns + (["Δ"] if delta else []), rows,
                                   notes + part_note(result.note))],
                 csv_rows=csv_rows, figures=[figure], checks=checks + _pair_checks(part, labels, ours_avg, paper_avg))


# ---------------------------------------------------------------------------------------------
# scenarios and sweeps: final AVG accuracy per federation setting (Tables 1, 6, A1, A2, A5, A6, A9, A10;
# Figures 7, 8)
# ---------------------------------------------------------------------------------------------


def _final_avg(result: PartResult, scenario: str, variant: str) -> list[float]:
    return [run.final["accuracy"]["AVG"] for run in result.runs[(scenario, variant)]]


def _scenario_cells(part: Part, result: PartResult, average: bool):
    """Rows and CSV rows of a scenarios table, and ours / the paper's value per column and row."""
    columns = [s.label for s in part.scenarios] + (["AVG"] if average else [])
    rows, csv_rows = [], []
    ours: dict[str, list[float | None]] = {c: [] for c in columns}
    paper: dict[str, list[float | None]] = {c: [] for c in columns}
    tested = {scenario.label: compare_rows({variant.label: by_seed(result.runs[(scenario.label, variant.label)],
                                                                   final_value("accuracy", "AVG"))
                                            for variant in part.variants})
              for scenario in part.scenarios}
    for variant in part.variants:
        row, means = [variant.label], []
        for c, scenario in enumerate(part.scenarios):
            values = _final_avg(result, scenario.label, variant.label)
            published = paper_value(part, variant.label, c)
            row.append(cell(values, published, tested[scenario.label], variant.label))
            mean, std = mean_std(values)
            means.append(mean)
            ours[scenario.label].append(mean)
            paper[scenario.label].append(published)
            csv_rows.append([part.name, variant.label, scenario.label, mean, std, published,
                             *cell_columns(values, tested[scenario.label], variant.label)])
        if average:
            present = [m for m in means if m is not None]  # the AVG column needs every scenario's mean
            average_mean = sum(present) / len(present) if len(present) == len(means) else None
            published = paper_value(part, variant.label, len(part.scenarios))
            row.append(("–" if average_mean is None else f"{average_mean:.2f}") + " / "
                       + (f"{published:.2f}" if published is not None else "–"))
            ours["AVG"].append(average_mean)
            paper["AVG"].append(published)
            csv_rows.append([part.name, variant.label, "AVG", average_mean, None, published])
        rows.append(row)
    return columns, rows, csv_rows, ours, paper, tested


def _delta_rows_note(labels: list[str], columns: list[str], ours: dict[str, list[float | None]],
                     paper: dict[str, list[float | None]]) -> str:
    """Table 6: each row's difference to the first row, per column, ours / the paper's."""
    return "Δ to the first row, ours / paper: " + "; ".join(
        f"{labels[i]}: " + ", ".join(f"{c} {signed(difference(ours[c][i], ours[c][0]))} / "
                                     f"{signed(difference(paper[c][i], paper[c][0]))}" for c in columns)
        for i in range(1, len(labels)))


def _sweep_figure(target: Target, part: Part, result: PartResult) -> Figure:
    """Accuracy against the swept setting, ours (mean ± std) beside the paper's values."""
    series, reference = {}, {}
    for variant in part.variants:
        stats = [mean_std(_final_avg(result, s.label, variant.label)) for s in part.scenarios]
        series[f"{variant.label} (ours)"] = ([m for m, _ in stats], [s for _, s in stats])
        if variant.label in part.paper:
            reference[f"{variant.label} (paper)"] = [paper_value(part, variant.label, i)
                                                     for i in range(len(part.scenarios))]
    return Figure(f"sweep_{slug(part.name)}.png", "sweep", ([s.label for s in part.scenarios], series), {
        "reference": reference, "title": f"{short_title(target.title)} -- {part.name}",
        "xlabel": part.extra.get("xlabel", "")})


def build_scenarios(target: Target, result: PartResult) -> Table:
    part = result.part
    average = bool(part.extra.get("average_column"))
    columns, rows, csv_rows, ours, paper, tested = _scenario_cells(part, result, average)
    labels = [v.label for v in part.variants]
    notes = ["each cell: ours (final AVG test accuracy, the mean over seeds with its 95 % t-interval in brackets) / "
             "the paper's published number", tested_note(next(iter(tested.values())),
                                                          "Each column is tested on its own"
                                                          + ("; AVG: the mean of the row's columns, not tested."
                                                             if average else "."))]
    notes += part_note(result.note)
    if part.extra.get("delta_rows"):
        notes.append(_delta_rows_note(labels, columns, ours, paper))
    checks = [ordering_check(f"{part.name} {column}", labels, ours[column], paper[column]) for column in columns]
    return Table(sections=[Section(part.name, ["Methods"] + columns, rows, notes)], csv_rows=csv_rows,
                 figures=[_sweep_figure(target, part, result)] if len(part.scenarios) > 1 else [],
                 checks=[line for line in checks if line])


# ---------------------------------------------------------------------------------------------
# convergence: rounds to reach an accuracy (Table A4, Figure 9)
# ---------------------------------------------------------------------------------------------


def _rounds_cell(reached: list[int | None], paper: float | None) -> str:
    mean = mean_std(reached)[0]
    missing = sum(r is None for r in reached)
    text = ("–" if mean is None else f"{mean:.1f}") + (f" ({missing} never)" if missing and mean else "")
    return f"{text} / " + (f"{paper:g}" if paper is not None else "–")


def _convergence_row(part: Part, label: str, runs: list[RunData], baseline: list[RunData], thresholds: list[float],
                     speed_at: float, columns: list[str], tested: Verdicts) -> tuple[list[str], list[list[Any]]]:
    """One method's row: rounds to each threshold, final AVG, and how much faster than the baseline."""
    row, csv_rows = [label], []
    for c, threshold in enumerate(thresholds):
        reached = [rounds_to_accuracy(run.rows, threshold) for run in runs]
        row.append(_rounds_cell(reached, paper_value(part, label, c)))
        csv_rows.append([part.name, label, columns[c], *mean_std(reached), paper_value(part, label, c)])
    avg_values = [run.final["accuracy"]["AVG"] for run in runs]
    row.append(cell(avg_values, paper_value(part, label, len(thresholds)), tested, label))
    csv_rows.append([part.name, label, "AVG", *mean_std(avg_values), paper_value(part, label, len(thresholds)),
                     *cell_columns(avg_values, tested, label)])
    up = mean_std([speedup(rounds_to_accuracy(run.rows, speed_at), rounds_to_accuracy(base.rows, speed_at))
                   for run, base in zip(runs, baseline)])[0]
    paper_up = paper_value(part, label, len(thresholds) + 1)
    row.append(("–" if up is None or label == part.variants[0].label else f"{100 * up:+.1f}%") + " / "
               + ("–" if paper_up is None else f"{paper_up:+.1f}%"))
    csv_rows.append([part.name, label, columns[-1], None if up is None else 100 * up, None, paper_up])
    return row, csv_rows


def build_convergence(target: Target, result: PartResult) -> Table:
    part, scenario = result.part, result.part.scenarios[0].label
    thresholds = [float(t) for t in part.extra.get("thresholds", [50, 60, 70, 75])]
    speed_at = float(part.extra.get("speedup_at", thresholds[-1]))
    columns = [f"R_{t:g}%" for t in thresholds] + ["AVG", f"Δ_{speed_at:g}%"]
    baseline = part.variants[0].label
    rows, csv_rows, ours_r, paper_r = [], [], [], []
    tested = compare_rows({variant.label: by_seed(result.runs[(scenario, variant.label)],
                                                  final_value("accuracy", "AVG"))
                           for variant in part.variants})
    for variant in part.variants:
        runs = result.runs[(scenario, variant.label)]
        row, cells = _convergence_row(part, variant.label, runs, result.runs[(scenario, baseline)], thresholds,
                                      speed_at, columns, tested)
        rows.append(row)
        csv_rows += cells
        ours_r.append(mean_std([rounds_to_accuracy(run.rows, speed_at) for run in runs])[0])
        paper_r.append(paper_value(part, variant.label, thresholds.index(speed_at))
                       if speed_at in thresholds else None)
    notes = ["R_acc: the first round whose AVG test accuracy reaches acc (mean over seeds; – never reached); "
             f"AVG: the final AVG test accuracy, the mean over seeds with its 95 % t-interval in brackets; "
             f"Δ: fewer rounds than {baseline} to reach {speed_at:g}% (positive = faster); ours / paper",
             tested_note(tested, "Tested: the AVG column.")]
    line = ordering_check(part.name, [v.label for v in part.variants], ours_r, paper_r, higher_is_better=False,
                          what=f"rounds to {speed_at:g}%")
    curves = {v.label: mean_curve(result.runs[(scenario, v.label)]) for v in part.variants}
    figure = Figure(f"convergence_{slug(part.name)}.png", "curves", (curves,), {
        "title": f"{short_title(target.title)} / Figure 9 -- {part.name}: AVG test accuracy per round",
        "ylabel": "test accuracy (%)"})
    return Table(sections=[Section(part.name, ["Methods"] + columns, rows, notes + part_note(result.note))],
                 csv_rows=csv_rows, figures=[figure],
                 checks=[line or f"{part.name}: too few methods reached {speed_at:g}% to compare the ordering of R"])


# ---------------------------------------------------------------------------------------------
# fairness: accuracy across clients (Table A8)
# ---------------------------------------------------------------------------------------------

#: (fairness key, column, higher is better)
FAIRNESS_COLUMNS = (("worst_10", "Worst 10%", True), ("best_10", "Best 10%", True), ("mean", "Average", True),
                    ("variance", "Variance", False))


def _fairness_checks(part: Part, means: dict[str, dict[str, Any]]) -> list[str]:
    """Per column: is FedHPro better than the first row in ours, and in the paper?"""
    fed, base = fedhpro_row(list(means)), part.variants[0].label
    if not fed or fed == base:
        return []
    checks = []
    for c, (key, column, higher) in enumerate(FAIRNESS_COLUMNS):
        ours_better = (means[fed][key] > means[base][key]) == higher
        p_f, p_b = paper_value(part, fed, c), paper_value(part, base, c)
        paper_better = None if p_f is None or p_b is None else ((p_f > p_b) == higher)
        verdict = "–" if paper_better is None else ("matches" if ours_better == paper_better else "does NOT match")
        checks.append(f"{part.name} {column}: {fed} {'better' if ours_better else 'worse'} than {base} "
                      f"in ours, {'better' if paper_better else 'worse'} in the paper -> {verdict}")
    return checks


def build_fairness(target: Target, result: PartResult) -> Table:
    part, scenario = result.part, result.part.scenarios[0].label
    rows, csv_rows = [], []
    bars: dict[str, dict[str, Any]] = {}  # row -> column -> mean (the bars drawn) and their spread
    errors: dict[str, dict[str, Any]] = {}
    means: dict[str, dict[str, Any]] = {}  # row -> fairness key -> mean
    tested = {key: compare_rows({variant.label: by_seed(result.runs[(scenario, variant.label)],
                                                        final_value("fairness", key))
                                 for variant in part.variants}, higher_is_better=higher)
              for key, _, higher in FAIRNESS_COLUMNS}
    for variant in part.variants:
        runs = result.runs[(scenario, variant.label)]
        row, means[variant.label] = [variant.label], {}
        bars[variant.label], errors[variant.label] = {}, {}
        for c, (key, column, _) in enumerate(FAIRNESS_COLUMNS):
            values = [run.final["fairness"][key] for run in runs]
            row.append(cell(values, paper_value(part, variant.label, c), tested[key], variant.label))
            means[variant.label][key], spread = mean_std(values)
            csv_rows.append([part.name, variant.label, column, *mean_std(values), paper_value(part, variant.label, c),
                             *cell_columns(values, tested[key], variant.label)])
            if key != "variance":
                bars[variant.label][column], errors[variant.label][column] = means[variant.label][key], spread
        stds = [run.final["fairness"]["std"] for run in runs]
        row.append(ours(stds))
        csv_rows.append([part.name, variant.label, "Std", *mean_std(stds), None, *cell_columns(stds)])
        bars[variant.label]["Std"] = mean_std(stds)[0]
        rows.append(row)
    clients = len(result.runs[(scenario, part.variants[0].label)][0].final["client_accuracy"])
    notes = [f"accuracy of each of the {clients} clients on its own test distribution at the last round; "
             "ours / paper. With one global model, clients of one domain share their domain's test set, so "
             "their accuracies are equal",
             "Worst 10% / Best 10%: the mean accuracy of the tenth of clients with the lowest / highest accuracy "
             "(at least one client); Average: the mean over clients. Variance: population variance of the clients' "
             "accuracies (%²); Std: its square root. The paper's 'Variance' values (8-13) are on the scale of a "
             "standard deviation: compare them with Std",
             tested_note(tested["worst_10"], "Each column is tested on its own (Variance: lower is better); Std "
                                             "(ours): intervals only.")]
    figure = Figure(f"fairness_{slug(part.name)}.png", "bars", (bars,), {
        "errors": errors, "ylabel": "test accuracy (%)",
        "title": f"{short_title(target.title)} -- {part.name}: accuracy across clients"})
    header = ["Methods"] + [c for _, c, _ in FAIRNESS_COLUMNS] + ["Std (ours)"]
    return Table(sections=[Section(part.name, header, rows, notes + part_note(result.note))], csv_rows=csv_rows,
                 figures=[figure], checks=_fairness_checks(part, means))


# ---------------------------------------------------------------------------------------------
# efficiency: cost per round (Table 4)
# ---------------------------------------------------------------------------------------------

EFFICIENCY_COLUMNS = ("Upload ×10^7", "Comm. MB", "FLOPs ×10^10", "Time_train s")


def _timing(run: RunData) -> list[dict[str, Any]]:
    path = run.path / "timing.jsonl"
    rows = read_jsonl(path)  # bounded, each row an object
    for number, row in enumerate(rows, 1):
        if not isinstance(row.get("clients"), (int, float)) or isinstance(row.get("clients"), bool):
            raise DataError(f"{path} row {number}: clients is not a number of seconds; the file is damaged: "
                            "replace it or run that job again")
    return rows


def _per_round(run: RunData, key: str) -> float | None:
    values = [row[key] for row in run.rows if key in row]
    return sum(values) / len(values) if values else None


def _costs(runs: list[RunData]) -> list[list[Any]]:
    """Per column of EFFICIENCY_COLUMNS, one value per run that has it (per round)."""
    upload = [_per_round(r, "params_up") for r in runs]
    flops = [_per_round(r, "flops_train") for r in runs]
    traffic = [(_per_round(r, "bytes_up"), _per_round(r, "bytes_down")) for r in runs]
    return [[value / 1e7 for value in upload if value is not None],
            [(up + down) / 2 ** 20 for up, down in traffic if up is not None and down is not None],
            [value / 1e10 for value in flops if value is not None],
            [sum(t["clients"] for t in _timing(r)) / max(len(_timing(r)), 1) for r in runs]]


def _efficiency_figure(target: Target, part: Part, labels: list[str], per_column: list[list]) -> list[Figure]:
    """FLOPs and bytes of each row relative to the first row (none without the first row's FLOPs)."""
    flops, comm = per_column[2], per_column[1]
    if not flops[0]:
        return []
    bars = {label: {"FLOPs vs first row": flops[i] / flops[0], "Comm. vs first row": comm[i] / comm[0]}
            for i, label in enumerate(labels)}
    return [Figure(f"efficiency_{slug(part.name)}.png", "bars", (bars,), {
        "ylabel": f"ratio to {labels[0]}",
        "title": f"{short_title(target.title)} -- {part.name}: cost per round relative to {labels[0]}"})]


def build_efficiency(target: Target, result: PartResult) -> Table:
    part, scenario = result.part, result.part.scenarios[0].label
    labels = [v.label for v in part.variants]
    rows, csv_rows = [], []
    per_column: list[list[Any]] = [[] for _ in EFFICIENCY_COLUMNS]  # each row's mean, per column
    for variant in part.variants:
        row = [variant.label]
        for c, values in enumerate(_costs(result.runs[(scenario, variant.label)])):
            paper, (mean, std) = paper_value(part, variant.label, c), mean_std(values)
            ours = "–" if mean is None else f"{mean:.{2 if c == 3 else 4}f}"  # seconds: 2 decimals
            row.append(f"{ours} / " + ("–" if paper is None else f"{paper:g}"))
            per_column[c].append(mean)
            csv_rows.append([part.name, variant.label, EFFICIENCY_COLUMNS[c], mean, std, paper])
        rows.append(row)
    clients = len(result.runs[(scenario, labels[0])][0].rows[0]["participants"])
    notes = [f"per round with {clients} participating clients; ours / paper (the paper: ResNet-10, 20 clients, "
             "an A5000 GPU); Upload: floating-point parameters sent by all clients; Comm.: bytes up + down "
             "(MiB), measured from the payload tensors; FLOPs: torch.utils.flop_counter over every client's "
             "local training (matrix products and convolutions, forward and backward); Time_train: wall "
             "seconds of the clients' training (timing.jsonl; varies with the machine and its load)"]
    checks = [ordering_check(f"{part.name} {column}", labels, per_column[c],
                             [paper_value(part, label, c) for label in labels], higher_is_better=False,
                             what=f"{column}, lower is better") for c, column in enumerate(EFFICIENCY_COLUMNS[:3])]
    return Table(sections=[Section(part.name, ["Methods"] + list(EFFICIENCY_COLUMNS), rows,
                                   notes + part_note(result.note))],
                 csv_rows=csv_rows, figures=_efficiency_figure(target, part, labels, per_column),
                 checks=[line for line in checks if line])


# ---------------------------------------------------------------------------------------------
# figures: prototype distances (Figure 2), L_GM (Figure 4), t-SNE (Figures 3 and 6)
# ---------------------------------------------------------------------------------------------


def _prototype_series(runs: list[RunData]):
    """Where the prototypes come from, the mean L2 and normalized-L2 curves over the seeds, and each seed's
    last row of distances."""
    source = "server" if "server" in runs[0].final.get("prototype_distance", {}) else "clients_mean"
    rows = [[row["prototype_distance"] for row in run.rows if "prototype_distance" in row] for run in runs]
    rounds = [row["round"] + 1 for row in runs[0].rows if "prototype_distance" in row]
    curves = {key: (rounds, [sum(r[i][source][key] for r in rows) / len(runs) for i in range(len(rounds))])
              for key in ("l2", "l2_normalized")}
    return source, curves, [r[-1] for r in rows]


def build_prototypes(target: Target, result: PartResult) -> Table:
    part, scenario = result.part, result.part.scenarios[0].label
    curves, normalized, rows, csv_rows, finals = {}, {}, [], [], {}
    for variant in part.variants:
        source, series, last = _prototype_series(result.runs[(scenario, variant.label)])
        curves[variant.label], normalized[variant.label] = series["l2"], series["l2_normalized"]
        l2, l2n = [d[source]["l2"] for d in last], [d[source]["l2_normalized"] for d in last]
        finals[variant.label] = mean_std(l2)[0]
        rows.append([variant.label, source, ours(l2, digits=3), ours(l2n, digits=3),
                     ours([d["centralized_norm"] for d in last], digits=3)])
        csv_rows.append([part.name, variant.label, "l2", *mean_std(l2), None, *cell_columns(l2)])
        csv_rows.append([part.name, variant.label, "l2_normalized", *mean_std(l2n), None, *cell_columns(l2n)])
    notes = ["distance at the last round: mean over classes of ||p_c - q_c||_2, q_c the centralized prototype "
             "(class mean of all clients' training features under the global model); 'normalized' compares "
             "unit vectors; the paper gives this only as a figure (no numbers). Each value: the mean over seeds "
             "with its 95 % t-interval in brackets (one seed: its value); not tested (the rows' prototypes come "
             "from different sources)",
             "source: server = the method's global prototypes (FedHPro: the averaged hyper-prototypes H); "
             "clients_mean = the unweighted mean of the clients' class means after local training (FedAvg's "
             "prototypes, Eq. 4)"]
    header = ["Prototypes", "source", "L2 distance", "L2 distance (normalized)", "centralized norm"]
    title = f"Figure 2 -- {part.name}: distance to the centralized prototypes"
    figures = [Figure(f"prototype_distance{suffix}_{slug(part.name)}.png", "curves", (series,),
                      {"ylabel": ylabel, "title": title})
               for suffix, series, ylabel in (("", curves, "L2 distance"),
                                              ("_normalized", normalized, "L2 distance of unit vectors"))]
    checks = best_row_check(part.name, finals, True, "the paper's Figure 2 has the hyper-prototypes closest to "
                                                     "the centralized prototypes", "closest")
    return Table(sections=[Section(part.name, header, rows, notes + part_note(result.note))], csv_rows=csv_rows,
                 figures=figures, checks=checks)


def _gm_means(runs: list[RunData]) -> dict[str, tuple[list[int], list[float]]] | None:
    """L_GM before and after matching per round, mean over the seeds (None for runs that log none)."""
    curves = [gm_series(run) for run in runs]
    if not curves[0]:
        return None
    return {when: (curves[0][when][0], [sum(c[when][1][i] for c in curves) / len(curves)
                                        for i in range(len(curves[0][when][0]))]) for when in ("before", "after")}


def build_gm_loss(target: Target, result: PartResult) -> Table:
    part = result.part
    series, rows, csv_rows, checks = {}, [], [], []
    for (scenario, label), runs in result.runs.items():
        means = _gm_means(runs)
        if means is None:
            continue
        name = label if len(part.scenarios) == 1 else f"{scenario} / {label}"
        (rounds, before), (_, after) = means["before"], means["after"]
        series[f"{name}: before matching"], series[f"{name}: after matching"] = means["before"], means["after"]
        csv_rows += [[part.name, name, r, b, a] for r, b, a in zip(rounds, before, after)]
        rows.append([name, before[0], after[0], before[-1], after[-1]])
        checks.append(f"{part.name} {name}: L_GM before matching goes {before[0]:.4f} -> {before[-1]:.4f} over "
                      f"{len(before)} rounds; the paper's Figure 4 shows it decreasing -> "
                      + ("matches" if before[-1] < before[0] else "does NOT match"))
    notes = ["L_GM = sum over classes of 1 - cos(g^c, g_HP^c) (Eq. 8), logged by the server before and after its "
             "M matching steps each round (mean over seeds); the paper gives this only as a figure"]
    header = ["run", "first round: before", "first round: after", "last round: before", "last round: after"]
    figure = Figure(f"gm_loss_{slug(part.name)}.png", "curves", (series,), {
        "ylabel": "L_GM (Eq. 8)", "log_y": all(min(v) > 0 for _, v in series.values()),
        "title": f"Figure 4 -- {part.name}: gradient-matching loss per round"})
    return Table(sections=[Section(part.name, header, rows, notes + part_note(result.note))], csv_rows=csv_rows,
                 figures=[figure], checks=checks)


def _silhouette(run: RunData) -> float:
    from sklearn.metrics import silhouette_score  # lazy: scikit-learn takes ~1.5 s to import, for one table

    data = load_npz(run_file(run.path, "tsne.npz"))  # a run folder's file: confined, within the array bounds
    return float(silhouette_score(data["points"], data["labels"]))


def build_tsne(target: Target, result: PartResult) -> Table:
    part, scenario = result.part, result.part.scenarios[0].label
    rows, csv_rows, scores, panels = [], [], {}, []
    for variant in part.variants:
        runs = result.runs[(scenario, variant.label)]
        panels.append((variant.label, run_file(runs[0].path, "tsne.npz")))
        score = [_silhouette(run) for run in runs]
        scores[variant.label] = mean_std(score)[0]
        rows.append([variant.label, ours(score, digits=3)])
        csv_rows.append([part.name, variant.label, "silhouette", *mean_std(score), None, *cell_columns(score)])
    notes = ["silhouette score of the test features by class in the 2-D t-SNE embedding (higher: classes more "
             "separated and compact; the paper argues this visually, without numbers); the mean over seeds with its "
             "95 % t-interval in brackets (one seed: its value), not tested"]
    figure = Figure(f"tsne_{slug(part.name)}.png", "tsne_panels", (panels,), {
        "title": f"{short_title(target.title)} -- {part.name}: t-SNE of test features "
                 "(colour = class, marker = domain, stars = prototypes)"})
    checks = best_row_check(part.name, scores, False, "the paper's Figure 6 shows FedHPro's classes best separated",
                            "best silhouette")
    return Table(sections=[Section(part.name, ["Methods", "silhouette (t-SNE)"], rows,
                                   notes + part_note(result.note))],
                 csv_rows=csv_rows, figures=[figure], checks=checks)


# ---------------------------------------------------------------------------------------------
# the layouts
# ---------------------------------------------------------------------------------------------

#: layout -> (its builder, the columns of its CSV)
BUILDERS: dict[str, tuple[Callable[[Target, PartResult], Table], tuple[str, ...]]] = {
    "domains": (build_domains, CELL_HEADER),
    "scenarios": (build_scenarios, CELL_HEADER),
    "sweep": (build_scenarios, CELL_HEADER),
    "convergence": (build_convergence, CELL_HEADER),
    "fairness": (build_fairness, CELL_HEADER),
    "efficiency": (build_efficiency, CELL_HEADER),
    "prototypes": (build_prototypes, MEASURE_HEADER),
    "gm_loss": (build_gm_loss, ("part", "scenario", "round", "gm_loss_before", "gm_loss_after")),
    "tsne": (build_tsne, MEASURE_HEADER),
    # the studies set their own CSV columns (they depend on the scenarios or the data's domains)
    "label_skew": (build_label_skew, ()),
    "gradient_matching": (build_gradient_matching, ()),
    "robustness": (build_robustness, ()),
    "faithfulness": (build_faithfulness, ()),
}


def build_table(target: Target, results: list[PartResult]) -> Table:
    """The target's table: its layout's builder over every part that ran, in order; a part that did not run
    gets a section saying why."""
    build, header = BUILDERS[target.layout]
    table = Table(csv_header=list(header))
    for result in results:
        if result.runs:
            part_table = build(target, result)
            # rows without an interval or a test (an AVG of means, a speed-up) leave those columns empty
            part_table.csv_rows = [row + [None] * (len(header) - len(row)) if header and len(row) < len(header)
                                   else row for row in part_table.csv_rows]
            table.extend(part_table)
            table.csv_header = part_table.csv_header or table.csv_header
        else:
            table.sections.append(Section(result.part.name, skipped=result.note))
    return table
