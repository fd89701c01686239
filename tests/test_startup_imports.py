"""What a fresh process imports to answer without training, read in that process (``sys.modules``), not timed;
and that the registries read the installed packages' entry points once for all of them.

``import torch`` is ~95 % of the CPU time of ``fedhpro config --keys`` (bench/startup.py). The commands that answer
without torch stay so; the robust aggregation rules are listed, and their options' names and needs read, without
it (the rules need torch only when they aggregate); every other registry declares its entries torch-free
(tests/test_torch_free_declarations.py)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fedhpro.registry
from fedhpro.registry import Registry

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules_after(code: str) -> dict:
    """``{"printed": what code printed (JSON), "torch": whether torch was imported}`` of ``code`` run in a fresh
    Python with this checkout's fedhpro."""
    probe = f"import json, sys\n{code}\nprint(json.dumps({{'printed': printed, 'torch': 'torch' in sys.modules}}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_the_robust_rules_are_listed_without_torch():
    result = _modules_after(
        "from fedhpro.aggregation import AGGREGATION_RULES, claim_cap\n"
        "from fedhpro.robust import REGISTRY\n"
        "printed = {'rules': dict(AGGREGATION_RULES), 'classes': [REGISTRY[n].__name__ for n in REGISTRY],\n"
        "           'cap': claim_cap([1, 1, 1, 100], 0.75, 2.0)}")
    assert result["printed"] == {
        "rules": {"mean": "", "median": "a coordinate-wise median", "trimmed-mean": "a trimmed mean",
                  "norm-clip": "each update's norm", "krum": "pairwise distances",
                  "geometric-median": "the distances between updates"},
        "classes": ["Mean", "Median", "TrimmedMean", "NormClip", "Krum", "GeometricMedian"],
        "cap": 2.0}  # twice the (lower) median claim of 1
    assert result["torch"] is False



def _install(site: Path, package: str, groups: dict[str, dict[str, str]], module: str) -> None:
    """What ``pip install`` leaves in ``site``: the package's module and a dist-info with its entry points."""
    folder = site / f"{package}-0.1.0.dist-info"
    folder.mkdir(parents=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1.0\n")
    (folder / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items())
        for group, entries in groups.items()))
    (site / f"{package}.py").write_text(module)


def test_the_registries_read_the_installed_entry_points_once(tmp_path, monkeypatch):
    real = importlib.metadata.entry_points
    reads: list[dict] = []

    def counted(**params):
        reads.append(params)
        return real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", counted)
    monkeypatch.setattr(fedhpro.registry, "_INSTALLED", [], raising=False)  # none read yet in this test
    _install(tmp_path / "site", "widgets_for_startup", {"fedhpro.tests.widgets": {"w": "widgets_for_startup:W"},
                                                        "fedhpro.tests.gadgets": {"g": "widgets_for_startup:G"}},
             "W, G = 'widget', 'gadget'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    widgets, gadgets = Registry("widget", "fedhpro.tests.widgets"), Registry("gadget", "fedhpro.tests.gadgets")
    assert (dict(widgets), dict(gadgets)) == ({"w": "widget"}, {"g": "gadget"})
    assert len(reads) == 1  # one read of every package, for both groups
    for group in ("fedhpro.tests.widgets", "fedhpro.tests.gadgets", "console_scripts"):  # as the library reads them
        assert list(fedhpro.registry.installed_entry_points(group)) == list(real(group=group))

    # a folder of packages put on sys.path later is read, by a registry loaded after it
    _install(tmp_path / "later", "gizmos_for_startup", {"fedhpro.tests.gizmos": {"z": "gizmos_for_startup:Z"}},
             "Z = 'gizmo'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "later"))
    assert dict(Registry("gizmo", "fedhpro.tests.gizmos")) == {"z": "gizmo"}
    assert len(reads) == 2
