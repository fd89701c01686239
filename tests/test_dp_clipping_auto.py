"""``privacy.clipping=auto`` (the default): each method's declared clipping (``MethodSpec.dp_clipping``) reaches the
round protocol, the privatized uploads and summary.json; a value the user gives wins.

References: the declarations themselves (every registered method says joint or per-group), and the two clippings'
definitions recomputed by hand on a two-group upload (joint: the whole vector to C; per-group: each group to
C / sqrt(2)).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from fedhpro.config import load_config
from fedhpro.errors import ConfigError
from fedhpro.experiment import protocol_settings
from fedhpro.methods import METHODS, MethodSpec
from fedhpro.privacy import client_privacy, privatize_upload

PRIVATE = {"privacy": "client", "privacy.noise_multiplier": 1.0, "privacy.clip": 1.0}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_auto_resolves_to_the_methods_declaration(method):
    config = load_config({"method": method, **PRIVATE})
    assert config.privacy.clipping == "auto"  # the config keeps what was given (or the default)
    resolved = protocol_settings(config)["privacy"]
    assert resolved.clipping == METHODS[method].dp_clipping in ("joint", "per-group")
    assert client_privacy(resolved, 1.0).clipping == resolved.clipping


@pytest.mark.parametrize("given", ["joint", "per-group"])
def test_a_given_clipping_wins(given):
    for method in METHODS:
        config = load_config({"method": method, **PRIVATE, "privacy.clipping": given})
        assert protocol_settings(config)["privacy"].clipping == given


def test_declared_clipping_is_checked():
    spec = METHODS["fedavg"]
    with pytest.raises(ConfigError, match="dp_clipping"):
        dataclasses.replace(spec, dp_clipping="sometimes")
    assert isinstance(dataclasses.replace(spec, dp_clipping="per-group"), MethodSpec)


def test_the_resolved_clipping_is_the_one_applied():
    """A two-group upload (weights update of norm 3, prototypes of norm 4): joint scales both by 1/5 (the whole
    vector's norm 5 to C = 1); per-group scales each group to C / sqrt(2)."""
    update = torch.tensor([3.0, 0.0])
    reply = {"weights": {"w": update.clone()}, "num_examples": 4,
             "prototypes": torch.tensor([[4.0, 0.0]]), "class_counts": torch.tensor([4])}
    broadcast = {"w": torch.zeros(2)}
    for clipping, weight_norm, row_norm in (("joint", 3 / 5, 4 / 5),
                                            ("per-group", 1 / math.sqrt(2), 1 / math.sqrt(2))):
        config = load_config({"method": "fedproto", **PRIVATE, "privacy.noise_multiplier": 0.0,
                              "privacy.clipping": clipping, "privacy.target_epsilon": 0.0})
        settings = client_privacy(protocol_settings(config)["privacy"], 0.0)
        out = privatize_upload(reply, broadcast, ["prototypes"], settings)
        assert float(out["weights"]["w"].norm()) == pytest.approx(weight_norm, rel=1e-6)
        assert float(out["prototypes"].norm()) == pytest.approx(row_norm, rel=1e-6)
