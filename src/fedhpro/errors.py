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


def run_handler(args: argparse.Namespace, prog: str) -> int:
    """A command's exit code: ``args.handler(args)``, or 2 after one line ``PROG: error: ...`` on stderr for a
    :class:`FedHProError` (the ``main`` of ``python -m fedhpro.flower`` and ``python -m fedhpro.deploy``)."""
    try:
        return args.handler(args)
    except FedHProError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
