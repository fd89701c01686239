"""``fedhpro reproduce NAME [scale=paper|smoke] [seeds=[...]] [out=DIR] [KEY=VALUE ...]``: one command per
table and figure of the paper.

Each target is one YAML file in ``configs/paper/`` (``NAME.yaml``): the paper's settings (Section 5.1,
Appendix C.1), a ``smoke`` section that shrinks them to minutes on 2 CPU cores, the rows (``variants``:
method + switches), and one or more ``parts`` (a data set, or a swept setting), each with its columns
and the paper's published numbers. ``reproduce`` runs every (part, scenario, variant, seed), reusing
finished runs with the same config (runs are shared between targets: Table A3's runs serve Table A4,
A7, A8 and Figure 4), then writes ``table.md`` / ``table.csv`` in the paper's layout with the
published numbers beside ours, the figures as PNG, and a line per part saying whether FedHPro's
ordering against the baselines matches the paper's.

Data: a part whose data set is absent is skipped with one line naming it, except that at
``scale=smoke`` a Digits part falls back to ``digits-offline`` (optdigits standing in for USPS and
mnistm for SVHN), said in the output.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import yaml

from fedhpro.config import PRESENTATION_KEYS
from fedhpro.errors import ConfigError, DataError
from fedhpro.metrics import rounds_to_accuracy, speedup
from fedhpro.reports import write_atomic, write_json
from fedhpro.reports.runs import RunData, gm_series, load_run
from fedhpro.reports.tables import csv_text, markdown_table, mean_pm_std, mean_std

SCALES = ("paper", "smoke")
#: the benchmark a smoke run may fall back to, and what it says about it
FALLBACKS = {"digits": ("digits-offline", "the real Digits benchmark (MNIST, USPS, SVHN, SYN) is not available "
                                          "here; ran on digits-offline, where optdigits stands in for USPS and "
                                          "mnistm for SVHN, with far fewer rounds than the paper")}


def configs_dir() -> Path:
    """``configs/paper`` of the source tree (next to ``src/``), or of the working directory."""
    here = Path(__file__).resolve().parents[2] / "configs" / "paper"
    return here if here.is_dir() else Path.cwd() / "configs" / "paper"


def available_targets() -> list[str]:
    return sorted(path.stem for path in configs_dir().glob("*.yaml"))


# ---------------------------------------------------------------------------------------------
# the target description
# ---------------------------------------------------------------------------------------------


@dataclass
class Variant:
    """One row of a table: a label, a method and its switches."""

    label: str
    method: str
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class Scenario:
    """One federation setting within a part (a column of a scenarios table, a point of a sweep)."""

    label: str
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class Part:
    """A sub-table or sub-figure: one data set (or sweep) with its columns and the paper's numbers."""

    name: str
    benchmark: str
    settings: dict[str, Any]
    scenarios: list[Scenario]
    columns: list[str]
    paper: dict[str, list[float | None]]
    extra: dict[str, Any]
    variants: list[Variant] = field(default_factory=list)  # the rows (the target's unless the part has its own)


@dataclass
class Target:
    name: str
    title: str
    layout: str
    seeds: list[int]
    settings: dict[str, Any]
    variants: list[Variant]
    parts: list[Part]
    notes: list[str]
    options: dict[str, Any]


LAYOUTS = ("domains", "scenarios", "convergence", "fairness", "efficiency", "prototypes", "gm_loss", "tsne", "sweep")


def load_target(name: str, scale: str = "paper") -> Target:
    """Read ``configs/paper/NAME.yaml`` and apply its ``smoke`` section when ``scale=smoke``."""
    if scale not in SCALES:
        raise ConfigError(f"scale={scale!r} is not valid; use scale=paper or scale=smoke")
    path = configs_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no reproduce target {name!r}; choose one of: {', '.join(available_targets())} "
                          f"(the YAML files in {configs_dir()})")
    raw = yaml.safe_load(path.read_text()) or {}
    smoke = raw.get("smoke") or {} if scale == "smoke" else {}
    layout = raw.get("layout", "domains")
    if layout not in LAYOUTS:
        raise ConfigError(f"{path}: layout={layout!r} is not one of {', '.join(LAYOUTS)}")
    settings = {**(raw.get("settings") or {}), **(smoke.get("settings") or {})}
    variants = [Variant(v["label"], v["method"], dict(v.get("settings") or {})) for v in raw.get("variants", [])]
    parts = []
    for index, part in enumerate(raw.get("parts", [])):
        # a part's ``smoke`` section may replace its settings, scenarios and extras (e.g. thresholds)
        part_smoke = (part.get("smoke") or {}) if scale == "smoke" else {}
        scenarios = part_smoke.get("scenarios") or part.get("scenarios") or [{"label": part.get("name", "all")}]
        rows = [Variant(v["label"], v["method"], dict(v.get("settings") or {})) for v in part.get("variants", [])]
        extra = {k: v for k, v in part.items() if k not in ("name", "benchmark", "settings", "scenarios", "columns",
                                                            "paper", "smoke", "variants")}
        extra.update({k: v for k, v in part_smoke.items() if k not in ("settings", "scenarios")})
        parts.append(Part(
            name=part.get("name", f"part{index}"),
            benchmark=part.get("benchmark", "digits"),
            settings={**(part.get("settings") or {}), **(part_smoke.get("settings") or {})},
            scenarios=[Scenario(str(s["label"]), dict(s.get("settings") or {})) for s in scenarios],
            columns=list(part.get("columns") or []),
            paper={str(k): list(v) for k, v in (part.get("paper") or {}).items()},
            extra=extra,
            variants=rows or variants,
        ))
    options = {**(raw.get("options") or {}), **(smoke.get("options") or {})}
    return Target(name=raw.get("name", name), title=raw.get("title", name), layout=layout,
                  seeds=list(smoke.get("seeds", raw.get("seeds", [0, 1, 2]))), settings=settings,
                  variants=variants, parts=parts, notes=list(raw.get("notes") or []), options=options)


# ---------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------


def _identity(config) -> str:
    values = {k: v for k, v in config.to_dict().items() if k not in PRESENTATION_KEYS}
    return hashlib.sha1(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:10]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "-", text).strip("-").lower() or "run"


def _filter_data_keys(settings: dict[str, Any], dataset: str) -> tuple[dict[str, Any], list[str]]:
    """Drop ``data.*`` keys the data set does not have (smoke sizes written for one benchmark)."""
    import dataclasses

    from fedhpro.data import get_dataset

    known = {f.name for f in dataclasses.fields(get_dataset(dataset).options)}
    kept, dropped = {}, []
    for key, value in settings.items():
        if key.startswith("data.") and key.split(".")[1] not in known:
            dropped.append(key)
        else:
            kept[key] = value
    return kept, dropped


def resolve_dataset(part: Part, settings: dict[str, Any], scale: str, echo) -> tuple[dict[str, Any] | None, str]:
    """The settings to run ``part`` with (its data set checked by building the federation once), or None
    with the reason when the data set is absent and there is no fallback. Returns ``(settings, note)``."""
    from fedhpro.api import build_experiment
    from fedhpro.config import load_config
    from fedhpro.data import DATASETS

    def usable(candidate: dict[str, Any]) -> str | None:
        dataset = candidate.get("dataset", "digits-offline")
        if dataset not in DATASETS:
            return f"data set {dataset!r} is not registered in this fedhpro (fedhpro.data.DATASETS)"
        filtered, _ = _filter_data_keys(candidate, dataset)
        try:
            build_experiment(load_config(None, {**filtered, "progress": False}))
        except DataError as error:
            return str(error)
        return None

    problem = usable(settings)
    if problem is None:
        return _filter_data_keys(settings, settings.get("dataset", "digits-offline"))[0], ""
    dataset = settings.get("dataset")
    if scale == "smoke" and dataset in FALLBACKS:
        fallback, note = FALLBACKS[dataset]
        candidate = {**settings, "dataset": fallback}
        if usable(candidate) is None:
            return _filter_data_keys(candidate, fallback)[0], f"{note} ({problem.split(';')[0]})"
    hint = (" (at scale=smoke the Digits tables fall back to digits-offline)" if dataset in FALLBACKS else "")
    return None, (f"{part.name}: needs data set {dataset!r}, which is not available here: "
                  f"{problem.split(';')[0]}; skipped{hint}")


def run_one(settings: dict[str, Any], seed: int, runs_dir: Path, label: str, echo: bool) -> RunData:
    """Run (or reuse) one configuration for one seed; returns its folder read back."""
    from fedhpro.api import run_or_continue
    from fedhpro.config import load_config

    pairs = {**settings, "seed": seed, "progress": False}
    config = load_config(None, pairs)
    # the folder's name carries the hash of the settings: a run kept there is this configuration's
    folder = runs_dir / f"{_slug(config.run.method)}-{_identity(config)}-seed{seed}"
    if (folder / "summary.json").is_file():
        if echo:
            print(f"  {label:34s} seed {seed}: reused {folder}", flush=True)
        return load_run(folder)
    started = time.perf_counter()
    summary = run_or_continue(config, folder)  # continues an interrupted run from its newest checkpoint
    if echo:
        print(f"  {label:34s} seed {seed}: AVG {summary['accuracy']:6.2f}  ({time.perf_counter() - started:.0f} s)",
              flush=True)
    return load_run(folder)


@dataclass
class PartResult:
    part: Part
    note: str
    runs: dict[tuple[str, str], list[RunData]]  # (scenario label, variant label) -> one run per seed
    domains: list[str] = field(default_factory=list)


def reproduce(name: str, scale: str = "paper", seeds: Sequence[int] | None = None, out: str | Path | None = None,
              overrides: dict[str, Any] | None = None, echo: bool = True) -> Path:
    """Run target ``name`` and write its table (Markdown, CSV) and figures (PNG) to ``out``."""
    target = load_target(name, scale)
    seeds = list(seeds) if seeds is not None else target.seeds
    overrides = dict(overrides or {})
    for forbidden in ("method", "seed", "out", "resume"):
        if forbidden in overrides:
            raise ConfigError(f"{forbidden}= is set by reproduce for each run; remove it")
    root = Path(out) if out else Path("runs") / "reproduce" / scale
    target_dir = root / target.name
    runs_dir = root / "runs"
    started = time.perf_counter()
    if echo:
        print(f"{target.title} -- scale={scale}, seeds {seeds}", flush=True)
    results: list[PartResult] = []
    for part in target.parts:
        base = {**target.settings, **part.settings, **overrides}
        resolved, note = resolve_dataset(part, base, scale, echo)
        if resolved is None:
            print(f"fedhpro reproduce {target.name}: {note}", flush=True)
            results.append(PartResult(part, note, {}))
            continue
        if note and echo:
            print(f"  {part.name}: {note}", flush=True)
        runs: dict[tuple[str, str], list[RunData]] = {}
        for scenario in part.scenarios:
            for variant in part.variants:
                settings = {**resolved, **scenario.settings, **variant.settings, **overrides,
                            "method": variant.method}
                settings = _filter_data_keys(settings, settings.get("dataset", "digits-offline"))[0]
                label = variant.label if len(part.scenarios) == 1 else f"{scenario.label} / {variant.label}"
                runs[(scenario.label, variant.label)] = [run_one(settings, seed, runs_dir, label, echo)
                                                         for seed in seeds]
        first = next(iter(runs.values()))[0]
        results.append(PartResult(part, note, runs, [d for d in first.final["accuracy"] if d != "AVG"]))
    builder = _BUILDERS[target.layout]
    sections, csv_rows, figures, checks = builder(target, results, seeds, target_dir)
    seconds = time.perf_counter() - started
    header = [f"# {target.title}", "",
              f"Reproduced with `fedhpro reproduce {target.name} scale={scale}` (seeds {seeds}); "
              f"ours: mean ± std over seeds; paper: the published number. Wall time {seconds:.0f} s.", ""]
    if scale == "smoke":
        header += ["**scale=smoke**: a few rounds of a small model on a few clients, to check that everything runs; "
                   "the numbers are NOT comparable with the paper's (R=100, E=10, ResNet-10).", ""]
    header += [f"- {note}" for note in target.notes]
    text = "\n".join(header) + "\n\n" + "\n".join(sections)
    if checks:
        text += "\n## Ordering against the paper\n\n" + "\n".join(f"- {line}" for line in checks) + "\n"
    write_atomic(target_dir / "table.md", text)
    write_atomic(target_dir / "table.csv", csv_text(*csv_rows) if csv_rows else "")
    write_json(target_dir / "reproduce.json", {"target": target.name, "scale": scale, "seeds": seeds,
                                                "seconds": seconds, "checks": checks,
                                                "notes": [r.note for r in results if r.note],
                                                "figures": [str(f) for f in figures]})
    if echo:
        print(text)
        written = ", ".join([str(target_dir / "table.md"), str(target_dir / "table.csv")] + [str(f) for f in figures])
        print(f"written: {written}")
    return target_dir


# ---------------------------------------------------------------------------------------------
# tables and figures, one builder per layout
# ---------------------------------------------------------------------------------------------


def _column_names(part: Part, domains: list[str]) -> list[str]:
    """The paper's column names with ours in brackets where the data set differs (optdigits for USPS)."""
    names = []
    for index, domain in enumerate(domains):
        paper = part.columns[index] if index < len(part.columns) else domain
        names.append(paper if paper.lower() == domain.lower() else f"{paper} (ours: {domain})")
    return names


def _cell(values: list[float | None], paper: float | None) -> str:
    ours = mean_pm_std(values)
    return f"{ours} / {paper:.2f}" if paper is not None else f"{ours} / –"


def _paper_value(part: Part, row: str, index: int) -> float | None:
    values = part.paper.get(row)
    if values is None or index >= len(values):
        return None
    return values[index]


def _kendall_tau(a: list[float], b: list[float]) -> float | None:
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


def _ordering_check(part: str, labels: list[str], ours: list[float | None], paper: list[float | None],
                    higher_is_better: bool = True, what: str = "AVG") -> str | None:
    """One line: the best row in ours and in the paper's, and the rank correlation of the two orderings."""
    rows = [(label, o, p) for label, o, p in zip(labels, ours, paper) if o is not None and p is not None]
    if len(rows) < 2:
        return None
    sign = 1 if higher_is_better else -1
    ours_values = [o for _, o, _ in rows]
    paper_values = [p for _, _, p in rows]
    tau = _kendall_tau(ours_values, paper_values)
    best_ours = max(rows, key=lambda r: sign * r[1])[0]
    best_paper = max(rows, key=lambda r: sign * r[2])[0]
    verdict = "matches" if best_ours == best_paper else "does NOT match"
    return (f"{part} ({what}): best row ours = {best_ours}, paper = {best_paper} -> {verdict}; "
            f"Kendall tau of the {len(rows)} rows' ordering vs the paper's = {tau:+.2f}")


def _fedhpro_row(labels: list[str]) -> str | None:
    return next((label for label in labels if label.lower().startswith("fedhpro")), None)


#: CSV columns of the builders whose rows are (part, row, measure) triples
_MEASURE_HEADER = ("part", "row", "measure", "ours_mean", "ours_std", "paper")


def _parts_that_ran(results: list[PartResult], sections: list[str]):
    """The results that have runs; each one without gets its "not run" section (naming why) instead."""
    for result in results:
        if result.runs:
            yield result
        else:
            sections.append(f"## {result.part.name}\n\nnot run: {result.note}\n")


def _build_domains(target: Target, results: list[PartResult], seeds, out: Path):
    sections, checks, figures = [], [], []
    csv_header = ["part", "row", "column", "ours_mean", "ours_std", "paper"]
    csv_rows = []
    for result in _parts_that_ran(results, sections):
        part = result.part
        scenario = part.scenarios[0].label
        columns = _column_names(part, result.domains) + ["AVG"]
        delta = bool(part.extra.get("delta", True))
        header = ["Methods"] + columns + (["Δ"] if delta else [])
        rows, ours_avg, paper_avg = [], [], []
        first_avg = None
        for index, variant in enumerate(part.variants):
            runs = result.runs[(scenario, variant.label)]
            row = [variant.label]
            for c, domain in enumerate(result.domains + ["AVG"]):
                values = [run.final["accuracy"][domain] for run in runs]
                paper = _paper_value(part, variant.label, c)
                row.append(_cell(values, paper))
                mean, std = mean_std(values)
                csv_rows.append([part.name, variant.label, columns[c], mean, std, paper])
            avg = mean_std([run.final["accuracy"]["AVG"] for run in runs])[0]
            ours_avg.append(avg)
            paper_avg.append(_paper_value(part, variant.label, len(result.domains)))
            if delta:
                if index == 0:
                    first_avg = avg
                    row.append("–")
                else:
                    paper_delta = (paper_avg[-1] - paper_avg[0]) if paper_avg[-1] is not None and paper_avg[0] is not None else None
                    row.append(f"{avg - first_avg:+.2f} / " + (f"{paper_delta:+.2f}" if paper_delta is not None else "–"))
            rows.append(row)
        notes = ["each cell: ours (mean ± std over seeds) / the paper's published number"]
        if delta:
            notes.append(f"Δ = AVG minus the first row's ({part.variants[0].label}) AVG")
        if result.note:
            notes.append(result.note)
        sections.append(f"## {part.name}\n\n" + markdown_table(header, rows, notes=notes))
        labels = [v.label for v in part.variants]
        line = _ordering_check(part.name, labels, ours_avg, paper_avg)
        if line:
            checks.append(line)
        pairs = part.extra.get("pairs")  # Table 3: (without, with) hyper-prototypes
        if pairs:
            for without, with_hp in pairs:
                i, j = labels.index(without), labels.index(with_hp)
                gain = ours_avg[j] - ours_avg[i]
                paper_gain = (paper_avg[j] - paper_avg[i]) if None not in (paper_avg[i], paper_avg[j]) else None
                agree = "matches" if paper_gain is None or (gain > 0) == (paper_gain > 0) else "does NOT match"
                checks.append(f"{part.name}: {with_hp} vs {without}: AVG {gain:+.2f} (paper "
                              + (f"{paper_gain:+.2f}" if paper_gain is not None else "–") + f") -> sign {agree}")
        curves = {variant.label: _mean_curve(result.runs[(scenario, variant.label)]) for variant in part.variants}
        path = out / f"accuracy_{_slug(part.name)}.png"
        from fedhpro.reports.plots import plot_curves

        plot_curves(curves, path, title=f"{target.title.split(':')[0]} -- {part.name}: AVG test accuracy per round",
                    ylabel="test accuracy (%)")
        figures.append(path)
    return sections, (csv_header, csv_rows), figures, checks


def _mean_curve(runs: list[RunData]) -> tuple[list[int], list[float]]:
    """Mean AVG accuracy per evaluated round over the seeds."""
    rounds = [row["round"] + 1 for row in runs[0].evaluated]
    values = [sum(run.evaluated[i]["accuracy"]["AVG"] for run in runs) / len(runs) for i in range(len(rounds))]
    return rounds, values


def _build_scenarios(target: Target, results: list[PartResult], seeds, out: Path):
    sections, checks, figures = [], [], []
    csv_header = ["part", "row", "column", "ours_mean", "ours_std", "paper"]
    csv_rows = []
    for result in _parts_that_ran(results, sections):
        part = result.part
        average = bool(part.extra.get("average_column", False))
        columns = [s.label for s in part.scenarios] + (["AVG"] if average else [])
        rows, labels, ours_by_column, paper_by_column = [], [], {c: [] for c in columns}, {c: [] for c in columns}
        for variant in part.variants:
            row = [variant.label]
            means = []
            for c, scenario in enumerate(part.scenarios):
                values = [run.final["accuracy"]["AVG"] for run in result.runs[(scenario.label, variant.label)]]
                paper = _paper_value(part, variant.label, c)
                row.append(_cell(values, paper))
                mean, std = mean_std(values)
                means.append(mean)
                ours_by_column[scenario.label].append(mean)
                paper_by_column[scenario.label].append(paper)
                csv_rows.append([part.name, variant.label, scenario.label, mean, std, paper])
            if average:
                mean = sum(means) / len(means)
                paper = _paper_value(part, variant.label, len(part.scenarios))
                row.append(f"{mean:.2f} / " + (f"{paper:.2f}" if paper is not None else "–"))
                ours_by_column["AVG"].append(mean)
                paper_by_column["AVG"].append(paper)
                csv_rows.append([part.name, variant.label, "AVG", mean, None, paper])
            rows.append(row)
            labels.append(variant.label)
        notes = ["each cell: ours (final AVG test accuracy, mean ± std over seeds) / the paper's published number"]
        if result.note:
            notes.append(result.note)
        if part.extra.get("delta_rows"):  # Table 6: difference to the first row, per column
            notes.append("Δ to the first row, ours / paper: " + "; ".join(
                f"{labels[i]}: " + ", ".join(
                    f"{c} {ours_by_column[c][i] - ours_by_column[c][0]:+.2f} / "
                    + (f"{paper_by_column[c][i] - paper_by_column[c][0]:+.2f}"
                       if None not in (paper_by_column[c][i], paper_by_column[c][0]) else "–")
                    for c in columns) for i in range(1, len(labels))))
        sections.append(f"## {part.name}\n\n" + markdown_table(["Methods"] + columns, rows, notes=notes))
        for column in columns:
            line = _ordering_check(f"{part.name} {column}", labels, ours_by_column[column], paper_by_column[column])
            if line:
                checks.append(line)
        if len(part.scenarios) > 1:
            from fedhpro.reports.plots import plot_sweep

            series = {}
            reference = {}
            for variant in part.variants:
                stats = [mean_std([run.final["accuracy"]["AVG"] for run in result.runs[(s.label, variant.label)]])
                         for s in part.scenarios]
                series[f"{variant.label} (ours)"] = ([m for m, _ in stats], [s for _, s in stats])
                if variant.label in part.paper:
                    reference[f"{variant.label} (paper)"] = [_paper_value(part, variant.label, i)
                                                             for i in range(len(part.scenarios))]
            path = out / f"sweep_{_slug(part.name)}.png"
            plot_sweep([s.label for s in part.scenarios], series, path, reference=reference,
                       title=f"{target.title.split(':')[0]} -- {part.name}", xlabel=part.extra.get("xlabel", ""))
            figures.append(path)
    return sections, (csv_header, csv_rows), figures, checks


def _build_convergence(target: Target, results: list[PartResult], seeds, out: Path):
    sections, checks, figures = [], [], []
    csv_header = ["part", "row", "column", "ours_mean", "ours_std", "paper"]
    csv_rows = []
    from fedhpro.reports.plots import plot_curves

    for result in _parts_that_ran(results, sections):
        part = result.part
        scenario = part.scenarios[0].label
        thresholds = [float(t) for t in part.extra.get("thresholds", [50, 60, 70, 75])]
        speed_at = float(part.extra.get("speedup_at", thresholds[-1]))
        columns = [f"R_{t:g}%" for t in thresholds] + ["AVG", f"Δ_{speed_at:g}%"]
        baseline = part.variants[0].label
        baseline_runs = result.runs[(scenario, baseline)]
        rows, labels, ours_r, paper_r = [], [], [], []
        for variant in part.variants:
            runs = result.runs[(scenario, variant.label)]
            row = [variant.label]
            for c, threshold in enumerate(thresholds):
                reached = [rounds_to_accuracy(run.rows, threshold) for run in runs]
                paper = _paper_value(part, variant.label, c)
                mean = mean_std(reached)[0]
                missing = sum(r is None for r in reached)
                text = ("–" if mean is None else f"{mean:.1f}") + (f" ({missing} never)" if missing and mean else "")
                row.append(f"{text} / " + (f"{paper:g}" if paper is not None else "–"))
                csv_rows.append([part.name, variant.label, columns[c], mean, mean_std(reached)[1], paper])
            avg_values = [run.final["accuracy"]["AVG"] for run in runs]
            row.append(_cell(avg_values, _paper_value(part, variant.label, len(thresholds))))
            csv_rows.append([part.name, variant.label, "AVG", *mean_std(avg_values),
                             _paper_value(part, variant.label, len(thresholds))])
            ups = [speedup(rounds_to_accuracy(run.rows, speed_at), rounds_to_accuracy(base.rows, speed_at))
                   for run, base in zip(runs, baseline_runs)]
            up = mean_std(ups)[0]
            paper_up = _paper_value(part, variant.label, len(thresholds) + 1)
            row.append(("–" if up is None or variant.label == baseline else f"{100 * up:+.1f}%") + " / "
                       + ("–" if paper_up is None else f"{paper_up:+.1f}%"))
            csv_rows.append([part.name, variant.label, columns[-1], None if up is None else 100 * up, None, paper_up])
            rows.append(row)
            labels.append(variant.label)
            r_last = mean_std([rounds_to_accuracy(run.rows, speed_at) for run in runs])[0]
            ours_r.append(r_last)
            paper_r.append(_paper_value(part, variant.label, thresholds.index(speed_at))
                           if speed_at in thresholds else None)
        notes = ["R_acc: the first round whose AVG test accuracy reaches acc (mean over seeds; – never reached); "
                 f"Δ: fewer rounds than {baseline} to reach {speed_at:g}% (positive = faster); ours / paper"]
        if result.note:
            notes.append(result.note)
        sections.append(f"## {part.name}\n\n" + markdown_table(["Methods"] + columns, rows, notes=notes))
        line = _ordering_check(part.name, labels, ours_r, paper_r, higher_is_better=False,
                               what=f"rounds to {speed_at:g}%")
        checks.append(line or f"{part.name}: too few methods reached {speed_at:g}% to compare the ordering of R")
        path = out / f"convergence_{_slug(part.name)}.png"
        plot_curves({v.label: _mean_curve(result.runs[(scenario, v.label)]) for v in part.variants}, path,
                    title=f"{target.title.split(':')[0]} / Figure 9 -- {part.name}: AVG test accuracy per round",
                    ylabel="test accuracy (%)")
        figures.append(path)
    return sections, (csv_header, csv_rows), figures, checks


def _build_fairness(target: Target, results: list[PartResult], seeds, out: Path):
    from fedhpro.reports.plots import plot_bars

    sections, checks, figures = [], [], []
    csv_header = ["part", "row", "column", "ours_mean", "ours_std", "paper"]
    csv_rows = []
    keys = [("worst_10", "Worst 10%", True), ("best_10", "Best 10%", True), ("mean", "Average", True),
            ("variance", "Variance", False)]
    for result in _parts_that_ran(results, sections):
        part = result.part
        scenario = part.scenarios[0].label
        rows, bars, errors = [], {}, {}
        stats_by_row = {}
        for variant in part.variants:
            runs = result.runs[(scenario, variant.label)]
            row = [variant.label]
            stats_by_row[variant.label] = {}
            for c, (key, column, _) in enumerate(keys):
                values = [run.final["fairness"][key] for run in runs]
                paper = _paper_value(part, variant.label, c)
                row.append(_cell(values, paper))
                stats_by_row[variant.label][key] = mean_std(values)[0]
                csv_rows.append([part.name, variant.label, column, *mean_std(values), paper])
            stds = [run.final["fairness"]["std"] for run in runs]
            row.append(mean_pm_std(stds))
            csv_rows.append([part.name, variant.label, "Std", *mean_std(stds), None])
            rows.append(row)
            bars[variant.label] = {column: stats_by_row[variant.label][key] for key, column, _ in keys[:3]}
            bars[variant.label]["Std"] = mean_std(stds)[0]
            errors[variant.label] = {column: mean_std([run.final["fairness"][key] for run in runs])[1]
                                     for key, column, _ in keys[:3]}
        clients = len(result.runs[(scenario, part.variants[0].label)][0].final["client_accuracy"])
        notes = [f"accuracy of each of the {clients} clients on its own test distribution at the last round; "
                 "ours / paper. With one global model, clients of one domain share their domain's test set, so "
                 "their accuracies are equal",
                 "Variance: population variance of the clients' accuracies (%²); Std: its square root. The paper's "
                 "'Variance' values (8-13) are on the scale of a standard deviation: compare them with Std"]
        if result.note:
            notes.append(result.note)
        sections.append(f"## {part.name}\n\n" + markdown_table(
            ["Methods"] + [c for _, c, _ in keys] + ["Std (ours)"], rows, notes=notes))
        fed = _fedhpro_row(list(stats_by_row))
        base = part.variants[0].label
        if fed and fed != base:
            for key, column, higher in keys:
                ours_better = (stats_by_row[fed][key] > stats_by_row[base][key]) == higher
                p_f, p_b = _paper_value(part, fed, keys.index((key, column, higher))), _paper_value(
                    part, base, keys.index((key, column, higher)))
                paper_better = None if None in (p_f, p_b) else ((p_f > p_b) == higher)
                verdict = "–" if paper_better is None else ("matches" if ours_better == paper_better else "does NOT match")
                checks.append(f"{part.name} {column}: {fed} {'better' if ours_better else 'worse'} than {base} "
                              f"in ours, {'better' if paper_better else 'worse'} in the paper -> {verdict}")
        path = out / f"fairness_{_slug(part.name)}.png"
        plot_bars(bars, path, errors=errors, ylabel="test accuracy (%)",
                  title=f"{target.title.split(':')[0]} -- {part.name}: accuracy across clients")
        figures.append(path)
    return sections, (csv_header, csv_rows), figures, checks


def _timing(run: RunData) -> list[dict[str, Any]]:
    path = run.path / "timing.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _build_efficiency(target: Target, results: list[PartResult], seeds, out: Path):
    from fedhpro.reports.plots import plot_bars

    sections, checks, figures = [], [], []
    csv_header = ["part", "row", "column", "ours_mean", "ours_std", "paper"]
    csv_rows = []
    columns = ["Upload ×10^7", "Comm. MB", "FLOPs ×10^10", "Time_train s"]
    for result in _parts_that_ran(results, sections):
        part = result.part
        scenario = part.scenarios[0].label
        rows, labels, per_column = [], [], {c: [] for c in columns}
        for variant in part.variants:
            runs = result.runs[(scenario, variant.label)]

            def per_round(run: RunData, key: str) -> float | None:
                values = [row[key] for row in run.rows if key in row]
                return sum(values) / len(values) if values else None

            measures = {
                columns[0]: [per_round(r, "params_up") / 1e7 for r in runs if per_round(r, "params_up") is not None],
                columns[1]: [(per_round(r, "bytes_up") + per_round(r, "bytes_down")) / 2 ** 20 for r in runs],
                columns[2]: [per_round(r, "flops_train") / 1e10 for r in runs if per_round(r, "flops_train") is not None],
                columns[3]: [sum(t["clients"] for t in _timing(r)) / max(len(_timing(r)), 1) for r in runs],
            }
            row = [variant.label]
            for c, column in enumerate(columns):
                paper = _paper_value(part, variant.label, c)
                mean, std = mean_std(measures[column])
                digits = 4 if column != columns[3] else 2
                row.append(("–" if mean is None else f"{mean:.{digits}f}") + " / " + ("–" if paper is None else f"{paper:g}"))
                per_column[column].append(mean)
                csv_rows.append([part.name, variant.label, column, mean, std, paper])
            rows.append(row)
            labels.append(variant.label)
        clients = len(result.runs[(scenario, part.variants[0].label)][0].rows[0]["participants"])
        notes = [f"per round with {clients} participating clients; ours / paper (the paper: ResNet-10, 20 clients, "
                 "an A5000 GPU); Upload: floating-point parameters sent by all clients; Comm.: bytes up + down "
                 "(MiB), measured from the payload tensors; FLOPs: torch.utils.flop_counter over every client's "
                 "local training (matrix products and convolutions, forward and backward); Time_train: wall "
                 "seconds of the clients' training (timing.jsonl; varies with the machine and its load)"]
        if result.note:
            notes.append(result.note)
        sections.append(f"## {part.name}\n\n" + markdown_table(["Methods"] + columns, rows, notes=notes))
        for c, column in enumerate(columns[:3]):
            line = _ordering_check(f"{part.name} {column}", labels, per_column[column],
                                   [_paper_value(part, label, c) for label in labels], higher_is_better=False,
                                   what=f"{column}, lower is better")
            if line:
                checks.append(line)
        base = per_column[columns[2]][0]
        if base:
            bars = {label: {"FLOPs vs first row": per_column[columns[2]][i] / base,
                            "Comm. vs first row": per_column[columns[1]][i] / per_column[columns[1]][0]}
                    for i, label in enumerate(labels)}
            path = out / f"efficiency_{_slug(part.name)}.png"
            plot_bars(bars, path, ylabel=f"ratio to {labels[0]}",
                      title=f"{target.title.split(':')[0]} -- {part.name}: cost per round relative to {labels[0]}")
            figures.append(path)
    return sections, (csv_header, csv_rows), figures, checks


def _build_prototypes(target: Target, results: list[PartResult], seeds, out: Path):
    """Figure 2: the distance of each method's prototypes to the centralized prototypes, per round."""
    from fedhpro.reports.plots import plot_curves

    sections, checks, figures = [], [], []
    csv_header = list(_MEASURE_HEADER)
    csv_rows = []
    for result in _parts_that_ran(results, sections):
        part = result.part
        scenario = part.scenarios[0].label
        curves, normalized, rows, finals = {}, {}, [], {}
        for variant in part.variants:
            runs = result.runs[(scenario, variant.label)]
            source = "server" if "server" in runs[0].final.get("prototype_distance", {}) else "clients_mean"
            rows_with = [[row for row in run.rows if "prototype_distance" in row] for run in runs]
            rounds = [row["round"] + 1 for row in rows_with[0]]
            l2 = [sum(r[i]["prototype_distance"][source]["l2"] for r in rows_with) / len(runs) for i in range(len(rounds))]
            l2n = [sum(r[i]["prototype_distance"][source]["l2_normalized"] for r in rows_with) / len(runs)
                   for i in range(len(rounds))]
            curves[variant.label] = (rounds, l2)
            normalized[variant.label] = (rounds, l2n)
            finals_l2 = [r[-1]["prototype_distance"][source]["l2"] for r in rows_with]
            finals_n = [r[-1]["prototype_distance"][source]["l2_normalized"] for r in rows_with]
            norm = [r[-1]["prototype_distance"]["centralized_norm"] for r in rows_with]
            finals[variant.label] = mean_std(finals_l2)[0]
            rows.append([variant.label, source, mean_pm_std(finals_l2, 3), mean_pm_std(finals_n, 3), mean_pm_std(norm, 3)])
            csv_rows.append([part.name, variant.label, "l2", *mean_std(finals_l2), None])
            csv_rows.append([part.name, variant.label, "l2_normalized", *mean_std(finals_n), None])
        notes = ["distance at the last round: mean over classes of ||p_c - q_c||_2, q_c the centralized prototype "
                 "(class mean of all clients' training features under the global model); 'normalized' compares "
                 "unit vectors; the paper gives this only as a figure (no numbers)",
                 "source: server = the method's global prototypes (FedHPro: the averaged hyper-prototypes H); "
                 "clients_mean = the unweighted mean of the clients' class means after local training (FedAvg's "
                 "prototypes, Eq. 4)"]
        if result.note:
            notes.append(result.note)
        sections.append(f"## {part.name}\n\n" + markdown_table(
            ["Prototypes", "source", "L2 distance", "L2 distance (normalized)", "centralized norm"], rows, notes=notes))
        fed = _fedhpro_row(list(finals))
        if fed:
            closest = min(finals, key=lambda k: finals[k])
            checks.append(f"{part.name}: the paper's Figure 2 has the hyper-prototypes closest to the centralized "
                          f"prototypes; ours: closest = {closest} -> "
                          + ("matches" if closest == fed else "does NOT match"))
        for suffix, series, label in (("", curves, "L2 distance"), ("_normalized", normalized, "L2 distance of unit vectors")):
            path = out / f"prototype_distance{suffix}_{_slug(part.name)}.png"
            plot_curves(series, path, ylabel=label,
                        title=f"Figure 2 -- {part.name}: distance to the centralized prototypes")
            figures.append(path)
    return sections, (csv_header, csv_rows), figures, checks


def _build_gm_loss(target: Target, results: list[PartResult], seeds, out: Path):
    """Figure 4: L_GM (Eq. 8) before and after the M matching steps, per round."""
    from fedhpro.reports.plots import plot_curves

    sections, checks, figures = [], [], []
    csv_header = ["part", "scenario", "round", "gm_loss_before", "gm_loss_after"]
    csv_rows = []
    for result in _parts_that_ran(results, sections):
        part = result.part
        series, rows = {}, []
        for (scenario, label), runs in result.runs.items():
            curves = [gm_series(run) for run in runs]
            if not curves[0]:
                continue
            name = label if len(part.scenarios) == 1 else f"{scenario} / {label}"
            for when in ("before", "after"):
                rounds = curves[0][when][0]
                values = [sum(c[when][1][i] for c in curves) / len(curves) for i in range(len(rounds))]
                series[f"{name}: {when} matching"] = (rounds, values)
            before = series[f"{name}: before matching"][1]
            after = series[f"{name}: after matching"][1]
            for r, b, a in zip(series[f"{name}: before matching"][0], before, after):
                csv_rows.append([part.name, name, r, b, a])
            rows.append([name, before[0], after[0], before[-1], after[-1]])
            falls = before[-1] < before[0]
            checks.append(f"{part.name} {name}: L_GM before matching goes {before[0]:.4f} -> {before[-1]:.4f} over "
                          f"{len(before)} rounds; the paper's Figure 4 shows it decreasing -> "
                          + ("matches" if falls else "does NOT match"))
        notes = ["L_GM = sum over classes of 1 - cos(g^c, g_HP^c) (Eq. 8), logged by the server before and after its "
                 "M matching steps each round (mean over seeds); the paper gives this only as a figure"]
        if result.note:
            notes.append(result.note)
        sections.append(f"## {part.name}\n\n" + markdown_table(
            ["run", "first round: before", "first round: after", "last round: before", "last round: after"], rows,
            notes=notes))
        path = out / f"gm_loss_{_slug(part.name)}.png"
        positive = all(min(v) > 0 for _, v in series.values())
        plot_curves(series, path, ylabel="L_GM (Eq. 8)", log_y=positive,
                    title=f"Figure 4 -- {part.name}: gradient-matching loss per round")
        figures.append(path)
    return sections, (csv_header, csv_rows), figures, checks


def _build_tsne(target: Target, results: list[PartResult], seeds, out: Path):
    """Figures 3 and 6: t-SNE panels of the final global models' test features, plus a silhouette score."""
    import numpy as np

    from fedhpro.reports.plots import MARKERS, _pyplot, save_figure

    sections, checks, figures = [], [], []
    csv_header = list(_MEASURE_HEADER)
    csv_rows = []
    for result in _parts_that_ran(results, sections):
        part = result.part
        scenario = part.scenarios[0].label
        plt = _pyplot()
        count = len(part.variants)
        figure, axes = plt.subplots(1, count, figsize=(4.6 * count, 5.4), dpi=130, squeeze=False)
        rows, scores = [], {}
        colours = plt.get_cmap("tab10")
        for axis, variant in zip(axes[0], part.variants):
            run = result.runs[(scenario, variant.label)][0]
            data = np.load(run.path / "tsne.npz")
            points, labels, names = data["points"], data["labels"], data["test_sets"].astype(str)
            for j, name in enumerate(dict.fromkeys(names.tolist())):
                where = names == name
                axis.scatter(points[where, 0], points[where, 1], c=[colours(int(c) % 10) for c in labels[where]],
                             marker=MARKERS[j % len(MARKERS)], s=7, alpha=0.6, linewidths=0, label=name)
            if len(data["prototype_points"]):
                axis.scatter(data["prototype_points"][:, 0], data["prototype_points"][:, 1], marker="*", s=220,
                             c=[colours(int(c) % 10) for c in data["prototype_labels"]], edgecolors="black", zorder=5)
            axis.set_title(variant.label, fontsize=10)
            axis.set_xticks([])
            axis.set_yticks([])
            score = [_silhouette(r) for r in result.runs[(scenario, variant.label)]]
            scores[variant.label] = mean_std(score)[0]
            rows.append([variant.label, mean_pm_std(score, 3)])
            csv_rows.append([part.name, variant.label, "silhouette", *mean_std(score), None])
        from matplotlib.lines import Line2D

        domains = axes[0][0].get_legend_handles_labels()[1]
        handles = [Line2D([], [], marker=MARKERS[j % len(MARKERS)], color="dimgrey", linestyle="", label=name)
                   for j, name in enumerate(domains)]
        handles += [Line2D([], [], marker="o", color=colours(c), linestyle="", label=f"class {c}") for c in range(10)]
        handles.append(Line2D([], [], marker="*", color="white", markeredgecolor="black", markersize=11,
                              linestyle="", label="prototypes"))
        figure.legend(handles=handles, loc="lower center", ncol=8, fontsize=8, frameon=False)
        figure.suptitle(f"{target.title.split(':')[0]} -- {part.name}: t-SNE of test features "
                        "(colour = class, marker = domain, stars = prototypes)", fontsize=10)
        figure.subplots_adjust(left=0.02, right=0.98, top=0.86, bottom=0.2, wspace=0.05)
        path = out / f"tsne_{_slug(part.name)}.png"
        save_figure(figure, path, tight_layout=False)
        figures.append(path)
        notes = ["silhouette score of the test features by class in the 2-D t-SNE embedding (higher: classes more "
                 "separated and compact; the paper argues this visually, without numbers)"]
        if result.note:
            notes.append(result.note)
        sections.append(f"## {part.name}\n\n" + markdown_table(["Methods", "silhouette (t-SNE)"], rows, notes=notes))
        fed = _fedhpro_row(list(scores))
        if fed:
            best = max(scores, key=lambda k: scores[k])
            checks.append(f"{part.name}: the paper's Figure 6 shows FedHPro's classes best separated; ours: best "
                          f"silhouette = {best} -> " + ("matches" if best == fed else "does NOT match"))
    return sections, (csv_header, csv_rows), figures, checks


def _silhouette(run: RunData) -> float:
    import numpy as np
    from sklearn.metrics import silhouette_score

    data = np.load(run.path / "tsne.npz")
    return float(silhouette_score(data["points"], data["labels"]))


_BUILDERS = {"domains": _build_domains, "scenarios": _build_scenarios, "sweep": _build_scenarios,
             "convergence": _build_convergence, "fairness": _build_fairness, "efficiency": _build_efficiency,
             "prototypes": _build_prototypes, "gm_loss": _build_gm_loss, "tsne": _build_tsne}


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def main(arguments: Sequence[str]) -> int:
    """``fedhpro reproduce NAME|all|list [scale=paper|smoke] [seeds=[..]] [out=DIR] [KEY=VALUE ...]``."""
    from fedhpro.compare import _as_list
    from fedhpro.config import parse_override

    items = list(arguments)
    if not items or items[0] in ("list", "--list"):
        print("reproduce targets (configs/paper/*.yaml):")
        for name in available_targets():
            target = load_target(name)
            data = sorted({p.settings.get("dataset", target.settings.get("dataset", "?")) for p in target.parts})
            print(f"  {name:10s} {target.title}  [data: {', '.join(data)}]")
        print("run: fedhpro reproduce NAME [scale=smoke] [seeds=[0,1,2]] [out=DIR] [KEY=VALUE ...]; NAME=all runs all")
        return 0
    name = items.pop(0)
    pairs = dict(map(parse_override, items))
    scale = str(pairs.pop("scale", "paper"))
    seeds = None
    if "seeds" in pairs:
        raw = _as_list(pairs.pop("seeds"), "seeds")
        try:
            seeds = [int(s) for s in raw]
        except ValueError:
            raise ConfigError(f"seeds={raw} must be integers, e.g. seeds=[0,1,2]") from None
    out = pairs.pop("out", None)
    names = available_targets() if name == "all" else [name]
    if name != "all" and name not in available_targets():
        raise ConfigError(f"no reproduce target {name!r}; choose one of: {', '.join(available_targets())}, all, list")
    for target in names:
        started = time.perf_counter()
        reproduce(target, scale, seeds, out, pairs)
        print(f"fedhpro reproduce {target} scale={scale}: {time.perf_counter() - started:.0f} s", flush=True)
    return 0
