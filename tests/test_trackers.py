"""Experiment trackers (``tracker=mlflow|wandb``), read back by the libraries' own readers, offline.

References: MLflow's ``MlflowClient`` on the file store (parameters, the metric history per round against
metrics.jsonl, the artifacts); W&B's own offline run file (``run-*.wandb``) read with its DataStore and protobuf
records; and the run's bytes with and without a tracker.
"""

from __future__ import annotations

import json

import pytest
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

import fedhpro
from fedhpro.trackers import row_metrics


def _run(data_dir, out, **extra):
    return fedhpro.run(method="fedavg", rounds=2, clients=4, local_epochs=1, feature_dim=16, progress=False,
                       threads=1, data_dir=str(data_dir), out=str(out),
                       **{"data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
                          "data.test_fraction": DIGITS_TEST_FRACTION, **extra})


def wandb_records(blob: bytes):
    """The records of a W&B run file: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB's log
    format (32 KiB blocks of records, each ``crc32, length (2, little-endian), type``: full, first, middle,
    last), each record one serialised ``wandb_internal_pb2.Record`` (W&B's own protobuf definitions)."""
    assert blob[:4] == b":W&B" and int.from_bytes(blob[4:6], "little") == 0xBEE1, blob[:7]
    position, pending = 7, b""
    while position + 7 <= len(blob):
        room = 32768 - position % 32768
        if room < 7:  # a block's tail too short for a header is padding
            position += room
            continue
        length, kind = int.from_bytes(blob[position + 4:position + 6], "little"), blob[position + 6]
        data = blob[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            yield data
        elif kind == 2:
            pending = data
        elif kind == 3:
            pending += data
        elif kind == 4:
            yield pending + data


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def plain(tmp_path_factory, digits_data_dir):
    return _run(digits_data_dir, tmp_path_factory.mktemp("plain") / "run")


@pytest.mark.slow
def test_mlflow_holds_the_config_every_rounds_metrics_and_the_files(digits_data_dir, tmp_path, plain):
    from mlflow.tracking import MlflowClient

    result = _run(digits_data_dir, tmp_path / "run", tracker="mlflow")
    for name in ("metrics.jsonl", "model.pt", "summary.json"):  # a tracker only looks
        if name != "summary.json":
            assert (result.out / name).read_bytes() == (plain.out / name).read_bytes(), name
    client = MlflowClient(tracking_uri=f"sqlite:///{(result.out / 'mlflow.db').resolve()}")
    experiment = client.get_experiment_by_name("fedhpro")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.params["method"] == "fedavg" and run.data.params["rounds"] == "2"
    assert run.info.status == "FINISHED"
    rows = _rows(result.out)
    for name in ("accuracy/AVG", "bytes_up"):
        history = client.get_metric_history(run.info.run_id, name)
        assert [(m.step, m.value) for m in history] == [
            (row["round"] + 1, dict(row_metrics(row))[name]) for row in rows if name in dict(row_metrics(row))]
    artifacts = {item.path for item in client.list_artifacts(run.info.run_id)}
    assert run.info.artifact_uri.startswith((result.out / "mlartifacts").resolve().as_uri())
    assert {"config.yaml", "summary.json", "metrics.jsonl", "model.pt", "model.json"} <= artifacts


@pytest.mark.slow
def test_wandb_offline_files_hold_the_history_and_the_config(digits_data_dir, tmp_path, plain):
    from wandb.proto import wandb_internal_pb2

    result = _run(digits_data_dir, tmp_path / "run", tracker="wandb")
    assert (result.out / "metrics.jsonl").read_bytes() == (plain.out / "metrics.jsonl").read_bytes()
    (path,) = sorted((result.out / "wandb").glob("offline-run-*/run-*.wandb"))
    history, config, kinds = [], {}, set()
    for data in wandb_records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append(items)
        elif record.WhichOneof("record_type") in ("run", "config"):
            updates = record.run.config.update if record.WhichOneof("record_type") == "run" else record.config.update
            for item in updates:
                config[item.key] = json.loads(item.value_json)
        kinds.add(record.WhichOneof("record_type"))
    rows = _rows(result.out)
    assert [entry["_step"] for entry in history] == [row["round"] + 1 for row in rows]
    for entry, row in zip(history, rows):
        for name, value in row_metrics(row):
            assert entry[name] == pytest.approx(value), name
    assert config["method"] == "fedavg" and config["rounds"] == 2
    assert {"artifact", "exit"} <= kinds  # the final files were logged and the run finished


class RecordingWriter:
    """A SummaryWriter that keeps its scalars (the tensorboard package is optional and not installed here)."""

    made: list[RecordingWriter] = []

    def __init__(self, log_dir: str, purge_step: int):
        self.log_dir, self.scalars, self.closed = log_dir, [], False
        RecordingWriter.made.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_flower_accepts_tensorboard_and_a_tracker_and_shows_each_round_to_them(monkeypatch, tmp_path):
    """From the trackers helper: the Flower settings accept both keys (refused before) and the ServerApp's engine
    hands each round's record to the observers and ends them, as the simulator does."""
    import sys
    import types

    from fedhpro.config import RunOptions
    from fedhpro.engines.protocol import RoundRecord
    from fedhpro.flower import server
    from fedhpro.flower.settings import config_from_run_config
    from fedhpro.flower.strategy import FlowerEngine
    from fedhpro.measurements import TensorBoardLog

    config, _ = config_from_run_config({"tensorboard": "true", "tracker": "mlflow"})
    assert config.run.tensorboard and config.run.tracker == "mlflow"
    board = types.ModuleType("torch.utils.tensorboard")
    board.SummaryWriter = RecordingWriter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", board)
    (observer,), tracker = server.record_observers(RunOptions(tensorboard=True), tmp_path, print)
    assert isinstance(observer, TensorBoardLog) and tracker == []
    records = {r: RoundRecord(round=r, participants=[0], train={"loss": 1.0 / (r + 1)}, server={},
                              accuracy=None, bytes_up=0, bytes_down=0, seconds={}) for r in range(2)}
    monkeypatch.setattr(FlowerEngine, "__init__", lambda self, *args: None)
    monkeypatch.setattr(FlowerEngine, "run_round", lambda self, r: records[r])
    monkeypatch.setattr(FlowerEngine, "end_run", lambda self: None)
    engine = server.ObservedFlowerEngine(None, None, 1.0, {}, [observer])
    assert [engine.run_round(r) for r in range(2)] == [records[0], records[1]]
    engine.end_run()
    (writer,) = RecordingWriter.made
    assert [s for s in writer.scalars if s[0] == "train/loss"] == [("train/loss", 1.0, 1), ("train/loss", 0.5, 2)]
    assert writer.closed


@pytest.mark.slow
def test_the_tracker_libraries_are_not_imported_unless_asked_for():
    import subprocess
    import sys

    code = ("import sys, fedhpro.api, fedhpro.measurements, fedhpro.flower.server; "
            "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert shown.stdout.strip() == "[]"


#: what the child runs: the network guard, then a tracker's first round (and W&B's end of the run), then at its
#: exit the refused lookups and connections as one line
TRACKER_CHILD = """
import atexit, sys, types
from pathlib import Path
sys.path.insert(0, sys.argv[3])
import network_guard
network_guard.install()
# registered before the tracker's library is imported, so run after its own exit handlers (which send)
atexit.register(lambda: print("REFUSED", sorted({str(attempt) for attempt in network_guard.attempts}), flush=True))
from fedhpro.trackers import tracker_for
kind, out = sys.argv[1], Path(sys.argv[2])
tracker = tracker_for(types.SimpleNamespace(tracker=kind, tracker_uri="", tracker_project="p"), out, {"lr": 0.1}, "n")
tracker.log_row({"round": 0, "accuracy": {"AVG": 50.0}})
if kind == "wandb":
    tracker.on_run_end()
"""
#: variables that turn a tracker library's telemetry off (theirs to set) or mark a CI machine or a test, which
#: MLflow takes as "off": the child runs as on a user's machine
TELEMETRY_VARIABLES = ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS",
                       "GITLAB_CI", "JENKINS_URL", "BUILDKITE", "TF_BUILD", "CIRCLECI", "TRAVIS")


@pytest.mark.slow
def test_the_trackers_offline_look_up_no_host(tmp_path):
    """MLflow's local store and W&B offline, each in a fresh process as on a user's machine (no CI marker, no
    opt-out of their telemetry) under the test suite's network guard: no name lookup and no connection outside
    loopback (before: MLflow looked up config.mlflow-telemetry.io, W&B its analytics host api.forge.coreweave.com)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "child.py"
    script.write_text(TRACKER_CHILD)
    env = {key: value for key, value in os.environ.items()
           if key not in TELEMETRY_VARIABLES and not key.startswith("WANDB_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(fedhpro.__file__).parents[1]), env.get("PYTHONPATH"))
                                        if p)
    children = {kind: subprocess.Popen([sys.executable, str(script), kind, str(tmp_path / kind),
                                        str(Path(__file__).parent)], env=env, cwd=tmp_path,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for kind in ("mlflow", "wandb")}
    for kind, child in children.items():
        shown, _ = child.communicate(timeout=180)
        assert child.returncode == 0, shown[-2000:]
        assert shown.strip().splitlines()[-1] == "REFUSED []", (kind, shown[-2000:])
