"""One plotting style for every figure fedhpro writes: a run's ``accuracy.png``, ``fedhpro compare`` and
``fedhpro report`` figures. Read back from the matplotlib objects and from the SVG written beside each PNG:
whole-number round ticks, curves that differ in line style or marker (not colour only), methods named as the
paper writes them (FedAvg, FedProx, MOON, ..., FedHPro; a plug-in keeps its own name), an optional title."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import fedhpro.methods  # noqa: F401 - the registry that gives the figures the methods' names
from fedhpro import cli
from fedhpro.data.federation import Federation
from fedhpro.reports import plots
from fedhpro.reports.plots import plot_curves, plot_mean_curves

#: the names the paper prints, by registered name (written out here by hand, not read from the code)
PAPER = {"fedavg": "FedAvg", "fedprox": "FedProx", "moon": "MOON", "fedrcl": "FedRCL", "fedproto": "FedProto",
         "fedtgp": "FedTGP", "fedgmkd": "FedGMKD", "fedsa": "FedSA", "fedhpro": "FedHPro"}


def _svg_texts(path: Path) -> list[str]:
    """The text elements of an SVG (matplotlib writes text as text with svg.fonttype none)."""
    return [t.strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", path.read_text(encoding="utf-8"))]


def _whole_ticks(axis) -> list[float]:
    low, high = axis.get_xlim()
    ticks = [t for t in axis.get_xticks() if low - 1e-9 <= t <= high + 1e-9]
    assert ticks
    return ticks


def _styles(axis) -> list[tuple[str, str]]:
    return [(str(line.get_linestyle()), str(line.get_marker())) for line in axis.get_lines()]


def test_every_method_is_named_as_the_paper_writes_it():
    assert {name: plots.display_name(name) for name in PAPER} == PAPER
    assert plots.display_label("fedhpro fedhpro.tau=0.1") == "FedHPro fedhpro.tau=0.1"
    assert plots.display_label("moon: L_GM before") == "MOON: L_GM before"
    assert plots.display_label("fedavg-digits-offline-20260101") == "fedavg-digits-offline-20260101"  # a folder name


def test_a_plugin_method_keeps_its_own_name():
    from fedhpro.methods import REGISTRY, fedavg, register

    register("fedavgm", dataclasses.replace(fedavg.METHOD, name="fedavgm", description="FedAvgM: server momentum"))
    register("my_rule", dataclasses.replace(fedavg.METHOD, name="my_rule", description="a rule of ours"))
    try:
        assert plots.display_name("fedavgm") == "FedAvgM"  # its registry entry spells it so
        assert plots.display_name("my_rule") == "my_rule"
        assert plots.display_name("not-registered") == "not-registered"
    finally:
        del REGISTRY["fedavgm"], REGISTRY["my_rule"]


def test_compare_and_report_curves_share_the_style(tmp_path):
    series = {name: ([1, 2, 3, 4, 5], [10.0 + i, 20.0 + i, 30.0, 35.0, 40.0 - i])
              for i, name in enumerate(["fedavg", "fedprox", "moon", "fedhpro"])}
    figure = plot_curves(series, tmp_path / "curves.png", ylabel="test accuracy (%)")
    (axis,) = figure.axes
    assert all(t == int(t) for t in _whole_ticks(axis))
    styles = _styles(axis)
    assert len(set(styles)) == 4 and len({style for style, _ in styles}) == 4, styles
    assert [text.get_text() for text in axis.get_legend().get_texts()] == ["FedAvg", "FedProx", "MOON", "FedHPro"]
    assert axis.get_title() == ""  # no title unless one is given
    svg = _svg_texts(tmp_path / "curves.svg")
    assert {"FedAvg", "FedProx", "MOON", "FedHPro"} <= set(svg)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    groups = {name: [([1, 2, 3], [1.0, 2.0, 3.0]), ([1, 2, 3], [2.0, 3.0, 4.0])] for name in ("fedsa", "fedtgp")}
    figure = plot_mean_curves(groups, tmp_path / "mean.png", title="two seeds")
    (axis,) = figure.axes
    assert axis.get_title() == "two seeds"
    assert all(t == int(t) for t in _whole_ticks(axis))
    assert len(set(_styles(axis))) == 2
    assert {"FedSA (mean of 2)", "FedTGP (mean of 2)", "two seeds"} <= set(_svg_texts(tmp_path / "mean.svg"))


def test_a_run_accuracy_plot_has_round_ticks_and_distinct_lines(tmp_path):
    rows = [{"round": r, "accuracy": {"mnist": 10.0 + r, "optdigits": 12.0, "mnistm": 9.0, "syn": 11.0 + r,
                                      "AVG": 11.0 + r / 2}} for r in range(3)]
    figure = plots.plot_run_accuracy(rows, tmp_path / "accuracy.png", title="FedAvg on digits-offline (seed 0)")
    (axis,) = figure.axes
    ticks = _whole_ticks(axis)
    assert all(t == int(t) for t in ticks) and {1.0, 2.0, 3.0} <= set(ticks)
    styles = _styles(axis)
    assert len(styles) == 5 and len(set(styles)) == 5, styles
    assert len({marker for _, marker in styles}) == 5
    assert (tmp_path / "accuracy.svg").is_file()
    assert plots.plot_run_accuracy([{"round": 0}], tmp_path / "none.png") is None  # no round evaluated: no figure


def _federation() -> Federation:
    generator = torch.Generator().manual_seed(3)
    pairs = [(torch.randn(40, 6, generator=generator), torch.arange(40) % 2) for _ in range(2)]
    return Federation.from_tensors(pairs, {"all": (torch.randn(20, 6, generator=generator), torch.arange(20) % 2)})


@pytest.mark.slow
def test_a_run_and_its_report_write_the_figures_in_the_style(tmp_path):
    import fedhpro

    runs = []
    for method in ("fedavg", "fedprox"):
        result = fedhpro.run(federation=_federation(), method=method, model="mlp", rounds=3, local_epochs=1,
                             feature_dim=4, batch_size=8, progress=False, threads=1, device="cpu",
                             out=str(tmp_path / method))
        runs.append(result.out)
    texts = _svg_texts(tmp_path / "fedavg" / "accuracy.svg")
    assert "FedAvg on custom (seed 0)" in texts
    # the round axis of a 3-round run: 1, 2, 3 and no 1.5 or 2.5
    numbers = {float(t) for t in texts if re.fullmatch(r"-?\d+(\.\d+)?", t)}
    assert {1.0, 2.0, 3.0} <= numbers and not {1.5, 2.5} & numbers
    assert not [t for t in texts if re.fullmatch(r"[123]\.\d*[1-9]", t)]
    assert cli.main(["report", *map(str, runs), f"out={tmp_path / 'report'}"]) == 0
    report = _svg_texts(tmp_path / "report" / "accuracy.svg")
    assert {"FedAvg", "FedProx"} <= set(report), report
    assert (tmp_path / "report" / "accuracy.png").is_file()
    json.loads((tmp_path / "fedavg" / "summary.json").read_text())  # the run finished as usual


@pytest.mark.parametrize("name", ["fedavg", "fedhpro"])
def test_display_names_do_not_touch_other_words(name):
    assert plots.display_label(f"{name}x") == f"{name}x"
    assert plots.display_label(f"x {name}") == f"x {name}"
