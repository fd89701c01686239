"""Every JSON file fedhpro writes is strict JSON: no ``NaN``, ``Infinity`` or ``-Infinity`` (Python's
``json`` writes them, strict parsers — JavaScript, jq, Go, Rust's serde — refuse the whole file).

Tiny runs of the simulator (a plain one, FedHPro with its server metrics and prototype distances, a run that
``privacy.max_epsilon`` stops before its first round, a resumed one) are parsed file by file with a strict
parser; the writers themselves are checked on values holding non-finite floats (written as ``null``) and,
against ``json.dumps`` as the reference, on values without them (the same bytes: default runs unchanged).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fedhpro
from fedhpro.files import strict_json
from fedhpro.reports import write_json, write_jsonl
from tests.conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION


def _refuse(name: str):
    raise ValueError(f"{name} is not strict JSON")


def strict_loads(text: str):
    """A strict JSON parser: Python's, with the three non-standard constants refused."""
    return json.loads(text, parse_constant=_refuse)


def strict_files(folder: Path) -> list[Path]:
    """Every .json and .jsonl file below ``folder``, each parsed strictly (a failure names the file)."""
    found = sorted(p for p in folder.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file())
    for path in found:
        text = path.read_text(encoding="utf-8")
        lines = [line for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" else [text]
        for number, line in enumerate(lines, 1):
            try:
                strict_loads(line)
            except ValueError as error:
                pytest.fail(f"{path.relative_to(folder)} line {number} is not strict JSON: {error}")
    return found


def tiny(data_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["rounds=2", "clients=3", "local_epochs=1", "feature_dim=16", "progress=false", "threads=1",
            "device=cpu", "seed=1", f"data_dir={data_dir}", f"out={out}", "data.fraction=0.02",
            f"data.syn_size={DIGITS_SYN_SIZE}", f"data.test_fraction={DIGITS_TEST_FRACTION}", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("name, extra", [
    ("fedavg", ["method=fedavg"]),
    ("fedhpro", ["method=fedhpro", "prototype_distance=true", "eval_every=2"]),
    ("budget-before-round-0", ["method=fedavg", "privacy=client", "privacy.max_epsilon=0.000001"]),
])
def test_every_json_file_of_a_run_is_strict_json(digits_data_dir, tmp_path, name, extra):
    out = tmp_path / name
    fedhpro.run(overrides=tiny(digits_data_dir, out, *extra), echo=False)
    found = {p.name for p in strict_files(out)}
    assert {"summary.json", "model.json", "partition.json"} <= found
    if name != "budget-before-round-0":
        assert {"metrics.jsonl", "timing.jsonl"} <= found


@pytest.mark.slow
def test_a_resumed_run_and_its_checkpoint_metrics_are_strict_json(digits_data_dir, tmp_path):
    from fedhpro.engines import checkpoint

    out = tmp_path / "run"
    fedhpro.run(overrides=tiny(digits_data_dir, out, "method=fedavg", "checkpoint_every=1"), echo=False)
    (out / "summary.json").unlink()  # as if it had stopped after its last checkpoint
    fedhpro.run(overrides=[f"resume={out}", "progress=false", "threads=1"], echo=False)
    strict_files(out)
    newest = checkpoint.latest(out)
    blob = torch.load(newest, map_location="cpu", weights_only=True)
    assert isinstance(strict_loads(blob["metrics"]), list)


NON_FINITE = [float("nan"), float("inf"), float("-inf")]


def test_the_writers_write_a_non_finite_measurement_as_null(tmp_path):
    """What an engine hands the writers may hold NaN (a diverged loss, an epsilon of no round): the files
    stay strict JSON, the value is null, everything else as json.dumps writes it."""
    row = {"round": 0, "train": {"loss": float("nan"), "ce": 1.5}, "privacy": {"epsilon": float("inf")},
           "client_accuracy": [10.0, float("-inf")], "pairs": (1, float("nan"))}
    write_json(tmp_path / "summary.json", row)
    write_jsonl(tmp_path / "metrics.jsonl", [row, {"round": 1, "loss": 2.0}])
    expected = {"round": 0, "train": {"loss": None, "ce": 1.5}, "privacy": {"epsilon": None},
                "client_accuracy": [10.0, None], "pairs": [1, None]}
    assert strict_loads((tmp_path / "summary.json").read_text()) == expected
    rows = [strict_loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [expected, {"round": 1, "loss": 2.0}]
    assert row["train"]["loss"] != row["train"]["loss"]  # the caller's value is left as it was


def test_a_checkpoint_keeps_its_metrics_strict(tmp_path):
    from fedhpro.engines import checkpoint

    path = checkpoint.save(tmp_path, 1, {}, [{"round": 0, "loss": float("nan"), "accuracy": {"AVG": 1.0}}])
    blob = checkpoint.load(path)
    assert blob["metrics"] == [{"round": 0, "loss": None, "accuracy": {"AVG": 1.0}}]


def reference(value):
    """Independent of the code under test: the value a strict reader gets back (non-finite floats as None,
    tuples as lists)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): reference(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [reference(v) for v in value]
    return value


VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.sampled_from(NON_FINITE), st.text(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                            st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=20)


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(VALUES, st.sampled_from([{}, {"indent": 2}, {"indent": 2, "sort_keys": True}]))
def test_strict_json_is_json_dumps_for_finite_values_and_null_for_the_rest(value, options):
    text = strict_json(value, **options)
    assert strict_loads(text) == reference(value)
    try:
        plain = json.dumps(value, allow_nan=False, **options)
    except ValueError:  # a non-finite float somewhere: strict_json wrote null for it (checked above)
        return
    assert text == plain  # the same bytes: runs without non-finite values are unchanged
