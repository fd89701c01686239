"""Ctrl-C on ``fedhpro run`` says how to go on: with a checkpoint written, the exact command that continues the
run (``fedhpro run resume=<out>``); before the first one, that there is nothing to resume. The resumed run says
where it restarts. Real processes sent a real SIGINT, as a terminal's Ctrl-C does; the run is a tiny one (an MLP
on ~40 digits per client) and the signal goes once the checkpoint file (or the run's config.yaml) is on disk."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

from fedhpro.engines import checkpoint

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[1] / "src"
ROUNDS = 20


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


def _run_args(data_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["run", "method=fedavg", f"rounds={ROUNDS}", "clients=3", "model=mlp", "data.fraction=0.02",
            f"data.syn_size={DIGITS_SYN_SIZE}", f"data.test_fraction={DIGITS_TEST_FRACTION}", "feature_dim=16",
            "local_epochs=1", "progress=false", "threads=1", "device=cpu", f"data_dir={data_dir}", f"out={out}",
            *extra]


def _interrupted(args: list[str], ready) -> tuple[int, str]:
    """Start ``fedhpro ARGS``, send SIGINT once ``ready()`` holds; its exit status and stderr."""
    # Ctrl-C's default disposition in the child, as a terminal gives it: a test run started in the background by a
    # non-interactive shell ignores SIGINT, and an ignored signal is inherited across exec (Python then installs
    # no KeyboardInterrupt handler)
    process = subprocess.Popen([sys.executable, "-m", "fedhpro", *args], env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not ready() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, f"the run ended before it was interrupted: {process.communicate()}"
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr


def test_an_interrupted_run_names_the_command_that_continues_it(digits_data_dir, tmp_path):
    out = tmp_path / "a run"  # a space: the command must come quoted, ready to paste
    code, stderr = _interrupted(_run_args(digits_data_dir, out, "checkpoint_every=1"),
                                lambda: checkpoint.latest(out) is not None)
    assert code == 130
    saved = checkpoint.saved_rounds(out)[-1]
    command = f"fedhpro run resume={shlex.quote(str(out))}"
    assert stderr.strip().splitlines()[-1] == (
        f"fedhpro: interrupted; its checkpoint after round {saved} is kept, continue with: {command}")
    # the line's command, as a shell would split it, continues the run and says from where
    words = shlex.split(command)
    resumed = subprocess.run([sys.executable, "-m", "fedhpro", *words[1:]], env=_env(), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"note: resuming {out} from round {saved + 1} of {ROUNDS}" in resumed.stdout.splitlines()
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == ROUNDS and (out / "summary.json").is_file()


def test_an_interrupt_before_the_first_checkpoint_says_there_is_nothing_to_resume(digits_data_dir, tmp_path):
    out = tmp_path / "run"
    # once its first round is written: inside the rounds (a signal during interpreter start-up or imports is not
    # this test's subject; one such early signal once ended the process before fedhpro could answer it)
    code, stderr = _interrupted(_run_args(digits_data_dir, out, "checkpoint_every=0"),
                                lambda: (out / "metrics.jsonl").is_file())
    assert code == 130
    assert checkpoint.latest(out) is None
    assert stderr.strip().splitlines()[-1] == f"fedhpro: interrupted; no checkpoint in {out} yet, nothing to resume: " \
                                              "run it again"
