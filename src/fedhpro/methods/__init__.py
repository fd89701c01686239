"""Federated learning methods, by name. Adding one is one new module plus one line in ``METHODS``."""

from __future__ import annotations

from fedhpro.methods import fedavg, fedgmkd, fedhpro, fedprox, fedproto, fedrcl, fedsa, fedtgp, moon
from fedhpro.methods.base import (
    Client,
    ClientData,
    MethodContext,
    MethodSpec,
    Replies,
    Server,
    TrainSettings,
)

METHODS: dict[str, MethodSpec] = {
    "fedavg": fedavg.METHOD,
    "fedhpro": fedhpro.METHOD,
    "fedprox": fedprox.METHOD,
    "moon": moon.METHOD,
    "fedrcl": fedrcl.METHOD,
    "fedproto": fedproto.METHOD,
    "fedtgp": fedtgp.METHOD,
    "fedgmkd": fedgmkd.METHOD,
    "fedsa": fedsa.METHOD,
}

__all__ = ["METHODS", "Client", "ClientData", "MethodContext", "MethodSpec", "Replies", "Server", "TrainSettings"]
