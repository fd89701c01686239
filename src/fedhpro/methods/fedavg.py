"""FedAvg (McMahan et al., AISTATS 2017): local SGD on cross-entropy, n_k-weighted averaging."""

from __future__ import annotations

from fedhpro.methods.base import Client, MethodSpec, Server
from fedhpro.methods.fedavg_options import DECLARATION
from fedhpro.methods.fedavg_options import FedAvgOptions as FedAvgOptions

METHOD = MethodSpec.from_declaration(
    DECLARATION,
    server=Server,
    client=Client,
)
