"""What a fresh process imports to answer without training, read in that process (``sys.modules``), not timed.

``import torch`` is ~95 % of the CPU time of ``fedhpro config --keys`` (bench/startup.py). The commands that answer
without torch stay so; the robust aggregation rules are listed, and their options' names and needs read, without
it (the rules need torch only when they aggregate). ``fedhpro config`` itself still loads torch: the methods, data
sets and models that declare its keys are torch modules (tests/test_startup.py says the same)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules_after(code: str) -> dict:
    """``{"printed": what code printed (JSON), "torch": whether torch was imported}`` of ``code`` run in a fresh
    Python with this checkout's fedhpro."""
    probe = f"import json, sys\n{code}\nprint(json.dumps({{'printed': printed, 'torch': 'torch' in sys.modules}}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_robust_rules_are_listed_without_torch():
    result = _modules_after(
        "from fedhpro.aggregation import AGGREGATION_RULES, claim_cap\n"
        "from fedhpro.robust import REGISTRY\n"
        "printed = {'rules': dict(AGGREGATION_RULES), 'classes': [REGISTRY[n].__name__ for n in REGISTRY],\n"
        "           'cap': claim_cap([1, 1, 1, 100], 0.75, 2.0)}")
    assert result["printed"] == {
        "rules": {"mean": "", "median": "a coordinate-wise median", "trimmed-mean": "a trimmed mean",
                  "norm-clip": "each update's norm", "krum": "pairwise distances"},
        "classes": ["Mean", "Median", "TrimmedMean", "NormClip", "Krum"],
        "cap": 2.0}  # twice the (lower) median claim of 1
    assert result["torch"] is False

