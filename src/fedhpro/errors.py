"""Errors that reach the user as one clear line (the CLI prints them without a traceback)."""

from __future__ import annotations

import argparse
import sys


class FedHProError(Exception):
    """Base class: a problem the user can fix; the message names the problem and the fix."""


class ConfigError(FedHProError, ValueError):
    """A wrong config key or value."""


class DataError(FedHProError, RuntimeError):
    """Missing or malformed data."""


class UpdateError(FedHProError):
    """A malformed or non-finite client update."""


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (SIGINT) in its folder ``out``: ``completed_rounds`` is the round of its newest
    checkpoint (what ``resume=`` continues from), None when none was written yet. A KeyboardInterrupt still, so
    that whoever stops on Ctrl-C stops on it; ``fedhpro run`` says how to continue."""

    def __init__(self, out: str, completed_rounds: int | None):
        super().__init__(out, completed_rounds)
        self.out, self.completed_rounds = out, completed_rounds


def run_handler(args: argparse.Namespace, prog: str) -> int:
    """A command's exit code: ``args.handler(args)``, or 2 after one line ``PROG: error: ...`` on stderr for a
    :class:`FedHProError` (the ``main`` of ``python -m fedhpro.flower`` and ``python -m fedhpro.deploy``)."""
    try:
        return args.handler(args)
    except FedHProError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
