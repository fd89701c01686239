"""Start-up: a command loads what it runs and no more. ``fedhpro --help``, ``--version``, a command's ``--help``
and usage errors answer without torch (~2-4 s of a start-up on a loaded machine); ``fedhpro config --keys``
leaves the engines, the run API, the trained model, the sweeps, the tuning and the reports unloaded (it used to
import every command's modules). Held without timing: the modules a fresh process has loaded after the command,
read in that process (``sys.modules``). That ``config``, ``config --keys`` and a refused run key or value load no
torch at all: tests/test_torch_free_declarations.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedhpro.config import RunOptions

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[1] / "src"

#: runs ``fedhpro.cli.main(argv)`` with stdout kept, then prints the exit code, the output and the modules loaded
PROBE = """
import contextlib, io, json, sys
from fedhpro import cli
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = cli.main(sys.argv[1:])
    except SystemExit as stop:  # argparse's --help, --version and usage errors
        code = stop.code
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(), "modules": sorted(sys.modules)}))
"""

#: what only training, sweeps, tuning, reports or a trained model need
NOT_FOR_CONFIG = ("fedhpro.api", "fedhpro.engines.simulator", "fedhpro.experiment", "fedhpro.compare", "fedhpro.tune",
                  "fedhpro.sweeps", "fedhpro.reproduce", "fedhpro.reports.runs", "fedhpro.trained")


def _probe(*argv: str, cwd: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["run", "--help"], ["predict", "--help"],
                                  ["config", "--help"], ["data"], ["no-such-command"]])
def test_help_version_and_usage_errors_load_no_torch(argv):
    result = _probe(*argv)
    assert result["code"] in (0, 2)
    assert result["out"] or result["err"]
    assert "torch" not in result["modules"]
    assert "numpy" not in result["modules"]


def test_config_keys_loads_no_engine_sweep_or_report(tmp_path):
    result = _probe("config", "--keys", cwd=tmp_path)
    assert result["code"] == 0
    keys = [line.split(":")[0].split(" [")[0] for line in result["out"].splitlines()]
    assert {field.name for field in dataclasses.fields(RunOptions)} <= set(keys)  # the listing is whole
    assert [name for name in NOT_FOR_CONFIG if name in result["modules"]] == []

