"""The keys each ``fedhpro`` command takes for itself (besides the run keys it hands on), declared beside the
command as options dataclasses (:mod:`.keys`): ``fedhpro compare`` (:mod:`.compare`), ``fedhpro tune``
(:mod:`.tune`), ``fedhpro report`` (:mod:`.report`), ``fedhpro reproduce`` (:mod:`.reproduce`), and the sweep's
(:mod:`.sweep`) of compare and reproduce. :data:`COMMAND_OPTIONS` is what ``fedhpro config --keys`` and the config
reference list. Torch-free, as every option declaration: ``fedhpro config --keys`` and a refused command key
answer before torch loads."""

from __future__ import annotations

from fedhpro.command_options.compare import CompareOptions
from fedhpro.command_options.keys import key_lines as options_lines
from fedhpro.command_options.report import ReportOptions
from fedhpro.command_options.reproduce import ReproduceOptions
from fedhpro.command_options.sweep import Sweep
from fedhpro.command_options.tune import TuneOptions

#: each command with its keys' options, in the order ``fedhpro config --keys`` lists them
COMMAND_OPTIONS: dict[str, tuple[type, ...]] = {
    "compare": (CompareOptions, Sweep),
    "tune": (TuneOptions,),
    "report": (ReportOptions,),
    "reproduce": (ReproduceOptions, Sweep),
}


def key_lines() -> list[str]:
    """``command: key [choices]: help (default: value)`` of every command's keys, as ``fedhpro config --keys``
    lists keys."""
    return [line for command, classes in COMMAND_OPTIONS.items() for cls in classes
            for line in options_lines(command, cls)]


__all__ = ["COMMAND_OPTIONS", "CompareOptions", "ReportOptions", "ReproduceOptions", "Sweep", "TuneOptions",
           "key_lines"]
