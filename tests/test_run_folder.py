"""A run's folder: claimed by one run at a time, and every way its files can fail is one line.

* ``claim_run_folder``: an ``fcntl.flock`` on ``<out>/.fedhpro.lock`` held for the run's life; a second run on
  the same ``out=`` (or ``resume=``) is refused naming the holder's pid and host; a dead holder frees it.
* A checkpoint that cannot be written (disk full, past the file size limit) stops the run in one line naming
  the newest good checkpoint, which is kept whole; ``resume=`` then finishes the run to the same numbers.
* A checkpoint that is truncated, lacks keys or holds objects other than tensors is refused in one line at
  ``resume=`` (``torch.load(weights_only=True)``: nothing in it is ever run).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

from fedhpro.cli import main as cli_main
from fedhpro.engines import checkpoint
from fedhpro.errors import ConfigError
from fedhpro.files import LOCK_NAME, RunFolderClaim, RunFolderInUse, claim_run_folder

ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def tiny_settings(data_dir: Path, out: Path, **extra) -> list[str]:
    settings = {"rounds": 3, "clients": 4, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
                "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 32, "local_epochs": 1,
                "progress": "false", "device": "cpu", "data_dir": str(data_dir), "out": str(out), "seed": 4,
                "checkpoint_every": 1, **extra}
    return [f"{key}={value}" for key, value in settings.items()]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedhpro: error: "), err
    assert "Traceback" not in err
    return lines[0]


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert path.exists(), f"{path} never appeared (exit {process.poll()})"


# ---------------------------------------------------------------------------- the claim itself


@pytest.mark.slow
def test_a_claim_is_exclusive_hidden_released_and_freed_by_a_dead_holder(tmp_path):
    folder = tmp_path / "run"
    claim = claim_run_folder(folder)
    assert isinstance(claim, RunFolderClaim) and claim.held
    assert [path.name for path in folder.iterdir()] == [LOCK_NAME] and LOCK_NAME.startswith(".")
    record = json.loads((folder / LOCK_NAME).read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    # a second claim, here or in another process, is refused in one line naming the holder
    with pytest.raises(RunFolderInUse) as refused:
        claim_run_folder(folder)
    message = str(refused.value)
    assert message.startswith(f"out={folder} is in use by run pid {os.getpid()} on host {socket.gethostname()} "
                              "since ") and message.endswith("; wait for it or choose another out=")
    assert "\n" not in message and isinstance(refused.value, ConfigError)
    other = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                            "from fedhpro.files import claim_run_folder; claim_run_folder(Path(sys.argv[1]))",
                            str(folder)], capture_output=True, text=True, env=ENV)
    assert other.returncode != 0 and f"is in use by run pid {os.getpid()}" in other.stderr
    claim.release()
    claim.release()  # twice is fine
    assert not claim.held and not folder.exists()  # it made the folder and nothing else filled it

    # a context manager; a folder it did not make (or that holds files) stays
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with claim_run_folder(folder, setting="resume") as held:
        with pytest.raises(RunFolderInUse, match=r"^resume=.* wait for it or choose another resume=$"):
            claim_run_folder(folder, setting="resume")
        assert held.held
    assert sorted(path.name for path in folder.iterdir()) == ["notes.txt"]

    # a holder killed with SIGKILL leaves its lock file behind but not its lock: the folder is free
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from fedhpro.files import claim_run_folder; claim_run_folder(Path(sys.argv[1])); "
                               "print('held', flush=True); time.sleep(600)", str(folder)],
                              stdout=subprocess.PIPE, text=True, env=ENV)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunFolderInUse, match=f"pid {holder.pid} "):
        claim_run_folder(folder)
    holder.kill()
    holder.wait()
    assert (folder / LOCK_NAME).exists()
    with claim_run_folder(folder):
        assert json.loads((folder / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_a_file_or_an_unusable_path_is_refused_in_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^out=.*afile is a file, not a folder"):
        claim_run_folder(afile)
    with pytest.raises(ConfigError, match=r"^out=.*afile/below: part of that path is a file"):
        claim_run_folder(afile / "below")
    assert afile.read_text() == "not a folder"
    # the folders a claim made go with it when nothing else filled them
    with claim_run_folder(tmp_path / "a" / "b" / "c"):
        (tmp_path / "a" / "keep.txt").write_text("x")
    assert sorted(path.name for path in (tmp_path / "a").iterdir()) == ["keep.txt"]
    with claim_run_folder(tmp_path / "d" / "e"):
        pass
    assert not (tmp_path / "d").exists()


# ---------------------------------------------------------------------------- two runs, one out=


@pytest.mark.slow
def test_two_runs_started_together_on_one_out_folder_one_is_refused_and_nothing_mixes(digits_data_dir, tmp_path):
    """Before the claim both runs passed the 'no run files here' check (neither had written yet) and both
    finished, leaving one run's config.yaml beside the other's metrics."""
    out = tmp_path / "shared"
    processes = {seed: subprocess.Popen([sys.executable, "-m", "fedhpro", "run",
                                         *tiny_settings(digits_data_dir, out, rounds=2, seed=seed)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
                 for seed in (1, 2)}
    results = {seed: (process.wait(timeout=600), process.stderr.read()) for seed, process in processes.items()}
    winners = [seed for seed, (code, _) in results.items() if code == 0]
    assert len(winners) == 1, results
    (winner,) = winners
    (loser,) = set(results) - {winner}
    code, err = results[loser]
    line = one_error_line(err)
    assert code == 2 and (f"is in use by run pid {processes[winner].pid} on host" in line
                          or "already holds a finished run" in line), line
    # the folder is the winner's alone
    import yaml
    assert yaml.safe_load((out / "config.yaml").read_text())["seed"] == winner
    assert json.loads((out / "summary.json").read_text())["seed"] == winner
    assert [row["round"] for row in rows(out / "metrics.jsonl")] == [0, 1]
    assert not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_run_started_while_another_builds_its_data_is_refused_and_nothing_mixes(digits_data_dir, tmp_path,
                                                                                    capsys, monkeypatch):
    """The race made certain: the second run starts while the first builds its data (before it wrote any file).
    Without the claim both passed the 'no run files here' check and both finished: the second run's
    config, metrics and round-3 checkpoint were left beside the first run's."""
    import fedhpro.api

    out = tmp_path / "shared"
    real_build = fedhpro.api.build_experiment
    started, second = [], []

    def build_while_another_run_starts(*args, **kwargs):
        if not started:  # the first run's build: the second run starts here, once
            started.append(True)
            second.append(cli_main(["run", *tiny_settings(digits_data_dir, out, rounds=3, seed=5)]))
            second.append(capsys.readouterr().err)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(fedhpro.api, "build_experiment", build_while_another_run_starts)
    assert cli_main(["run", *tiny_settings(digits_data_dir, out, rounds=2)]) == 0
    code, err = second
    assert code == 2, "both runs finished in one folder"
    line = one_error_line(err)
    assert code == 2 and f"out={out} is in use by run pid {os.getpid()} on host {socket.gethostname()}" in line
    import yaml
    assert yaml.safe_load((out / "config.yaml").read_text())["seed"] == 4
    assert [row["round"] for row in rows(out / "metrics.jsonl")] == [0, 1]
    assert sorted(path.name for path in (out / "checkpoints").iterdir()) == ["round-000001.pt", "round-000002.pt"]


@pytest.mark.slow
def test_a_live_run_holds_its_folder_and_a_resume_works_after_it_ends(digits_data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "fedhpro", "run", *tiny_settings(digits_data_dir, out, rounds=6)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        wait_for(out / "checkpoints" / "round-000001.pt", first)
        first.send_signal(signal.SIGSTOP)  # alive and holding its claim, for as long as the test needs
        assert first.poll() is None, "the first run ended before it could be stopped"
        before = (out / "config.yaml").read_bytes()
        host = socket.gethostname()
        assert cli_main(["run", *tiny_settings(digits_data_dir, out, seed=9)]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"out={out} is in use by run pid {first.pid} on host {host} since " in line
        assert line.endswith("wait for it or choose another out=")
        assert cli_main(["run", f"resume={out}", "progress=false"]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert f"resume={out} is in use by run pid {first.pid} on host {host}" in line
        assert (out / "config.yaml").read_bytes() == before
    finally:
        first.kill()  # ends it, stopped or not: the operating system drops its lock
        first.wait()
    assert not (out / "summary.json").exists()
    assert cli_main(["run", f"resume={out}", "progress=false"]) == 0
    assert [row["round"] for row in rows(out / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]
    assert json.loads((out / "summary.json").read_text())["seed"] == 4
    assert not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_out_naming_an_existing_file_is_one_line(digits_data_dir, tmp_path, capsys):
    afile = tmp_path / "results.txt"
    afile.write_text("keep me")
    assert cli_main(["run", *tiny_settings(digits_data_dir, afile)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"out={afile} is a file, not a folder" in line
    assert afile.read_text() == "keep me"


# ---------------------------------------------------------------------------- checkpoints that cannot be written


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_keeps_the_previous_one_stops_in_one_line_and_resumes(
        digits_data_dir, tmp_path, capsys, monkeypatch):
    reference = tmp_path / "reference"
    assert cli_main(["run", *tiny_settings(digits_data_dir, reference)]) == 0
    capsys.readouterr()

    out = tmp_path / "run"
    real_write = checkpoint.write_atomic_with

    def disk_full_at_round_2(path, write):
        if Path(path).name != "round-000002.pt":
            return real_write(path, write)

        def half_then_full(handle):
            handle.write(b"x" * 4096)  # part of it reaches the temporary file, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(path, half_then_full)

    monkeypatch.setattr(checkpoint, "write_atomic_with", disk_full_at_round_2)
    assert cli_main(["run", *tiny_settings(digits_data_dir, out)]) == 2
    line = one_error_line(capsys.readouterr().err)
    folder = out / "checkpoints"
    assert f"could not write checkpoint {folder / 'round-000002.pt'} (No space left on device)" in line
    assert f"the newest good checkpoint, {folder / 'round-000001.pt'} (round 1), is kept" in line
    assert f"free space, then continue with resume={out}" in line
    assert sorted(path.name for path in folder.iterdir()) == ["round-000001.pt"]  # no temporary file left
    assert checkpoint.load(folder / "round-000001.pt")["completed_rounds"] == 1
    assert not (out / "summary.json").exists() and not (out / LOCK_NAME).exists()
    # the rows written are the uninterrupted run's (round 1's too, past the kept checkpoint: resume redoes
    # it to the same bytes)
    assert rows(out / "metrics.jsonl") == rows(reference / "metrics.jsonl")[:2]

    monkeypatch.undo()
    assert cli_main(["run", f"resume={out}", "progress=false"]) == 0
    assert (out / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()


@pytest.mark.slow
def test_a_checkpoint_past_the_file_size_limit_is_one_line_not_torchs_zip_error(digits_data_dir, tmp_path):
    """A real failing write (RLIMIT_FSIZE; Python ignores SIGXFSZ, so write() fails with EFBIG): torch.save
    alone reports it as 'unexpected pos ...'; the run names the disk's own error."""
    out = tmp_path / "run"
    limit = 100_000  # above metrics.jsonl, config.yaml and partition.json; below one checkpoint

    def limited() -> None:
        import resource
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    process = subprocess.run([sys.executable, "-m", "fedhpro", "run", *tiny_settings(digits_data_dir, out)],
                             capture_output=True, text=True, env=ENV, preexec_fn=limited, timeout=600)
    line = one_error_line(process.stderr)
    assert process.returncode == 2
    assert f"could not write checkpoint {out / 'checkpoints' / 'round-000001.pt'} (File too large)" in line
    assert "no earlier checkpoint exists" in line
    assert list((out / "checkpoints").iterdir()) == []  # the temporary file went with the failed write
    assert [row["round"] for row in rows(out / "metrics.jsonl")] == [0]


# ---------------------------------------------------------------------------- checkpoints that cannot be read


@pytest.fixture
def interrupted(digits_data_dir, tmp_path, capsys):
    """A run with checkpoints after rounds 1 and 2 and no summary: as if killed after round 2."""
    out = tmp_path / "run"
    assert cli_main(["run", *tiny_settings(digits_data_dir, out, rounds=3, keep_checkpoints=3)]) == 0
    (out / "summary.json").unlink()
    (out / "checkpoints" / "round-000003.pt").unlink()
    capsys.readouterr()
    return out


class RunsCode:
    """Unpickling this creates a file: a checkpoint holding it must never be unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def damage_missing_rng(path: Path, _tmp: Path) -> str:
    blob = torch.load(path, weights_only=True)
    del blob["rng"]
    torch.save(blob, path)
    return f"{path} is not a fedhpro checkpoint (no 'rng'); it may be from another version or damaged"


def damage_truncated(path: Path, _tmp: Path) -> str:
    path.write_bytes(path.read_bytes()[:1000])
    return f"checkpoint {path} cannot be loaded (it is truncated or not a torch file"


def damage_garbage(path: Path, _tmp: Path) -> str:
    path.write_bytes(b"\x00garbage" * 100)
    return f"checkpoint {path} cannot be loaded (it is truncated or not a torch file"


def damage_foreign_objects(path: Path, tmp: Path) -> str:
    blob = torch.load(path, weights_only=True)
    blob["state"] = RunsCode(tmp / "pwned")
    torch.save(blob, path)
    return f"checkpoint {path} cannot be loaded (it holds objects other than tensors, which are never unpickled)"


@pytest.mark.slow
@pytest.mark.parametrize("damage", [damage_missing_rng, damage_truncated, damage_garbage, damage_foreign_objects])
def test_a_damaged_checkpoint_at_resume_is_one_line_naming_the_earlier_one(damage, interrupted, tmp_path, capsys):
    newest = interrupted / "checkpoints" / "round-000002.pt"
    expected = damage(newest, tmp_path)
    assert cli_main(["run", f"resume={interrupted}", "progress=false"]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert expected in line
    assert (f"resume from an earlier one: move round-000002.pt out of {interrupted / 'checkpoints'} and resume "
            "again (the one before is round-000001.pt)") in line
    assert not (tmp_path / "pwned").exists()  # nothing in the file ran
    # doing what the line says finishes the run
    newest.rename(tmp_path / "set-aside.pt")
    assert cli_main(["run", f"resume={interrupted}", "progress=false"]) == 0
    assert [row["round"] for row in rows(interrupted / "metrics.jsonl")] == [0, 1, 2]


def test_checkpoints_are_loaded_weights_only(tmp_path, monkeypatch):
    seen = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.append(k.get("weights_only")) or real_load(*a, **k))
    path = checkpoint.save(tmp_path, 1, {"w": torch.ones(2)}, [])
    checkpoint.load(path)
    assert seen == [True]


@pytest.mark.slow
def test_report_and_resume_pass_a_stale_lock_file_by(digits_data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_NAME).write_text('{"pid": 1, "host": "gone", "started": 0}\n')  # a crashed run's, unlocked
    assert cli_main(["run", *tiny_settings(digits_data_dir, out, rounds=1)]) == 0
    assert cli_main(["report", str(out), f"out={tmp_path / 'report'}"]) == 0
    assert (tmp_path / "report" / "table.md").is_file()
    assert not (out / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_resume_removes_what_a_killed_write_left_half_written(interrupted, capsys):
    partial = interrupted / "checkpoints" / ".round-000003.pt.4242.0badf00d.tmp"
    partial.write_bytes(b"half a checkpoint")
    (interrupted / ".metrics.jsonl.4242.0badf00d.tmp").write_text('{"round": 0')
    assert cli_main(["run", f"resume={interrupted}", "progress=false", "keep_checkpoints=2"]) == 0
    assert not partial.exists() and not (interrupted / ".metrics.jsonl.4242.0badf00d.tmp").exists()
    assert sorted(path.name for path in (interrupted / "checkpoints").iterdir()) == [
        "round-000002.pt", "round-000003.pt"]  # keep_checkpoints=2: set again on the resume line, it wins


def test_the_flower_serverapp_claims_its_out_folder_before_asking_any_node(tmp_path):
    """A second Flower run on a live run's out= is refused in one line before a node is asked; once that
    run's claim ends the folder is free again (checked by a grid that fails the test if it is used)."""
    pytest.importorskip("flwr")
    from fedhpro.flower.server import run_server

    class UntouchableGrid:
        def __getattr__(self, name):
            raise AssertionError(f"the grid was used ({name}) although out= is in use")

    out = tmp_path / "flower-out"
    with claim_run_folder(out):
        with pytest.raises(RunFolderInUse, match=f"^out={out} is in use by run pid {os.getpid()} "):
            run_server(UntouchableGrid(), {"out": str(out), "rounds": 1})
        with pytest.raises(RunFolderInUse, match=f"^resume={out} is in use by run pid {os.getpid()} "):
            run_server(UntouchableGrid(), {"resume": str(out)})
    with pytest.raises(ConfigError, match="resume=") as free:  # claimed now, and refused for having no checkpoint
        run_server(UntouchableGrid(), {"resume": str(out)})
    assert not isinstance(free.value, RunFolderInUse)
    assert not (out / LOCK_NAME).exists()
