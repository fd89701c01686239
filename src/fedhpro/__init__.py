"""fedhpro: FedHPro (Federated Hyper-Prototype Learning via Gradient Matching) and its baselines.

``fedhpro.run(config)`` runs one federated training; ``fedhpro.functional``
holds the paper's equations as pure functions.
"""

from fedhpro.errors import ConfigError, DataError, FedHProError, UpdateError

__version__ = "0.1.0"


def run(*args, **kwargs):
    """Run one federated training; see :func:`fedhpro.api.run`."""
    from fedhpro.api import run as _run

    return _run(*args, **kwargs)


__all__ = ["run", "ConfigError", "DataError", "FedHProError", "UpdateError", "__version__"]
