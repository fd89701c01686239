"""Clients trained side by side (``parallel_clients``) against the reference: the same simulator training one
client at a time with the same threads a client, which must give the same bits, whatever order the clients
finish in (a slowed client forces replies to arrive out of order: they are copied and handed in order)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from conftest import TinyBNNet, TinyNet, make_federation

from fedhpro.config import FaultOptions, load_config
from fedhpro.engines.observers import FlopCount, PrototypeDistance
from fedhpro.engines.simulator import Simulator
from fedhpro.errors import ConfigError
from fedhpro.methods import METHODS, TrainSettings
from fedhpro.methods.fedhpro import FedHProOptions
from fedhpro.runtime import client_parallelism, denormals_flushed

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4)
SIZES = [40, 12, 20, 9, 16, 11]  # client 0 the largest: it finishes last when slowed


@pytest.fixture(autouse=True)
def one_thread():
    """The engine's thread at one torch thread, as each client's: a parallel run then computes every operation
    with the same thread count as the sequential reference."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def options_of(method: str):
    return FedHProOptions(match_steps=3) if method == "fedhpro" else METHODS[method].options()


def build(method: str, parallel: int, *, model=TinyNet, rounds: int = 2, **kwargs) -> Simulator:
    federation = make_federation(SIZES, classes=[[0, 1, 2], [1, 2, 3], [0, 3], [2, 3], [0, 1], [1, 3]])
    federation.test_sets = {"d0": federation.test_sets["a"], "d1": federation.test_sets["b"]}  # each domain's
    return Simulator(METHODS[method], options_of(method), federation, model, TRAIN, rounds=rounds, seed=3,
                     parallel_clients=parallel, client_threads=1, **kwargs)


def slow_client(sim: Simulator, size: int, seconds: float) -> list[str]:
    """The client holding ``size`` samples sleeps ``seconds`` before training (its ``prepare``), so the others
    finish first; returns the names of the threads that trained clients."""
    threads: list[str] = []
    prepare = sim.client.prepare

    def slowed(round):
        threads.append(threading.current_thread().name)
        if len(round.data) == size:
            time.sleep(seconds)
        return prepare(round)

    sim.client.prepare = slowed  # the instance's hook: fit stays the library's own (replies lend their weights)
    return threads


def run(sim: Simulator) -> list:
    records = [sim.run_round(r) for r in range(sim.rounds)]
    sim.end_run()
    return records


def assert_same_run(a: Simulator, records_a: list, b: Simulator, records_b: list) -> None:
    for x, y in zip(records_a, records_b):
        assert x.to_json() == y.to_json()
    wa, wb = a.server.state_dict(), b.server.state_dict()
    assert wa.keys() == wb.keys()
    for key in wa:
        if isinstance(wa[key], dict):
            for name in wa[key]:
                assert torch.equal(wa[key][name], wb[key][name]), (key, name)
        elif isinstance(wa[key], torch.Tensor):
            assert torch.equal(wa[key], wb[key]), key


@pytest.mark.parametrize("method", sorted(METHODS))
def test_side_by_side_equals_one_at_a_time(method):
    reference = build(method, 1)
    expected = run(reference)
    parallel = build(method, 3)
    threads = slow_client(parallel, SIZES[0], 0.3)
    got = run(parallel)
    assert_same_run(reference, expected, parallel, got)
    assert len(set(threads)) == 3 and all(name.startswith("fedhpro-client") for name in threads)


def test_out_of_order_replies_are_copied_and_handed_in_order():
    reference = build("fedavg", 1)
    expected = run(reference)
    parallel = build("fedavg", 2)
    received: list[int] = []
    original = parallel.protocol.open

    def open_round(round):
        current = original(round)
        receive = current.receive

        def spy(client, reply, metrics, num_samples, borrowed=False):
            received.append((client, borrowed))
            return receive(client, reply, metrics, num_samples, borrowed=borrowed)

        current.receive = spy
        return current

    parallel.protocol.open = open_round
    slow_client(parallel, SIZES[0], 0.4)
    got = run(parallel)
    assert_same_run(reference, expected, parallel, got)
    clients = [k for k, _ in received]
    assert clients == sorted(clients[:len(SIZES)]) + sorted(clients[len(SIZES):])  # the participants' order
    # client 0 held slot 0 for 0.4 s: later clients finished first, so some replies were copies, not views
    assert any(not borrowed for _, borrowed in received)
    assert received[0] == (0, True)


def test_personal_models_and_faults_side_by_side():
    kwargs = dict(client_architectures=["model"] * len(SIZES), architecture_factory=lambda name: TinyBNNet(),
                  shared="classifier", faults=FaultOptions(dropout=0.2, corrupt=0.2), model=TinyBNNet, rounds=3)
    reference = build("fedavg", 1, **kwargs)
    expected = run(reference)
    parallel = build("fedavg", 3, **kwargs)
    slow_client(parallel, SIZES[0], 0.3)
    got = run(parallel)
    assert any(record.dropped for record in expected)  # the faults did happen
    assert_same_run(reference, expected, parallel, got)
    for k in range(len(SIZES)):
        for key, value in reference.models.client_weights[k].items():
            assert torch.equal(value, parallel.models.client_weights[k][key]), (k, key)


def test_a_client_that_raises_is_dropped_as_one_at_a_time():
    def failing(sim):
        prepare = sim.client.prepare

        def hook(round):
            if len(round.data) == SIZES[2]:
                raise RuntimeError("disk on fire")
            return prepare(round)

        sim.client.prepare = hook

    reference, parallel = build("fedprox", 1), build("fedprox", 2)
    failing(reference)
    failing(parallel)
    expected, got = run(reference), run(parallel)
    assert "disk on fire" in json.dumps([r.dropped for r in got])
    assert_same_run(reference, expected, parallel, got)


def test_flop_counts_side_by_side_and_observers_that_need_order():
    reference = build("fedavg", 1, count_flops=True)
    parallel = build("fedavg", 2, count_flops=True)
    assert parallel.side_by_side(6) == 2  # FlopCount counts each client in its own thread
    a, b = run(reference), run(parallel)
    assert [r.extra["flops_train"] for r in a] == [r.extra["flops_train"] for r in b]
    assert a[0].extra["flops_train"] > 0
    ordered = build("fedavg", 2, prototype_distance=True)
    assert ordered.side_by_side(6) == 1  # it reads each trained model as the client finishes
    assert build("fedavg", 2, observers=[PrototypeDistance()]).side_by_side(6) == 1
    assert FlopCount.concurrent_clients and not PrototypeDistance.concurrent_clients


def test_client_parallelism_resolution():
    assert client_parallelism("auto", 2, "cpu") == (2, 1)
    assert client_parallelism("auto", 1, "cpu") == (1, 1)
    assert client_parallelism("auto", 8, "cuda:0") == (1, 8)
    assert client_parallelism("2", 8, "cpu") == (2, 4)
    assert client_parallelism("3", 8, "cpu") == (3, 2)
    assert client_parallelism("1", 4, "cpu") == (1, 4)


@pytest.mark.parametrize("given, problem", [("parallel_clients=3 threads=2", "needs at least as many threads"),
                                            ("parallel_clients=0", "not valid"),
                                            ("parallel_clients=many", "not valid")])
def test_bad_parallel_clients_is_one_line(given, problem):
    with pytest.raises(ConfigError, match=problem) as error:
        load_config(None, dict(item.split("=") for item in given.split()))
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_the_summary_says_how_clients_trained(digits_data_dir, tmp_path):
    from fedhpro import api

    result = api.run(None, [f"data_dir={digits_data_dir}", "dataset=digits-offline", "rounds=1", "local_epochs=1",
                            "clients=4", "threads=2", "progress=false", f"out={tmp_path / 'run'}"])
    machine = json.loads((tmp_path / "run" / "summary.json").read_text())["machine"]
    assert (machine["threads"], machine["parallel_clients"], machine["client_threads"]) == (2, 2, 1)
    assert result.summary["machine"] == machine



@pytest.mark.parametrize("flush", [True, False])
def test_worker_threads_flush_denormals_as_the_engine_does(flush):
    # new threads inherit their creator's setting; a later change must reach the pool's threads as well
    seen: list[bool] = []
    sim = build("fedavg", 2, rounds=2)
    prepare = sim.client.prepare

    def probe(round):
        seen.append(denormals_flushed())
        return prepare(round)

    sim.client.prepare = probe
    torch.set_flush_denormal(not flush)  # conftest's autouse fixture puts the default back
    sim.run_round(0)  # the worker threads start here
    torch.set_flush_denormal(flush)
    sim.run_round(1)
    sim.end_run()
    assert seen == [not flush] * len(SIZES) + [flush] * len(SIZES)


@pytest.mark.slow
@pytest.mark.parametrize("privacy", [[], ["privacy=client", "privacy.clip=0.5", "privacy.noise_multiplier=1.2"],
                                     ["privacy=client", "privacy.clip=0.5", "privacy.noise_multiplier=1.2",
                                      "privacy.noise=local"],
                                     ["privacy=sample", "privacy.clip=1.0", "privacy.noise_multiplier=1.0"]],
                         ids=["plain", "client-central", "client-local", "sample"])
def test_a_run_with_clients_side_by_side_trains_the_one_thread_runs_weights(privacy, digits_data_dir, tmp_path):
    """The whole `fedhpro run` path (config, CPU runtime, worker threads, privatisation): FedAvg at threads=2
    (two clients at once, one thread each) ends with the very weights of the same run at threads=1 (FedAvg's
    server step, central noise included, is elementwise, so the engine thread's count cannot move them; the
    clients' clipping, local noise and DP-SGD noise are drawn from each client's own seeded stream)."""
    from fedhpro import api

    weights = []
    for threads in (1, 2):
        out = tmp_path / f"threads{threads}"
        api.run(None, [f"data_dir={digits_data_dir}", "dataset=digits-offline", "method=fedavg", "rounds=2",
                       "local_epochs=1", "clients=4", "data.fraction=0.05", "feature_dim=16", f"threads={threads}",
                       "progress=false", f"out={out}", *privacy])
        machine = json.loads((out / "summary.json").read_text())["machine"]
        assert machine["parallel_clients"] == threads and machine["client_threads"] == 1
        weights.append(torch.load(out / "server_state.pt", weights_only=True)["server"]["weights"])
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
