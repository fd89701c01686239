"""The authors' FedHPro code and fedhpro's ``recipe=authors``, side by side on the same data and partition.

Needs a checkout of the authors' repository (https://github.com/mala-lab/FedHPro, fetched by hand; it is never
a dependency of the package or its tests, and none of its code is copied here). Steps, each reusing what an
earlier call finished:

    python bench/authors_side_by_side.py run --authors /tmp/authors-fedhpro --out /tmp/side-by-side
    python bench/authors_side_by_side.py table --out /tmp/side-by-side      # markdown table + figure

1. ``data/cifar10``: a CIFAR-10-format folder (torchvision's ``cifar-10-batches-py`` pickles) made from the built-in
   ``mnistm`` domain of digits-offline: the first 150 training images of each class (1,500) and the first 100
   test images of each class (1,000), 32 x 32 RGB.
2. Their ``main_run.py`` runs in a child process of this script (``_authors``), on the CPU, with a patch applied
   at run time and nothing else changed: ``torchvision.datasets.CIFAR10`` opens that folder without download or
   integrity check (their code hard-codes ``./data/CIFAR10/`` and ``download=True``); their per-round test
   accuracy is recorded by wrapping ``Global.global_eval``, and their client partition by wrapping
   ``clients_indices``: it is written out as fedhpro's ``partition.json``. Their settings: ``--imb_factor 1``
   (no long tail: all 1,500 images), Dirichlet 0.5 over 10 clients, all clients every round, batch 64, SGD 0.1,
   5 local epochs, 5 rounds, ``--seed s``. The variant ``copied`` also wraps ``Local.local_train`` to return a
   copy of the trained weights (their published code returns the live ``state_dict()``, so every client's
   entry ends up holding the last client's model).
3. fedhpro runs on the same folder (``dataset=cifar10 data.verify=false``) and reads that partition
   (``partition.load``), with ``fedhpro.recipe=authors`` and the same settings, ``seed=s``; then one option of
   the recipe reverted at a time (seed 0 and 1); FedAvg with the recipe's network and optimiser; and
   ``fedhpro.authors_last_client=true`` (their aggregation mistake) to reproduce their published curve.

The runs are independent processes, one thread each; ``--jobs`` of them at a time (default 2).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROUNDS, CLIENTS, EPOCHS, BATCH, ALPHA = 5, 10, 5, 64, 0.5
TRAIN_PER_CLASS, TEST_PER_CLASS = 150, 100
CLASSES = [str(digit) for digit in range(10)]

#: fedhpro's keys shared by every fedhpro run here (the recipe gives d = 256, SGD 0.1 / 0 / 0, their ResNet-10)
FEDHPRO_BASE = ["dataset=cifar10", "data.verify=false", f"rounds={ROUNDS}", f"clients={CLIENTS}",
                f"local_epochs={EPOCHS}", f"batch_size={BATCH}", "fedhpro.recipe=authors", "device=cpu",
                "threads=1", "progress=false", "checkpoint_every=0"]

#: variant -> (method, extra keys): the recipe, each of its options of the authors' code reverted, FedAvg
FEDHPRO_VARIANTS: dict[str, tuple[str, list[str]]] = {
    "fedhpro-authors": ("fedhpro", []),
    "fedhpro-authors-last-client": ("fedhpro", ["fedhpro.authors_last_client=true"]),
    "fedavg-authors": ("fedavg", []),
    "without-elementwise": ("fedhpro", ["fedhpro.matching_distance=cosine"]),
    "without-gradient-divide": ("fedhpro", ["fedhpro.class_gradient_divide=false"]),
    "without-random-samples": ("fedhpro", ["fedhpro.gradient_sample_choice=first"]),
    "without-dsa": ("fedhpro", ["fedhpro.gradient_augment=none"]),
    "without-crop-flip": ("fedhpro", ["fedhpro.local_augment=none"]),
    "without-synthetic-classifier": ("fedhpro", ["fedhpro.classifier_step=none"]),
    "without-their-normalisation": ("fedhpro", ["data.mean=null", "data.std=null"]),
    "fedhpro-resnet10": ("fedhpro", ["model=resnet10"]),
}
AUTHORS_VARIANTS = ("authors-published", "authors-copied")
MAIN = ("authors-published", "authors-copied", "fedhpro-authors", "fedavg-authors", "fedhpro-authors-last-client")
LABELS = {
    "authors-published": "authors' main_run.py",
    "authors-copied": "authors' code, each client's weights copied before upload",
    "fedhpro-authors": "fedhpro recipe=authors (all options)",
    "fedhpro-authors-last-client": "fedhpro recipe=authors + authors_last_client",
    "fedavg-authors": "fedhpro FedAvg, same network and optimiser",
    "without-elementwise": "recipe=authors, matching_distance=cosine",
    "without-gradient-divide": "recipe=authors, class_gradient_divide=false",
    "without-random-samples": "recipe=authors, gradient_sample_choice=first",
    "without-dsa": "recipe=authors, gradient_augment=none",
    "without-crop-flip": "recipe=authors, local_augment=none",
    "without-synthetic-classifier": "recipe=authors, classifier_step=none",
    "without-their-normalisation": "recipe=authors, data.mean/std=null (fedhpro's CIFAR-10 std)",
    "fedhpro-resnet10": "recipe=authors, model=resnet10 (fedhpro's)",
}


# ---------------------------------------------------------------------------- 1. the data


def write_cifar_folder(root: Path) -> Path:
    """``root/cifar-10-batches-py`` from digits-offline's mnistm domain (see the module doc); returns it."""
    from fedhpro.data.digits_offline import build_digits_offline

    folder = root / "cifar-10-batches-py"
    if (folder / "test_batch").is_file():
        return folder
    mnistm = build_digits_offline()["mnistm"]

    def first_per_class(x, y, per_class):
        y = y.numpy()
        index = np.concatenate([np.flatnonzero(y == c)[:per_class] for c in range(10)])
        index.sort()  # the domain's own order, every class interleaved as it comes
        return x.numpy()[index].reshape(len(index), -1).astype(np.uint8), y[index].tolist()

    train_x, train_y = first_per_class(mnistm.train_x, mnistm.train_y, TRAIN_PER_CLASS)
    test_x, test_y = first_per_class(mnistm.test_x, mnistm.test_y, TEST_PER_CLASS)
    folder.mkdir(parents=True, exist_ok=True)
    parts = np.array_split(np.arange(len(train_y)), 5)
    for number, rows in enumerate(parts, start=1):
        batch = {"batch_label": f"training batch {number} of 5", "data": train_x[rows],
                 "labels": [train_y[i] for i in rows], "filenames": [f"{i}.png" for i in rows]}
        (folder / f"data_batch_{number}").write_bytes(pickle.dumps(batch, protocol=2))
    (folder / "test_batch").write_bytes(pickle.dumps({"batch_label": "testing batch 1 of 1", "data": test_x,
                                                      "labels": test_y,
                                                      "filenames": [f"{i}.png" for i in range(len(test_y))]},
                                                     protocol=2))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": CLASSES, "num_cases_per_batch": 300,
                                                        "num_vis": 3072}, protocol=2))
    return folder


def training_labels(data_root: Path) -> list[int]:
    """The labels of the training pickles under ``data_root/cifar-10-batches-py``, in the datasets' order."""
    labels: list[int] = []
    for number in range(1, 6):
        batch = pickle.loads((data_root / "cifar-10-batches-py" / f"data_batch_{number}").read_bytes())
        labels += batch["labels"]
    return labels


# ---------------------------------------------------------------------------- 2. their code, patched at run time


def run_authors_in_this_process(checkout: Path, data_root: Path, seed: int, variant: str, result: Path) -> None:
    """Their ``main_run.py``'s ``__main__`` block (seeds, then ``FedHPro()``) with the offline patch; writes
    ``result`` (per-round accuracy in %, their partition and class counts, the wall time)."""
    import random

    import torch
    import torchvision
    import torchvision.datasets.cifar

    torch.set_num_threads(1)
    sys.path.insert(0, str(checkout))
    os.chdir(checkout)
    sys.argv = ["main_run.py", "--device", "cpu", "--num_rounds", str(ROUNDS), "--num_epochs_local_training",
                str(EPOCHS), "--batch_size_local_training", str(BATCH), "--num_clients", str(CLIENTS),
                "--num_online_clients", str(CLIENTS), "--non_iid_alpha", str(ALPHA), "--imb_factor", "1",
                "--seed", str(seed)]
    original = torchvision.datasets.CIFAR10

    class OfflineCIFAR10(original):  # type: ignore[misc, valid-type]
        """Their dataset, opened from ``data_root`` without download or md5 check."""

        def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
            super().__init__(str(data_root), train=train, transform=transform, target_transform=target_transform,
                             download=False)

        def _check_integrity(self) -> bool:
            return True

    torchvision.datasets.CIFAR10 = OfflineCIFAR10
    torchvision.datasets.cifar.check_integrity = lambda *args, **kwargs: True  # the metadata file's md5
    import main_run  # their module, from the checkout

    record: dict = {"variant": variant, "seed": seed, "accuracy": []}
    real_split = main_run.clients_indices

    class PartitionMade(Exception):
        """``--variant partition``: stop their run once the partition is drawn."""

    def recording_split(*args, **kwargs):
        split = real_split(*args, **kwargs)
        record["partition"] = [[int(i) for i in part] for part in split]
        if variant == "partition":
            raise PartitionMade
        return split

    main_run.clients_indices = recording_split
    real_eval = main_run.Global.global_eval

    def recording_eval(self, data_test, batch_size_test):
        accuracy = real_eval(self, data_test, batch_size_test)
        record["accuracy"].append(100.0 * accuracy)
        return accuracy

    main_run.Global.global_eval = recording_eval
    if variant == "authors-copied":
        real_train = main_run.Local.local_train

        def copied_train(self, args, global_params):
            return copy.deepcopy(real_train(self, args, global_params))

        main_run.Local.local_train = copied_train
    start = time.perf_counter()
    # their __main__ block (main_run.py lines 524-532)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    try:
        main_run.FedHPro()
    except PartitionMade:
        pass
    record["seconds"] = time.perf_counter() - start
    labels = training_labels(data_root)
    record["class_counts"] = [np.bincount(np.asarray(labels)[part], minlength=10).tolist()
                              for part in record["partition"]]
    result.write_text(json.dumps(record))


def write_partition(authors_result: Path, data_root: Path, path: Path) -> None:
    """Their recorded client partition as fedhpro's ``partition.json`` (``partition.load``)."""
    from fedhpro.data.partition import Partition

    record = json.loads(authors_result.read_text())
    labels = np.asarray(training_labels(data_root))
    partition = Partition([np.asarray(part, dtype=np.int64) for part in record["partition"]], "dirichlet",
                          {"alpha": ALPHA, "source": "the authors' clients_indices"})
    partition.save(path, labels, 10, record["seed"])


# ---------------------------------------------------------------------------- 3. the runs


def run_one(name: str, seed: int, args: argparse.Namespace) -> tuple[str, int, str]:
    out = Path(args.out).resolve()
    data_root = out / "data"  # fedhpro's data_dir; their CIFAR10 root is data_root / "cifar10"
    result = out / "runs" / f"{name}-seed{seed}.json"
    if result.is_file():
        return name, seed, "reused"
    result.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    log = result.with_suffix(".log")
    if name in AUTHORS_VARIANTS:
        command = [sys.executable, str(Path(__file__).resolve()), "_authors", "--authors", str(args.authors),
                   "--data", str(data_root / "cifar10"), "--seed", str(seed), "--variant", name,
                   "--result", str(result)]
        with log.open("w") as handle:
            code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
        return name, seed, f"exit {code}"
    partition = out / "runs" / f"partition-seed{seed}.json"
    method, extra = FEDHPRO_VARIANTS[name]
    folder = out / "runs" / f"{name}-seed{seed}"
    command = [sys.executable, "-m", "fedhpro", "run", f"method={method}", *FEDHPRO_BASE, *extra,
               f"data_dir={data_root}", f"partition.load={partition}", f"seed={seed}", f"out={folder}"]
    start = time.perf_counter()
    with log.open("w") as handle:
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        return name, seed, f"exit {code}"
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    accuracy = [row["accuracy"].get("all", row["accuracy"].get("AVG")) for row in rows if "accuracy" in row]
    movement = [row.get("server", {}).get("hyper_movement") for row in rows]
    saved = json.loads((folder / "partition.json").read_text())
    result.write_text(json.dumps({"variant": name, "seed": seed, "accuracy": accuracy, "hyper_movement": movement,
                                  "seconds": time.perf_counter() - start,
                                  "class_counts": [client["class_counts"] for client in saved["clients"]]}))
    return name, seed, "done"


def run(args: argparse.Namespace) -> None:
    out = Path(args.out).resolve()
    write_cifar_folder(out / "data" / "cifar10")
    names = list(MAIN) if args.part == "main" else [n for n in FEDHPRO_VARIANTS if n not in MAIN]
    if args.only:
        names = [name for name in names if name in args.only]
    # their partition of each seed first (their code, stopped once it has drawn it): every fedhpro run reads it
    for seed in args.seeds:
        partition = out / "runs" / f"partition-seed{seed}.json"
        if not partition.is_file():
            drawn = out / "runs" / f"authors-partition-seed{seed}.json"
            partition.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "_authors", "--authors", str(args.authors),
                            "--data", str(out / "data" / "cifar10"), "--seed", str(seed), "--variant", "partition",
                            "--result", str(drawn)], check=True, capture_output=True)
            write_partition(drawn, out / "data" / "cifar10", partition)
    jobs = [(name, seed) for name in names for seed in args.seeds]
    with ThreadPoolExecutor(args.jobs) as pool:
        for name, seed, status in pool.map(lambda job: run_one(job[0], job[1], args), jobs):
            print(f"{name} seed {seed}: {status}", flush=True)


# ---------------------------------------------------------------------------- the table and the figure


def load_results(out: Path) -> dict[str, dict[int, dict]]:
    results: dict[str, dict[int, dict]] = {}
    for path in sorted((out / "runs").glob("*-seed*.json")):
        if path.name.startswith(("partition-", "authors-partition-")):
            continue
        record = json.loads(path.read_text())
        results.setdefault(record["variant"], {})[record["seed"]] = record
    return results


def table(args: argparse.Namespace) -> None:
    from fedhpro.reports.plots import plot_curves

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness import machine_info

    out = Path(args.out).resolve()
    results = load_results(out)
    order = [name for name in (*MAIN, *FEDHPRO_VARIANTS) if name in results]
    lines = [f"| run | seed | {' | '.join(f'R{r + 1}' for r in range(ROUNDS))} | min / run |",
             "|---|---|" + "---|" * ROUNDS + "---|"]
    for name in dict.fromkeys(order):
        for seed, record in sorted(results[name].items()):
            cells = " | ".join(f"{value:.1f}" for value in record["accuracy"])
            lines.append(f"| {LABELS[name]} | {seed} | {cells} | {record['seconds'] / 60:.1f} |")
    print("\n".join(lines))
    print()
    finals = {name: [record["accuracy"][-1] for record in results[name].values()] for name in dict.fromkeys(order)}
    for name, values in finals.items():
        spread = f"{statistics.mean(values):.1f} (min {min(values):.1f}, max {max(values):.1f})"
        print(f"- final accuracy, {LABELS[name]}: {spread} over seeds {sorted(results[name])}")
    # the partition fedhpro read is theirs: the class counts of every client agree
    for seed, record in results.get("authors-published", {}).items():
        for name in FEDHPRO_VARIANTS:
            other = results.get(name, {}).get(seed)
            if other is not None and other["class_counts"] != record["class_counts"]:
                print(f"- WARNING: {name} seed {seed} trained on other class counts than the authors' run")
    for name in ("fedhpro-authors", "without-elementwise"):
        for seed, record in sorted(results.get(name, {}).items()):
            moves = ", ".join(f"{100 * m:.2f}" for m in record.get("hyper_movement", []) if m is not None)
            print(f"- hyper-prototype movement ||S_r - S_0|| / ||S_0|| (%), {LABELS[name]}, seed {seed}: {moves}")
    info = machine_info()
    print(f"\nmachine: {info['cpu']}; {info['torch']}; {info['load']}; {info['date']}")
    series = {}
    for name in dict.fromkeys(order):
        if name not in MAIN:
            continue
        for seed, record in sorted(results[name].items()):
            series[f"{LABELS[name]}, seed {seed}"] = (list(range(1, len(record["accuracy"]) + 1)),
                                                      record["accuracy"])
    plot_curves(series, out / "side_by_side.png", ylabel="test accuracy (%)",
                title="authors' code and fedhpro recipe=authors, same data and partition",
                styles={label: {"linewidth": 1.8} for label in series})  # every run alike, none highlighted
    print(f"figure: {out / 'side_by_side.png'}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    runner = sub.add_parser("run", help="the runs (reusing finished ones)")
    runner.add_argument("--authors", required=True, help="a checkout of github.com/mala-lab/FedHPro")
    runner.add_argument("--out", required=True)
    runner.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    runner.add_argument("--part", choices=("main", "ablations"), default="main")
    runner.add_argument("--jobs", type=int, default=2)
    runner.add_argument("--only", nargs="+", choices=(*AUTHORS_VARIANTS, *FEDHPRO_VARIANTS),
                        help="only these variants of the part")
    shower = sub.add_parser("table", help="the table (markdown) and the figure of the finished runs")
    shower.add_argument("--out", required=True)
    inner = sub.add_parser("_authors", help=argparse.SUPPRESS)
    inner.add_argument("--authors", required=True)
    inner.add_argument("--data", required=True)
    inner.add_argument("--seed", type=int, required=True)
    inner.add_argument("--variant", choices=(*AUTHORS_VARIANTS, "partition"), required=True)
    inner.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    if args.command == "run":
        if not (Path(args.authors) / "main_run.py").is_file():
            parser.error(f"--authors {args.authors}: no main_run.py there; give a checkout of mala-lab/FedHPro")
        run(args)
    elif args.command == "table":
        table(args)
    else:
        run_authors_in_this_process(Path(args.authors).resolve(), Path(args.data).resolve(), args.seed,
                                    args.variant, Path(args.result).resolve())


if __name__ == "__main__":
    main()
