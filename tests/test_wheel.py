"""``python -m build`` makes a wheel that installs and runs without the clone: built from a copy of the project
(no network: ``--no-isolation``), installed with ``--no-deps --no-index`` into a fresh virtualenv whose
dependencies are the test environment's (a ``.pth`` line, so nothing is downloaded), then run from a folder
with no source tree: ``fedhpro --help``, ``--version``, ``reproduce list`` (the paper's configs travel in the
wheel) and a one-round ``fedhpro run``. One test of ~15-40 s: the build, the venv and two torch start-ups."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE")


def _project_copy(where: Path) -> Path:
    """The files the build reads, copied (the build writes build/ and *.egg-info beside them, not in the clone)."""
    copy = where / "project"
    copy.mkdir()
    for name in PROJECT_FILES:
        shutil.copy2(ROOT / name, copy / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    shutil.copytree(ROOT / "src", copy / "src", ignore=ignore)
    shutil.copytree(ROOT / "configs", copy / "configs", ignore=ignore)
    return copy


def _run(command: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}: {done.stdout[-2000:]} {done.stderr[-3000:]}"
    return done


def test_the_wheel_installs_and_runs_without_the_clone(digits_data_dir, tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"
    project = _project_copy(tmp_path)
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check",
          "--outdir", str(tmp_path / "dist"), str(project)], tmp_path, env)
    [wheel] = (tmp_path / "dist").glob("fedhpro-*.whl")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert wheel.name == f"fedhpro-{version}-py3-none-any.whl"
    # every module of the source tree and every paper config is in it
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {path.relative_to(ROOT / "src").as_posix() for path in (ROOT / "src" / "fedhpro").rglob("*.py")}
    assert modules <= names, sorted(modules - names)[:5]
    configs = sorted(path.name for path in (ROOT / "configs" / "paper").glob("*.yaml"))
    assert configs and all(f"fedhpro-{version}.data/data/share/fedhpro/configs/paper/{name}" in names
                           for name in configs)

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
          "--no-cache-dir", "--quiet", str(wheel)], tmp_path, env)
    # the dependencies (torch and the rest) from this environment: a path line, whose own .pth files
    # (an editable fedhpro's among them) are not read, so the wheel's fedhpro is the one imported
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path,
                     env).stdout.strip())
    (site / "shared-dependencies.pth").write_text(f"{Path(torch.__file__).parents[1]}\n")
    elsewhere = tmp_path / "elsewhere"  # no src/, no configs/ here
    elsewhere.mkdir()
    where = _run([str(python), "-c", "import fedhpro; print(fedhpro.__file__)"], elsewhere, env).stdout.strip()
    assert Path(where).is_relative_to(venv), where
    fedhpro = str(venv / "bin" / "fedhpro")
    assert _run([fedhpro, "--help"], elsewhere, env).stdout.startswith("usage: fedhpro")
    assert _run([fedhpro, "--version"], elsewhere, env).stdout.strip() == f"fedhpro {version}"
    listed = _run([fedhpro, "reproduce", "list"], elsewhere, env).stdout
    assert all(f"  {Path(name).stem} " in listed for name in configs), listed
    out = tmp_path / "run"
    _run([fedhpro, "run", "method=fedavg", "rounds=1", "clients=3", "model=mlp", "data.fraction=0.02",
          f"data.syn_size={DIGITS_SYN_SIZE}", f"data.test_fraction={DIGITS_TEST_FRACTION}", "feature_dim=16",
          "progress=false", "threads=1", f"data_dir={digits_data_dir}", f"out={out}"], elsewhere, env)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "fedavg" and (out / "model.pt").is_file()
