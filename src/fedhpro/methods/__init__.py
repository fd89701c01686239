"""Federated learning methods, by name. Adding one is one new module plus one line in ``METHODS``."""

from __future__ import annotations

from fedhpro.methods import fedavg, fedhpro, fedprox, fedproto, fedrcl, fedtgp, moon
from fedhpro.methods.base import (
    Client,
    ClientData,
    MethodContext,
    MethodSpec,
    Server,
    TrainSettings,
    payload_bytes,
)

METHODS: dict[str, MethodSpec] = {
    "fedavg": fedavg.METHOD,
    "fedhpro": fedhpro.METHOD,
    "fedprox": fedprox.METHOD,
    "moon": moon.METHOD,
    "fedrcl": fedrcl.METHOD,
    "fedproto": fedproto.METHOD,
    "fedtgp": fedtgp.METHOD,
}

__all__ = ["METHODS", "Client", "ClientData", "MethodContext", "MethodSpec", "Server", "TrainSettings", "payload_bytes"]
