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
against the total weight of a round (``metrics.jsonl``'s ``capped``) (``--study claims``).

``--study content``: liars of their content rather than their size, with ``aggregation.update_bound=off``
against the default (on, since the nodes hold their own data), at K in 3 5 10: the boosted liar (claims
twice the median, 48, or its true 24, trains honestly, sends ``g + boost (T - g)`` with ``boost`` the round's
total weight over its own and ``T`` its model with the classifier rows swapped, or zero), 2 and 3 boosted
colluders at 10 sites (also under ``aggregation=median`` and ``norm-clip``), FedProto's liar reversing its
prototype rows at norm 1e6 and 1e30, and the honest runs: equal sites, label skew and quantity skew (a
harder task). Each cell: model norm / headline % / worst honest site %.

``--study sweep``: ``aggregation.update_multiple`` (``--multiples``) against the liars (worst honest site %)
and the honest heterogeneous federations (headline change), for the weighted pull ``n_k ||Delta_k||`` (the
shipped bound) and the plain norm.

    python bench/liar_sites.py                         # claims (K in 3 5 10 50) and content (~20 min)
    python bench/liar_sites.py --study claims --sites 3 10 --ratios 2
    python bench/liar_sites.py --study sweep           # ~20 min on 2 shared cores
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


def write_site(folder: Path, seed: int, train: tuple[int, int] = (TRAIN, TRAIN), noise: float = 40.0,
               contrast: float = 1.0) -> None:
    """``folder/{train,test}/<class>/*.png``: 12x12 images, a class colour plus noise of std ``noise``
    (learnable); ``train``: the training images of each class (the test split is always 6 of each);
    ``contrast``: the class colours pulled towards their midpoint (1: as they are; smaller: a harder task)."""
    rng = np.random.default_rng(seed)
    middle = (np.array(COLOURS["cat"]) + np.array(COLOURS["dog"])) / 2
    for split, counts in (("train", train), ("test", (TEST, TEST))):
        for (name, colour), count in zip(COLOURS.items(), counts):
            colour = middle + contrast * (np.array(colour) - middle)
            (folder / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = np.clip(np.array(colour) + rng.normal(0, noise, (12, 12, 3)), 0, 255).astype(np.uint8)
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


def classifier_key(weights: dict[str, torch.Tensor]) -> str:
    """The classifier's weight: the last 2-D tensor with one row per class."""
    return [key for key, value in weights.items() if value.dim() == 2 and value.shape[0] == len(COLOURS)][-1]


def swapped(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with the classifier's two class rows (weight and bias) swapped: the model that calls every
    cat a dog."""
    key = classifier_key(weights)
    out = dict(weights)
    for name in (key, key[:-len("weight")] + "bias"):
        if name in out:
            out[name] = out[name].flip(0).clone()
    return out


def boosted(claim: int, boost: float, target: str):
    """The boosted liar: declares ``claim`` training samples (its test size true), trains honestly and sends
    ``g + boost (T - g)``, ``g`` the broadcast weights and ``T`` its trained model with the classifier rows
    swapped (``target="swap"``) or zero (``"zero"``): with ``boost`` the round's total weight over its own the
    aggregate is ``T`` plus the others' updates shrunk to almost nothing."""

    def forge(kind, header, reply, message):
        if kind == MessageType.QUERY and str(header["query"]) == "data":
            info = json.loads(str(reply.content.config_records[NODE_RECORD]["info"]))
            info.update(train_size=claim)
            return Message(RecordDict({NODE_RECORD: ConfigRecord({"info": json.dumps(info)})}), reply_to=message)
        if kind == MessageType.TRAIN:
            payload = records.decode_payload(reply.content)
            glob = records.decode_payload(message.content)["weights"]
            mine = payload["weights"]
            aim = swapped(mine) if target == "swap" else {k: torch.zeros_like(v) for k, v in mine.items()}
            payload["weights"] = {k: (glob[k] + boost * (aim[k] - glob[k])).to(v.dtype)
                                  if v.is_floating_point() else v for k, v in mine.items()}
            payload["num_examples"] = claim
            counts = payload.get("class_counts")
            if isinstance(counts, torch.Tensor):
                payload["class_counts"] = counts * claim // max(1, int(counts.sum()))
            content = RecordDict({**records.encode_payload(payload), records.METRICS: reply.content[records.METRICS]})
            return Message(content, reply_to=message)
        return reply

    return forge


def reversed_rows(norm: float):
    """FedProto's row liar: sends its prototypes reversed and scaled to L2 norm ``norm`` a row, its size true."""

    def forge(kind, header, reply, message):
        if kind == MessageType.TRAIN:
            payload = records.decode_payload(reply.content)
            rows = payload["prototypes"].double()
            payload["prototypes"] = (-rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-12) * norm).float()
            content = RecordDict({**records.encode_payload(payload), records.METRICS: reply.content[records.METRICS]})
            return Message(content, reply_to=message)
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
    liars = {k for k in range(len(sites)) if 100 + k in forge} or {last}
    capped = [item for item in rows[-1].get("capped", []) if item["client"] == last]
    liar_weight = capped[0]["weight"] if capped else None
    honest = [a for k, a in enumerate(per_client) if k not in liars and a is not None]
    return {"norm": model_norm(out), "headline": summary["accuracy"], "median": summary["site_accuracy"]["median"],
            "honest": float(np.mean(honest)), "worst": float(min(honest)), "per_client": per_client,
            "liar_weight": liar_weight, "bounded": [row.get("bounded", []) for row in rows]}


def cell(result: dict[str, Any] | None) -> str:
    """A run as ``model norm / headline % / worst honest site %`` (``aborted`` for a run that stopped)."""
    if result is None:
        return "aborted"
    return f"{result['norm']:.3g} / {result['headline']:.1f} / {result['worst']:.1f}"


def attempt(sites: list[Path], work: Path, forge: dict[int, Any], training: dict[str, Any],
            **config: Any) -> dict[str, Any] | None:
    """:func:`one_run`, None where the run stops (a non-finite loss aborts it)."""
    try:
        return one_run(sites, work, forge, training, **config)
    except Exception as error:  # noqa: BLE001 - an aborted run is a result of the study
        print(f"<!-- aborted: {type(error).__name__}: {str(error).splitlines()[0][:160]} -->", file=sys.stderr)
        return None


class Sites:
    """The study's site folders, written once per (layout, K)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[tuple[str, int], list[Path]] = {}
        self.runs = 0

    def get(self, layout: str, count: int) -> list[Path]:
        if (layout, count) not in self.made:
            sites = []
            for k in range(count):
                sites.append(self.root / layout / f"K{count}" / f"clinic-{k:02d}")
                if layout == "same":
                    write_site(sites[-1], seed=k)
                elif layout == "label-skew":  # class balances 20/4, 4/20, 12/12, ...; a harder task
                    write_site(sites[-1], seed=k, train=((20, 4), (4, 20), (12, 12))[k % 3], noise=80.0,
                               contrast=0.25)
                else:  # quantity skew: 4, 8, 12 or 24 images a class; a harder task
                    size = (4, 8, 12, 24)[k % 4]
                    write_site(sites[-1], seed=k, train=(size, size), noise=80.0, contrast=0.25)
            self.made[layout, count] = sites
        return self.made[layout, count]

    def work(self) -> Path:
        self.runs += 1
        return self.root / "runs" / str(self.runs)


def claims_study(args: argparse.Namespace, training: dict[str, Any], sites: Sites) -> None:
    """The size-claim liar under each bound on claims (the study this bench began with)."""
    print("\n| sites | run | model norm | headline (pooled) % | median site % | honest sites % | liar's weight |")
    print("|---|---|---|---|---|---|---|")
    for count in args.sites:
        hostile = 100 + count - 1
        honest_total = 24 * (count - 1)
        runs: list[tuple[str, dict[int, Any], dict[str, Any]]] = [
            ("honest", {}, {}),
            ("zeros, true size", {hostile: liar(None, None)}, {}),
            ("liar, max_share 0.75 only", {hostile: liar(CLAIM, CLAIM)}, {"aggregation.max_ratio": 0.0})]
        runs += [(f"liar, max_ratio {ratio:g}", {hostile: liar(CLAIM, CLAIM)}, {"aggregation.max_ratio": ratio})
                 for ratio in args.ratios]
        for label, forge, config in runs:
            result = one_run(sites.get("same", count), sites.work(), forge, training, **config)
            weight = result["liar_weight"]
            share = (f"{weight} of {weight + honest_total} ({100.0 * weight / (weight + honest_total):.0f} %)"
                     if weight is not None else ("24 (claims its size)" if "true" in label or label == "honest"
                                                 else "uncapped"))
            print(f"| {count} | {label} | {result['norm']:.3f} | {result['headline']:.1f} | "
                  f"{result['median']:.1f} | {result['honest']:.1f} | {share} |", flush=True)


def attacks(count: int) -> list[tuple[str, dict[int, Any]]]:
    """The content liars at ``count`` sites (the last sites lie): boosted by the round's total weight over
    theirs, so that without a bound the aggregate is their target."""
    total = 48 + 24 * (count - 1)
    last = 100 + count - 1
    out = [("boosted 2x claim, T = swapped rows", {last: boosted(48, total / 48, "swap")}),
           ("boosted 2x claim, T = 0", {last: boosted(48, total / 48, "zero")}),
           ("boosted true size, T = swapped rows", {last: boosted(24, 24.0 * count / 24, "swap")}),
           ("boosted true size, T = 0", {last: boosted(24, 24.0 * count / 24, "zero")})]
    if count >= 10:
        for liars in (2, 3):
            total = 48 * liars + 24 * (count - liars)
            out.append((f"{liars} colluders, 2x claims, T = swapped rows",
                        {100 + count - 1 - i: boosted(48, total / (48 * liars), "swap") for i in range(liars)}))
    return out


def content_study(args: argparse.Namespace, training: dict[str, Any], sites: Sites) -> None:
    """What one reply's content buys: each liar with the bound off (today's main) and on (the default), and
    the colluders under the opt-in rules; FedProto's row liars; honest heterogeneous federations."""
    off = {"aggregation.update_bound": "off"}
    print("\nModel norm / headline (pooled) % / worst honest site %:\n")
    print("| sites | run | update_bound off | default (update_multiple "
          f"{args.default_multiple:g}) | aggregation=median | aggregation=norm-clip |")
    print("|---|---|---|---|---|---|")
    for count in args.sites:
        same = sites.get("same", count)
        runs = [("honest", {})] + attacks(count)
        for label, forge in runs:
            robust = "colluders" in label
            cells = [attempt(same, sites.work(), forge, training, **off),
                     attempt(same, sites.work(), forge, training)]
            if robust:
                cells += [attempt(same, sites.work(), forge, training, **{"aggregation": "median"}),
                          attempt(same, sites.work(), forge, training, **{"aggregation": "norm-clip"})]
            print(f"| {count} | {label} | " + " | ".join(cell(c) for c in cells)
                  + (" | - | -" if not robust else "") + " |", flush=True)
        fedproto = {"method": "fedproto"}
        last = 100 + count - 1
        for label, forge in (("FedProto honest", {}), ("FedProto rows reversed, norm 1e6", {last: reversed_rows(1e6)}),
                             ("FedProto rows reversed, norm 1e30", {last: reversed_rows(1e30)})):
            cells = [attempt(same, sites.work(), forge, training, **fedproto, **off),
                     attempt(same, sites.work(), forge, training, **fedproto)]
            print(f"| {count} | {label} | " + " | ".join(cell(c) for c in cells) + " | - | - |", flush=True)
        for layout in ("label-skew", "quantity-skew"):
            federation = sites.get(layout, count)
            cells = [attempt(federation, sites.work(), {}, training, **off),
                     attempt(federation, sites.work(), {}, training)]
            print(f"| {count} | honest, {layout} | " + " | ".join(cell(c) for c in cells) + " | - | - |", flush=True)


def sweep_study(args: argparse.Namespace, training: dict[str, Any], sites: Sites) -> None:
    """kappa against the liars (worst honest site %) and against honest heterogeneous federations (headline %
    minus the unbounded run's), for the weighted pull ``n_k ||Delta_k||`` and the plain ``||Delta_k||``."""
    from fedhpro.engines.content import BoundedFold

    off = {"aggregation.update_bound": "off"}
    base = {(layout, count): attempt(sites.get(layout, count), sites.work(), {}, training, **off)
            for layout in ("same", "label-skew", "quantity-skew") for count in args.sites}
    print("\nUnbounded headline % of the honest runs: " + ", ".join(
        f"{layout} K={count} {result['headline']:.1f}" for (layout, count), result in base.items() if result))
    columns = [f"{label} K={count}" for count in args.sites for label, _ in attacks(count)[:3]]
    columns += [f"{layout} K={count}" for layout in ("label-skew", "quantity-skew") for count in args.sites]
    print("\nWorst honest site % under each liar; headline change (points) of the honest heterogeneous runs:\n")
    print("| pull | kappa | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for weighted in (True, False):
        BoundedFold.weighted = weighted
        for multiple in args.multiples:
            config = {"aggregation.update_bound": "on", "aggregation.update_multiple": multiple}
            values = []
            for count in args.sites:
                for _, forge in attacks(count)[:3]:
                    result = attempt(sites.get("same", count), sites.work(), forge, training, **config)
                    values.append("aborted" if result is None else f"{result['worst']:.1f}")
            for layout in ("label-skew", "quantity-skew"):
                for count in args.sites:
                    result = attempt(sites.get(layout, count), sites.work(), {}, training, **config)
                    before = base[layout, count]
                    values.append("-" if result is None or before is None
                                  else f"{result['headline'] - before['headline']:+.1f}")
            print(f"| {'n_k x norm' if weighted else 'norm'} | {multiple:g} | "
                  + " | ".join(values) + " |", flush=True)
    BoundedFold.weighted = True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", nargs="+", choices=("claims", "content", "sweep"), default=["claims", "content"])
    parser.add_argument("--sites", type=int, nargs="+", default=None,
                        help="K (default: 3 5 10 50 for claims, 3 5 10 for content and sweep)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    parser.add_argument("--multiples", type=float, nargs="+", default=[1.0, 1.5, 2.0, 3.0, 4.0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    from fedhpro.config import AggregationOptions

    args.default_multiple = AggregationOptions().update_multiple
    training = {"rounds": args.rounds, "local_epochs": args.local_epochs, "lr": args.lr}
    # outside a Flower run, flwr refuses to address a Message: this process plays the run's task
    inside_a_run()
    harness.print_header(f"Lying sites among K on Flower (FedAvg, {args.rounds} rounds of {args.local_epochs} "
                         f"local epochs at lr {args.lr:g}, 24 training / 12 test images a site)")
    chosen = args.sites
    with tempfile.TemporaryDirectory(prefix="liar-sites-") as tmp:
        sites = Sites(Path(tmp))
        for study in args.study:
            started = time.perf_counter()
            args.sites = chosen or ([3, 5, 10, 50] if study == "claims" else [3, 5, 10])
            {"claims": claims_study, "content": content_study, "sweep": sweep_study}[study](args, training, sites)
            print(f"<!-- {study}: {time.perf_counter() - started:.1f} s -->", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
