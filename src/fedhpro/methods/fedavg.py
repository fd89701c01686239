"""FedAvg (McMahan et al., AISTATS 2017): local SGD on cross-entropy, n_k-weighted averaging."""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.methods.base import Client, MethodSpec, Server


@dataclass
class FedAvgOptions:
    """FedAvg has no knobs beyond the shared training settings."""


METHOD = MethodSpec(
    name="fedavg",
    paper_order=0,
    baseline=True,
    options=FedAvgOptions,
    server=Server,
    client=Client,
    description="FedAvg: local SGD, weighted averaging by n_k",
)
