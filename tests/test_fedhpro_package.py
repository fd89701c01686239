"""The FedHPro package: its options load without torch, and its modes, chosen once from the option strings,
mean what the options' help says (checked against the strings themselves, written out here)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from fedhpro.methods.fedhpro import authors_code, equations
from fedhpro.methods.fedhpro.modes import modes_of
from fedhpro.methods.fedhpro.options import FedHProOptions

SOURCE = Path(__file__).resolve().parents[1] / "src"


def choices() -> dict[str, tuple[str, ...]]:
    """Every option of FedHProOptions that takes one of a few strings, with those strings."""
    found = {}
    for field in dataclasses.fields(FedHProOptions):
        values = field.metadata.get("choices") if field.metadata else None
        if values is None and isinstance(field.default, str):
            raise AssertionError(f"fedhpro.{field.name} is a string without choices")
        if values is not None:
            found[field.name] = tuple(values)
    return found


def test_the_options_and_the_package_load_without_torch():
    """``fedhpro.methods.fedhpro`` and its ``options`` import no torch (``fedhpro.methods`` itself is stood in
    for by an empty package here: its registry imports every method's code)."""
    methods = str(SOURCE / "fedhpro" / "methods")
    code = ("import sys, types, fedhpro\n"
            f"stand_in = types.ModuleType('fedhpro.methods'); stand_in.__path__ = [{methods!r}]\n"
            "sys.modules['fedhpro.methods'] = stand_in\n"
            "import fedhpro.methods.fedhpro, fedhpro.methods.fedhpro.options as options\n"
            "assert options.FedHProOptions().margin == 'raw' and options.AUTHORS_RECIPE\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(SOURCE), "PATH": ""})
    assert done.stdout.strip() == "False", done.stderr


def test_every_choice_of_every_string_option_has_its_mode():
    options = choices()
    assert set(options) >= {"margin", "prototypes", "gradient_timing", "classifier_step", "hpal_form",
                            "gradient_sample_choice", "gradient_augment", "local_augment", "matching_distance",
                            "hyper_optimizer", "hyper_init", "recipe"}
    for name, values in options.items():
        for value in values:
            modes_of(FedHProOptions(**{name: value}))  # a choice without a table entry raises KeyError


@pytest.mark.parametrize("prototypes", ["hyper", "global", "global-hpcl", "global-hpal"])
def test_table_6_targets(prototypes):
    modes = modes_of(FedHProOptions(prototypes=prototypes))
    assert modes.hpcl_on_global == (prototypes in ("global", "global-hpcl"))
    assert modes.hpal_on_global == (prototypes in ("global", "global-hpal"))
    assert modes.uses_global == (prototypes != "hyper")
    assert modes.fused_losses == (prototypes == "hyper")


@pytest.mark.parametrize("margin", ["raw", "normalized", "off", "dot"])
@pytest.mark.parametrize("hpcl_weight", [0.0, 1.0])
def test_margin_and_hpcl_forms(margin, hpcl_weight):
    modes = modes_of(FedHProOptions(margin=margin, hpcl_weight=hpcl_weight))
    if margin == "off" or hpcl_weight == 0:
        assert modes.margin is None
    elif margin == "dot":
        assert modes.margin is authors_code.dot_product_margin
    else:
        assert modes.margin.func is equations.client_margin
        assert modes.margin.keywords == {"normalized": margin == "normalized"}
    assert modes.hpcl is (authors_code.hpcl_loss_log_margin if margin == "dot" else equations.hpcl_loss)
    assert modes.fused_losses == (hpcl_weight > 0 and margin != "dot")


def test_the_other_modes_follow_their_strings():
    paper, authors = modes_of(FedHProOptions()), modes_of(FedHProOptions(
        gradient_timing="before", classifier_step="synthetic", hpal_form="paper", gradient_augment="dsa",
        local_augment="crop-flip"))
    assert (paper.gradients_before, paper.synthetic_classifier, paper.hpal_normalized, paper.gradient_augment,
            paper.crop_flip) == (False, False, True, None, False)
    assert (authors.gradients_before, authors.synthetic_classifier, authors.hpal_normalized, authors.crop_flip) == (
        True, True, False, True)
    assert authors.gradient_augment is authors_code.class_batch_augment
    # the statistics pass serves the margin only on all samples, the first ones, unaugmented, before training
    assert modes_of(FedHProOptions(gradient_timing="before")).statistics_give_margin_prototypes
    for changed in ({}, {"gradient_samples_per_class": 5}, {"gradient_sample_choice": "random"},
                    {"gradient_augment": "dsa"}):
        if changed:
            assert not modes_of(FedHProOptions(gradient_timing="before", **changed)).statistics_give_margin_prototypes
    assert not paper.statistics_give_margin_prototypes
    assert paper.plain_class_statistics
    for changed in ({"gradient_sample_choice": "random"}, {"gradient_augment": "dsa"}, {"class_gradient_divide": True}):
        assert not modes_of(FedHProOptions(**changed)).plain_class_statistics
