"""``fedhpro compare``'s default methods and baseline come from the registry: the paper's order declared on each
method's spec (no table of method names elsewhere), and a plug-in method runs in a default comparison too."""

from __future__ import annotations

import dataclasses

from fedhpro import compare
from fedhpro.methods import METHODS

#: the paper's tables (Tables 1-3), written out by hand
PAPER = ["fedavg", "fedprox", "moon", "fedproto", "fedtgp", "fedgmkd", "fedrcl", "fedsa", "fedhpro"]


def test_the_specs_declare_the_papers_order_and_one_baseline():
    builtin = [name for name in compare.table_order(METHODS) if METHODS[name].paper_order is not None]
    assert builtin == PAPER
    assert [name for name, spec in METHODS.items() if spec.baseline] == ["fedavg"] == [compare.baseline_method()]


def test_a_plug_in_runs_in_a_default_compare_after_the_papers_methods(monkeypatch):
    monkeypatch.setitem(METHODS, "aardvark", dataclasses.replace(METHODS["fedavg"], name="aardvark", paper_order=None,
                                                                 baseline=False))
    asked = {}
    monkeypatch.setattr(compare, "compare", lambda methods, seeds, *args, **kwargs: asked.update(methods=methods))
    assert compare.main(["seeds=[0]", "out=/nonexistent/never-written"]) == 0
    assert asked["methods"] == PAPER + ["aardvark"]  # by name after the paper's, not first although "a" < "f"
    assert compare.table_order(["fedhpro", "zeta", "fedavg", "aardvark"]) == ["fedavg", "fedhpro", "aardvark", "zeta"]
