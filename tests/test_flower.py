"""The Flower engine (fedhpro.flower) against the in-process simulator, its reference.

* units: the payload <-> record codec (bit-exact round trip), the run_config mapping,
  node discovery errors, the example app's pyproject;
* Flower's simulation engine (``flwr.simulation.run_simulation``, Ray): FedHPro for 2 rounds
  with 3 clients, and every method of ``METHODS`` for one round, each compared with
  ``fedhpro.run`` for the same seed and config;
* a real deployment on loopback: a SuperLink, 2 SuperNodes and ``flwr run`` (test_flower_deployment.py).

Tolerance: none. Both engines run the same method code on the same data with
the same seeded generators, one torch thread per process (conftest; Ray gives
each 1-CPU actor OMP_NUM_THREADS=1), and arrays travel as exact ``.npy``
bytes, so every number must be equal to the last bit: accuracies, training
losses, server metrics, the hyper-prototypes and the global weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # silences a Ray FutureWarning
# Ray on 127.0.0.1 only (before ray is imported: fedhpro.flower.engine.RAY_LOOPBACK_ENV)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION, run_flower_simulation  # noqa: E402
from flwr.app import ConfigRecord, Message, RecordDict  # noqa: E402

import fedhpro  # noqa: E402
from fedhpro.config import RunOptions, load_config  # noqa: E402
from fedhpro.engines import checkpoint  # noqa: E402
from fedhpro.errors import ConfigError, UpdateError  # noqa: E402
from fedhpro.flower import records  # noqa: E402
from fedhpro.flower.nodes import discover_nodes  # noqa: E402
from fedhpro.flower.settings import (  # noqa: E402
    FLOWER_CHECKPOINT_EVERY,
    FlowerSettings,
    app_pyproject_toml,
    config_from_run_config,
    split_run_config,
)
from fedhpro.methods import METHODS  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]

#: the metrics.jsonl keys both engines write (the simulator's opt-in measurements are simulator-only)
CORE_KEYS = ("round", "participants", "train", "server", "bytes_up", "bytes_down", "accuracy", "dropped", "skipped")


def tiny_config(data_dir: Path, **extra: Any) -> dict[str, Any]:
    """A federation small enough for 2 CPU cores: 3 clients of ~40 images, d=16, one local epoch."""
    return {"rounds": 2, "clients": 3, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
            "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 16, "local_epochs": 1, "device": "cpu",
            "data_dir": str(data_dir), "progress": False, "seed": 1, **extra}


def core(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: row[key] for key in CORE_KEYS if key in row} for row in rows]


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def reference(settings: dict[str, Any], out: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(metrics rows, final server state)`` of the in-process simulator for ``settings``."""
    result = fedhpro.run(settings, out=str(out))
    state = checkpoint.load(checkpoint.latest(out))[checkpoint.STATE]["server"]
    return result.metrics, state


def assert_same_state(flower: dict[str, Any], simulator: dict[str, Any]) -> None:
    """Every tensor of the method's server state equal to the last bit (weights, hyper-prototypes, ...)."""
    assert set(flower) == set(simulator)
    for key, value in simulator.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(flower[key], value), key
        elif isinstance(value, dict):
            assert list(flower[key]) == list(value), key
            for name, tensor in value.items():
                assert torch.equal(flower[key][name], tensor), f"{key}.{name}"


# ---------------------------------------------------------------------------- units


def test_payload_records_round_trip_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    payload = {
        "weights": {"features.0.weight": torch.randn(4, 3, generator=generator),
                    "bn.num_batches_tracked": torch.tensor(7), "classifier.bias": torch.randn(2, generator=generator)},
        "hyper_prototypes": torch.randn(3, 2, 5, generator=generator).double(),
        "prototype_mask": torch.tensor([True, False, True]),
        "class_counts": torch.tensor([3, 0, 9]),
        "num_examples": 12, "ratio": 0.25, "flag": True, "empty": {},
    }
    content = RecordDict(records.encode_payload(payload))
    assert isinstance(content["weights"], records.ArrayRecord)
    decoded = records.decode_payload(content)
    assert list(decoded) == list(payload) and list(decoded["weights"]) == list(payload["weights"])
    for key, value in payload.items():
        if isinstance(value, torch.Tensor):
            assert decoded[key].dtype == value.dtype and torch.equal(decoded[key], value)
        elif isinstance(value, dict):
            assert all(torch.equal(decoded[key][name], tensor) for name, tensor in value.items())
        else:
            assert decoded[key] == value and type(decoded[key]) is type(value)


@pytest.mark.parametrize("payload, words", [
    ({"weights": {"a": [1.0]}}, "holds non-tensors"),
    ({"items": [1, 2]}, "is a list"),
    ({"fedhpro.layout": 1}, "cannot travel"),
])
def test_payloads_that_cannot_travel_are_one_line_update_errors(payload, words):
    with pytest.raises(UpdateError, match=words):
        records.encode_payload(payload)


def test_run_config_maps_onto_fedhpro_keys():
    run_config = {"method": "moon", "rounds": 3, "fedhpro.tau": 0.2, "moon.mu": "0.5", "clients": "",
                  "data.clients_per_domain.mnist": 2, "progress": False, "flower.node-wait": 5}
    config, settings = config_from_run_config(run_config)
    assert (config.run.method, config.run.rounds, config.run.clients) == ("moon", 3, None)
    assert config.methods["fedhpro"].tau == 0.2 and config.methods["moon"].mu == 0.5
    assert config.data.clients_per_domain["mnist"] == 2
    assert settings == FlowerSettings(node_wait=5.0)
    # an empty run_config (as run_simulation passes) gives the defaults, then the app's base settings
    config, _ = config_from_run_config({}, {"method": "fedavg"})
    assert config.run.method == "fedavg" and config.run.rounds == load_config(None).run.rounds
    # Flower's own checkpoint default: after every round unless the run sets checkpoint_every
    assert config.run.checkpoint_every == FLOWER_CHECKPOINT_EVERY == 1
    assert config_from_run_config({"checkpoint_every": 5})[0].run.checkpoint_every == 5
    assert config_from_run_config({}, {"checkpoint_every": 0})[0].run.checkpoint_every == 0
    assert config_from_run_config({"checkpoint_every": ""})[0].run.checkpoint_every == 1  # "" = the default
    assert config_from_run_config({"flower.node-auth": True})[1].node_auth


@pytest.mark.parametrize("run_config, words", [
    ({"fedhpro.tua": 0.1}, "did you mean 'fedhpro.tau'"),
    ({"rounds": 0}, "rounds"),
    ({"flower.wait": 3}, "unknown Flower setting"),
    ({"flower.node-wait": -1}, "seconds > 0"),
    ({"flower.node-auth": 1}, "true or false"),
    pytest.param({"flops": True}, "only by the in-process simulator",
                 marks=pytest.mark.skipif(not hasattr(RunOptions, "flops"), reason="no flops switch in this version")),
])
def test_bad_run_config_is_a_one_line_config_error(run_config, words):
    with pytest.raises(ConfigError, match=words) as error:
        config_from_run_config(run_config)
    assert "\n" not in str(error.value)


def test_split_keeps_flower_settings_out_of_the_experiment():
    overrides, settings = split_run_config({"flower.round-timeout": 30, "lr": "0.1", "out": ""})
    assert overrides == {"lr": 0.1} and settings.round_timeout == 30.0


class FakeGrid:
    """Just enough of flwr's Grid for node discovery: nodes answer a query with their node_config."""

    def __init__(self, node_configs: dict[int, dict[str, Any]]):
        self.node_configs = node_configs

    def get_node_ids(self):
        return list(self.node_configs)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for message in messages:
            info = self.node_configs[message.metadata.dst_node_id]
            reply = Message(RecordDict({"fedhpro.node": ConfigRecord(info)}), reply_to=message)
            replies.append(reply)  # a reply comes from the node the message went to
        return replies


def test_node_discovery_maps_partitions_and_names_the_fix(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # outside a run, flwr refuses to address a Message
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    grid = FakeGrid({11: {"partition-id": 1, "num-partitions": 2}, 7: {"partition-id": 0, "num-partitions": 2}})
    assert discover_nodes(grid, None, FlowerSettings(node_wait=1)) == ({0: 7, 1: 11}, 2)
    with pytest.raises(ConfigError, match="set clients=2 or run 3 SuperNodes"):
        discover_nodes(grid, 3, FlowerSettings(node_wait=1))
    twins = FakeGrid({1: {"partition-id": 0, "num-partitions": 2}, 2: {"partition-id": 0, "num-partitions": 2}})
    with pytest.raises(ConfigError, match="both hold partition-id=0"):
        discover_nodes(twins, None, FlowerSettings(node_wait=1))


def test_server_refuses_an_out_folder_holding_another_run_before_asking_any_node(tmp_path):
    from fedhpro.flower.server import run_server

    class UntouchableGrid:
        def __getattr__(self, name):
            raise AssertionError(f"the grid was used ({name}) before the out folder was checked")

    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="already holds a finished run; give another out="):
        run_server(UntouchableGrid(), {}, {"out": str(tmp_path), "rounds": 1})
    assert (tmp_path / "summary.json").read_text() == "{}"


def test_example_app_declares_every_config_key():
    """flwr run accepts only the keys the app declares: examples/flower/pyproject.toml must be current."""
    path = REPO / "examples" / "flower" / "pyproject.toml"
    declared = tomllib.loads(path.read_text())["tool"]["flwr"]["app"]
    # a declared key the config lacks is harmless ("" = skipped); a missing one would be refused by flwr
    missing = set(tomllib.loads(app_pyproject_toml())["tool"]["flwr"]["app"]["config"]) - set(declared["config"])
    assert not missing, (f"examples/flower/pyproject.toml lacks {sorted(missing)}; regenerate it: "
                         "python -m fedhpro.flower new-app examples/flower")
    assert declared["components"] == {"serverapp": "fedhpro.flower.server:app",
                                      "clientapp": "fedhpro.flower.client:app"}
    config = declared["config"]
    assert {"method", "rounds", "clients", "seed", "fedhpro.tau", "moon.mu", "data.fraction"} <= set(config)
    # every config section's knobs, privacy's too (config.yaml omits that section while privacy is off)
    from fedhpro.config import SECTIONS

    for section in SECTIONS:
        knobs = {f"{section.name}.{field.name}" for field in dataclasses.fields(section.options_for("digits-offline"))}
        assert knobs <= set(config), f"the app lacks {sorted(knobs - set(config))}"
    # the declared table alone (all "" = defaults) resolves to the defaults
    assert config_from_run_config(config)[0].to_dict() == load_config(
        None, {"checkpoint_every": FLOWER_CHECKPOINT_EVERY}).to_dict()


# ---------------------------------------------------------------------------- Flower's simulation engine


#: (name, config overrides) run in one Flower simulation (one Ray start): FedHPro 2 rounds, every method one
#: round, MOON and FedSA 2 rounds (their per-client state in Context.state is used from the 2nd round), and
#: FedProto proto-only 2 rounds (personal models in Context.state, evaluated on the nodes)
SIMULATED = ([("fedhpro-2-rounds", {"method": "fedhpro", "rounds": 2})]
             + [(name, {"method": name, "rounds": 2 if name in ("moon", "fedsa") else 1}) for name in METHODS]
             + [("fedproto-proto-only", {"method": "fedproto", "rounds": 2, "fedproto.protocol": "proto-only"})]
             # hostile clients and a robust rule: the same protocol code on both engines
             + [("fedhpro-scaled-median", {"method": "fedhpro", "rounds": 2, "faults.scale": 0.4,
                                           "aggregation": "median"}),
                ("fedavg-flipped-norm-clip", {"method": "fedavg", "rounds": 2, "faults.sign_flip": 0.4,
                                              "aggregation": "norm-clip"})]
             # validation parts held out of training, tested on the server in partition mode
             + [("fedavg-validation", {"method": "fedavg", "rounds": 2, "validation": 0.25}),
                ("fedavg-matched", {"method": "fedavg", "rounds": 2, "client_test": "matched"})])
#: refused before a round: personal models are evaluated on the nodes, whose replies carry no validation
REFUSED = [("fedproto-proto-only-validation", {"method": "fedproto", "rounds": 1, "fedproto.protocol": "proto-only",
                                               "validation": 0.25}),
           ("fedproto-proto-only-matched", {"method": "fedproto", "rounds": 1, "fedproto.protocol": "proto-only",
                                            "client_test": "matched"}),
           ("fedavg-unseen", {"method": "fedavg", "rounds": 1, "unseen_clients": 0.3})]


@pytest.fixture(scope="module")
def simulated(digits_data_dir, tmp_path_factory):
    """Runs every SIMULATED config through ``run_simulation`` (3 SuperNodes, 1 Ray CPU) in one session."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    from fedhpro.flower.client import app as client_app
    from fedhpro.flower.server import run_server

    root = tmp_path_factory.mktemp("flower-sim")
    outcomes: dict[str, Any] = {}
    server_app = ServerApp()
    this_process = os.getpid()  # Ray's processes descend from it (the ServerApp may run in another one)

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        assert dict(context.run_config) == {}  # what run_simulation passes: the apps must cope
        for name, extra in SIMULATED + REFUSED:
            try:
                run_server(grid, context.run_config, tiny_config(digits_data_dir, out=str(root / name), **extra))
                outcomes[name] = root / name
            except Exception as error:  # keep going: each method's test reports its own failure
                outcomes[name] = error
            if "listening" not in outcomes:  # a run went through Ray: what do its processes listen on?
                outcomes["listening"] = listening_addresses(this_process)

    run_flower_simulation(server_app, client_app)  # Ray on loopback, PYTHONPATH put back
    return outcomes, root


def listening_addresses(root: int) -> list[str]:
    """The local addresses of the TCP sockets that process ``root`` and its descendants listen on (``ss``)."""
    import subprocess

    children: dict[int, list[int]] = {}
    for line in subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.splitlines():
        pid, parent = map(int, line.split())
        children.setdefault(parent, []).append(pid)
    tree, stack = set(), [root]
    while stack:
        pid = stack.pop()
        tree.add(pid)
        stack += children.get(pid, [])
    listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
    return [line.split()[3] for line in listening if any(f"pid={pid}," in line for pid in tree)]


def test_ray_listens_on_loopback_only(simulated):
    outcomes, _ = simulated
    listening = outcomes["listening"]
    assert listening, "no listening socket of Ray found (is ss installed?)"
    outside = [address for address in listening
               if not address.startswith(("127.", "[::ffff:127.", "[::1]", "localhost"))]
    assert not outside, f"Ray listens outside 127.0.0.0/8: {outside} (all: {listening})"


def flower_result(simulated, name):
    outcomes, _ = simulated
    outcome = outcomes.get(name, RuntimeError("the Flower simulation did not reach this config"))
    if isinstance(outcome, Exception):
        raise outcome
    return read_rows(outcome / "metrics.jsonl"), torch.load(outcome / "server_state.pt", weights_only=True)


def test_fedhpro_on_flower_simulation_equals_the_simulator(simulated, digits_data_dir, tmp_path):
    rows, state = flower_result(simulated, "fedhpro-2-rounds")
    expected_rows, expected_state = reference(tiny_config(digits_data_dir, method="fedhpro", rounds=2), tmp_path)
    assert len(rows) == 2 and all(row["participants"] == [0, 1, 2] for row in rows)
    assert core(rows) == core(expected_rows)  # accuracies, losses, server metrics, bytes: exactly
    assert [row["accuracy"]["AVG"] for row in rows] == [row["accuracy"]["AVG"] for row in expected_rows]
    assert torch.equal(state["server"]["hyper_prototypes"], expected_state["hyper_prototypes"])
    assert_same_state(state["server"], expected_state)
    # the whole run folder as the simulator writes it (one run driver): metrics.jsonl to the byte, summary.json
    # but for the wall time and the engine's name (params_up/down, fairness, ... included), config, partition
    flower_out = simulated[1] / "fedhpro-2-rounds"
    assert (flower_out / "metrics.jsonl").read_bytes() == (tmp_path / "metrics.jsonl").read_bytes()
    summary, expected = (json.loads((where / "summary.json").read_text()) for where in (flower_out, tmp_path))
    assert summary.pop("engine") == "flower" and summary.pop("seconds") > 0 and expected.pop("seconds") > 0
    assert list(summary.items()) == list(expected.items())
    assert {"params_up", "params_down", "fairness", "client_accuracy"} <= set(summary)
    for name in ("partition.json", "accuracy.png", "timing.jsonl"):
        assert (flower_out / name).is_file(), name
    assert (flower_out / "partition.json").read_bytes() == (tmp_path / "partition.json").read_bytes()
    # the trained model: the ServerApp writes the same model.pt as the simulator, and load_model rebuilds it
    import fedhpro

    flower_model = torch.load(flower_out / "model.pt", weights_only=True)
    simulator_model = torch.load(tmp_path / "model.pt", weights_only=True)
    assert flower_model.keys() == simulator_model.keys()
    assert all(torch.equal(flower_model[key], simulator_model[key]) for key in flower_model)
    x = torch.zeros(2, *json.loads((flower_out / "model.json").read_text())["input_shape"])
    assert torch.equal(fedhpro.load_model(flower_out)(x), fedhpro.load_model(tmp_path)(x))


@pytest.mark.parametrize("name", [name for name, _ in SIMULATED[1:]])
def test_every_method_runs_on_flower_simulation(simulated, name, digits_data_dir, tmp_path):
    rows, state = flower_result(simulated, name)
    extra = dict(SIMULATED)[name]
    assert len(rows) == extra["rounds"] and "accuracy" in rows[-1]
    expected_rows, expected_state = reference(tiny_config(digits_data_dir, **extra), tmp_path)
    assert core(rows) == core(expected_rows)
    assert_same_state(state["server"], expected_state)
    if "aggregation" in extra:
        assert all(row["server"]["robust_updates"] == 3 for row in rows)
    if "validation" in extra:  # the same validation parts held out, tested with the same model
        assert [row["validation"] for row in rows] == [row["validation"] for row in expected_rows]
        assert all(set(row["validation"]) >= {"AVG"} for row in rows)
    if "client_test" in extra:  # the same matched test sets: each client's own accuracy
        assert [row["client_accuracy"] for row in rows] == [row["client_accuracy"] for row in expected_rows]


def test_validation_where_the_nodes_evaluate_is_refused_in_one_line(simulated):
    from fedhpro.errors import ConfigError
    from fedhpro.flower.server import SERVER_TESTS_ONLY

    for name in ("fedproto-proto-only-validation", "fedproto-proto-only-matched"):
        outcome = simulated[0][name]
        assert isinstance(outcome, ConfigError) and str(outcome) == SERVER_TESTS_ONLY
    unseen = simulated[0]["fedavg-unseen"]  # every SuperNode is a client that trains
    assert isinstance(unseen, ConfigError) and "unseen_clients / unseen_domain are not available on Flower" in str(
        unseen)
