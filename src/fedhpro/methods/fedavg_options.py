"""FedAvg's options and declaration (:class:`~fedhpro.methods.declaration.MethodDeclaration`): what the
config, ``fedhpro config --keys`` and the reports read. No torch; the method's code is
:mod:`fedhpro.methods.fedavg`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.methods.declaration import MethodDeclaration


@dataclass
class FedAvgOptions:
    """FedAvg has no knobs beyond the shared training settings."""


#: ``method=fedavg`` as the registry declares it (its code, ``fedhpro.methods.fedavg:METHOD``, loads on first use)
DECLARATION = MethodDeclaration(
    name="fedavg",
    options=FedAvgOptions,
    paper_order=0,
    baseline=True,
    description="FedAvg: local SGD, weighted averaging by n_k",
)
