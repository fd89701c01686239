"""One lying site among K on Flower: what a huge size claim buys under each bound on claims.

The attack of the threat model, measured on the real ServerApp (``run_server``) over an in-process grid whose
nodes run the real ClientApp on their own site folders (no data leaves a node but what the ClientApp sends):
K sites of 24 training / 12 test images each (2 colour classes, 12x12 PNG), FedAvg (by default 2 rounds of 2
local epochs at lr 0.05: the honest federation learns the task, and a zero-sending site of its true size
does not undo it), no roster.
The liar is the last site: it declares 10^9 training and test samples, sends all-zero weights and answers
every evaluation with all 10^9 right. For each K the bench runs

* ``honest``: every site honest (the liar's node answers as its ClientApp would);
* ``true size``: the liar sends zeros but declares its true size (what sending zeros alone buys);
* one liar run per bound: ``max_share`` only (``aggregation.max_ratio=0``, the bound before it existed)
  and ``aggregation.max_ratio`` r for each ``--ratios`` r (with the default ``max_share``).

and prints, as a Markdown table, the global model's L2 norm, the headline (pooled) accuracy, the median of
the sites' own accuracies, the mean accuracy of the honest sites in the liar's run, and the liar's weight
against the total weight of a round (``metrics.jsonl``'s ``capped``).

    python bench/liar_sites.py                         # K in 3 5 10 50, ratios 1 2 4 (~2-5 min)
    python bench/liar_sites.py --sites 3 10 --ratios 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# before torch or flwr are imported: one thread, no telemetry or update check
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import harness  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import ConfigRecord, Message, MessageType, RecordDict  # noqa: E402
from PIL import Image  # noqa: E402

from fedhpro.flower import records  # noqa: E402
from fedhpro.flower.local_grid import LocalGrid, inside_a_run  # noqa: E402
from fedhpro.flower.server import EVAL_RECORD, NODE_RECORD, run_server  # noqa: E402

CLAIM = 10 ** 9
TRAIN, TEST = 12, 6  # images a class: 24 training and 12 test images a site
COLOURS = {"cat": (200, 40, 40), "dog": (40, 200, 40)}


def write_site(folder: Path, seed: int) -> None:
    """``folder/{train,test}/<class>/*.png``: 12x12 images, a class colour plus noise (learnable)."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", TRAIN), ("test", TEST)):
        for name, colour in COLOURS.items():
            (folder / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = np.clip(np.array(colour) + rng.normal(0, 40, (12, 12, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / split / name / f"{i}.png")


def liar(train: int | None, test: int | None):
    """The hostile node: declares ``train`` / ``test`` samples (None: its true sizes), sends all-zero weights
    with ``num_examples`` its declared size and answers every evaluation with all of ``test`` right."""

    def forge(kind, header, reply, message):
        if kind == MessageType.QUERY and str(header["query"]) == "data":
            if train is None:
                return reply
            info = json.loads(str(reply.content.config_records[NODE_RECORD]["info"]))
            info.update(train_size=train, test_size=test)
            return Message(RecordDict({NODE_RECORD: ConfigRecord({"info": json.dumps(info)})}), reply_to=message)
        if kind == MessageType.TRAIN:
            payload = records.decode_payload(reply.content)
            payload["weights"] = {k: torch.zeros_like(v) for k, v in payload["weights"].items()}
            if train is not None:
                payload["num_examples"] = train
            content = RecordDict({**records.encode_payload(payload), records.METRICS: reply.content[records.METRICS]})
            return Message(content, reply_to=message)
        if kind == MessageType.EVALUATE and test is not None:
            record = reply.content.config_records[EVAL_RECORD]
            return Message(RecordDict({EVAL_RECORD: ConfigRecord(
                {"test-set": record["test-set"], "correct": test, "total": test})}), reply_to=message)
        return reply

    return forge


def model_norm(out: Path) -> float:
    state = torch.load(out / "model.pt", weights_only=True)
    weights = state.get("weights", state) if isinstance(state, dict) else state
    return sum(float(t.double().norm() ** 2) for t in weights.values()
               if isinstance(t, torch.Tensor) and t.is_floating_point()) ** 0.5


def one_run(sites: list[Path], work: Path, forge: dict[int, Any], training: dict[str, Any],
            **config: Any) -> dict[str, Any]:
    folders = {100 + k: folder for k, folder in enumerate(sites)}
    out = work / "out"
    settings = {"dataset": "clients", "method": "fedavg", "clients": len(sites), "feature_dim": 8, "batch_size": 8,
                "data.image_size": 16, "device": "cpu", "progress": False, "seed": 3, "flower.node-wait": 5,
                "out": str(out), **training, **config}
    run_server(LocalGrid(folders, work / "state", forge), settings)
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_client = summary["site_accuracy"]["per_client"]
    last = len(sites) - 1
    capped = [item for item in rows[-1].get("capped", []) if item["client"] == last]
    liar_weight = capped[0]["weight"] if capped else None
    return {"norm": model_norm(out), "headline": summary["accuracy"], "median": summary["site_accuracy"]["median"],
            "honest": float(np.mean([a for k, a in enumerate(per_client) if k != last and a is not None])),
            "liar_weight": liar_weight}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sites", type=int, nargs="+", default=[3, 5, 10, 50])
    parser.add_argument("--ratios", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    training = {"rounds": args.rounds, "local_epochs": args.local_epochs, "lr": args.lr}
    # outside a Flower run, flwr refuses to address a Message: this process plays the run's task
    inside_a_run()
    harness.print_header(f"One lying site among K on Flower (FedAvg, {args.rounds} rounds of {args.local_epochs} "
                         f"local epochs at lr {args.lr:g}, 24 training / 12 test images a site)")
    print("\n| sites | run | model norm | headline (pooled) % | median site % | honest sites % | liar's weight |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="liar-sites-") as tmp:
        root = Path(tmp)
        for count in args.sites:
            sites = []
            for k in range(count):
                sites.append(root / f"K{count}" / f"clinic-{k:02d}")
                write_site(sites[-1], seed=k)
            hostile = 100 + count - 1
            honest_total = 24 * (count - 1)
            runs: list[tuple[str, dict[int, Any], dict[str, Any]]] = [
                ("honest", {}, {}),
                ("zeros, true size", {hostile: liar(None, None)}, {}),
                ("liar, max_share 0.75 only", {hostile: liar(CLAIM, CLAIM)}, {"aggregation.max_ratio": 0.0})]
            runs += [(f"liar, max_ratio {ratio:g}", {hostile: liar(CLAIM, CLAIM)}, {"aggregation.max_ratio": ratio})
                     for ratio in args.ratios]
            for label, forge, config in runs:
                started = time.perf_counter()
                result = one_run(sites, root / f"K{count}-{len(label)}-{abs(hash(label))}", forge, training, **config)
                weight = result["liar_weight"]
                share = (f"{weight} of {weight + honest_total} ({100.0 * weight / (weight + honest_total):.0f} %)"
                         if weight is not None else ("24 (claims its size)" if "true" in label or label == "honest"
                                                     else "uncapped"))
                print(f"| {count} | {label} | {result['norm']:.3f} | {result['headline']:.1f} | "
                      f"{result['median']:.1f} | {result['honest']:.1f} | {share} |", flush=True)
                print(f"<!-- {time.perf_counter() - started:.1f} s -->", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
