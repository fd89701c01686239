"""Operations tooling for a secured Flower deployment of fedhpro: certificates and keys
(:mod:`~fedhpro.deploy.certificates`), the nginx access layer in front of the SuperLink
(:mod:`~fedhpro.deploy.gate`) and a supervised deployment on loopback (:mod:`~fedhpro.deploy.up`, with its
network namespaces in :mod:`~fedhpro.deploy.namespaces` and its process supervision in
:mod:`~fedhpro.deploy.processes`).

Commands: ``python -m fedhpro.deploy certificates|gate|up ...``. It starts Flower's own programs
(``flower-superlink``, ``flower-supernode``, ``flwr``) and nginx; it imports none of fedhpro's methods,
engines, API or Flower apps (:mod:`fedhpro.flower`, which runs on what it sets up).
"""

from __future__ import annotations

try:  # the certificates need it; it comes with the flower extra (Flower's own TLS needs it too)
    import cryptography  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the install
    from fedhpro.errors import ConfigError

    raise ConfigError('fedhpro.deploy needs the flower extra: pip install "fedhpro[flower]"') from error
