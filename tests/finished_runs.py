"""Tiny finished runs built once per test run and shared by the test files that only read run folders (export,
predict, ONNX metadata): the ``finished_runs`` fixture of tests/conftest.py.

Under pytest-xdist the workers of one test run share them: the first worker to ask builds them under a file
lock in the folder the workers' temporary folders share, the others wait and read. Each user gets its own copy
(:meth:`FinishedRuns.copy`), since some write into the folder (``model.onnx``, predictions).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock  # a dependency of torch

import fedhpro
from fedhpro.config import Config, load_config

#: the digits-offline cache the runs read: tests/conftest.py's digits_data_dir
DIGITS = {"syn_size": 200, "test_fraction": 0.05}
#: the runs by name: keyword arguments of fedhpro.run (data_dir and out are set here)
RUNS: Mapping[str, Mapping[str, Any]] = {
    # fedavg on 2% of digits-offline, 4 clients, 1 round: a trained image model (model.pt, model.json)
    "image": {"method": "fedavg", "rounds": 1, "clients": 4, "local_epochs": 1, "feature_dim": 16,
              "progress": False, "threads": 1, "data.fraction": 0.02, "data.syn_size": DIGITS["syn_size"],
              "data.test_fraction": DIGITS["test_fraction"]},
}


@dataclass(frozen=True)
class FinishedRun:
    """A finished run's folder, as the tests read it: ``out`` (as fedhpro.run's result names it), its
    summary.json and its config.yaml."""

    out: Path

    @property
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    @property
    def config(self) -> Config:
        return load_config(self.out / "config.yaml")


class FinishedRuns:
    """The runs of :data:`RUNS` on the digits-offline cache in ``data_dir``, each built at its first use under
    ``root``."""

    def __init__(self, root: Path, data_dir: Path):
        self.root, self.data_dir = root, data_dir
        root.mkdir(parents=True, exist_ok=True)

    def built(self, name: str) -> Path:
        """The folder of run ``name``, built now unless a test (of any worker) built it already."""
        folder = self.root / name
        with FileLock(str(self.root / "build.lock")):
            if not (folder / "summary.json").is_file():
                shutil.rmtree(folder, ignore_errors=True)  # a build killed half-way
                fedhpro.run(**RUNS[name], data_dir=str(self.data_dir), out=str(folder))
        return folder

    def copy(self, name: str, where: Path) -> FinishedRun:
        """A copy of run ``name`` at ``where/name``, the caller's to read and write."""
        return FinishedRun(Path(shutil.copytree(self.built(name), where / name)))
