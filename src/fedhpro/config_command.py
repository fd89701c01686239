"""What ``fedhpro config`` does: print the resolved config, or every key with its choices, help and default.
A module of its own, apart from :mod:`fedhpro.commands`, so that the command loads the config's modules only,
not the engines, the trained model, the sweeps or the reports (:mod:`fedhpro.cli` imports it for ``config``)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from typing import Any

import yaml

from fedhpro import command_options
from fedhpro.command_options.keys import take
from fedhpro.config import SECTIONS, RunOptions, load_config, parse_override
from fedhpro.flower import options as flower_options
from fedhpro.methods import method_declarations


def check_command_keys(command: str, settings: list[str]) -> None:
    """The keys ``command`` (``run``, ``compare``, ``tune``, ``report``, ``reproduce``) takes for itself, read and
    checked from its ``settings`` as the command will read them, before the engines load: a bad key or value is
    refused in one line before torch loads. ``run`` reads its whole config (its warnings are left to the run);
    the others their own keys (:mod:`fedhpro.command_options`; the run keys they hand on, grids among them, are
    checked by the command)."""
    if command == "run":
        overrides = list(settings)
        source = overrides.pop(0) if overrides and "=" not in overrides[0] else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_config(source, overrides)
        return
    pairs = dict(parse_override(item) for item in settings if "=" in item)
    for cls in command_options.COMMAND_OPTIONS.get(command, ()):
        take(cls, pairs)


def _shown(value: object) -> str:
    """A default as it is typed on the command line: ``true``, ``null``, ``0.01``, ``[1, 2]``, ``cnn``."""
    return value if isinstance(value, str) else json.dumps(value)


def key_lines(dataset: str) -> list[str]:
    """``key [choices]: help (default: value)`` for every config key: the run's, every method's, the data
    set's (its ``data.*`` keys), ``faults.*``, ``partition`` / ``partition.*``, ``aggregation`` /
    ``aggregation.*`` (each robust rule's own knobs among them), ``privacy`` / ``privacy.*``, the commands' own
    keys, each line starting with its command (``compare: seeds: ...``,
    :data:`fedhpro.command_options.COMMAND_OPTIONS`), and the Flower apps' ``flower.*``
    (:data:`fedhpro.flower.options.FLOWER_KEYS`). Defaults are the
    values a run of ``dataset`` gets when the key is not set (a data set's own run settings included);
    an unset (null) default whose help already says what it means is not repeated."""
    defaults = load_config(None, {"dataset": dataset})
    groups: list[tuple[str, type[Any], Any]] = [("", RunOptions, defaults.run)]
    groups += [(f"{name}.", declaration.options, defaults.methods[name])
               for name, declaration in method_declarations().items()]
    groups += [(f"{section.name}.", section.options_for(dataset), getattr(defaults, section.name))
               for section in SECTIONS]
    lines = []
    for prefix, cls, values in groups:
        for field in dataclasses.fields(cls):
            choices = field.metadata.get("choices")
            extra = f" [{'|'.join(map(str, choices))}]" if choices else ""
            text, value = field.metadata.get("help", ""), getattr(values, field.name)
            if not (value is None and "default" in text):  # else the help says what an unset key means
                text += f" (default: {_shown(value)})"
            lines.append(f"{prefix}{field.name}{extra}: {text}")
    # the commands' own keys after the run's; the sections' shorthands and the flower.* keys end the listing
    lines += command_options.key_lines()
    for section in SECTIONS:
        if section.shorthand:
            value = getattr(getattr(defaults, section.name), section.shorthand)
            lines.append(f"{section.name}: short for {section.name}.{section.shorthand} (default: {_shown(value)})")
    return lines + flower_options.key_lines()


def cmd_config(args: argparse.Namespace) -> int:
    """Print the resolved config, or (``--keys``) every key with its choices, help and default."""
    overrides = list(args.settings)
    source = overrides.pop(0) if overrides and "=" not in overrides[0] else None
    config = load_config(source, overrides)
    if args.keys:
        print("\n".join(key_lines(config.run.dataset)))
        return 0
    print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
    return 0
