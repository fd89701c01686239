"""Privacy audit: an honest-but-curious server reads every reply the round protocol receives.

For each method (by default every registered one: the nine of the paper's tables) and privacy setting
(off, and client-level DP at a few epsilons), one run of the in-process simulator. The server's view is
captured where the round protocol is handed each reply (``OpenRound.receive``; with ``privacy=client``
the client's privatized upload, whose ``weights`` are its clipped update and whose counts are public
constants). The client's truth (its class counts, its class-mean features under the model it trained) is taken where the
simulator shows an accepted client to its observers. On the final round's replies the attacks of
:mod:`fedhpro.privacy.audit` run:

- (a) label set (accuracy, F1) and label distribution (total variation) of each client;
- (b) cosine of the estimated class-mean features to the true ones (and, for reference, to the mean of
  the client's other classes: ReLU features always have positive cosines);
- (c) membership advantage (max TPR - FPR, and AUC) of a loss-threshold attack on the weights the client
  returned: members are its training samples, non-members as many test samples of its domain drawn with
  its class shares; beside it the same attack on the global model the server sent (the reference: what is
  not the client's own update).

Channels: ``weights`` (the classifier update, every method that sends weights), ``rows+counts`` (the
uploaded prototypes and class counts), ``rows`` (the prototypes alone, as if counts were not sent),
``class gradients`` (FedHPro's Eq. 5 tensors, inverted through the client's returned head).

Beside the attacks, each run's "sent, not read" column: the keys of the clients' replies that the method's
server never reads (:mod:`fedhpro.methods.reads`: the replies the engine hands its ``aggregate`` record every key
looked up, over every round); the privacy's own keys under ``privacy=client`` (``dp_*``, read by the private sum)
are not counted. Every key there left the clients for nothing; "-" is none.

    nice -n 10 python bench/privacy_audit.py --out results/audit

writes ``audit.json``, ``audit.csv`` and ``audit.md`` there (atomically) and prints the commands it ran.
"""

from __future__ import annotations

import argparse
import copy
import csv
import io
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fedhpro import functional
from fedhpro.config import load_config
from fedhpro.engines.observers import RoundObserver
from fedhpro.errors import FedHProError
from fedhpro.experiment import build_experiment, build_simulator
from fedhpro.files import write_atomic
from fedhpro.methods import method_names
from fedhpro.methods.no_grad import extract_features
from fedhpro.methods.parts import classifier_of
from fedhpro.methods.reads import RecordedReplies, sent_not_read
from fedhpro.privacy.audit import (
    class_means_from_class_gradients,
    class_means_from_classifier_update,
    cosine_rows,
    cosine_to_other_classes,
    label_set_score,
    labels_from_class_rows,
    labels_from_classifier_update,
    membership_advantage,
    total_variation,
)
from fedhpro.privacy.client import BELOW_CLIP_KEY, HOLDERS_KEY, PRIVATIZED_KEY

#: the reply keys of client-level DP itself (read by its private sum, not by the method's server)
PRIVACY_KEYS = (HOLDERS_KEY, PRIVATIZED_KEY, BELOW_CLIP_KEY)

#: the audit's federation: 10 label-skewed clients of digits-offline, small enough for two shared cores
#: (two of the four domains, ~480 training samples a client; label partitions split whole domains)
BASE = ["dataset=digits-offline", "data.domains=[mnist,syn]", "data.syn_size=1000", "clients=10",
        "partition=dirichlet", "partition.alpha=0.3", "feature_dim=64", "local_epochs=2", "rounds=3",
        "participation=1.0", "progress=false", "threads=1", "device=cpu"]


class Capture(RoundObserver):
    """Keeps what the server was handed in each round (client -> reply, a deep copy), each accepted
    client's truth (its class counts and class-mean features under the model it trained) and every key of a
    reply the method's server read (``reads``: its round containers are :class:`RecordedReplies`, which fold
    and aggregate as the engine's own)."""

    def __init__(self) -> None:
        self.replies: dict[int, dict[int, dict[str, Any]]] = {}
        self.truth: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.payloads: dict[int, dict[str, Any]] = {}
        self.reads: set[str] = set()
        self.round = -1

    def attach(self, simulator) -> None:
        super().attach(simulator)
        protocol = simulator.protocol
        opened = protocol.open
        capture = self
        server = protocol.server
        new_replies = server.new_replies

        def recorded_replies() -> RecordedReplies:
            return RecordedReplies(capture.reads, fold_weights=new_replies().folds_weights)

        server.new_replies = recorded_replies  # type: ignore[method-assign]

        def open_round(round: int):
            current = opened(round)
            capture.round = round
            capture.payloads[round] = copy.deepcopy(current.payload)
            capture.replies[round] = {}
            receive = current.receive

            def receive_and_keep(client, reply, metrics, num_samples, borrowed=False):
                # exactly what the protocol is handed: the reply as it left the client (privatized when
                # privacy=client: the clipped, and under local noise noised, update and class rows); copied
                # now, as borrowed weights are the working model's own tensors
                capture.replies[round][client] = copy.deepcopy(reply)
                return receive(client, reply, metrics, num_samples, borrowed=borrowed)

            current.receive = receive_and_keep  # type: ignore[method-assign]
            return current

        protocol.open = open_round  # type: ignore[method-assign]

    def client_trained(self, k: int, model: torch.nn.Module) -> None:
        data = self.simulator.federation.clients[k]
        num_classes = self.simulator.federation.num_classes
        means, _ = functional.local_prototypes(extract_features(model, data.x), data.y, num_classes)
        counts = torch.bincount(data.y, minlength=num_classes)[:num_classes]
        self.truth.setdefault(self.round, {})[k] = (counts.cpu(), means.detach().cpu())


def _losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return torch.cat([F.cross_entropy(model(x[i:i + 512]), y[i:i + 512], reduction="none")
                          for i in range(0, x.shape[0], 512)])


def nonmembers(test: tuple[torch.Tensor, torch.Tensor], counts: torch.Tensor, seed: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Test samples with the client's class shares (as many per class as it holds, at most what the test
    set has), drawn with a seeded generator."""
    x, y = test
    generator = torch.Generator().manual_seed(seed)
    picked = []
    for c, n in enumerate(counts.tolist()):
        where = (y.cpu() == c).nonzero().squeeze(1)
        if n and where.numel():
            picked.append(where[torch.randperm(where.numel(), generator=generator)[:n]])
    index = torch.cat(picked)
    return x[index], y[index]


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else float("nan")


def row_noise_threshold(reply: dict[str, Any], key: str, noise_std: float) -> float:
    """The L2 norm a row of pure noise of std ``noise_std`` per entry stays below with high probability
    (mean norm sqrt(d) sigma plus 4 standard deviations of it, sigma / sqrt(2)): the noise-aware
    attacker's cut between an absent class (noise only) and a held one. 0 without noise."""
    if noise_std <= 0:
        return 0.0
    width = reply[key][0].numel()
    return noise_std * (math.sqrt(width) + 4 / math.sqrt(2))


def audit_round(sim, capture: Capture, round: int, noise_std: float) -> dict[str, dict[str, list[float]]]:
    """Every attack on every reply of ``round``: per channel, lists of per-client scores. ``noise_std``: the
    std of the noise on each coordinate of a reply (local noise; 0: clean), known to the server."""
    out: dict[str, dict[str, list[float]]] = {}

    def add(channel: str, **scores: float) -> None:
        for name, value in scores.items():
            out.setdefault(channel, {}).setdefault(name, []).append(float(value))

    payload = capture.payloads[round]
    sent = payload.get("weights") or {}
    scratch = copy.deepcopy(sim.eval_model)
    head_prefix = next(name for name, module in scratch.named_modules() if module is classifier_of(scratch))
    weight_key, bias_key = f"{head_prefix}.weight", f"{head_prefix}.bias"
    private = getattr(sim.protocol, "client_privacy", None) is not None  # weights are the update itself
    holders_key = "dp_holders"
    for k, reply in sorted(capture.replies[round].items()):
        if k not in capture.truth.get(round, {}):
            continue
        counts, true_means = capture.truth[round][k]
        held = counts > 0
        weights = reply.get("weights")
        returned: dict[str, torch.Tensor] = {}  # the model the client returned (sent + update under privacy)
        if isinstance(weights, dict):
            returned = {key: sent[key] + value for key, value in weights.items()} if private else dict(weights)
        if isinstance(weights, dict) and weight_key in weights and weight_key in sent:
            base = {key: torch.zeros_like(value) for key, value in sent.items()} if private else sent
            delta_w = (weights[weight_key] - base[weight_key]).cpu()
            delta_b = (weights[bias_key] - base[bias_key]).cpu() if bias_key in weights else None
            guess = labels_from_classifier_update(delta_w, delta_b)
            estimate = class_means_from_classifier_update(delta_w)
            label = label_set_score(guess.present, counts)
            data = sim.federation.clients[k]
            x_out, y_out = nonmembers(sim.client_test(k)[1], counts, seed=1000 + 31 * round + k)
            scratch.load_state_dict({**sent, **returned})
            own = membership_advantage(_losses(scratch, data.x, data.y), _losses(scratch, x_out, y_out))
            scratch.load_state_dict(sent)
            reference = membership_advantage(_losses(scratch, data.x, data.y), _losses(scratch, x_out, y_out))
            add("weights", label_accuracy=label.accuracy, label_f1=label.f1,
                label_tv=total_variation(guess.distribution, counts),
                cos_true=float(cosine_rows(estimate, true_means, held).mean()),
                cos_other=_mean(cosine_to_other_classes(estimate, true_means, held).tolist()),
                mi_advantage=own.advantage, mi_auc=own.auc,
                mi_advantage_global=reference.advantage, mi_auc_global=reference.auc)
        prototypes = reply.get("prototypes")
        if isinstance(prototypes, torch.Tensor):
            for channel, with_counts in (("rows+counts", True), ("rows", False)):
                # under privacy=client the counts are public zeros; the class set travels as the (noised)
                # 0/1 holder vector instead, which the server reads the same way
                uploaded = reply.get(holders_key if private else "class_counts") if with_counts else None
                if with_counts and uploaded is None:
                    continue
                guess = labels_from_class_rows(prototypes.cpu(), uploaded.cpu() if uploaded is not None else None,
                                               row_noise_threshold(reply, "prototypes", noise_std))
                label = label_set_score(guess.present, counts)
                add(channel, label_accuracy=label.accuracy, label_f1=label.f1,
                    label_tv=total_variation(guess.distribution, counts),
                    cos_true=float(cosine_rows(prototypes.cpu(), true_means, held).mean()),
                    cos_other=_mean(cosine_to_other_classes(prototypes.cpu(), true_means, held).tolist()))
        gradients = reply.get("class_gradients")
        if isinstance(gradients, torch.Tensor) and weight_key in returned:
            head_w, head_b = returned[weight_key].cpu(), returned.get(bias_key)
            estimate = class_means_from_class_gradients(gradients.cpu(), head_w,
                                                        head_b.cpu() if head_b is not None else None)
            guess = labels_from_class_rows(gradients.cpu(), None, row_noise_threshold(reply, "class_gradients",
                                                                                     noise_std))
            label = label_set_score(guess.present, counts)
            add("class gradients", label_accuracy=label.accuracy, label_f1=label.f1,
                label_tv=total_variation(guess.distribution, counts),
                cos_true=float(cosine_rows(estimate, true_means, held).mean()),
                cos_other=_mean(cosine_to_other_classes(estimate, true_means, held).tolist()))
    return out


def privacy_overrides(setting: str) -> list[str]:
    """``off`` or ``<noise>:<epsilon>`` (client-level DP, e.g. ``local:4``) as config overrides."""
    if setting == "off":
        return []
    noise, _, epsilon = setting.partition(":")
    return ["privacy=client", f"privacy.noise={noise}", f"privacy.target_epsilon={float(epsilon):g}"]


def noise_std_of(sim) -> float:
    """The std of the noise each reply carries as the server sees it (local noise), 0 when clean: read from
    the protocol's privacy settings when they exist."""
    settings = getattr(sim.protocol, "client_privacy", None)
    if settings is None or settings.noise != "local":
        return 0.0
    return float(settings.noise_multiplier) * float(settings.clip)


def run_one(method: str, setting: str, seed: int, base: Sequence[str]) -> dict[str, Any]:
    overrides = [*base, f"method={method}", f"seed={seed}", *privacy_overrides(setting)]
    config = load_config(None, overrides)
    torch.manual_seed(seed)
    parts = build_experiment(config, "cpu")
    capture = Capture()
    sim = build_simulator(config, parts, torch.device("cpu"), observers=[capture], on_drop=None)
    started = time.perf_counter()
    record, stopped = None, None
    for round in range(config.run.rounds):
        try:
            record = sim.run_round(round)
        except FedHProError as error:  # every client failed (noise made local training diverge): audit the last
            stopped = f"round {round}: {str(error).splitlines()[0]}"  # round that closed
            break
    done = [round for round in capture.replies if record is not None and round <= record.round]
    last = max(done) if done else None
    channels = audit_round(sim, capture, last, noise_std_of(sim)) if last is not None else {}
    sent = [{key: None for key in reply if key not in PRIVACY_KEYS}
            for replies in capture.replies.values() for reply in replies.values()]
    row = {"method": method, "privacy": setting, "seed": seed, "audited_round": last, "stopped": stopped,
           "sent_not_read": sent_not_read(sent, capture.reads),
           "accuracy": (record.accuracy or {}).get("AVG") if record is not None else None,
           "epsilon": (record.extra.get("privacy") or {}).get("epsilon") if record is not None else None,
           "seconds": round_to(time.perf_counter() - started, 1), "command": "fedhpro run " + " ".join(overrides),
           "channels": {name: {key: _mean(values) for key, values in scores.items()}
                        for name, scores in channels.items()},
           "clients_audited": len(capture.replies[last]) if last is not None else 0}
    return row


def round_to(value: float, digits: int) -> float:
    return float(f"{value:.{digits}f}")


COLUMNS = ("label_accuracy", "label_f1", "label_tv", "cos_true", "cos_other", "mi_advantage", "mi_auc",
           "mi_advantage_global")


def table(rows: Sequence[dict[str, Any]]) -> str:
    head = ("| method | privacy | eps | AVG % | sent, not read | channel | label acc | label F1 | label TV | cos true "
            "| cos other | MI adv | MI AUC | MI adv (global) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for row in rows:
        setting = row["privacy"]
        if row.get("stopped"):
            setting += f" (diverged; round {row['audited_round']} audited)"
        for channel, scores in (row["channels"] or {"(none)": {}}).items():
            cells = [row["method"], setting,
                     "-" if row["epsilon"] is None else f"{row['epsilon']:.2f}",
                     "-" if row["accuracy"] is None else f"{row['accuracy']:.1f}", unread_text(row), channel]
            cells += ["" if key not in scores or math.isnan(scores[key]) else f"{scores[key]:.3f}" for key in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def unread_text(row: dict[str, Any]) -> str:
    """The run's "sent, not read" keys as one cell: "-" for none (rows of an audit.json written before the
    column have no entry: "")."""
    if "sent_not_read" not in row:
        return ""
    return " ".join(row["sent_not_read"]) or "-"


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["method", "privacy", "seed", "epsilon", "accuracy", "sent_not_read", "channel", *COLUMNS])
    for row in rows:
        for channel, scores in row["channels"].items():
            writer.writerow([row["method"], row["privacy"], row["seed"], row["epsilon"], row["accuracy"],
                             unread_text(row), channel, *[scores.get(key, "") for key in COLUMNS]])
    return buffer.getvalue()


def chance_reference(base: Sequence[str], seed: int) -> str:
    """The scores of guesses that read nothing, on the audit's federation: every class held (label accuracy
    and F1) and the uniform distribution (TV), as one Markdown line."""
    config = load_config(None, [*base, f"seed={seed}"])
    federation = build_experiment(config, "cpu").federation
    accuracy, f1, tv = [], [], []
    for data in federation.clients:
        counts = torch.bincount(data.y.cpu(), minlength=federation.num_classes)[:federation.num_classes]
        everything = torch.ones(federation.num_classes, dtype=torch.bool)
        score = label_set_score(everything, counts)
        accuracy.append(score.accuracy)
        f1.append(score.f1)
        tv.append(total_variation(everything.double(), counts))
    return (f"Reference without reading any upload (seed {seed}): guessing every class held gives label accuracy "
            f"{_mean(accuracy):.3f} and F1 {_mean(f1):.3f}; the uniform distribution has TV {_mean(tv):.3f}; a "
            "coin flip per class has accuracy 0.5.\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for audit.json / audit.csv / audit.md")
    parser.add_argument("--methods", nargs="+", default=method_names(), help="default: every registered method")
    parser.add_argument("--settings", nargs="+", default=["off"],
                        help="off, or NOISE:EPSILON with NOISE local|central (client-level DP), e.g. local:4")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="extra config overrides (after the audit's base)")
    parser.add_argument("--collect", nargs="+", type=Path, default=None,
                        help="only merge the audit.json of these folders into --out's tables")
    args = parser.parse_args(argv)
    if args.collect:
        stored = [json.loads((folder / "audit.json").read_text()) for folder in args.collect]
        rows = [row for part in stored for row in part["rows"]]
        args.out.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out / "audit.json", json.dumps({"rows": rows, "base": stored[0]["base"]}, indent=1) + "\n")
        write_atomic(args.out / "audit.csv", csv_text(rows))
        text = table(rows) + "\n" + chance_reference(stored[0]["base"], args.seed)
        write_atomic(args.out / "audit.md", text)
        print(text)
        return 0
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for setting in args.settings:
        for method in args.methods:
            row = run_one(method, setting, args.seed, [*BASE, *args.set])
            rows.append(row)
            print(f"{method:9s} {setting:10s} {row['seconds']:6.1f} s  {row['command']}", flush=True)
            write_atomic(args.out / "audit.json", json.dumps({"rows": rows, "base": [*BASE, *args.set],
                                                              "cpu_count": os.cpu_count()}, indent=1) + "\n")
    write_atomic(args.out / "audit.csv", csv_text(rows))
    write_atomic(args.out / "audit.md", table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
