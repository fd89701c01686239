"""A config is built once and changed section by section: ``Config.replaced(section, **values)`` checks each value as
``load_config`` checks its key and rebuilds nothing else; ``Config.updated`` (the program's own settings, flat keys)
goes through it and gives what resolving the whole config again from its dict gives (the reference: the former
``load_config(config.to_dict(), settings)``)."""

from __future__ import annotations

import dataclasses

import pytest

from fedhpro.config import Config, load_config
from fedhpro.errors import ConfigError


def rebuilt(config: Config, settings: dict) -> Config:
    """The reference: the whole config resolved again from its dict with ``settings`` on top."""
    return dataclasses.replace(load_config(config.to_dict(), settings), given=config.given)


# what the Flower server sets after discovery, and what the apps set of their own
FLOWER_SETTINGS = [
    {"checkpoint_every": 1},
    {"progress": False, "privacy.secure_noise": True},
    {"data.standardize": "client"},
    {"data.classes": ["cat", "dog", "owl"]},
    {"data.feature_mean": [0.5, 1.5], "data.feature_std": [2.0, 0.5]},
    {"clients": 4},
    {"aggregation.trim": 0.1, "fedprox.mu": 0.5},
    {"threads": 3, "parallel_clients": "auto"},
]


@pytest.mark.parametrize("settings", FLOWER_SETTINGS, ids=lambda s: ",".join(s))
def test_updated_gives_what_resolving_again_gives(settings):
    bases = [{"dataset": "clients", "privacy": "client", "seed": 4}]
    if not any(key.startswith("data.") for key in settings):  # the default data set has no such keys
        bases.append({"rounds": 3, "method": "fedprox"})
    for base in bases:
        config = load_config(base)
        new, reference = config.updated(settings), rebuilt(config, settings)
        assert new == reference and new.to_dict() == reference.to_dict()
        assert new.given == config.given and new.set_keys() == reference.set_keys() == config.given


def test_updated_sets_one_entry_of_a_mapping_without_resolving_again():
    config = load_config({"dataset": "digits", "rounds": 3})
    settings = {"data.clients_per_domain.usps": 2, "data.clients_per_domain.svhn": 5}
    new = config.updated(settings)
    assert new.data.clients_per_domain == {"mnist": 3, "usps": 2, "svhn": 5, "syn": 4}  # the paper's layout, 2 set
    assert new == rebuilt(config, settings) and new.run is config.run and new.methods is config.methods
    with pytest.raises(ConfigError, match="unknown config key 'data.rounds.x'"):
        config.updated({"data.rounds.x": 1})


def test_replaced_checks_each_value_in_one_line_and_changes_one_section():
    config = load_config({"dataset": "clients"})
    changed = config.replaced("data", classes=["a", "b"])
    assert changed.data.classes == ["a", "b"] and config.data.classes is None
    assert changed.run is config.run and changed.methods is config.methods and changed.faults is config.faults
    assert config.replaced("run", clients="4").run.clients == 4  # converted as a command line's text is
    with pytest.raises(ConfigError, match=r"^clients=0 is too small; it must be >= 1$"):
        config.replaced("run", clients=0)
    with pytest.raises(ConfigError, match=r"unknown config key 'data.clases' \(did you mean 'data.classes'"):
        config.replaced("data", clases=["a"])
    with pytest.raises(ConfigError, match=r"aggregation.trim=0.5 is too large"):
        config.replaced("aggregation", trim=0.5)
    with pytest.raises(ConfigError, match=r"'flower' is not a config section"):
        config.replaced("flower", address="x")
    with pytest.raises(ConfigError, match=r"parallel_clients=4 needs at least as many threads"):
        config.replaced("run", threads="2", parallel_clients="4")
