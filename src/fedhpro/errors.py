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


class TrainingDiverged(UpdateError):
    """A client's local training exploded: its mean cross-entropy over the round is non-finite or far above its
    first batch's (:func:`fedhpro.methods.training.divergence`). Not a faulty client but the run's settings (the
    learning rate, the gradient cap), so the in-process simulator stops the run with it instead of dropping the
    client. ``detail`` says what rose and which lr and cap trained; the message, ``local training diverged:
    <detail>``, stands alone (a Flower node sends it as its error); :meth:`at` names the client and the round."""

    def __init__(self, detail: str, subject: str = "local training diverged"):
        super().__init__(f"{subject}: {detail}")
        self.detail = detail

    def at(self, client: int, round: int) -> TrainingDiverged:
        """The same divergence said of client ``client`` in round ``round`` (counted from 1, as people read it):
        ``client 7 diverged in round 1: <detail>``."""
        return TrainingDiverged(self.detail, f"client {client} diverged in round {round}")


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
