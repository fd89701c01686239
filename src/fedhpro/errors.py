"""Errors that reach the user as one clear line (the CLI prints them without a traceback)."""


class FedHProError(Exception):
    """Base class: a problem the user can fix; the message names the problem and the fix."""


class ConfigError(FedHProError, ValueError):
    """A wrong config key or value."""


class DataError(FedHProError, RuntimeError):
    """Missing or malformed data."""


class UpdateError(FedHProError):
    """A malformed or non-finite client update."""
