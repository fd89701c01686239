"""A resumed run keeps how the interrupted run ran: the resumable keys it had (``tensorboard``, ``progress``,
``parallel_clients``, ...) unless the resume line sets them again, each round once in TensorBoard, and the
whole run's seconds.

The interruption is made in-process and deterministic: the run stops with KeyboardInterrupt right after
round 2 (0-based) ended, whose checkpoint is not due (``checkpoint_every=2``: the newest is round 2's, so
the resume redoes round 2). TensorBoard is a recording stand-in for ``torch.utils.tensorboard`` (the
package is optional); the rule it is checked against is TensorBoard's documented ``purge_step``: a writer
opened with ``purge_step=T`` hides every earlier event of step ``>= T``.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

from fedhpro.api import run
from fedhpro.config import load_config
from fedhpro.engines import lifecycle

pytestmark = pytest.mark.slow


class Writer:
    """``SummaryWriter`` as the run calls it, keeping every event in :data:`EVENTS`."""

    opened: list[Writer] = []

    def __init__(self, log_dir, purge_step=None):
        self.log_dir, self.purge_step, self.events = log_dir, purge_step, []
        Writer.opened.append(self)

    def add_scalar(self, tag, value, step):
        self.events.append((tag, step))

    def flush(self):
        pass

    def close(self):
        pass


def shown_steps(writers: list[Writer], tag: str) -> list[int]:
    """The steps of ``tag`` TensorBoard shows after these writers, in order: each writer's ``purge_step``
    hides the earlier writers' events at or after it."""
    shown: list[int] = []
    for writer in writers:
        if writer.purge_step is not None:
            shown = [step for step in shown if step < writer.purge_step]
        shown += [step for name, step in writer.events if name == tag]
    return shown


def settings(data_dir: Path, out: Path) -> list[str]:
    return ["method=fedavg", "rounds=4", "clients=3", "data.fraction=0.02", f"data.syn_size={DIGITS_SYN_SIZE}",
            f"data.test_fraction={DIGITS_TEST_FRACTION}", "feature_dim=16", "local_epochs=1", "seed=2",
            f"data_dir={data_dir}", "threads=1", "checkpoint_every=2", "tensorboard=true", "progress=false",
            f"out={out}"]


def test_a_resumed_run_keeps_tensorboard_and_progress_writes_each_round_once_and_counts_all_seconds(
        digits_data_dir, tmp_path, monkeypatch):
    board = types.ModuleType("torch.utils.tensorboard")
    board.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", board)
    Writer.opened = []
    out = tmp_path / "run"
    round_done = lifecycle.Run.round_done

    def interrupted(self, record, state):
        written = round_done(self, record, state)
        if record.round == 2:
            time.sleep(0.3)  # the first part's time, which the whole run's seconds must count
            raise KeyboardInterrupt
        return written

    monkeypatch.setattr(lifecycle.Run, "round_done", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(overrides=settings(digits_data_dir, out), echo=False)
    monkeypatch.setattr(lifecycle.Run, "round_done", round_done)
    first_part = [json.loads(line) for line in (out / "timing.jsonl").read_text().splitlines()]
    assert [row["round"] for row in first_part] == [0, 1, 2] and not (out / "summary.json").exists()

    result = run(overrides=[f"resume={out}"], echo=False)  # nothing else on the resume line
    assert result.config.run.tensorboard is True and result.config.run.progress is False  # kept, not the defaults
    assert load_config(out / "config.yaml").run.tensorboard is True
    first, second = Writer.opened
    assert second.purge_step == 3  # the newest checkpoint is after round 1 (0-based): round 2 (step 3) is redone
    assert shown_steps(Writer.opened, "accuracy/AVG") == [1, 2, 3, 4]  # each round once
    assert [step for name, step in first.events if name == "accuracy/AVG"] == [1, 2, 3]  # written before
    timings = [json.loads(line) for line in (out / "timing.jsonl").read_text().splitlines()]
    assert [row["round"] for row in timings] == [0, 1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["seconds"] >= first_part[1]["elapsed"] + 0.0
    assert timings[-1]["elapsed"] > first_part[1]["elapsed"]  # the clock goes on from the first part's
    # a key set again on the resume line wins
    again = tmp_path / "again"
    with pytest.raises(KeyboardInterrupt):
        monkeypatch.setattr(lifecycle.Run, "round_done", interrupted)
        run(overrides=settings(digits_data_dir, again), echo=False)
    monkeypatch.setattr(lifecycle.Run, "round_done", round_done)
    assert run(overrides=[f"resume={again}", "tensorboard=false"], echo=False).config.run.tensorboard is False
