"""Generated reference pages of the documentation site, written from the code so they cannot go stale.

``config_keys_markdown()``: every config key (the run's, each method's ``<method>.*``, each section's
``<section>.*``, the ``flower.*`` keys, the commands' own keys, and the ``data.*`` keys of every data set) with its
choices, default and meaning, read from the option metadata in :mod:`fedhpro.config`, :mod:`fedhpro.flower.options`
and :mod:`fedhpro.command_options` (the source ``fedhpro config --keys`` prints).
``cli_markdown()``: the ``--help`` of every ``fedhpro`` command, from the argument parser itself.

docs/hooks.py puts them into reference/config.md and reference/cli.md while MkDocs builds the site.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
from typing import Any

from fedhpro.cli import build_parser
from fedhpro.command_options import COMMAND_OPTIONS
from fedhpro.command_options.keys import defaults_of, key_of
from fedhpro.config import SECTIONS, RunOptions, load_config
from fedhpro.data import DATASETS, get_dataset
from fedhpro.flower.options import FLOWER_KEYS, FlowerSettings
from fedhpro.methods import all_methods

DEFAULT_DATASET = RunOptions.dataset


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell (pipes escaped, no line breaks)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _shown(value: Any) -> str:
    """A default as it is typed on the command line: ``true``, ``null``, ``0.01``, ``cnn``."""
    return value if isinstance(value, str) else json.dumps(value)


def _unbroken(markdown: str) -> str:
    """Cell Markdown whose code spans (key names, choices, defaults) never break mid-word: the site's
    docs/stylesheets/fedhpro.css keeps ``.config-code code`` on one line."""
    return f'<span class="config-code">{markdown}</span>' if markdown else ""


def _table(prefix: str, cls: type, values: Any) -> list[str]:
    rows = ["| key | choices | default | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        rows.append(_row(f"{prefix}{field.name}", field, getattr(values, field.name)))
    return rows


def _row(key: str, field: dataclasses.Field, value: Any) -> str:
    """One key's row: its name, choices, default and meaning."""
    choices = field.metadata.get("choices")
    shown_choices = ", ".join(f"`{choice}`" for choice in choices) if choices else ""
    default = f"`{_cell(_shown(value))}`"
    return (f"| {_unbroken(f'`{key}`')} | {_unbroken(_cell(shown_choices))} | {_unbroken(default)} | "
            f"{_cell(field.metadata.get('help', ''))} |")


def _command_tables() -> list[str]:
    """A table per command of the keys it takes for itself (:data:`fedhpro.command_options.COMMAND_OPTIONS`)."""
    out = ["", "## Command keys", "", "Keys a command takes for itself, beside the run keys it hands to its runs "
           "(`fedhpro compare seeds=[0,1] lr=0.05`: `seeds` is compare's, `lr` every run's); `fedhpro config --keys` "
           "lists them as `COMMAND: KEY: ...`. A default of `null` means unset: the meaning says what that does."]
    for command, classes in COMMAND_OPTIONS.items():
        out += ["", f"### `{command}`", "", f"The keys of `fedhpro {command}`:", "",
                "| key | choices | default | meaning |", "|---|---|---|---|"]
        for cls in classes:
            defaults = defaults_of(cls)
            out += [_row(key_of(field), field, defaults[key_of(field)]) for field in dataclasses.fields(cls)]
    return out


def config_keys_markdown() -> str:
    """The config-key reference as Markdown: one table per group of keys."""
    defaults = load_config(None, {"dataset": DEFAULT_DATASET})
    out = [f"Defaults are those of a run of `dataset={DEFAULT_DATASET}` (a data set may bring its own run "
           "defaults, such as `clients`; `fedhpro config --keys dataset=NAME` lists them for another).", "",
           "## Run keys", "", "Set as `KEY=VALUE` on the command line, `KEY: VALUE` in YAML, or "
           "`fedhpro.run(KEY=VALUE)` from Python.", ""]
    out += _table("", RunOptions, defaults.run)
    for name, spec in all_methods().items():
        fields = dataclasses.fields(spec.options)
        out += ["", f"## `{name}.*`", ""]
        out += _table(f"{name}.", spec.options, defaults.methods[name]) if fields else ["This method has no knobs."]
    for section in SECTIONS:
        if section.name == "data":
            continue
        out += ["", f"## `{section.name}.*`", ""]
        if section.shorthand:
            value = getattr(getattr(defaults, section.name), section.shorthand)
            out += [f"`{section.name}` is short for `{section.name}.{section.shorthand}`: `{section.name}=VALUE` sets "
                    f"`{section.name}.{section.shorthand}=VALUE` (default `{_shown(value)}`).", ""]
        out += _table(f"{section.name}.", section.options_for(DEFAULT_DATASET), getattr(defaults, section.name))
    out += ["", "## `flower.*`", "", "Read by Flower runs only (`fedhpro-flower` apps, `flwr run --run-config`); "
            "`fedhpro run` refuses them.", "", "| key | default | meaning |", "|---|---|---|"]
    flower_defaults = FlowerSettings()
    for entry in FLOWER_KEYS:
        value = getattr(flower_defaults.secagg if entry.secagg else flower_defaults, entry.field)
        default = f"`{_cell(_shown(value))}`"
        out.append(f"| {_unbroken(f'`{entry.key}`')} | {_unbroken(default)} | {_cell(entry.help)} |")
    out += _command_tables()
    out += ["", "## `data.*`, per data set", "",
            "The `data.*` keys depend on `dataset=`; data sets that share their keys are listed together.", ""]
    groups: dict[type, list[str]] = {}
    for dataset in DATASETS.names():
        groups.setdefault(get_dataset(dataset).options, []).append(dataset)
    for cls, datasets in groups.items():
        values = load_config(None, {"dataset": datasets[0]}).data
        out += [f"### {', '.join(f'`{d}`' for d in datasets)}", ""]
        out += _table("data.", cls, values) if dataclasses.fields(cls) else ["No `data.*` keys."]
        out.append("")
    return "\n".join(out) + "\n"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help(parser: argparse.ArgumentParser) -> str:
    """The parser's help, wrapped at 100 columns whatever the terminal of the build (argparse reads COLUMNS)."""
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"
    try:
        with contextlib.redirect_stdout(io.StringIO()) as text:
            parser.print_help()
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return text.getvalue().rstrip()


def cli_markdown() -> str:
    """Every ``fedhpro`` command's ``--help`` as Markdown sections (subcommands of subcommands included)."""
    parser = build_parser()
    out = ["## `fedhpro`", "", "```text", _help(parser), "```"]
    pending = [("fedhpro " + name, sub) for name, sub in _subparsers(parser).items()]
    while pending:
        title, sub = pending.pop(0)
        out += ["", f"## `{title}`", "", "```text", _help(sub), "```"]
        pending[0:0] = [(f"{title} {name}", inner) for name, inner in _subparsers(sub).items()]
    return "\n".join(out) + "\n"
