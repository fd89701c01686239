"""Parallel sweeps (``jobs=N``, ``executor=ray``) against the sequential sweep, and the ``threads`` key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from fedhpro.compare import compare
from fedhpro.config import PRESENTATION_KEYS, load_config
from fedhpro.errors import ConfigError
from fedhpro.sweeps import SweepFailed, auto_threads, make_sweep

pytestmark = [pytest.mark.ray, pytest.mark.slow]

METHODS = ["fedavg", "fedhpro"]
SEEDS = [0, 1]
RUNS = [f"{method}-seed{seed}" for method in METHODS for seed in SEEDS]


def settings(data_dir: Path, **extra) -> dict:
    return {"rounds": 2, "clients": 4, "data.fraction": 0.02, "data.syn_size": DIGITS_SYN_SIZE,
            "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 16, "local_epochs": 1,
            "progress": False, "device": "cpu", "threads": 1, "data_dir": str(data_dir), **extra}


def outputs(out: Path) -> dict[str, bytes]:
    """The bytes that must not depend on how the sweep ran: the table and every run's metrics."""
    files = {name: (out / name).read_bytes() for name in ("table.md", "table.csv")}
    files.update({run: (out / run / "metrics.jsonl").read_bytes() for run in RUNS})
    return files


@pytest.fixture(scope="module")
def sequential(digits_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sequential")
    compare(METHODS, SEEDS, settings(digits_data_dir), out, echo=False)
    return out


@pytest.fixture(scope="module")
def parallel(digits_data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel")
    compare(METHODS, SEEDS, settings(digits_data_dir), out, echo=False, jobs=2)
    return out


def test_two_worker_processes_give_the_sequential_sweeps_bytes(sequential, parallel):
    expected, got = outputs(sequential), outputs(parallel)
    assert got.keys() == expected.keys()
    for name in expected:
        assert got[name] == expected[name], name


def test_finished_runs_are_reused_with_jobs_2_no_worker_starts(parallel, digits_data_dir, monkeypatch):
    import fedhpro.sweeps

    def no_workers(*args, **kwargs):
        raise AssertionError("a finished run was sent to a worker")

    monkeypatch.setattr(fedhpro.sweeps, "_run_processes", no_workers)
    before = {run: (parallel / run / "metrics.jsonl").stat().st_mtime_ns for run in RUNS}
    table = (parallel / "table.csv").read_bytes()
    compare(METHODS, SEEDS, settings(digits_data_dir), parallel, echo=False, jobs=2)
    assert {run: (parallel / run / "metrics.jsonl").stat().st_mtime_ns for run in RUNS} == before
    assert (parallel / "table.csv").read_bytes() == table


def test_ray_tasks_give_the_sequential_sweeps_bytes(sequential, digits_data_dir, tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        compare(METHODS, SEEDS, settings(digits_data_dir), tmp_path, echo=False, executor="ray")
    finally:
        ray.shutdown()
    expected, got = outputs(sequential), outputs(tmp_path)
    for name in expected:
        assert got[name] == expected[name], name


def test_a_failed_run_is_reported_and_the_others_finish(sequential, digits_data_dir, tmp_path, capsys):
    (tmp_path / "fedavg-seed1").write_text("a file where the run's folder should be")
    with pytest.raises(SweepFailed) as failed:
        compare(["fedavg"], SEEDS, settings(digits_data_dir), tmp_path, echo=True, jobs=2)
    message = str(failed.value)
    assert message.startswith("1 of 2 runs failed") and "fedavg seed 1" in message and "seed 0" not in message
    assert "failed: fedavg seed 1" in capsys.readouterr().err  # reported when it happened
    assert (tmp_path / "fedavg-seed0" / "metrics.jsonl").read_bytes() == \
        (sequential / "fedavg-seed0" / "metrics.jsonl").read_bytes()
    assert "| FedAvg |" in (tmp_path / "table.md").read_text()  # the table of what finished


def test_threads_key_auto_or_a_whole_number_and_presentational():
    assert load_config(None).run.threads == "auto"
    assert load_config(None, {"threads": 3}).run.threads == "3"
    for bad in (0, -1, "many", 1.5):
        with pytest.raises(ConfigError, match="threads="):
            load_config(None, {"threads": bad})
    assert "threads" in PRESENTATION_KEYS  # a resumed or reused run may change it


def test_auto_threads_are_the_affinity_cores_divided_among_jobs(monkeypatch):
    import os

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 5, 6}, raising=False)
    assert [auto_threads(jobs) for jobs in (1, 2, 5, 8)] == [5, 2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # as torch's own default: the variable wins
    assert auto_threads(1) == 4


@pytest.mark.parametrize(("threads", "expected"), [(1, 1), ("auto", 3)])
def test_a_run_sets_its_thread_count_and_puts_the_callers_back(threads, expected, monkeypatch, tmp_path):
    import os

    import fedhpro.api

    class Built(Exception):
        """the run stopped where its engine is built, inside the run's thread count"""

    seen = []

    def built(*args):
        seen.append(torch.get_num_threads())
        raise Built

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    monkeypatch.setattr(fedhpro.api.InProcessRun, "_built", built)
    before = torch.get_num_threads()
    with pytest.raises(Built):
        fedhpro.api.run(None, {"threads": threads, "device": "cpu", "out": str(tmp_path / "run")})
    assert seen == [expected] and torch.get_num_threads() == before


def test_sweep_settings_are_checked():
    assert make_sweep().sequential and not make_sweep(2).sequential and not make_sweep(1, "ray").sequential
    for jobs, executor, address in ((0, "local", None), ("two", "local", None), (2, "dask", None),
                                    (1, "local", "auto")):
        with pytest.raises(ConfigError):
            make_sweep(jobs, executor, address)


def test_executor_ray_without_ray_is_one_line_naming_the_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ConfigError, match=r'executor=ray needs Ray.*pip install "fedhpro\[flower\]"'):
        make_sweep(2, "ray")
