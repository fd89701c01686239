"""``resume=``: a resumed run refuses every key that differs from the saved config (one line naming it) and
accepts keys equal to the saved ones."""

from __future__ import annotations

from pathlib import Path

import pytest

import fedhpro
from conftest import FEATURE_DIM, TinyNet, make_federation
from fedhpro.errors import ConfigError

pytestmark = pytest.mark.slow


def tiny_settings(out: Path, **extra) -> dict:
    return {"rounds": 2, "local_epochs": 1, "batch_size": 8, "progress": False, "device": "cpu", "out": str(out),
            "feature_dim": FEATURE_DIM, **extra}


# ---------------------------------------------------------------------------- 1. resume refuses changed keys


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A finished 2-round FedHPro run with a non-default tau (0.1; the default is 0.05), and its federation."""
    federation = make_federation([10, 12])
    out = tmp_path_factory.mktemp("resume") / "run"
    fedhpro.run(method="fedhpro", federation=federation, model=TinyNet,
                **tiny_settings(out, checkpoint_every=1, **{"fedhpro.tau": 0.1}))
    return out, federation


@pytest.mark.parametrize("given, named", [
    (["fedhpro.tau=0.5"], "fedhpro.tau"),
    (["fedhpro.tau=0.05"], "fedhpro.tau"),  # the default, but not the saved value: still a change
    (["fedhpro.match_steps=3"], "fedhpro.match_steps"),
    (["data.fraction=0.5"], "data.fraction"),
    (["data.clients_per_domain.mnist=2"], "data.clients_per_domain.mnist"),
    (["partition.alpha=0.3"], "partition.alpha"),
    (["partition=dirichlet"], "partition.scheme"),
    (["faults.dropout=0.2"], "faults.dropout"),
    (["lr=0.5"], "lr"),
    ({"fedhpro": {"tau": 0.5}}, "fedhpro.tau"),  # a nested mapping, as a YAML section
])
def test_resume_refuses_any_key_that_differs_from_the_saved_config(saved_run, given, named):
    out, federation = saved_run
    overrides = given if isinstance(given, dict) else [f"resume={out}", *given]
    extra = {"resume": str(out)} if isinstance(given, dict) else {}
    with pytest.raises(ConfigError) as error:
        fedhpro.run(None, overrides, federation=federation, model=TinyNet, **extra)
    message = str(error.value)
    assert "\n" not in message
    assert f"resume takes its settings from {out / 'config.yaml'}; remove {named} (" in message


def test_resume_accepts_given_keys_equal_to_the_saved_ones_and_the_run_settings(saved_run):
    out, federation = saved_run
    # rounds=2 and tau=0.1 are the saved values (neither is the default): nothing changes, so resume runs
    result = fedhpro.run(None, [f"resume={out}", "rounds=2", "fedhpro.tau=0.1", "progress=false", "device=cpu",
                                "tensorboard=false"], federation=federation, model=TinyNet)
    assert result.config.method_options.tau == 0.1 and result.config.run.rounds == 2
