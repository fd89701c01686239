"""A peer side by side: the same FedAvg run by our simulator, by our Flower engine, and by a plain Flower app.

Three variants of one experiment (FedAvg, digits-offline, 3 clients of 5 % of
the data, the ``cnn`` with d = 512, E = 1, batch 64, SGD lr 0.01, momentum
0.9, weight decay 1e-5, 3 rounds, seed 0, CPU), run interleaved in one
process (see ``harness.py``):

* ``a simulator``: ``fedhpro.run`` (the in-process simulator), one process,
  one thread; it evaluates the global model after every round;
* ``b fedhpro on Flower``: our ServerApp (``fedhpro.flower.server.run_server``,
  what ``make_server_app`` runs) and our ClientApp in Flower's simulation
  engine (``flwr.simulation.run_simulation``, Ray, 3 SuperNodes, 1 CPU per
  client, 2 CPUs for Ray); it also evaluates after every round (on the server);
* ``c plain Flower``: a Flower app written as Flower's tutorials write one,
  below: a ``ClientApp`` whose ``@app.train()`` loads the ArrayRecord into the
  same model, trains with plain torch SGD on the same client tensors
  (``build_experiment(config).federation.clients[partition-id]``, built once
  per process and cached, as the tutorials cache their data set) and replies
  with the ArrayRecord and a MetricRecord with ``num-examples``; a
  ``ServerApp`` running Flower's own ``FedAvg`` (``fraction_evaluate=0``).
  Its final model is evaluated afterwards, untimed, on the same test sets.

Per run: wall seconds, and where they go: start-up (before the first round:
Ray, actors, data), the rounds (from ``timing.jsonl`` for a and b, from our
own clock for c, which is ``FedAvg.start``'s ``evaluate_fn`` hook returning
nothing), and the end (files, Ray shut down). The ratios b/a, c/a and b/c are
taken within each repeat. a and b must give the same accuracies to the last
digit (the Flower engine's contract); c's differs (its own batch order).

    OMP_NUM_THREADS=1 python bench/peer_flower.py            # 2 repeats after a warm-up (~3-5 min)
    OMP_NUM_THREADS=1 python bench/peer_flower.py --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a Ray FutureWarning

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

#: the experiment of all three variants (fedhpro config keys)
SETTINGS: dict[str, Any] = {"method": "fedavg", "dataset": "digits-offline", "clients": 3, "data.fraction": 0.05,
                            "local_epochs": 1, "rounds": 3, "device": "cpu", "seed": 0, "progress": False}
#: Flower's simulation engine as the tests run it: one CPU per client, two for Ray (so two clients at a time)
BACKEND = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
           "init_args": {"num_cpus": 2, "include_dashboard": False}}

# ---------------------------------------------------------------------------- c: a plain Flower app

plain_client = ClientApp()


@functools.lru_cache(maxsize=1)
def load_partitions() -> tuple[Any, ...]:
    """Every client's training tensors, built once per process (a Ray actor serves several nodes)."""
    from fedhpro.config import load_config
    from fedhpro.experiment import build_experiment

    return tuple(build_experiment(load_config(dict(SETTINGS))).federation.clients)


def new_model() -> torch.nn.Module:
    from fedhpro.models import build_model

    return build_model("cnn", 10, (3, 32, 32), 512)


def train_locally(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int) -> float:
    """Plain torch SGD (the package's settings), batches of 64 in a fresh random order each epoch; a trailing
    batch of one sample is skipped (BatchNorm cannot train on it), as fedhpro does. Returns the mean loss."""
    from fedhpro.runtime import configure_cpu_runtime

    configure_cpu_runtime()  # the process settings the other two variants use: frameworks compared, not allocators
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5)
    model.train()
    losses = []
    for _ in range(epochs):
        order = torch.randperm(len(y))
        for start in range(0, len(y), 64):
            index = order[start:start + 64]
            if index.numel() < 2:
                continue
            loss = F.cross_entropy(model(x[index]), y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return sum(losses) / max(len(losses), 1)


@plain_client.train()
def plain_train(msg: Message, context: Context) -> Message:
    """Load the global arrays, train on this node's partition, reply with the arrays and num-examples."""
    model = new_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    data = load_partitions()[int(context.node_config["partition-id"])]
    loss = train_locally(model, data.x, data.y, int(SETTINGS["local_epochs"]))
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"train_loss": loss, "num-examples": len(data.y)})})
    return Message(content=content, reply_to=msg)


def make_plain_server(clock: dict[str, Any]) -> ServerApp:
    """Flower's FedAvg for ``rounds`` rounds; ``clock`` gets the start, each round's end and the final arrays."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        clock["main"] = time.perf_counter()
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=int(SETTINGS["clients"]))

        def tick(server_round: int, arrays: ArrayRecord) -> None:  # a clock, not an evaluation
            clock.setdefault("rounds", []).append(time.perf_counter())

        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(new_model().state_dict()),
                                num_rounds=int(SETTINGS["rounds"]), evaluate_fn=tick)
        clock["arrays"] = result.arrays
        clock["main_end"] = time.perf_counter()

    return server


# ---------------------------------------------------------------------------- the three variants


def simulate_flower(server_app: ServerApp, client_app: ClientApp) -> None:
    """``run_simulation`` with 3 SuperNodes; Flower's Ray backend leaves PYTHONPATH set: restore it."""
    from flwr.simulation import run_simulation

    pythonpath = os.environ.get("PYTHONPATH")
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=int(SETTINGS["clients"]),
                       backend_config=BACKEND)
    finally:
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_simulator(out: Path, record: list[dict[str, Any]]) -> None:
    import fedhpro

    started = time.perf_counter()
    fedhpro.run(dict(SETTINGS), out=str(out))
    wall = time.perf_counter() - started
    timing = read_jsonl(out / "timing.jsonl")
    first_start = timing[0]["elapsed"] - sum(timing[0][k] for k in ("clients", "server", "eval"))
    record.append({"wall": wall, "timing": timing, "metrics": read_jsonl(out / "metrics.jsonl"),
                   "before_rounds": first_start, "after_rounds": wall - timing[-1]["elapsed"]})


def run_our_flower(out: Path, record: list[dict[str, Any]]) -> None:
    from fedhpro.flower.client import app as client_app
    from fedhpro.flower.server import run_server

    clock: dict[str, float] = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:  # what make_server_app({...}) runs, with a clock around it
        clock["main"] = time.perf_counter()
        run_server(grid, context.run_config, {**SETTINGS, "out": str(out)})
        clock["main_end"] = time.perf_counter()

    started = time.perf_counter()
    simulate_flower(server_app, client_app)
    wall = time.perf_counter() - started
    timing = read_jsonl(out / "timing.jsonl")
    rounds = sum(row["clients"] + row["server"] + row["eval"] for row in timing)
    summary = json.loads((out / "summary.json").read_text())
    record.append({"wall": wall, "timing": timing, "metrics": read_jsonl(out / "metrics.jsonl"),
                   "to_main": clock["main"] - started,
                   # in the ServerApp before the first round: the server's engine (data, model), node discovery
                   "server_setup": summary["seconds"] - rounds,
                   "before_rounds": clock["main"] - started + summary["seconds"] - rounds,
                   "after_rounds": wall - (clock["main_end"] - started)})


def run_plain_flower(record: list[dict[str, Any]]) -> None:
    import peer_flower  # this file as a module: Ray's workers import the ClientApp by name, so its cache lives on

    clock: dict[str, Any] = {}
    started = time.perf_counter()
    simulate_flower(make_plain_server(clock), peer_flower.plain_client)
    wall = time.perf_counter() - started
    ticks = clock["rounds"]  # evaluate_fn(0) before round 1, then after each round
    record.append({"wall": wall, "round_seconds": [b - a for a, b in zip(ticks, ticks[1:])],
                   "to_main": clock["main"] - started, "before_rounds": ticks[0] - started,
                   "after_rounds": wall - (clock["main_end"] - started), "arrays": clock["arrays"]})


# ---------------------------------------------------------------------------- the report


def med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f} - {max(values):.2f}]"


def plain_accuracy(arrays: ArrayRecord) -> float:
    """c's final model on the test sets the simulator uses (AVG over test sets, as fedhpro reports it)."""
    from fedhpro.config import load_config
    from fedhpro.engines.client_tests import evaluate
    from fedhpro.experiment import build_experiment

    model = new_model()
    model.load_state_dict(arrays.to_torch_state_dict())
    return evaluate(model, build_experiment(load_config(dict(SETTINGS))).federation.test_sets)["AVG"]


COLD_BUILD = """
import json, sys, time
started = time.perf_counter()
from fedhpro.config import load_config
settings = json.loads(sys.argv[1])
if sys.argv[2] == "engine":
    from fedhpro.flower.engine import build_engine
    build_engine(load_config(settings))
else:
    from fedhpro.experiment import build_experiment
    build_experiment(load_config(settings))
print(time.perf_counter() - started)
"""


def cold_build(kind: str) -> float:
    """Seconds a fresh process takes to import fedhpro and build ``kind``: ``engine`` (what our ClientApp builds
    on its first message in each Ray worker: federation, method, models) or ``data`` (what c's client loads)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", COLD_BUILD, json.dumps(SETTINGS), kind], check=True,
                          capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1])


def engine_extras() -> dict[str, float]:
    """What our engine does that plain Flower does not: the config header carried by every message (against
    the weights' size), and building the whole engine in a fresh process (against the data alone)."""
    from fedhpro.config import load_config
    from fedhpro.flower.engine import config_text

    weights = ArrayRecord(new_model().state_dict()).count_bytes()
    return {"header_bytes": len(config_text(load_config(dict(SETTINGS))).encode()), "weights_bytes": weights,
            "build_data_s": cold_build("data"), "build_engine_s": cold_build("engine")}


def report(records: dict[str, list[dict[str, Any]]], times: dict[str, list[float]], extras: dict[str, float]) -> None:
    import harness

    a, b, c = "a simulator", "b fedhpro on Flower", "c plain Flower"
    print("wall seconds per run (3 rounds), median [min - max]:")
    harness.report_times(times)
    print("ratios within each repeat:")
    harness.report_ratio(times, b, a, "b / a (our Flower / simulator)")
    harness.report_ratio(times, c, a, "c / a (plain Flower / simulator)")
    harness.report_ratio(times, b, c, "b / c (our Flower / plain Flower)")
    print("where the time goes, seconds, median [min - max] over repeats:")
    for name in (a, b):
        rows = records[name]
        print(f"  {name}: before round 1 {med([r['before_rounds'] for r in rows])}, "
              f"after the last {med([r['after_rounds'] for r in rows])}")
        for index in range(len(rows[0]["timing"])):
            print(f"    round {index + 1}: clients {med([r['timing'][index]['clients'] for r in rows])}, "
                  f"server {med([r['timing'][index]['server'] for r in rows])}, "
                  f"eval {med([r['timing'][index]['eval'] for r in rows])}")
    rows_b = records[b]
    print(f"    b: run_simulation to ServerApp main {med([r['to_main'] for r in rows_b])}, in main before round 1 "
          f"(Ray's start, the workers, node discovery, the server's engine) {med([r['server_setup'] for r in rows_b])}")
    rows_c = records[c]
    print(f"  {c}: before round 1 {med([r['before_rounds'] for r in rows_c])} (run_simulation to ServerApp main "
          f"{med([r['to_main'] for r in rows_c])}), after the last {med([r['after_rounds'] for r in rows_c])}")
    for index in range(len(rows_c[0]["round_seconds"])):
        print(f"    round {index + 1}: {med([r['round_seconds'][index] for r in rows_c])} (no evaluation)")
    print("our engine's extras over plain Flower:")
    print(f"  config header in every message: {extras['header_bytes']} bytes (the weights: "
          f"{extras['weights_bytes']} bytes)")
    print(f"  import + build in a fresh process: the data alone {extras['build_data_s']:.2f} s, our whole engine "
          f"(data, method, models) {extras['build_engine_s']:.2f} s")
    first_b = [r["timing"][0]["clients"] - statistics.median([row["clients"] for row in r["timing"][1:]])
               for r in rows_b]
    print(f"  b's round-1 client step over its later ones (each worker imports fedhpro, builds the engine): "
          f"{med(first_b)}")
    until_b = [r["before_rounds"] + r["timing"][0]["clients"] + r["timing"][0]["server"] for r in rows_b]
    until_c = [r["before_rounds"] + r["round_seconds"][0] for r in rows_c]
    print(f"  start-up + round 1's training: b {med(until_b)} (before its round 1: Ray, workers, node discovery, "
          f"the server's engine), c {med(until_c)} (c's round 1 holds Ray's start-up)")
    later_b = [row["clients"] for r in rows_b for row in r["timing"][1:]]
    later_c = [s for r in rows_c for s in r["round_seconds"][1:]]
    print(f"  rounds 2-3: b's client step {med(later_b)} against c's whole round {med(later_c)}; b's "
          f"server evaluation per round {med([row['eval'] for r in rows_b for row in r['timing']])}")
    print("accuracy (AVG %, after each round):")
    same = True
    for r_a, r_b in zip(records[a], rows_b):
        acc_a = [row["accuracy"]["AVG"] for row in r_a["metrics"]]
        acc_b = [row["accuracy"]["AVG"] for row in r_b["metrics"]]
        same = same and acc_a == acc_b
    print(f"  a {acc_a}\n  b {acc_b}\n  a == b in every repeat (to the last digit): {same}")
    finals_c = [plain_accuracy(r["arrays"]) for r in rows_c]
    print(f"  c final: {', '.join(f'{v:.2f}' for v in finals_c)} (a's final {acc_a[-1]:.2f}; "
          f"difference {statistics.median(finals_c) - acc_a[-1]:+.2f} points: other batch orders)")


def main() -> None:
    import harness

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="counted repeats (after one warm-up)")
    args = parser.parse_args()
    harness.prepare_torch(1)
    harness.print_header(f"peer: FedAvg, {SETTINGS['clients']} clients of digits-offline (fraction "
                         f"{SETTINGS['data.fraction']}), E = {SETTINGS['local_epochs']}, {SETTINGS['rounds']} rounds; "
                         f"Flower backend {BACKEND}")
    root = Path(tempfile.mkdtemp(prefix="peer-flower-"))
    records: dict[str, list[dict[str, Any]]] = {"a simulator": [], "b fedhpro on Flower": [], "c plain Flower": []}
    counter = iter(range(10 ** 6))
    variants = {
        "a simulator": lambda: run_simulator(root / f"a{next(counter)}", records["a simulator"]),
        "b fedhpro on Flower": lambda: run_our_flower(root / f"b{next(counter)}", records["b fedhpro on Flower"]),
        "c plain Flower": lambda: run_plain_flower(records["c plain Flower"]),
    }
    times = harness.interleaved(variants, args.repeats,
                                on_repeat=lambda r, s: print(f"  repeat {r}: " + ", ".join(
                                    f"{k} {v:.2f} s" for k, v in s.items()), flush=True))
    for name in records:  # drop the warm-up's records
        records[name] = records[name][1:]
    report(records, times, engine_extras())
    print(f"  after: {harness.machine_info()['load']}")


if __name__ == "__main__":
    main()
