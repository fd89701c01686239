"""Feature scaling of tabular federations: data.standardize=federated (one scaling shared by every site),
client (each site's own statistics) and none, against a pooled scikit-learn logistic regression on the same
training rows (StandardScaler fitted on all of them), on real tables split into sites five ways:

* wine-skewed / cancer-skewed: the rows sorted by class and cut into 3 sites (site-0 holds one class), as the
  data of sites that each see other patients come;
* cancer-docs: the breast-cancer table of docs/how-to/own-data.md (random sites, 25 % test);
* wine-csv: wine as tests/test_csv_data.py splits it (a random permutation into 3 sites, 70 % train);
* digits-iid: scikit-learn's digits (64 pixel features) in 5 random (IID) sites.

    python bench/federated_scaling.py --out /tmp/scaling [--seeds 0 1] [--rounds 20] [--batch-size 16]

Writes ``scaling.json`` and ``scaling.csv`` (one row per data set, mode and seed: the run's final AVG
accuracy, the pooled logistic regression's) and prints a table of means. Accuracy only: no timing here.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
from sklearn.datasets import load_breast_cancer, load_digits, load_wine
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

import fedhpro
from fedhpro.errors import TrainingDiverged

MODES = ("federated", "client", "none")


def write_sites(root: Path, frame: pd.DataFrame, site: np.ndarray, test: np.ndarray) -> None:
    """``root/<site>/{train,test}.csv`` of ``frame`` (features and ``label``)."""
    for name in sorted(set(site)):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for split, rows in (("train", (site == name) & ~test), ("test", (site == name) & test)):
            frame[rows].to_csv(folder / f"{split}.csv", index=False)


def table(loader) -> pd.DataFrame:
    data = loader(as_frame=True)
    frame = data.data.copy()
    frame.columns = [f"f{j}" for j in range(frame.shape[1])]
    frame["label"] = data.target.to_numpy()
    return frame


def federations(root: Path) -> dict[str, Path]:
    made = {}
    rng = np.random.default_rng(0)
    for name, loader in (("wine-skewed", load_wine), ("cancer-skewed", load_breast_cancer)):
        frame = table(loader)
        order = np.argsort(frame.label.to_numpy(), kind="stable")
        site = np.empty(len(frame), dtype=object)
        for k, part in enumerate(np.array_split(order, 3)):
            site[part] = f"site-{k}"
        test = np.zeros(len(frame), dtype=bool)
        for k in range(3):  # 30 % of each site's rows test
            rows = rng.permutation(np.flatnonzero(site == f"site-{k}"))
            test[rows[int(0.7 * len(rows)):]] = True
        write_sites(root / name, frame, site, test)
        made[name] = root / name
    frame = table(load_breast_cancer)  # the docs' hospitals
    docs = np.random.default_rng(0)
    site = np.array([f"hospital-{k}" for k in docs.integers(0, 3, len(frame))], dtype=object)
    write_sites(root / "cancer-docs", frame, site, docs.random(len(frame)) < 0.25)
    made["cancer-docs"] = root / "cancer-docs"
    # wine as tests/test_csv_data.py's wine_parts splits it; digits in 5 IID sites
    for name, loader, sites, seed in (("wine-csv", load_wine, 3, 0), ("digits-iid", load_digits, 5, 1)):
        frame = table(loader)
        write_sites(root / name, frame, *random_sites(len(frame), sites, seed))
        made[name] = root / name
    return made


def random_sites(rows: int, sites: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(site of each row, whether it is a test row)``: a random permutation cut into ``sites`` equal parts,
    the last 30 % of each part its test rows."""
    order = np.random.default_rng(seed).permutation(rows)
    site, test = np.empty(rows, dtype=object), np.zeros(rows, dtype=bool)
    for k, part in enumerate(np.array_split(order, sites)):
        site[part] = f"site-{k}"
        test[part[int(len(part) * 0.7):]] = True
    return site, test


def pooled_regression(folder: Path) -> float:
    train = pd.concat(pd.read_csv(path) for path in sorted(folder.glob("*/train.csv")))
    test = pd.concat(pd.read_csv(path) for path in sorted(folder.glob("*/test.csv")))
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000))
    model.fit(train.drop(columns="label"), train.label)
    return 100.0 * model.score(test.drop(columns="label"), test.label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16, help="small sites: 2 to 4 steps an epoch")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for name, folder in federations(args.out / "data").items():
        reference = pooled_regression(folder)
        for mode in MODES:
            for seed in args.seeds:
                out = args.out / "runs" / f"{name}-{mode}-{seed}"
                try:
                    result = fedhpro.run({"dataset": "clients", "data_dir": str(folder), "model": "mlp",
                                          "method": "fedavg", "rounds": args.rounds, "local_epochs": 2,
                                          "feature_dim": 16, "batch_size": args.batch_size, "seed": seed,
                                          "progress": False, "threads": 1, "data.standardize": mode}, out=str(out))
                    accuracy = result.summary["accuracy"]
                except TrainingDiverged:  # raw features of scales up to 10^3 at lr=0.01: a result too
                    accuracy = None
                rows.append({"data": name, "mode": mode, "seed": seed, "accuracy": accuracy,
                             "pooled_logistic_regression": reference})
                shown = "diverged" if accuracy is None else f"{accuracy:6.2f}"
                print(f"{name:14s} {mode:10s} seed {seed}: {shown}  (pooled LR {reference:.2f})", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaling.json").write_text(json.dumps(rows, indent=2) + "\n")
    with open(args.out / "scaling.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{'data':14s} " + " ".join(f"{mode:>10s}" for mode in MODES) + f" {'pooled LR':>10s}")
    for name in dict.fromkeys(row["data"] for row in rows):
        cells = []
        for mode in MODES:
            found = [r["accuracy"] for r in rows if r["data"] == name and r["mode"] == mode]
            done = [a for a in found if a is not None]
            cells.append(f"{statistics.mean(done):10.2f}" if len(done) == len(found) else
                         f"{f'{len(found) - len(done)} diverged':>10s}")
        reference = next(r["pooled_logistic_regression"] for r in rows if r["data"] == name)
        print(f"{name:14s} " + " ".join(cells) + f" {reference:10.2f}")


if __name__ == "__main__":
    main()
