"""Operations tooling for a secured Flower deployment of fedhpro: certificates and keys
(:mod:`~fedhpro.deploy.certificates`), the nginx access layer in front of the SuperLink
(:mod:`~fedhpro.deploy.gate`) and a supervised deployment on loopback (:mod:`~fedhpro.deploy.up`).

Commands: ``python -m fedhpro.deploy certificates|gate|up ...``. It starts Flower's own programs
(``flower-superlink``, ``flower-supernode``, ``flwr``) and nginx; it imports none of fedhpro's methods,
engines, API or Flower apps (:mod:`fedhpro.flower`, which runs on what it sets up).
"""
