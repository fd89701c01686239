"""Every method with every value of each of its choice options: one tiny round on both engines.

The cases come from the registry alone (no method or option named here): for each method of
:data:`fedhpro.methods.METHODS`, one run at its defaults, then one run per value of each options field
declared with ``choices`` (:func:`fedhpro.options.option`) that is not the field's default, plus each of
the method's recipes (``<method>.recipe=<name>``) where ``recipe`` is not itself a choices field. Each case
changes that one key; the rest is a federation small enough for one CPU core (3 clients of ~40 images,
d=16, one local epoch, one round).

* the in-process simulator, from the command line (``fedhpro.cli.main(["run", ...])``): the run ends with
  exit status 0 and a summary.json of finite accuracy, or the CLI refuses the combination in exactly one
  line ``fedhpro: error: ...`` (exit status 2, no traceback) that names the option. A method at its defaults
  is never refused.
* Flower's simulation engine (``flwr.simulation.run_simulation``, 3 SuperNodes, one Ray start for every
  case): ``fedhpro.flower.server.run_server`` finishes with summary.json, or raises a one-line
  :class:`~fedhpro.errors.FedHProError` naming the option. Where both engines ran, the final accuracy and the
  core keys of every metrics.jsonl row are equal (the engines are bit-identical by design, test_flower.py).

Timings: ``python -m pytest -n 0 -s tests/test_every_option.py`` prints each case's seconds per engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION, RAY_GROUP, run_flower_simulation

from fedhpro.cli import main
from fedhpro.errors import FedHProError
from fedhpro.methods import METHODS, recipes_of

pytestmark = pytest.mark.slow

# as test_flower.py: no telemetry or update check, Ray quiet and on loopback only (before ray is imported)
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

#: the metrics.jsonl keys both engines write (test_flower.py's CORE_KEYS)
CORE_KEYS = ("round", "participants", "train", "server", "bytes_up", "bytes_down", "accuracy", "dropped", "skipped")


class Case(NamedTuple):
    """One run: ``method`` with ``option=value`` (both None: the method at its defaults)."""

    method: str
    option: str | None = None
    value: Any = None

    @property
    def id(self) -> str:
        return f"{self.method}-defaults" if self.option is None else f"{self.method}-{self.option}={self.value}"

    @property
    def key(self) -> str | None:
        return None if self.option is None else f"{self.method}.{self.option}"


def typed(value: Any) -> str:
    """``value`` as typed on the command line (``true``, ``0.5``, ``proto-only``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def every_case() -> list[Case]:
    """Each method at its defaults, then each non-default choice of each of its options and each recipe."""
    cases = []
    for method, spec in METHODS.items():
        cases.append(Case(method))
        defaults = spec.options()
        choice_fields = [f for f in dataclasses.fields(spec.options) if f.metadata.get("choices") is not None]
        for f in choice_fields:
            cases += [Case(method, f.name, value) for value in list(f.metadata["choices"])
                      if value != getattr(defaults, f.name)]
        if "recipe" not in {f.name for f in choice_fields}:
            cases += [Case(method, "recipe", recipe) for recipe in recipes_of(method)
                      if recipe != getattr(defaults, "recipe", None)]
    return cases


CASES = every_case()


def settings(case: Case, data_dir: Path, out: Path) -> dict[str, str]:
    """The run's keys as the command line gives them: test_flower.py's tiny federation, one round."""
    keys = {"method": case.method, "rounds": "1", "clients": "3", "data.fraction": "0.02",
            "data.syn_size": str(DIGITS_SYN_SIZE), "data.test_fraction": str(DIGITS_TEST_FRACTION),
            "feature_dim": "16", "local_epochs": "1", "device": "cpu", "data_dir": str(data_dir),
            "progress": "false", "seed": "1", "out": str(out)}
    if case.key is not None:
        keys[case.key] = typed(case.value)
    return keys


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def core(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: row[key] for key in CORE_KEYS if key in row} for row in rows]


def finished(out: Path) -> dict[str, Any]:
    """summary.json of a finished run in ``out``, with its finite accuracy checked."""
    summary_path = out / "summary.json"
    assert summary_path.is_file(), f"no summary.json in {out}"
    summary = json.loads(summary_path.read_text())
    assert isinstance(summary["accuracy"], float) and math.isfinite(summary["accuracy"]), summary["accuracy"]
    return summary


def assert_explained_refusal(case: Case, message: str) -> None:
    """A refusal is acceptable for a changed option only, in one non-empty line naming the option."""
    assert case.option is not None, f"{case.method} at its defaults was refused: {message}"
    assert message.strip() and "\n" not in message.strip(), f"not one line: {message!r}"
    assert "Traceback" not in message, message
    assert case.option in message, f"the refusal does not name {case.option}: {message!r}"


# ---------------------------------------------------------------------------- the in-process simulator (CLI)


class CliOutcome(NamedTuple):
    code: int
    stdout: str
    stderr: str
    out: Path
    seconds: float


#: this process's simulator runs, by case id (the Flower tests compare with them; run again where missing,
#: e.g. on another xdist worker)
_SIMULATED: dict[str, CliOutcome] = {}


@pytest.fixture(scope="session")
def simulator_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("every-option-simulator")


def simulate(case: Case, data_dir: Path, root: Path) -> CliOutcome:
    """``fedhpro run <the case's keys>`` in this process (once per process and case)."""
    if case.id not in _SIMULATED:
        out = root / case.id
        argv = ["run", *(f"{key}={value}" for key, value in settings(case, data_dir, out).items())]
        stdout, stderr = io.StringIO(), io.StringIO()
        started = time.perf_counter()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
        _SIMULATED[case.id] = CliOutcome(code, stdout.getvalue(), stderr.getvalue(), out,
                                         time.perf_counter() - started)
    return _SIMULATED[case.id]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_every_option_runs_on_the_simulator_from_the_cli(case, digits_data_dir, simulator_root):
    outcome = simulate(case, digits_data_dir, simulator_root)
    print(f"\nsimulator {case.id}: exit {outcome.code} in {outcome.seconds:.2f} s")
    assert "Traceback" not in outcome.stderr, outcome.stderr
    if outcome.code == 0:
        finished(outcome.out)
        return
    # a refusal: exactly one line on stderr, as the CLI prints a FedHProError, and no run folder results
    lines = outcome.stderr.splitlines()
    assert outcome.code == 2, f"exit {outcome.code}; stderr:\n{outcome.stderr}"
    errors = [line for line in lines if line.startswith("fedhpro: error: ")]
    assert len(errors) == 1, f"not one error line; stderr:\n{outcome.stderr}"
    assert lines[-1] == errors[0], f"the error is not the last line; stderr:\n{outcome.stderr}"
    assert_explained_refusal(case, errors[0].removeprefix("fedhpro: error: "))
    assert not (outcome.out / "summary.json").exists()


# ---------------------------------------------------------------------------- Flower's simulation engine


@pytest.fixture(scope="module")
def flower_runs(digits_data_dir, tmp_path_factory):
    """Every case through ``run_simulation`` (3 SuperNodes, 1 Ray CPU) in one session, as test_flower.py's
    ``simulated``: case id -> (out folder or the exception raised, seconds)."""
    pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    from fedhpro.flower.client import app as client_app
    from fedhpro.flower.server import run_server

    root = tmp_path_factory.mktemp("every-option-flower")
    outcomes: dict[str, tuple[Path | Exception, float]] = {}
    server_app = ServerApp()

    @server_app.main()
    def _main(grid: Grid, context: Context) -> None:
        for case in CASES:
            started = time.perf_counter()
            try:
                run_server(grid, context.run_config, settings(case, digits_data_dir, root / case.id))
                result: Path | Exception = root / case.id
            except Exception as error:  # keep going: each case's test reports its own outcome
                result = error
            outcomes[case.id] = (result, time.perf_counter() - started)

    started = time.perf_counter()
    run_flower_simulation(server_app, client_app)  # Ray on loopback, PYTHONPATH put back
    print(f"\nFlower: {len(outcomes)} cases in one run_simulation, {time.perf_counter() - started:.1f} s")
    for name, (result, _) in outcomes.items():
        if isinstance(result, Exception):
            print(f"Flower {name}: {type(result).__name__}: {result}")
    return outcomes


@pytest.mark.ray
@pytest.mark.xdist_group(RAY_GROUP)  # one Ray instance at a time (conftest.py), with test_flower.py's
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_every_option_on_flower_equals_the_simulator(case, flower_runs, digits_data_dir, simulator_root):
    result, seconds = flower_runs.get(case.id, (RuntimeError("the Flower simulation did not reach this case"), 0.0))
    print(f"\nflower {case.id}: {type(result).__name__} in {seconds:.2f} s")
    if isinstance(result, FedHProError):
        print(f"flower refused {case.id}: {result}")
        assert_explained_refusal(case, str(result))
        return
    if isinstance(result, Exception):
        raise result
    summary = finished(result)
    reference = simulate(case, digits_data_dir, simulator_root)
    assert reference.code == 0, (f"Flower ran {case.id} but the simulator refused it:\n{reference.stderr}")
    expected = finished(reference.out)
    assert summary["accuracy"] == expected["accuracy"]
    assert core(read_rows(result / "metrics.jsonl")) == core(read_rows(reference.out / "metrics.jsonl"))
