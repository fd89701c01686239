"""Client-level DP that learns: final accuracy against the cohort size (clients a round), with and without DP.

One federation of ``--clients`` N clients (default 10,000: the synthetic digits, ``data.syn_size=60000``,
48,000 training images, iid, 4-5 images a client); each cohort size m samples every client with probability
``q = m / N`` a round (Poisson), so the cohorts differ only in m. For each m, FedAvg runs with client-level DP
(central noise, ``privacy.target_epsilon=--epsilon``, delta the default 1/N^1.1) and without, as
``fedhpro compare`` folders (``bench/privacy_utility.py``'s layout: every run a folder of its own, so
``fedhpro report`` rebuilds every number): ``<out>/cohort-<m>/client/eps-<E>`` and ``.../eps-inf``. The
accountant calibrates the noise multiplier sigma to the planned rounds at sampling rate q; the server adds
``N(0, sigma^2 C^2)`` to the sum of the clipped updates and divides by ``q N = m``, so the noise on each
coordinate of the averaged update has std ``sigma C / m``: what the table's ``noise`` column shows.

Files, written atomically from the runs' ``summary.json``: ``<out>/dp-cohorts.json``, ``.csv``, ``.md``
(mean ± std over the seeds that finished) and the figure (``--figure``, default
``docs/images/dp-cohorts.png``; accuracy against m, one line with DP and one without).

    nice -n 10 python bench/dp_cohorts.py --out results/dp-cohorts --cohorts 100 1000 --seeds 0 1
    nice -n 10 python bench/dp_cohorts.py --out results/dp-cohorts --cohorts 100 --seeds 0 1 2 --clip-only
    nice -n 10 python bench/dp_cohorts.py --out results/dp-cohorts-120 --more "rounds=120 eval_every=10" \\
        --cohorts 100 --seeds 0 1 --figure results/dp-cohorts-120/dp-cohorts.png
    python bench/dp_cohorts.py --out results/dp-cohorts --collect --cohorts 100 1000 --seeds 0 1 2 \\
        --panel results/dp-cohorts-120

The first form runs (finished runs are read back) and collects; ``--clip-only`` adds the control of DP's clipping
with negligible noise; ``--collect`` only collects, ``--panel`` draws another finished study (here 120 rounds) as a
second panel of the figure.

Cost measured on a shared 2-core Xeon (1 thread, amp=bf16, the settings below, other jobs on the machine): a
client's round (3 epochs of batches of 2 on 4-5 images) about 20 ms, so 30 rounds of a cohort of 100 take 1-1.5
minutes a run, of 1,000 about 11 minutes (20 s a round); a cohort of 5,000 would take about 100 s a round, some
50 minutes a run (an estimate from the per-client cost, not run); 120 rounds of 100 take about 3 minutes a run,
of 300 about 9. The runs go seed by seed, cohorts in order, so
an interrupted study has whole seeds to collect; finished runs are read back, not run again.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import privacy_utility

import fedhpro.methods  # noqa: F401  (its registry gives display_name the paper's names: FedAvg, FedHPro)
from fedhpro.files import write_atomic
from fedhpro.reports.plots import display_name

#: the study's shared settings (FedAvg on the synthetic digits, the cnn with 64 features: 156,810 weights)
SETTINGS = ("dataset=digits-offline data.domains=[syn] data.syn_size=60000 partition=iid feature_dim=64 "
            "amp=bf16 threads=1 progress=false checkpoint_every=0 batch_size=2 local_epochs=3 lr=0.05 "
            "momentum=0.9 rounds=30 eval_every=5 privacy.clip=3")
ROOT = Path(__file__).resolve().parent.parent
#: the folder label and sigma of the clip-only control (``--clip-only``): DP's clipping and public denominator with
#: noise too small to matter (sigma 0.01: a noise std of sigma C / m = 3e-4 a coordinate at m = 100, against 1e-2
#: at epsilon 8), so its gap to the DP runs is the noise's cost and its gap to no DP the clipping's
CLIP_ONLY, CLIP_ONLY_SIGMA = "clip-only", 0.01


def cohort_settings(settings: Sequence[str], clients: int, cohort: int) -> list[str]:
    """The shared settings with the federation's size and the sampling rate of cohort size ``cohort``."""
    if not 0 < cohort <= clients:
        raise ValueError(f"a cohort of {cohort} does not fit a federation of {clients} clients")
    return [*settings, f"clients={clients}", f"participation={cohort / clients:g}"]


def clip_only_command(out: Path, settings: Sequence[str], seed: int) -> list[str]:
    """The clip-only control of one seed: ``privacy=client`` with sigma :data:`CLIP_ONLY_SIGMA`, in
    ``<out>/client/eps-clip-only`` beside the cohort's DP and non-DP folders."""
    return [sys.executable, "-m", "fedhpro", "compare", "methods=[fedavg]", f"seeds=[{seed}]", "jobs=1",
            f"out={out / 'client' / f'eps-{CLIP_ONLY}'}", *settings, "privacy=client", "privacy.noise=central",
            f"privacy.noise_multiplier={CLIP_ONLY_SIGMA:g}"]


def collect(out: Path, cohorts: Sequence[int], seeds: Sequence[int], epsilon: str) -> list[dict[str, Any]]:
    """One row per cohort size: the final AVG accuracy of every seed with DP, without, and of the clip-only control
    where it ran (``privacy_utility.collect`` of the cohort's folder), their means, stds and the gap DP to no DP,
    and the DP runs' sigma, clip and the per-coordinate noise std on the averaged update ``sigma C / m``."""
    rows = []
    for cohort in cohorts:
        folder = out / f"cohort-{cohort}" / "client"
        private, public, clipped = privacy_utility.collect(folder, ["fedavg"], seeds, [epsilon, "inf", CLIP_ONLY])
        sigma = clip = None
        for seed in seeds:
            path = folder / f"eps-{epsilon}" / f"fedavg-seed{seed}" / "summary.json"
            if path.is_file():
                privacy = json.loads(path.read_text()).get("privacy") or {}
                sigma, clip = privacy.get("noise_multiplier", sigma), privacy.get("clip", clip)
        noise = sigma * clip / cohort if sigma is not None and clip is not None else None
        gap = public["mean"] - private["mean"] if private["accuracy"] and public["accuracy"] else None
        rows.append({"cohort": cohort, "dp": private["accuracy"], "dp_mean": private["mean"], "dp_std": private["std"],
                     "no_dp": public["accuracy"], "no_dp_mean": public["mean"], "no_dp_std": public["std"],
                     "clip_only": clipped["accuracy"], "clip_only_mean": clipped["mean"],
                     "clip_only_std": clipped["std"],
                     "gap": gap, "epsilon_reached": private["epsilon_reached"], "noise_multiplier": sigma,
                     "clip": clip, "noise_std": noise})
    return rows


def _cell(values: Sequence[float], mean: float, std: float, seeds: int) -> str:
    if not values:
        return "not run"
    return f"{mean:.2f} ± {std:.2f}" + (f" ({len(values)} seed{'s' if len(values) > 1 else ''})"
                                         if len(values) != seeds else "")


def markdown(rows: Sequence[dict[str, Any]], epsilon: str, seeds: Sequence[int], caption: str) -> str:
    control = any(row["clip_only"] for row in rows)
    lines = [caption, "", f"| clients a round | sigma | noise std on the mean update (sigma C / m) | eps = {epsilon} "
             "| no DP | gap (points) | epsilon reached |" + (" clip only, no noise |" if control else ""),
             "|---" * (8 if control else 7) + "|"]
    for row in rows:
        sigma = "–" if row["noise_multiplier"] is None else f"{row['noise_multiplier']:.3f}"
        noise = "–" if row["noise_std"] is None else f"{row['noise_std']:.2e}"
        gap = "–" if row["gap"] is None else f"{row['gap']:.2f}"
        reached = "–" if row["epsilon_reached"] is None else f"{row['epsilon_reached']:.2f}"
        lines.append(f"| {row['cohort']:,} | {sigma} | {noise} | "
                     f"{_cell(row['dp'], row['dp_mean'], row['dp_std'], len(seeds))} | "
                     f"{_cell(row['no_dp'], row['no_dp_mean'], row['no_dp_std'], len(seeds))} | {gap} | {reached} |"
                     + (f" {_cell(row['clip_only'], row['clip_only_mean'], row['clip_only_std'], len(seeds))} |"
                        if control else ""))
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["cohort", "noise_multiplier", "clip", "noise_std", "dp_mean", "dp_std", "dp_per_seed",
                     "no_dp_mean", "no_dp_std", "no_dp_per_seed", "gap", "epsilon_reached", "clip_only_mean",
                     "clip_only_std", "clip_only_per_seed"])
    for row in rows:
        writer.writerow([row["cohort"], row["noise_multiplier"], row["clip"], row["noise_std"], row["dp_mean"],
                         row["dp_std"], " ".join(f"{v:.4f}" for v in row["dp"]), row["no_dp_mean"], row["no_dp_std"],
                         " ".join(f"{v:.4f}" for v in row["no_dp"]), row["gap"], row["epsilon_reached"],
                         row["clip_only_mean"], row["clip_only_std"], " ".join(f"{v:.4f}" for v in row["clip_only"])])
    return buffer.getvalue()


def rounds_of(settings: Sequence[str]) -> str:
    """The ``rounds=`` of a study's settings (the last one given wins, as in a run's overrides)."""
    return next((item.split("=", 1)[1] for item in reversed(settings) if item.startswith("rounds=")), "?")


def plot(panels: Sequence[tuple[Sequence[dict[str, Any]], str]], epsilon: str, path: Path, title: str) -> None:
    """Accuracy against the cohort size, one panel per ``(rows, panel title)``, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False, sharey=True)
    for axis, (rows, name) in zip(axes[0], panels):
        _panel(axis, rows, epsilon, name)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, metadata={"Software": None})
    plt.close(figure)
    write_atomic(path, buffer.getvalue())


def _panel(axis: Any, rows: Sequence[dict[str, Any]], epsilon: str, title: str) -> None:
    for key, label, style in (("no_dp", "no DP", "o-"), ("dp", f"client-level DP, eps = {epsilon}", "s--"),
                              ("clip_only", f"clip only (sigma = {CLIP_ONLY_SIGMA:g}, no privacy)", "^:")):
        points = [(r["cohort"], r[f"{key}_mean"], r[f"{key}_std"]) for r in rows if r[key]]
        if points:
            xs, ys, errors = zip(*points)
            axis.errorbar(xs, ys, yerr=errors, fmt=style, capsize=3, label=label)
    axis.axhline(10.0, color="grey", linewidth=0.8, linestyle=":", label="chance")
    axis.set_xscale("log")
    axis.set_xticks([r["cohort"] for r in rows])
    axis.set_xticklabels([f"{r['cohort']:,}" for r in rows])
    axis.xaxis.set_minor_formatter("")  # no 2 x 10^2 between the cohorts' own ticks
    axis.set_xlabel("clients a round (m)")
    axis.set_ylabel("final accuracy (%)")
    axis.set_title(title, fontsize=9)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)


#: the per-method study's clip arms: the fixed clip ``privacy.clip`` and adaptive clipping to the median update norm
#: (Andrew et al. 2021's choice of quantile, learning rate 0.2, starting at ``privacy.clip``)
CLIP_ARMS = {"fixed": [], "adaptive": ["privacy.clip_quantile=0.5"]}


def method_cohort_settings(settings: Sequence[str], clients: int, trained: int, cohort: int) -> list[str]:
    """The per-method study's settings of one cohort size: ``trained`` clients a round train (Poisson, rate
    ``trained / clients``); a cohort above it is a noise cohort (``privacy.noise_cohort``: the noise and the epsilon of
    ``cohort`` clients a round, a simulation said so in every run's summary), the trained cohort itself a real one."""
    if not 0 < trained <= cohort <= clients:
        raise ValueError(f"need 0 < trained ({trained}) <= cohort ({cohort}) <= clients ({clients})")
    more = [f"privacy.noise_cohort={cohort}"] if cohort > trained else []
    return [*cohort_settings(settings, clients, trained), *more]


def method_commands(out: Path, settings: Sequence[str], methods: Sequence[str], clients: int, trained: int,
                    cohorts: Sequence[int], seeds: Sequence[int], epsilon: str, jobs: int,
                    tuned: Path | None = None) -> list[list[str]]:
    """Seed by seed: the run without DP (``<out>/no-dp``, the trained cohort's), then per cohort and clip arm the DP
    run (``<out>/cohort-<m>/<arm>``), every one a ``fedhpro compare`` of all ``methods`` (``fedhpro report`` of a
    folder rebuilds its row of the table); ``tuned``: the ``tuned.yaml`` of ``fedhpro tune`` (each method at its
    own tuned settings, found without DP on validation data)."""
    commands = []
    for seed in seeds:
        base = [sys.executable, "-m", "fedhpro", "compare", f"methods=[{','.join(methods)}]", f"seeds=[{seed}]",
                f"jobs={jobs}", *([f"tuned={tuned}"] if tuned is not None else [])]
        commands.append([*base, f"out={out / 'no-dp'}", *cohort_settings(settings, clients, trained)])
        for cohort in cohorts:
            for arm, keys in CLIP_ARMS.items():
                commands.append([*base, f"out={out / f'cohort-{cohort}' / arm}",
                                 *method_cohort_settings(settings, clients, trained, cohort),
                                 *privacy_utility.privacy_keys("client", epsilon), *keys])
    return commands


def _final(folder: Path, method: str, seeds: Sequence[int]) -> tuple[list[float], dict[str, Any], list[int]]:
    """The final AVG accuracy of each seed's run that finished, the privacy summary of one, and the seeds whose run
    started (its metrics.jsonl) but wrote no summary: a run stopped by a non-finite loss (the study's log says)."""
    values, privacy, failed = [], {}, []
    for seed in seeds:
        run = folder / f"{method}-seed{seed}"
        path = run / "summary.json"
        if path.is_file():
            summary = json.loads(path.read_text())
            if summary.get("accuracy") is not None:
                values.append(float(summary["accuracy"]))
                privacy = summary.get("privacy") or privacy
        elif (run / "metrics.jsonl").is_file():
            failed.append(seed)
    return values, privacy, failed


def _stats(values: Sequence[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return mean, std


def collect_methods(out: Path, methods: Sequence[str], cohorts: Sequence[int], seeds: Sequence[int],
                    trained: int) -> list[dict[str, Any]]:
    """One row per (method, cohort): the final AVG accuracy of each seed without DP (the trained cohort's run, the
    same for every cohort), with DP at the fixed clip and with adaptive clipping; means, stds, the gaps to no DP,
    sigma, the clip, whether the cohort is a noise cohort and the largest epsilon reached."""
    rows = []
    for method in methods:
        public, _, public_failed = _final(out / "no-dp", method, seeds)
        for cohort in cohorts:
            row: dict[str, Any] = {"method": method, "cohort": cohort, "trained": trained,
                                   "noise_cohort": cohort > trained, "no_dp": public, "no_dp_failed": public_failed}
            row["no_dp_mean"], row["no_dp_std"] = _stats(public)
            reached = []
            for arm in CLIP_ARMS:
                values, privacy, failed = _final(out / f"cohort-{cohort}" / arm, method, seeds)
                row[arm], row[f"{arm}_failed"] = values, failed
                row[f"{arm}_mean"], row[f"{arm}_std"] = _stats(values)
                row[f"{arm}_gap"] = (row["no_dp_mean"] - row[f"{arm}_mean"]
                                     if row["no_dp_mean"] is not None and row[f"{arm}_mean"] is not None else None)
                if privacy:
                    row["noise_multiplier"], row["clip"] = privacy.get("noise_multiplier"), privacy.get("clip")
                    if isinstance(privacy.get("epsilon"), (int, float)):
                        reached.append(float(privacy["epsilon"]))
            row.setdefault("noise_multiplier", None)
            row.setdefault("clip", None)
            row["epsilon_reached"] = max(reached) if reached else None
            rows.append(row)
    return rows


def _failed_cell(values: Sequence[float], mean: float | None, std: float | None, seeds: int,
                 failed: Sequence[int]) -> str:
    """:func:`_cell`, saying how many seeds' runs stopped on a non-finite loss ("diverged")."""
    if not values:
        return f"diverged ({len(failed)} of {seeds} seeds)" if failed else "not run"
    cell = _cell(values, float(mean or 0.0), float(std or 0.0), seeds)
    return cell + (f"; {len(failed)} diverged" if failed else "")


def methods_markdown(rows: Sequence[dict[str, Any]], epsilon: str, seeds: Sequence[int], caption: str) -> str:
    lines = [caption, "", f"| method | clients a round | sigma | no DP | eps = {epsilon}, fixed clip | gap | "
             f"eps = {epsilon}, adaptive clip | gap | epsilon reached |", "|---" * 9 + "|"]
    for row in rows:
        cohort = f"{row['cohort']:,}" + (f" (noise cohort; {row['trained']:,} train)" if row["noise_cohort"] else "")
        sigma = "–" if row["noise_multiplier"] is None else f"{row['noise_multiplier']:.3f}"
        cells = []
        for key in ("no_dp", "fixed", "adaptive"):
            cells.append(_failed_cell(row[key], row[f"{key}_mean"], row[f"{key}_std"], len(seeds),
                                      row[f"{key}_failed"]))
            if key != "no_dp":
                cells.append("–" if row[f"{key}_gap"] is None else f"{row[f'{key}_gap']:.2f}")
        reached = "–" if row["epsilon_reached"] is None else f"{row['epsilon_reached']:.2f}"
        lines.append(f"| {display_name(row['method'])} | {cohort} | {sigma} | {' | '.join(cells)} | {reached} |")
    return "\n".join(lines) + "\n"


def methods_csv(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    keys = ["method", "cohort", "trained", "noise_cohort", "noise_multiplier", "clip", "no_dp_mean", "no_dp_std",
            "fixed_mean", "fixed_std", "fixed_gap", "adaptive_mean", "adaptive_std", "adaptive_gap", "epsilon_reached"]
    arms = ("no_dp", "fixed", "adaptive")
    writer.writerow([*keys, *(f"{arm}_per_seed" for arm in arms), *(f"{arm}_diverged_seeds" for arm in arms)])
    for row in rows:
        writer.writerow([row[k] for k in keys] + [" ".join(f"{v:.4f}" for v in row[arm]) for arm in arms]
                        + [" ".join(str(seed) for seed in row[f"{arm}_failed"]) for arm in arms])
    return buffer.getvalue()


def plot_methods(rows: Sequence[dict[str, Any]], methods: Sequence[str], epsilon: str, path: Path, title: str) -> None:
    """One panel per method: final accuracy against the cohort size without DP (a line: the trained cohort's run),
    with DP at the fixed clip and with adaptive clipping."""
    import matplotlib  # only the figure needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(methods), figsize=(3.2 * len(methods), 3.4), squeeze=False, sharey=True)
    for axis, method in zip(axes[0], methods):
        mine = [r for r in rows if r["method"] == method]
        public = next((r for r in mine if r["no_dp_mean"] is not None), None)
        if public is not None:
            axis.axhspan(public["no_dp_mean"] - public["no_dp_std"], public["no_dp_mean"] + public["no_dp_std"],
                         color="black", alpha=0.08)
            lost = f" ({len(public['no_dp'])} seed; {len(public['no_dp_failed'])} diverged)" \
                if public["no_dp_failed"] else ""
            axis.axhline(public["no_dp_mean"], color="black", linewidth=1.2, label=f"no DP{lost}")
        for key, label, style, colour in (("fixed", f"eps = {epsilon}, fixed clip", "s--", "C0"),
                                          ("adaptive", f"eps = {epsilon}, adaptive clip", "^-", "C1")):
            points = [(r["cohort"], r[f"{key}_mean"], r[f"{key}_std"]) for r in mine if r[key]]
            if points:
                xs, ys, errors = zip(*points)
                axis.errorbar(xs, ys, yerr=errors, fmt=style, color=colour, capsize=3, label=label)
            for row in mine:  # every seed stopped on a non-finite loss: said where its point would be
                if not row[key] and row[f"{key}_failed"]:
                    axis.plot([row["cohort"]], [10.0], "x", color=colour, markersize=9)
                    axis.annotate("diverged", (row["cohort"], 10.0), textcoords="offset points", xytext=(0, 7),
                                  ha="center", fontsize=7, color=colour)
        axis.axhline(10.0, color="grey", linewidth=0.8, linestyle=":", label="chance")
        axis.set_xscale("log")
        axis.set_xticks([r["cohort"] for r in mine])
        axis.set_xticklabels([f"{r['cohort']:,}" for r in mine])
        axis.xaxis.set_minor_formatter("")
        axis.set_xlabel("clients a round (noise cohort)")
        axis.set_title(display_name(method), fontsize=9)
        axis.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("final accuracy (%)")
    axes[0][0].legend(fontsize=7)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    for suffix in ("png", "pdf"):
        buffer = io.BytesIO()
        figure.savefig(buffer, format=suffix, dpi=150, metadata={"Creator": None} if suffix == "pdf"
                       else {"Software": None})
        write_atomic(path.with_suffix(f".{suffix}"), buffer.getvalue())
    plt.close(figure)


def tuned_summary(path: Path) -> str:
    """Each method's tuned settings in ``tuned.yaml``, one ``FedAvg lr=0.05`` phrase each."""
    import yaml  # the tuned settings only where the study was tuned

    methods = (yaml.safe_load(path.read_text()) or {}).get("methods") or {}
    return "; ".join(f"{display_name(name)} " + " ".join(f"{key}={value:.3g}" if isinstance(value, float)
                                                          else f"{key}={value}" for key, value in values.items())
                     for name, values in methods.items())


def settings_chosen(path: Path) -> str | None:
    """How a settings file's methods' settings were chosen when not by ``fedhpro tune`` (its ``tuning.chosen``
    line), else None."""
    import yaml  # the tuned settings only where the study was tuned

    chosen = ((yaml.safe_load(path.read_text()) or {}).get("tuning") or {}).get("chosen")
    return chosen if isinstance(chosen, str) else None


def methods_study(args: argparse.Namespace, settings: list[str]) -> int:
    """``--methods``: every method at every cohort size, fixed and adaptive clip, against its run without DP."""
    saved = args.out / "dp-methods.json"
    if args.collect and saved.is_file():
        study = json.loads(saved.read_text())
        settings, args.clients, args.trained = study["settings"], study["clients"], study["trained"]
        args.methods, args.cohorts, args.seeds = study["methods"], study["cohorts"], study["seeds"]
        args.tuned = Path(study["tuned"]) if study.get("tuned") else None
    trained = args.trained or min(args.cohorts)
    commands = method_commands(args.out, settings, args.methods, args.clients, trained, args.cohorts, args.seeds,
                               args.epsilon, args.jobs, args.tuned)
    if not args.collect:
        privacy_utility.run_commands(commands)
    rows = collect_methods(args.out, args.methods, args.cohorts, args.seeds, trained)
    caption = (f"Final accuracy (%) on the synthetic digits, {args.clients:,} clients (iid), {trained:,} of them "
               f"trained a round; a larger cohort is a noise cohort (privacy.noise_cohort: noise and epsilon of that "
               f"many clients a round, simulated); client-level DP with central noise, delta = 1/N^1.1; mean ± std "
               f"over seeds {list(args.seeds)}; settings: `{' '.join(settings)}`")
    if args.tuned is not None:
        chosen = settings_chosen(args.tuned)
        caption += (f"; each method at its settings tuned without DP (`{args.tuned}`: {tuned_summary(args.tuned)})"
                    if chosen is None else
                    f"; each method at settings chosen without DP, not tuned by this study (`{args.tuned}`: "
                    f"{tuned_summary(args.tuned)}; {chosen})")
    write_atomic(saved, json.dumps({"settings": settings, "clients": args.clients, "trained": trained,
                                    "tuned": None if args.tuned is None else str(args.tuned),
                                    "methods": list(args.methods), "cohorts": list(args.cohorts),
                                    "seeds": list(args.seeds), "epsilon": args.epsilon, "rows": rows,
                                    "commands": [shlex.join(["fedhpro", *c[3:]]) for c in commands]},
                                   indent=1) + "\n")
    write_atomic(args.out / "dp-methods.csv", methods_csv(rows))
    table = methods_markdown(rows, args.epsilon, args.seeds, caption)
    write_atomic(args.out / "dp-methods.md", table)
    plot_methods(rows, args.methods, args.epsilon, args.figure,
                 f"synthetic digits, {args.clients:,} clients, {trained:,} train a round: client-level DP "
                 f"eps = {args.epsilon}")
    print(table)
    return 0 if all(r["no_dp"] and r["fixed"] and r["adaptive"] for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=10000, help="N, the federation's clients")
    parser.add_argument("--cohorts", nargs="+", type=int, default=[100, 1000, 5000], help="clients a round")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epsilon", default="8")
    parser.add_argument("--settings", default=SETTINGS, help="the runs' shared KEY=VALUE settings, one string")
    parser.add_argument("--more", default="", help="KEY=VALUE settings appended to --settings (e.g. rounds=120)")
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "images" / "dp-cohorts.png")
    parser.add_argument("--clip-only", action="store_true",
                        help="also run the clip-only control (DP's clipping, negligible noise), every cohort and seed")
    parser.add_argument("--collect", action="store_true", help="only collect finished runs into the table")
    parser.add_argument("--panel", type=Path, action="append", default=[],
                        help="the --out of another finished study (e.g. more rounds), drawn as a panel of the figure")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="the per-method study: these methods at every cohort, fixed and adaptive clip "
                             "(files dp-methods.*; --figure default docs/images/dp-methods.png)")
    parser.add_argument("--trained", type=int, default=0,
                        help="--methods: the clients that train a round (default the smallest cohort); larger "
                             "cohorts are noise cohorts")
    parser.add_argument("--tuned", type=Path, default=None,
                        help="--methods: the tuned.yaml of fedhpro tune (each method at its tuned settings)")
    parser.add_argument("--jobs", type=int, default=1, help="--methods: runs at once (fedhpro compare's jobs=)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    settings = shlex.split(args.settings) + shlex.split(args.more)
    if args.methods:
        if args.figure == parser.get_default("figure"):
            args.figure = ROOT / "docs" / "images" / "dp-methods.png"
        return methods_study(args, settings)
    saved = args.out / "dp-cohorts.json"
    if args.collect and saved.is_file():  # the study's own settings, cohorts and seeds, unless given
        study = json.loads(saved.read_text())
        settings, args.clients = study["settings"], study["clients"]
        given = set(argv if argv is not None else sys.argv[1:])
        args.cohorts = args.cohorts if "--cohorts" in given else study["cohorts"]
        args.seeds = args.seeds if "--seeds" in given else study["seeds"]
    commands = []
    for seed in args.seeds:
        for cohort in args.cohorts:
            for epsilon in (args.epsilon, "inf"):
                commands.append(privacy_utility.compare_command(
                    "client", epsilon, args.out / f"cohort-{cohort}",
                    cohort_settings(settings, args.clients, cohort), ["fedavg"], [seed], 1))
            if args.clip_only:
                commands.append(clip_only_command(args.out / f"cohort-{cohort}",
                                                  cohort_settings(settings, args.clients, cohort), seed))
    if not args.collect:
        privacy_utility.run_commands(commands)
    rows = collect(args.out, args.cohorts, args.seeds, args.epsilon)
    caption = (f"FedAvg, final accuracy (%) on the synthetic digits, {args.clients:,} clients (iid), mean ± std over "
               f"seeds {args.seeds}; client-level DP with central noise, delta = 1/N^1.1; settings: "
               f"`{' '.join(settings)}`")
    write_atomic(saved, json.dumps({"settings": settings, "clients": args.clients, "cohorts": args.cohorts,
                                    "seeds": args.seeds, "epsilon": args.epsilon, "rows": rows,
                                    "commands": [shlex.join(["fedhpro", *c[3:]]) for c in commands]},
                                   indent=1) + "\n")
    write_atomic(args.out / "dp-cohorts.csv", csv_text(rows))
    write_atomic(args.out / "dp-cohorts.md", markdown(rows, args.epsilon, args.seeds, caption))
    panels: list[tuple[Sequence[dict[str, Any]], str]] = [(rows, f"{rounds_of(settings)} rounds, seeds {args.seeds}")]
    for other in args.panel:
        study = json.loads((other / "dp-cohorts.json").read_text())
        panels.append((study["rows"], f"{rounds_of(study['settings'])} rounds, seeds {study['seeds']}"))
    plot(panels, args.epsilon, args.figure,
         f"FedAvg, synthetic digits, {args.clients:,} clients: client-level DP eps = {args.epsilon} against none")
    print(markdown(rows, args.epsilon, args.seeds, caption))
    return 0 if all(r["dp"] and r["no_dp"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
