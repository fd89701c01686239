"""Why FedSA beats FedHPro under label skew and long tail (issue 27): runs, per-class accuracy, geometry.

Two settings of ``configs/paper/label_skew.yaml`` (real MNIST from digits-offline, the cnn with d = 512,
SGD 0.01 / 0.9 / 1e-5, batch 64, E = 2): ``skew`` (NID1_0.2: Dirichlet 0.2 over K = 10) and ``longtail``
(rho = 100, then Dirichlet 0.5 over K = 10, balanced test set); and ``default`` (the default ``fedhpro run``),
named with ``--settings``. Every variant is one ``fedhpro compare``
folder under ``--root`` (``<root>/<setting>/<variant>``), so ``fedhpro report <that folder>`` rebuilds its
mean ± std table and curves, and running this script again reuses every finished run.

    python bench/fedsa_vs_fedhpro.py run --part main          # fedavg, fedsa, fedhpro, 3 seeds, both settings
    python bench/fedsa_vs_fedhpro.py run --part ablations     # one switch at a time (see VARIANTS)
    python bench/fedsa_vs_fedhpro.py run --part curves        # R = 50, 3 seeds
    python bench/fedsa_vs_fedhpro.py run --part matching --settings skew longtail default
                                                              # the authors' element-wise matching vs Eq. 8
    python bench/fedsa_vs_fedhpro.py analyze                  # tables (markdown) from the finished runs

``analyze`` reloads each finished run's global model (``fedhpro.load_model``), rebuilds its federation
from its config (same seed: same data) and measures on the test set: per-class accuracy (head = the
three largest classes of the federation's training data, tail = the three smallest), the norms and the
inter-class cosines of the class-mean features, and from ``server_state.pt`` the geometry of FedHPro's
hyper-prototypes and of FedSA's anchors (:mod:`fedhpro.metrics.geometry`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

BASE = ["device=cpu", "progress=false", "threads=1", "checkpoint_every=0", "jobs=1"]
MNIST = ["dataset=digits-offline", "data.domains=[mnist]", "model=cnn", "feature_dim=512", "local_epochs=2",
         "lr=0.01", "momentum=0.9", "weight_decay=1e-05", "batch_size=64"]
SETTINGS = {
    "skew": [*MNIST, "partition=dirichlet", "partition.alpha=0.2", "clients=10"],
    "longtail": [*MNIST, "partition=longtail", "partition.rho=100", "clients=10"],
    # the default `fedhpro run` (digits-offline's four domains, 20 clients, E = 5), one thread a run
    "default": [],
}
#: the settings a part runs unless --settings names others
DEFAULT_SETTINGS = ["skew", "longtail"]
# variant -> (method, extra keys); each is one switch away from the method's default
MAIN = {
    "fedavg": ("fedavg", []),
    "fedsa": ("fedsa", []),
    "fedhpro": ("fedhpro", []),
}
VARIANTS = {
    # FedSA's components, one at a time, and FedSA's losses on FedHPro's hyper-prototypes (Table 3's plug-in)
    "fedsa-no-calibration": ("fedsa", ["fedsa.lambda1=0"]),
    "fedsa-on-hyper": ("fedsa", ["fedsa.prototypes=hyper"]),
    "fedsa-no-mse": ("fedsa", ["fedsa.lambda2=0"]),
    "fedsa-no-margin-ce": ("fedsa", ["fedsa.lambda3=0"]),
    # FedHPro's
    "fedhpro-init-orthogonal-nonnegative": ("fedhpro", ["fedhpro.hyper_init=orthogonal-nonnegative"]),
    "fedhpro-init-simplex": ("fedhpro", ["fedhpro.hyper_init=simplex"]),
    "fedhpro-init-orthogonal-nonnegative-margin-off": ("fedhpro", ["fedhpro.hyper_init=orthogonal-nonnegative",
                                                                    "fedhpro.margin=off"]),
    "fedhpro-synthetic-classifier": ("fedhpro", ["fedhpro.classifier_step=synthetic"]),
    "fedhpro-margin-off": ("fedhpro", ["fedhpro.margin=off"]),
    "fedhpro-hpcl-only": ("fedhpro", ["fedhpro.hpal_weight=0"]),
    "fedhpro-hpal-only": ("fedhpro", ["fedhpro.hpcl_weight=0"]),
    "fedhpro-frozen-random": ("fedhpro", ["fedhpro.match_steps=0"]),
    "fedhpro-frozen-simplex": ("fedhpro", ["fedhpro.hyper_init=simplex", "fedhpro.match_steps=0"]),
    "fedhpro-frozen-orthogonal-nonnegative": ("fedhpro", ["fedhpro.hyper_init=orthogonal-nonnegative",
                                                          "fedhpro.match_steps=0"]),
    "fedhpro-margin-normalized": ("fedhpro", ["fedhpro.margin=normalized"]),
    "fedhpro-match-adam": ("fedhpro", ["fedhpro.hyper_optimizer=adam"]),  # matching that does move S
    "fedhpro-tau-0.5": ("fedhpro", ["fedhpro.tau=0.5"]),
    # 0.05 x 0.45: Gaussian |I| = 5 similarities span +-0.45, so this gives them the logit range of |I| = 1
    "fedhpro-tau-0.0225": ("fedhpro", ["fedhpro.tau=0.0225"]),
    "fedhpro-hyper-1": ("fedhpro", ["fedhpro.num_hyper=1"]),
}
# the authors' gradient-matching distance against Eq. 8's cosine (faithfulness: their code matches element by
# element), alone and with their class-gradient scale; fedhpro and fedsa as in MAIN, for the table
MATCHING = {
    "fedhpro": ("fedhpro", []),
    "fedsa": ("fedsa", []),
    "fedhpro-elementwise": ("fedhpro", ["fedhpro.matching_distance=elementwise"]),
    "fedhpro-elementwise-divide": ("fedhpro", ["fedhpro.matching_distance=elementwise",
                                               "fedhpro.class_gradient_divide=true"]),
}
CURVES = {"fedavg": ("fedavg", []), "fedsa": ("fedsa", []), "fedhpro": ("fedhpro", []),
          "fedhpro-init-orthogonal-nonnegative": VARIANTS["fedhpro-init-orthogonal-nonnegative"],
          "fedhpro-init-simplex": VARIANTS["fedhpro-init-simplex"]}


def compare_command(out: Path, method: str, keys: Sequence[str], setting: str, seeds: Sequence[int],
                    rounds: int) -> list[str]:
    seed_list = "[" + ",".join(str(s) for s in seeds) + "]"
    return (["fedhpro", "compare", f"methods=[{method}]", f"seeds={seed_list}", f"rounds={rounds}", *BASE,
             *SETTINGS[setting], *keys, f"out={out}"])


def plan(part: str, root: Path, seeds: Sequence[int], rounds: int, settings: Sequence[str],
         only: Sequence[str]) -> list[tuple[Path, list[str]]]:
    jobs = []
    table = {"main": MAIN, "ablations": VARIANTS, "curves": CURVES, "matching": MATCHING}[part]
    for setting in settings:
        for label, (method, keys) in table.items():
            if only and label not in only:
                continue
            folder = root / (f"curves{rounds}-{setting}" if part == "curves" else setting) / label
            if part == "matching" and rounds != 10:
                folder = root / f"rounds{rounds}-{setting}" / label
            jobs.append((folder, compare_command(folder, method, keys, setting, seeds, rounds)))
    return jobs


def run_all(jobs: list[tuple[Path, list[str]]], parallel: int) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def one(job: tuple[Path, list[str]]) -> int:
        folder, command = job
        folder.mkdir(parents=True, exist_ok=True)
        start = time.time()
        with open(folder / "compare.log", "a") as log:
            log.write(" ".join(command) + "\n")
            log.flush()
            code = subprocess.call(["nice", "-n", "10", *command], stdout=log, stderr=subprocess.STDOUT, env=env)
        print(f"{folder}: exit {code}, {time.time() - start:.0f} s", flush=True)
        return code

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        codes = list(pool.map(one, jobs))
    return max(codes, default=0)


# ---------------------------------------------------------------------------- analysis


def finished_runs(folder: Path) -> list[Path]:
    return sorted(p.parent for p in folder.glob("*/summary.json"))


def measure_run(run: Path) -> dict[str, object]:
    """Per-class accuracy and feature geometry of one finished run's global model on its test set."""
    import torch

    from fedhpro.config import load_config
    from fedhpro.data import get_dataset
    from fedhpro.methods.no_grad import extract_features
    from fedhpro.methods.parts import classifier_of
    from fedhpro.metrics import geometry
    from fedhpro.metrics.prototypes import class_means
    from fedhpro.trained import load_model

    torch.set_num_threads(1)
    config = load_config(run / "config.yaml")
    options = config.run
    federation = get_dataset(options.dataset).build(config.data, options.clients, options.seed,
                                                    data_dir=options.data_dir, progress=False,
                                                    partition=config.partition)
    # every test set pooled (one on MNIST; the default run's four domains)
    x = torch.cat([x for x, _ in federation.test_sets.values()])
    y = torch.cat([y for _, y in federation.test_sets.values()])
    model = load_model(run)
    with torch.no_grad():
        features = extract_features(model, x)
        logits = classifier_of(model)(features)
    num_classes = federation.num_classes
    train_counts = sum(torch.bincount(c.y.cpu(), minlength=num_classes) for c in federation.clients)
    per_class = geometry.per_class_accuracy(logits.argmax(1), y, num_classes)
    order = torch.argsort(train_counts, descending=True, stable=True)
    head, middle, tail = order[:3], order[3:-3], order[-3:]
    means, _ = class_means(features, y, num_classes)
    means = means.double()
    head_layer = classifier_of(model)
    weight = head_layer.weight.detach()
    bias = head_layer.bias.detach() if head_layer.bias is not None else None
    out: dict[str, object] = {
        "run": run.name,
        "accuracy": float((logits.argmax(1) == y).double().mean() * 100),
        "per_class": [float(v) for v in per_class],
        "train_counts": [int(v) for v in train_counts],
        "head_acc": float(per_class[head].mean()),
        "middle_acc": float(per_class[middle].mean()),
        "tail_acc": float(per_class[tail].mean()),
        "balanced_acc": float(per_class.mean()),
        "feature_norm": float(features.norm(dim=1).mean()),
        "class_mean_cosine": geometry.mean_offdiagonal_cosine(means),
        "within_class_cosine": geometry.within_class_cosine(features, y, num_classes),
        "classifier_bias_head_minus_tail": float(bias[head].mean() - bias[tail].mean()) if bias is not None else 0.0,
        "classifier_norm_head_over_tail": float(weight[head].norm(dim=1).mean() / weight[tail].norm(dim=1).mean()),
        "predicted_share_head": float(torch.isin(logits.argmax(1), head).double().mean()),
    }
    state_path = run / "server_state.pt"
    if state_path.is_file():
        state = torch.load(state_path, weights_only=True, map_location="cpu")
        state = state.get("method", state) if isinstance(state, dict) else state
        targets = find_targets(state)
        if targets is not None:
            name, tensor = targets
            vectors = tensor.double()
            if vectors.dim() == 3:
                vectors = vectors.mean(1)  # H^c, the averaged hyper-prototypes
            out["targets"] = name
            out["target_cosine"] = geometry.mean_offdiagonal_cosine(vectors)
            out["target_min_angle_cosine"] = geometry.max_offdiagonal_cosine(vectors)
            out["target_nonnegative_share"] = float((vectors >= 0).double().mean())
            out["feature_target_cosine"] = geometry.matched_cosine(means, vectors.to(means.dtype))
    return out


def find_targets(state: object) -> tuple[str, object] | None:
    """The hyper-prototypes (C x I x d) or the anchors (C x d) somewhere in a server state."""
    if not isinstance(state, dict):
        return None
    for key in ("hyper", "hyper_prototypes", "anchors"):
        if key in state:
            return key, state[key]
    for value in state.values():
        found = find_targets(value)
        if found is not None:
            return found
    return None


def federation_table(run: Path) -> str:
    """Per class: its training images, how many clients hold it and their smallest / largest share, from the
    run's partition.json: the inputs of Eq. 6's unweighted mean over holders."""
    partition = json.loads((run / "partition.json").read_text())
    counts = [client["class_counts"] for client in partition["clients"]]
    num_classes = len(counts[0])
    lines = [f"Federation of {run.parent.parent.name} (seed {run.name.rsplit('seed', 1)[-1]}): Eq. 6 gives every "
             "holder of a class the same weight", "",
             "| class | images | holders | fewest / most images of a holder | clients holding <= 2 classes among "
             "its holders |", "|---|---|---|---|---|"]
    held_classes = [sum(1 for n in client if n > 0) for client in counts]
    for c in range(num_classes):
        holders = [k for k, client in enumerate(counts) if client[c] > 0]
        sizes = [counts[k][c] for k in holders]
        few = sum(1 for k in holders if held_classes[k] <= 2)
        lines.append(f"| {c} | {sum(sizes)} | {len(holders)} | {min(sizes, default=0)} / {max(sizes, default=0)} | "
                     f"{few} |")
    lines += ["", "Classes held per client: " + ", ".join(str(n) for n in held_classes), ""]
    return "\n".join(lines)


def client_margins(run: Path) -> str:
    """Eq. 10's d_k of every client under the run's final global model (raw and on L2-normalised prototypes),
    beside the number of classes the client holds: how the margin scales under label skew."""
    import torch

    from fedhpro import functional
    from fedhpro.config import load_config
    from fedhpro.data import get_dataset
    from fedhpro.methods.fedhpro import equations
    from fedhpro.methods.no_grad import extract_features
    from fedhpro.trained import load_model

    config = load_config(run / "config.yaml")
    options = config.run
    federation = get_dataset(options.dataset).build(config.data, options.clients, options.seed,
                                                    data_dir=options.data_dir, progress=False,
                                                    partition=config.partition)
    model = load_model(run)
    rows = []
    with torch.no_grad():
        for k, client in enumerate(federation.clients):
            prototypes, present = functional.local_prototypes(extract_features(model, client.x), client.y,
                                                      federation.num_classes)
            raw = float(equations.client_margin(prototypes, present))
            normalized = float(equations.client_margin(prototypes, present, normalized=True))
            rows.append((int(present.sum()), len(client.y), raw, normalized, k))
    lines = [f"d_k per client, {run.parent.parent.name}/{run.parent.name}/{run.name} (final global model)", "",
             "| client | classes held | images | d_k raw | d_k / tau | d_k normalized |", "|---|---|---|---|---|---|"]
    tau = float(config.methods["fedhpro"].tau)
    for held, size, raw, normalized, k in sorted(rows):
        lines.append(f"| {k} | {held} | {size} | {raw:.3f} | {raw / tau:.1f} | {normalized:.3f} |")
    return "\n".join(lines) + "\n"


def mean_std(values: Sequence[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def analyze(root: Path, out: Path | None = None) -> str:
    cache_path = root / "measurements.json"
    cache: dict[str, dict[str, object]] = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    lines = []
    for setting_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        rows = []
        for variant_dir in sorted(p for p in setting_dir.iterdir() if p.is_dir()):
            measured = []
            for run in finished_runs(variant_dir):
                key = str(run.relative_to(root))
                if key not in cache:
                    cache[key] = measure_run(run)
                    from fedhpro.files import write_atomic
                    write_atomic(cache_path, json.dumps(cache, indent=1, sort_keys=True))
                measured.append(cache[key])
            if not measured:
                continue
            rows.append((variant_dir.name, measured))
        if not rows:
            continue
        lines += [f"### {setting_dir.name}", "",
                  "| variant | seeds | accuracy | head 3 | middle 4 | tail 3 | head share of predictions | "
                  "bias head-tail | feature norm | class-mean cosine | within-class cosine | "
                  "target cosine | feature-target cosine |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for label, measured in rows:
            def col(name: str, scale: float = 1.0, measured: list = measured) -> str:
                return mean_std([float(m[name]) * scale for m in measured if name in m])
            lines.append(f"| {label} | {len(measured)} | {col('accuracy')} | {col('head_acc')} | {col('middle_acc')} | "
                         f"{col('tail_acc')} | "
                         f"{col('predicted_share_head', 100)} | {col('classifier_bias_head_minus_tail')} | "
                         f"{col('feature_norm')} | {col('class_mean_cosine')} | {col('within_class_cosine')} | "
                         f"{col('target_cosine')} | {col('feature_target_cosine')} |")
        lines.append("")
        counts = rows[0][1][0]["train_counts"]
        classes = range(len(counts))  # type: ignore[arg-type]
        lines += [f"Per-class test accuracy (%, mean over seeds), {setting_dir.name}; the first row gives each class's "
                  "training images (summed over clients):", "",
                  "| variant | " + " | ".join(f"{c}" for c in classes) + " |",
                  "|---|" + "---|" * len(counts), # type: ignore[arg-type]
                  "| training images | " + " | ".join(str(n) for n in counts) + " |"]  # type: ignore[union-attr]
        for label, measured in rows:
            per_class = [statistics.mean(float(m["per_class"][c]) for m in measured)  # type: ignore[index]
                         for c in classes]
            lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in per_class) + " |")
        lines.append("")
    text = "\n".join(lines)
    if out is not None:
        from fedhpro.files import write_atomic
        write_atomic(out, text + "\n")
    return text


def round_accuracies(run: Path) -> list[float]:
    return [json.loads(line)["accuracy"]["AVG"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def mean_curves(setting_dir: Path, series: Callable[[Path], list[float]]) -> list[tuple[str, int, list[float]]]:
    """Per variant folder of ``setting_dir``: ``(name, runs, the mean over its runs of series(run) round by
    round)``, over the rounds every run has; variants without a run that logged the series are left out."""
    rows = []
    for variant_dir in sorted(p for p in setting_dir.iterdir() if p.is_dir()):
        runs = [values for values in (series(run) for run in finished_runs(variant_dir)) if values]
        if runs:
            length = min(len(r) for r in runs)
            rows.append((variant_dir.name, len(runs), [statistics.mean(r[i] for r in runs) for i in range(length)]))
    return rows


def hyper_movements(run: Path) -> list[float]:
    """||S_r - S_0|| / ||S_0|| of FedHPro's hyper-prototypes after each round (%), from metrics.jsonl."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [100 * row["server"]["hyper_movement"] for row in rows
            if row.get("server", {}).get("hyper_movement") is not None]


def movements(root: Path) -> str:
    """How far the hyper-prototypes move: per FedHPro variant, the mean over its seeds of their relative
    movement after rounds 1, 2, 5, 10, ... (from each run's metrics.jsonl)."""
    lines = []
    for setting_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        rows = mean_curves(setting_dir, hyper_movements)
        if not rows:
            continue
        length = max(len(r[2]) for r in rows)
        shown = [i for i in range(length) if i in (0, 1) or (i + 1) % 5 == 0]
        lines += [f"### hyper-prototype movement, {setting_dir.name} (||S_r - S_0|| / ||S_0||, %, mean over seeds)",
                  "", "| variant | seeds | " + " | ".join(f"R{i + 1}" for i in shown) + " |",
                  "|---|---|" + "---|" * len(shown)]
        for label, seeds, curve in rows:
            lines.append(f"| {label} | {seeds} | " + " | ".join(f"{curve[i]:.3g}" if i < len(curve) else "–"
                                                             for i in shown) + " |")
        lines.append("")
    return "\n".join(lines)


def curves(root: Path, every: int = 2) -> str:
    """Learning curves: per variant, the mean over its seeds of the test accuracy after every ``every``-th
    round (from each run's metrics.jsonl)."""
    lines = []
    for setting_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        rows = mean_curves(setting_dir, round_accuracies)
        if not rows:
            continue
        length = max(len(r[2]) for r in rows)
        step = every if length <= 10 else 5
        shown = [i for i in range(length) if (i + 1) % step == 0]
        lines += [f"### learning curves, {setting_dir.name} (mean test accuracy % over seeds)", "",
                  "| variant | seeds | " + " | ".join(f"R{i + 1}" for i in shown) + " |",
                  "|---|---|" + "---|" * len(shown)]
        for label, seeds, curve in rows:
            lines.append(f"| {label} | {seeds} | " + " | ".join(f"{curve[i]:.1f}" if i < len(curve) else "–"
                                                             for i in shown) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("run", "analyze"))
    parser.add_argument("--root", type=Path, default=Path("runs/fedsa_vs_fedhpro"))
    parser.add_argument("--part", choices=("main", "ablations", "curves", "matching"), default="main")
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    parser.add_argument("--only", nargs="*", default=[], help="variant labels to run (default: all of the part)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--parallel", type=int, default=2, help="compare folders run at a time")
    parser.add_argument("--out", type=Path, default=None, help="analyze: also write the tables here")
    args = parser.parse_args(argv)
    if args.action == "run":
        rounds = 50 if args.part == "curves" and args.rounds == 10 else args.rounds
        return run_all(plan(args.part, args.root, args.seeds, rounds, args.settings, args.only), args.parallel)
    text = analyze(args.root, None) + "\n" + curves(args.root) + "\n" + movements(args.root)
    for setting in SETTINGS:
        seed0 = args.root / setting / "fedhpro" / "fedhpro-seed0"
        if (seed0 / "summary.json").is_file():
            text += "\n" + federation_table(seed0) + "\n" + client_margins(seed0)
    if args.out is not None:
        from fedhpro.files import write_atomic
        write_atomic(args.out, text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
