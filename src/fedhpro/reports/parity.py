"""float32 against mixed precision: the parity table of ``fedhpro report`` over comparison folders that differ
only in precision.

``fedhpro report`` given comparison folders (``fedhpro compare``'s ``out``) whose runs were trained at more
than one precision (``amp=off`` and ``amp=bf16``, with what ``amp`` brings: ``channels_last``) groups their
runs by every setting that decides the numbers (all but the seed and the presentational keys,
:data:`fedhpro.reports.run_data.NOT_A_SETTING`) but the precision keys (:data:`PRECISION_KEYS`): one group
is one *setting*. Within a setting, each float32 group (``amp=off``) is paired with each mixed-precision one, and a
row says, for the final AVG accuracy and each domain: the float32 mean ± sample std over its seeds, the
mixed-precision mean ± std, the difference of means (mixed minus float32), the larger of the two seed stds
and the verdict: *within* when ``|difference| <= larger std`` (the difference of means lies within the
larger seed spread), else *outside*; beside it the two-sided paired t-test of the two sides over the seeds they
share (``scipy.stats.ttest_rel`` through :func:`fedhpro.reports.significance.verdicts`, alpha 0.05, none with
fewer than 3 shared seeds), and in ``parity.csv`` each side's 95 % t-interval and the p value.

Nothing names a setting: a setting is labelled by the folder its comparison folders share (``default`` for
``study/default/float32`` and ``study/default/bf16``), or by the settings that tell it from the others. A
setting given at one precision only is left out with one line; folders that cannot be paired because they
differ in something besides the precision are refused in one line naming the keys.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedhpro.errors import ConfigError
from fedhpro.reports import write_atomic, write_json
from fedhpro.reports.run_data import NOT_A_SETTING, RunData, run_labels, run_seed
from fedhpro.reports.significance import MIN_SEEDS, Verdicts, verdicts
from fedhpro.reports.tables import csv_text, dotted_keys, format_number, interval_bounds, markdown_table, mean_std

#: the run settings that make a run's precision: ``amp`` and ``channels_last`` (on with ``amp`` for conv models
#: under ``auto``); two comparison folders that differ only in these are the two precisions of one setting
PRECISION_KEYS = ("amp", "channels_last")
#: the files the parity report writes, beside the report's table
PARITY_FILES = ("parity.md", "parity.csv", "parity.json")
#: the accuracy the main table compares (the mean over domains, as the paper reports)
AVERAGE = "AVG"


def _numbers_settings(run: RunData) -> dict[str, Any]:
    """The run's flat settings that decide its numbers (:data:`~fedhpro.reports.run_data.NOT_A_SETTING`, the
    seed and the presentational keys, left out), as the seed table groups runs."""
    return {key: value for key, value in dotted_keys(run.config).items() if key not in NOT_A_SETTING}


@dataclass
class PrecisionGroup:
    """The runs of one setting at one precision (the seeds of one comparison folder, usually)."""

    settings: dict[str, Any]  # flat settings but the seed, precision keys included
    runs: list[RunData] = field(default_factory=list)

    @property
    def finished(self) -> list[RunData]:
        return [run for run in self.runs if run.finished]

    @property
    def unfinished(self) -> list[RunData]:
        return [run for run in self.runs if not run.finished]

    @property
    def setting_key(self) -> str:
        return json.dumps({k: v for k, v in self.settings.items() if k not in PRECISION_KEYS}, sort_keys=True,
                          default=str)

    @property
    def is_reference(self) -> bool:
        """Whether this is the float32 side (``amp=off``)."""
        return str(self.settings.get("amp", "off")) == "off"

    def machine(self, key: str) -> str | None:
        """``key`` of the finished runs' summary.json ``machine`` block, when they all record the same."""
        blocks = [run.summary.get("machine") if run.summary else None for run in self.finished]
        values = {str(block.get(key)) if isinstance(block, dict) else "None" for block in blocks}
        return values.pop() if len(values) == 1 and "None" not in values else None

    @property
    def precision(self) -> str:
        """The precision local training ran in, as summary.json's ``machine`` block resolved it (``float32``,
        ``bf16``, ``fp16`` on a GPU without native bfloat16); ``amp``'s value where no finished run says."""
        resolved = self.machine("precision")
        if resolved is not None:
            return resolved
        return "float32" if self.is_reference else str(self.settings.get("amp"))

    @property
    def keys(self) -> str:
        """``"amp=bf16, channels_last=auto"``: the precision keys as the runs' config.yaml writes them."""
        recorded = self.runs[0].config
        return ", ".join(f"{key}={recorded.get(key)}" for key in PRECISION_KEYS if key in recorded)

    @property
    def described(self) -> str:
        """``"amp=bf16, channels_last=auto (memory format channels_last)"``: the keys and what they resolved to."""
        memory = self.machine("memory_format")
        return self.keys + (f" (memory format {memory})" if memory else "")

    @property
    def folder(self) -> Path:
        """The folder holding the group's run folders (its comparison folder)."""
        parents = sorted({str(run.path.parent.resolve()) for run in self.runs})
        return Path(os.path.commonpath(parents))

    @property
    def seeds(self) -> str:
        return ",".join(str(run.config.get("seed", "?")) for run in self.finished)


def precision_groups(runs: Sequence[RunData]) -> list[PrecisionGroup]:
    """``runs`` grouped by their settings but the seed, in the order of their first run."""
    groups: dict[str, PrecisionGroup] = {}
    for run in runs:
        settings = _numbers_settings(run)
        key = json.dumps(settings, sort_keys=True, default=str)
        groups.setdefault(key, PrecisionGroup(settings)).runs.append(run)
    return list(groups.values())


def mixes_precisions(runs: Sequence[RunData]) -> bool:
    """Whether ``runs`` were trained at more than one precision (``amp`` differs; runs that differ in
    ``channels_last`` alone are all float32 or all mixed precision, a plain comparison)."""
    return len({str(run.config.get("amp", "off")) for run in runs}) > 1


@dataclass
class Measure:
    """One accuracy (AVG or a domain) of a pair: the seeds' mean and sample std on each side, and the paired
    t-test over the seeds both sides share (:func:`fedhpro.reports.significance.verdicts`: the p value, the 95 %
    t-intervals, ▲ / ▼ where the compared side is better / worse at alpha 0.05; no test with fewer than 3 shared
    seeds)."""

    reference: tuple[float | None, float | None]
    compared: tuple[float | None, float | None]
    tested: Verdicts | None = None

    @property
    def p_paired(self) -> float | None:
        return None if self.tested is None else self.tested.p_baseline.get(COMPARED)

    @property
    def intervals(self) -> list[float | None]:
        """``[reference low, reference high, compared low, compared high]`` (None with fewer than 2 seeds)."""
        if self.tested is None:
            return [None] * 4
        return interval_bounds(self.tested, REFERENCE) + interval_bounds(self.tested, COMPARED)

    @property
    def test_text(self) -> str:
        """The paired test's cell: ``p = 0.031 ▼``, or why there is none."""
        if self.tested is None or not self.tested.tested:
            shared = 0 if self.tested is None else len(self.tested.shared_seeds)
            return f"no test ({shared} shared seed{'s' if shared != 1 else ''})"
        mark = self.tested.against_baseline.get(COMPARED, "")
        return f"p = {self.p_paired:.3g}" + (f" {mark}" if mark else "")

    @property
    def difference(self) -> float | None:
        if self.reference[0] is None or self.compared[0] is None:
            return None
        return self.compared[0] - self.reference[0]

    @property
    def larger_std(self) -> float | None:
        spreads = [std for _, std in (self.reference, self.compared) if std is not None]
        return max(spreads) if spreads else None

    @property
    def verdict(self) -> str | None:
        """``within`` when the difference of means is no larger than the larger seed std, else ``outside``."""
        difference, spread = self.difference, self.larger_std
        if difference is None or spread is None:
            return None
        return "within" if abs(difference) <= spread else "outside"


@dataclass
class ParityRow:
    """A setting's float32 group against one of its mixed-precision groups."""

    setting: str  # the label in the table
    settings: str  # what tells the setting from the others (``fedhpro partition.scheme=longtail``)
    reference: PrecisionGroup
    compared: PrecisionGroup
    measures: dict[str, Measure]  # AVG first, then the domains


@dataclass
class Parity:
    """The parity table's rows and the lines about what it left out."""

    rows: list[ParityRow]
    left_out: list[str]


def _final_accuracy(run: RunData, measure: str) -> float | None:
    value = run.final["accuracy"].get(measure)
    return None if value is None else float(value)


#: the two sides as the paired test names them
REFERENCE, COMPARED = "reference", "compared"


def _by_seed(group: PrecisionGroup, measure: str) -> dict[int, float | None]:
    return {run_seed(run, index): _final_accuracy(run, measure) for index, run in enumerate(group.finished)}


def _measures(reference: PrecisionGroup, compared: PrecisionGroup) -> dict[str, Measure]:
    domains = [name for name in reference.finished[0].final["accuracy"] if name != AVERAGE]
    return {measure: Measure(mean_std([_final_accuracy(run, measure) for run in reference.finished]),
                             mean_std([_final_accuracy(run, measure) for run in compared.finished]),
                             verdicts({REFERENCE: _by_seed(reference, measure), COMPARED: _by_seed(compared, measure)},
                                      baseline=REFERENCE))
            for measure in [AVERAGE] + domains}


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _differences(a: PrecisionGroup, b: PrecisionGroup) -> list[str]:
    keys = sorted((set(a.settings) | set(b.settings)) - set(PRECISION_KEYS))
    return [key for key in keys if a.settings.get(key) != b.settings.get(key)]


def _refusal(references: Sequence[PrecisionGroup], compared: Sequence[PrecisionGroup]) -> ConfigError:
    """The one line refusing float32 and mixed-precision folders that differ besides the precision: the
    closest two named, with the keys they differ in."""
    a, b = min(((x, y) for x in references for y in compared), key=lambda pair: len(_differences(*pair)))
    keys = _differences(a, b)
    shown = "; ".join(f"{key} {_shown(a.settings.get(key))} against {_shown(b.settings.get(key))}"
                      for key in keys[:3]) + (f"; and {len(keys) - 3} more" if len(keys) > 3 else "")
    return ConfigError(
        f"{a.folder} ({a.precision}) and {b.folder} ({b.precision}) differ in {shown}, not only in the precision "
        f"({', '.join(PRECISION_KEYS)}): give each setting's comparison folders at both precisions with the "
        "same settings, or report them apart")


def _setting_labels(settings: dict[str, list[PrecisionGroup]]) -> tuple[list[str], list[str]]:
    """Per setting ``(label, settings label)``: the label is the folder that holds its comparison folders (the
    one their parents share), relative to the folder all settings' share (``default`` for
    ``study/default/float32`` and ``study/default/bf16``; its name for one setting), when that tells the
    settings apart; else the settings
    label, :func:`fedhpro.reports.run_data.run_labels` of one run per setting with the precision keys and
    :data:`~fedhpro.reports.run_data.NOT_A_SETTING` left out."""
    firsts = []
    for groups in settings.values():
        run = groups[0].runs[0]
        config = {k: v for k, v in run.config.items() if k not in PRECISION_KEYS and k not in NOT_A_SETTING}
        firsts.append(RunData(run.path, config, run.rows, run.summary))
    described = run_labels(firsts) if len(firsts) > 1 else [firsts[0].method]
    folders = [Path(os.path.commonpath([str(group.folder.parent) for group in groups]))
               for groups in settings.values()]
    root = Path(os.path.commonpath([str(folder) for folder in folders]))
    if len(folders) == 1:  # one setting: the name of the folder holding its comparison folders
        return [folders[0].name or described[0]], described
    relative = [folder.relative_to(root).as_posix() for folder in folders]
    if all(name != "." for name in relative) and len(set(relative)) == len(relative):
        return relative, described
    return described, described


def pair_precisions(runs: Sequence[RunData]) -> Parity:
    """The parity rows of ``runs`` (runs at more than one precision, :func:`mixes_precisions`).

    A setting with a float32 group and a mixed-precision group gives a row per such pair (their finished
    runs; a side with none yet is named and left out). A setting at one precision only is named and left
    out. Float32 and mixed-precision groups that both lack a partner are refused (:class:`ConfigError`,
    one line naming the keys the closest two differ in): they were meant as pairs but differ besides the
    precision."""
    by_setting: dict[str, list[PrecisionGroup]] = {}
    for group in precision_groups(runs):
        by_setting.setdefault(group.setting_key, []).append(group)
    lone_references = [g for groups in by_setting.values() if all(x.is_reference for x in groups) for g in groups]
    lone_compared = [g for groups in by_setting.values() if not any(x.is_reference for x in groups) for g in groups]
    if lone_references and lone_compared:
        raise _refusal(lone_references, lone_compared)
    labels, described = _setting_labels(by_setting)
    compared_names = sorted({g.precision for groups in by_setting.values() for g in groups if not g.is_reference})
    rows: list[ParityRow] = []
    left_out: list[str] = []
    for label, settings_label, groups in zip(labels, described, by_setting.values()):
        references = [g for g in groups if g.is_reference]
        others = [g for g in groups if not g.is_reference]
        if not references or not others:
            alone = groups[0]
            missing = "/".join(compared_names) if alone.is_reference else "float32"
            left_out.append(f"{label}: {alone.precision} only ({alone.folder}), no {missing} comparison folder "
                            "of the same settings given: left out of the parity table")
            continue
        for reference in references:
            for other in others:
                waiting = [g for g in (reference, other) if not g.finished]
                if waiting:
                    left_out.append(f"{label}: no finished {waiting[0].precision} run yet in {waiting[0].folder} "
                                    "(see table.md): left out of the parity table until one finishes")
                    continue
                # several groups at one side (channels_last set apart): each row says which two it pairs
                shown = (label if len(references) == len(others) == 1
                         else f"{label} ({reference.keys} / {other.keys})")
                rows.append(ParityRow(shown, settings_label, reference, other, _measures(reference, other)))
                left_out += [f"{label}: {run.path} is unfinished ({run.progress}): left out of its mean"
                             for group in (reference, other) for run in group.unfinished]
    return Parity(rows, left_out)


def _sides(rows: Sequence[ParityRow]) -> tuple[str, str]:
    """The names of the two sides in the headers: the precisions when every row has the same, else
    ``reference`` / ``compared`` (and a column naming each row's)."""
    references = {row.reference.precision for row in rows}
    compared = {row.compared.precision for row in rows}
    if len(references) == 1 and len(compared) == 1 and references != compared:
        return references.pop(), compared.pop()
    return "reference", "compared"


def _cell(mean: float | None, std: float | None) -> str:
    return "–" if mean is None else f"{mean:.2f} ± {format_number(std)}"


def _signed(value: float | None) -> str:
    return "–" if value is None else f"{value:+.2f}"


def parity_markdown(parity: Parity) -> str:
    """parity.md: the AVG table (one row per pair), the per-domain table, the rule and the notes."""
    rows = parity.rows
    reference, compared = _sides(rows)
    named = (reference, compared) != ("reference", "compared")
    lead = ["setting", "seeds"] + ([] if named else ["precisions"])
    header = lead + [f"{reference} AVG", f"{compared} AVG", "difference", "larger seed std", "verdict",
                     "paired test"]
    body = []
    for row in rows:
        measure = row.measures[AVERAGE]
        seeds = (row.reference.seeds if row.reference.seeds == row.compared.seeds
                 else f"{row.reference.seeds} / {row.compared.seeds}")
        body.append([row.setting, seeds] + ([] if named else [f"{row.reference.precision} / {row.compared.precision}"])
                    + [_cell(*measure.reference), _cell(*measure.compared), _signed(measure.difference),
                       format_number(measure.larger_std), measure.verdict or "–", measure.test_text])
    caption = (f"{reference} against {compared}: final test accuracy (%), mean ± sample std over each side's seeds; "
               f"difference = {compared} mean − {reference} mean; verdict: within when |difference| ≤ the larger "
               "of the two seed stds (the larger seed spread), else outside; paired test: the two-sided paired "
               "t-test (scipy.stats.ttest_rel) of the two sides over the seeds they share, alpha = 0.05, one test "
               f"per row and measure (no correction), ▲ / ▼ where {compared} is better / worse; no test with fewer "
               f"than {MIN_SEEDS} shared seeds. parity.csv adds each side's 95 % t-interval and the p value.")
    precisions = sorted({f"{group.precision}: {group.described}" for row in rows
                         for group in (row.reference, row.compared)})
    notes = [f"precision {text}" for text in precisions]
    notes += [f"{row.setting}: {row.settings}" for row in rows if row.setting != row.settings]
    notes += parity.left_out
    text = markdown_table(header, body, caption, notes)
    domain_rows = [[row.setting, name, _cell(*m.reference), _cell(*m.compared), _signed(m.difference),
                    format_number(m.larger_std), m.verdict or "–", m.test_text]
                   for row in rows for name, m in row.measures.items() if name != AVERAGE]
    if domain_rows:
        text += "\n" + markdown_table(["setting", "domain", reference, compared, "difference", "larger seed std",
                                       "verdict", "paired test"], domain_rows, "Per domain, the same comparison:")
    return text


CSV_HEADER = ["setting", "settings", "measure", "reference", "compared", "reference_seeds", "compared_seeds",
              "reference_mean", "reference_std", "compared_mean", "compared_std", "difference", "larger_std",
              "verdict", "reference_ci_low", "reference_ci_high", "compared_ci_low", "compared_ci_high", "p_paired"]


def parity_csv(parity: Parity) -> str:
    """parity.csv: one line per pair and measure (AVG, then each domain), full precision."""
    lines = [[row.setting, row.settings, name, row.reference.precision, row.compared.precision,
              row.reference.seeds, row.compared.seeds, *m.reference, *m.compared, m.difference, m.larger_std,
              m.verdict, *m.intervals, m.p_paired] for row in parity.rows for name, m in row.measures.items()]
    return csv_text(CSV_HEADER, lines)


def _side(group: PrecisionGroup) -> dict[str, Any]:
    return {"precision": group.precision, **{key: group.settings.get(key) for key in PRECISION_KEYS},
            "memory_format": group.machine("memory_format"), "folder": str(group.folder),
            "seeds": [run.config.get("seed") for run in group.finished],
            "runs": [str(run.path.resolve()) for run in group.finished]}


def parity_record(parity: Parity) -> dict[str, Any]:
    """parity.json: per pair both sides (precision, keys, folder, seeds, runs) and every measure."""
    return {
        "rule": "verdict within when |compared mean - reference mean| <= max(reference std, compared std), "
                "sample stds over the seeds",
        "pairs": [{"setting": row.setting, "settings": row.settings, "reference": _side(row.reference),
                   "compared": _side(row.compared),
                   "measures": {name: {"reference_mean": m.reference[0], "reference_std": m.reference[1],
                                       "compared_mean": m.compared[0], "compared_std": m.compared[1],
                                       "difference": m.difference, "larger_std": m.larger_std,
                                       "verdict": m.verdict, "p_paired": m.p_paired,
                                       "intervals": dict(zip(("reference_low", "reference_high", "compared_low",
                                                              "compared_high"), m.intervals))}
                                for name, m in row.measures.items()}}
                  for row in parity.rows],
        "left_out": parity.left_out,
    }


def write_parity(out: Path, parity: Parity, echo: bool = True) -> None:
    """Write parity.md, parity.csv and parity.json to ``out`` (atomically); print the table with ``echo``."""
    text = parity_markdown(parity) if parity.rows else ""
    if not parity.rows:
        text = "No setting has finished runs at both precisions yet.\n\n" + "".join(
            f"- {line}\n" for line in parity.left_out)
    write_atomic(out / "parity.md", text)
    write_atomic(out / "parity.csv", parity_csv(parity))
    write_json(out / "parity.json", parity_record(parity))
    if echo:
        print(text)
        print(f"written to {out}/: {', '.join(PARITY_FILES)}")
