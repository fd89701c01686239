"""Run any fedhpro method on Flower (flwr 1.42, Message API): simulation engine or real SuperLink/SuperNodes.

* :data:`fedhpro.flower.server.app` / :func:`~fedhpro.flower.server.make_server_app`: the ServerApp
  (the method's server part, the simulator's sampling, validation and evaluation);
* :data:`fedhpro.flower.client.app`: the ClientApp (the method's client part on partition
  ``partition-id`` of the federation);
* :mod:`fedhpro.flower.strategy`: the rounds (the shared round protocol's messages);
  :mod:`fedhpro.flower.nodes` and :mod:`fedhpro.flower.answers`: node discovery, the roster of client ->
  node, and the checks of what nodes answer; :mod:`fedhpro.flower.secagg` and
  :mod:`fedhpro.flower.secure_sum`: SecAgg+;
* :mod:`fedhpro.flower.records`: payloads <-> ArrayRecord / ConfigRecord / MetricRecord;
* :mod:`fedhpro.flower.settings`: Flower's ``run_config`` -> a fedhpro Config.

The same seed and config give the numbers ``fedhpro run`` gives. Needs the
``flower`` extra: ``pip install "fedhpro[flower]"``. See docs/how-to/flower.md.
"""

from __future__ import annotations

import importlib.util

# asked of the installed packages, not imported: flwr takes ~0.4 s to import, and the torch-free declarations of
# this package (fedhpro.flower.options: the flower.* keys) are read by ``fedhpro config`` without it
if importlib.util.find_spec("flwr") is None:  # pragma: no cover - depends on the install
    from fedhpro.errors import ConfigError

    raise ConfigError('fedhpro.flower needs Flower: pip install "fedhpro[flower]"')
