"""Round observers (optional measurements watch the simulator, never change it), checkpoints by elapsed
time, the progress bar's text and ``fedhpro report`` on unfinished runs and existing report folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import FEATURE_DIM, TinyNet, make_federation

import fedhpro
from fedhpro.config import OBSERVER_KEYS
from fedhpro.engines import lifecycle, printout
from fedhpro.engines.observers import FlopCount, PrototypeDistance, RoundObserver
from fedhpro.engines.simulator import Simulator
from fedhpro.errors import ConfigError
from fedhpro.measurements import TensorBoardLog, TSNEPlot, observers_for
from fedhpro.methods import METHODS, TrainSettings

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.0, weight_decay=0.0)


def simulator(method: str = "fedhpro", **kwargs) -> Simulator:
    spec = METHODS[method]
    options = spec.options(match_steps=2) if method == "fedhpro" else spec.options()
    return Simulator(spec, options, make_federation([10, 12, 14], seed=3), TinyNet, TRAIN, rounds=2, seed=5,
                     eval_every=2, **kwargs)


def tiny_settings(out: Path, **extra) -> dict:
    return {"rounds": 4, "local_epochs": 1, "batch_size": 8, "progress": False, "device": "cpu", "out": str(out),
            "feature_dim": FEATURE_DIM, "method": "fedavg", **extra}


# ---------------------------------------------------------------------------- observers


class Recorder(RoundObserver):
    """Writes down every hook call, and adds one key of its own to each row."""

    def __init__(self):
        self.calls: list[tuple] = []

    def attach(self, simulator):
        super().attach(simulator)
        self.calls.append(("attach",))

    def on_round_start(self, round, evaluating):
        self.calls.append(("start", round, evaluating))

    def client_trained(self, k, model):
        self.calls.append(("trained", k))

    def training_measurements(self):
        return {"seen_clients": sum(1 for call in self.calls if call[0] == "trained")}

    def evaluation_measurements(self):
        self.calls.append(("evaluated",))
        return {}

    def on_round_end(self, record):
        self.calls.append(("end", record.round, record.extra["seen_clients"]))

    def on_run_end(self):
        self.calls.append(("run end",))


def test_observers_see_every_hook_in_order_and_change_no_number():
    plain = simulator()
    recorder = Recorder()
    watched = simulator(observers=[recorder])
    rows = [(plain.run_round(r).to_json(), watched.run_round(r).to_json()) for r in range(2)]
    watched.end_run()
    for a, b in rows:
        assert a == {key: value for key, value in b.items() if key != "seen_clients"}
    assert [row["seen_clients"] for _, row in rows] == [3, 6]
    assert recorder.calls == [("attach",), ("start", 0, False), ("trained", 0), ("trained", 1), ("trained", 2),
                              ("end", 0, 3), ("start", 1, True), ("trained", 0), ("trained", 1), ("trained", 2),
                              ("evaluated",), ("end", 1, 6), ("run end",)]
    # the measurement keys keep their place: FLOPs before the accuracy's keys, prototype distances after
    row = simulator(count_flops=True, prototype_distance=True).run_round(1).to_json()  # an evaluated round
    keys = list(row)
    assert keys.index("flops_server") < keys.index("client_accuracy") < keys.index("fairness") \
        < keys.index("prototype_distance")


def test_the_flag_shorthands_are_the_flop_and_prototype_observers():
    flags = simulator(count_flops=True, prototype_distance=True)
    explicit = simulator(observers=[FlopCount(), PrototypeDistance()])
    for r in range(2):
        assert flags.run_round(r).to_json() == explicit.run_round(r).to_json()
    with pytest.raises(ConfigError, match="prototype_distance=true needs one shared global model"):
        simulator("fedavg", shared="none", observers=[PrototypeDistance()])


def test_observers_are_picked_from_the_run_keys_in_one_place(tmp_path):
    from fedhpro.config import RunOptions
    from fedhpro.flower.settings import SIMULATOR_ONLY

    assert set(SIMULATOR_ONLY) == set(OBSERVER_KEYS)  # what Flower refuses is what the observers measure
    assert observers_for(RunOptions(), tmp_path, print, "t") == []
    chosen = observers_for(RunOptions(flops=True, prototype_distance=True, tsne=True), tmp_path, print, "t")
    assert [type(o) for o in chosen] == [FlopCount, PrototypeDistance, TSNEPlot]


class FakeWriter:
    """A SummaryWriter that keeps what it is given."""

    made: list[FakeWriter] = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir, self.purge_step, self.scalars, self.closed = log_dir, purge_step, [], False
        FakeWriter.made.append(self)

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_tensorboard_logs_every_number_of_each_row_at_round_plus_one(tmp_path):
    FakeWriter.made = []
    board = TensorBoardLog(tmp_path, FakeWriter)
    sim = simulator("fedavg", count_flops=True, observers=[board])
    assert FakeWriter.made == []  # opened at the first round only
    rows = [sim.run_round(r).to_json() for r in range(2)]
    sim.end_run()
    (writer,) = FakeWriter.made
    assert writer.log_dir == str(tmp_path / "tensorboard") and writer.closed
    expected = []
    for row in rows:
        for group in ("accuracy", "train", "server", "fairness"):
            expected += [(f"{group}/{k}", v, row["round"] + 1) for k, v in row.get(group, {}).items()]
        expected += [(f"communication/{k}", row[k], row["round"] + 1)
                     for k in ("bytes_up", "bytes_down", "params_up", "params_down")]
        expected += [(f"compute/{k}", row[k], row["round"] + 1) for k in ("flops_train", "flops_server")]
    assert sorted(writer.scalars) == sorted(expected)


# ---------------------------------------------------------------------------- checkpoints by elapsed time


class FakeClock:
    """A clock whose minutes pass only when the test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rounds_take(monkeypatch, minutes: float, killed_at: int | None = None) -> FakeClock:
    """Make the checkpoint schedule read a fake clock on which every round takes ``minutes`` minutes (and
    round ``killed_at``, if given, is interrupted as by Ctrl-C)."""
    clock = FakeClock()
    monkeypatch.setattr(lifecycle, "_now", clock)
    real_round = Simulator.run_round

    def timed_round(self, round):
        if round == killed_at:
            raise KeyboardInterrupt
        record = real_round(self, round)
        clock.now += 60.0 * minutes
        return record

    monkeypatch.setattr(Simulator, "run_round", timed_round)
    return clock


def test_schedule_is_due_by_count_by_time_and_at_the_end(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(lifecycle, "_now", clock)
    schedule = lifecycle.CheckpointSchedule(every=3, minutes=5, rounds=10)
    assert not schedule.due(1)
    clock.now += 4 * 60
    assert not schedule.due(2)
    assert schedule.due(3)  # by count
    schedule.written()
    clock.now += 5 * 60
    assert schedule.due(4)  # by time, 5 minutes after the last one
    schedule.written()
    assert not schedule.due(5) and schedule.due(10)
    clock.now += 60 * 60
    assert not lifecycle.CheckpointSchedule(every=0, minutes=0, rounds=10).due(7)


def checkpoints(folder: Path) -> list[str]:
    return sorted(p.name for p in (folder / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_checkpoint_is_written_once_the_minutes_pass_and_changes_no_number(monkeypatch, tmp_path):
    federation = make_federation([10, 12])
    plain = fedhpro.run(federation=federation, model=TinyNet, **tiny_settings(
        tmp_path / "plain", checkpoint_every=0, checkpoint_minutes=0, keep_checkpoints=9))
    assert checkpoints(tmp_path / "plain") == ["round-000004.pt"]
    rounds_take(monkeypatch, 3.0)
    timed = fedhpro.run(federation=federation, model=TinyNet, **tiny_settings(
        tmp_path / "timed", checkpoint_every=0, checkpoint_minutes=5, keep_checkpoints=9))
    # rounds end at minutes 3, 6 (5 passed: written), 9 (3 since), 12 (the last); checkpoint_every never came
    assert checkpoints(tmp_path / "timed") == ["round-000002.pt", "round-000004.pt"]
    assert (tmp_path / "timed" / "metrics.jsonl").read_text() == (tmp_path / "plain" / "metrics.jsonl").read_text()
    assert timed.metrics == plain.metrics


@pytest.mark.slow
def test_a_run_killed_before_checkpoint_every_came_resumes_from_its_timed_checkpoint(monkeypatch, tmp_path):
    federation = make_federation([10, 12])
    whole = fedhpro.run(federation=federation, model=TinyNet, **tiny_settings(tmp_path / "whole"))
    rounds_take(monkeypatch, 3.0, killed_at=3)  # as the run: killed long before round 5
    with pytest.raises(KeyboardInterrupt):
        fedhpro.run(federation=federation, model=TinyNet, **tiny_settings(tmp_path / "killed", checkpoint_every=5))
    assert checkpoints(tmp_path / "killed") == ["round-000002.pt"]
    monkeypatch.undo()
    resumed = fedhpro.run(federation=federation, model=TinyNet, resume=str(tmp_path / "killed"), progress=False,
                          device="cpu", checkpoint_minutes=10)
    assert resumed.metrics == whole.metrics
    assert resumed.config.run.checkpoint_minutes == 10  # a setting a resumed run may change


# ---------------------------------------------------------------------------- the progress bar


def test_the_bar_shows_the_cross_entropy_labelled_else_the_whole_loss():
    hpro = {"ce": 0.25, "hpcl": 150.0, "hpal": 0.5, "loss": 150.75, "margin": 0.6}
    assert printout.progress_text(hpro, {"a": 40.0, "AVG": 45.678}) == "train CE 0.250  AVG 45.68%"
    assert printout.progress_text({"loss": 1.5}, None) == "train loss 1.500  AVG -"
    assert printout.progress_text({}, {"AVG": 10.0}) == "AVG 10.00%"  # a skipped round: no training metrics


def test_fedhpro_reports_the_cross_entropy_the_bar_shows():
    record = simulator().run_round(0)
    assert {"ce", "hpcl", "loss"} <= set(record.train)
    assert printout.progress_text(record.train, None).startswith(f"train CE {record.train['ce']:.3f}")


# ---------------------------------------------------------------------------- fedhpro report


def fake_run(folder: Path, method: str, avg: list[float], rounds: int, finished: bool) -> Path:
    """A run folder with ``len(avg)`` of ``rounds`` rounds, with summary.json only when ``finished``."""
    folder.mkdir(parents=True)
    rows = [{"round": r, "participants": [0], "train": {}, "server": {}, "bytes_up": 10, "bytes_down": 30,
             "accuracy": {"mnist": value, "AVG": value}} for r, value in enumerate(avg)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "config.yaml").write_text(yaml.safe_dump({"method": method, "rounds": rounds}))
    if finished:
        (folder / "summary.json").write_text(json.dumps({"accuracy": avg[-1]}))
    return folder


def test_report_marks_an_unfinished_run(tmp_path):
    from fedhpro.reports.runs import report

    done = fake_run(tmp_path / "runs" / "a", "fedavg", [10.0, 20.0], rounds=2, finished=True)
    cut = fake_run(tmp_path / "runs" / "b", "fedhpro", [11.0, 12.0, 13.0, 14.0], rounds=10, finished=False)
    out = report([done, cut], echo=False)
    assert out == tmp_path / "runs" / "report"
    table = (out / "table.md").read_text()
    assert "| FedAvg | 20.00 |" in table
    assert "| FedHPro (4/10 rounds, unfinished) | 14.00 |" in table
    assert "FedHPro (4/10 rounds, unfinished): no summary.json" in table and "(round 4)" in table
    assert "unfinished" not in (table.split("FedHPro")[0])  # the finished run is not marked
    assert json.loads((out / "report.json").read_text())["runs"] == sorted([str(done.resolve()),
                                                                           str(cut.resolve())])


def test_report_refuses_to_overwrite_a_report_of_other_runs(tmp_path, capsys):
    from fedhpro.cli import main
    from fedhpro.reports.runs import report

    a = fake_run(tmp_path / "runs" / "a", "fedavg", [10.0, 20.0], rounds=2, finished=True)
    b = fake_run(tmp_path / "runs" / "b", "fedhpro", [30.0, 40.0], rounds=2, finished=True)
    out = report([a], echo=False)
    first = (out / "table.md").read_text()
    with pytest.raises(ConfigError) as error:
        report([b], echo=False)
    message = str(error.value)
    assert "\n" not in message and "already holds the report of a" in message
    assert "give another out=DIR, or force=true" in message
    assert (out / "table.md").read_text() == first  # untouched
    assert report([a], echo=False) == out  # the same runs: refreshed
    assert main(["report", str(b)]) == 2 and "force=true" in capsys.readouterr().err
    assert main(["report", str(b), "force=true"]) == 0
    assert "| FedHPro | 40.00 |" in (out / "table.md").read_text()
    assert report([a, b], out=tmp_path / "both", echo=False) == tmp_path / "both"  # a new out=
    assert main(["report", str(a), "force=maybe"]) == 2


def test_report_refuses_a_folder_of_another_kind_of_report_or_a_run_folder(tmp_path):
    from fedhpro.reports.runs import report

    a = fake_run(tmp_path / "runs" / "a", "fedavg", [10.0, 20.0], rounds=2, finished=True)
    other = tmp_path / "reproduced"
    other.mkdir()
    (other / "table.md").write_text("a table fedhpro reproduce wrote\n")
    with pytest.raises(ConfigError, match="already holds another report \\(table.md\\); give another out=DIR"):
        report([a], out=other, echo=False)
    assert (other / "table.md").read_text() == "a table fedhpro reproduce wrote\n"
    with pytest.raises(ConfigError, match="is a run folder"):
        report([a], out=a, echo=False, force=True)
