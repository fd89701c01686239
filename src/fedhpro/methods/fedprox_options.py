"""FedProx's options and declaration (:class:`~fedhpro.methods.declaration.MethodDeclaration`): what the
config, ``fedhpro config --keys`` and the reports read. No torch; the method's code is
:mod:`fedhpro.methods.fedprox`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.methods.declaration import MethodDeclaration
from fedhpro.options import option
from fedhpro.search_space import LogUniform


@dataclass
class FedProxOptions:
    mu: float = option(0.01, min=0.0, help="proximal coefficient mu of (mu/2)||w - w^t||^2 (paper C.1: 0.01)",
                       search=LogUniform(1e-4, 1.0))


#: ``method=fedprox`` as the registry declares it (its code, ``fedhpro.methods.fedprox:METHOD``, loads on first use)
DECLARATION = MethodDeclaration(
    name="fedprox",
    options=FedProxOptions,
    paper_order=1,
    description="FedProx: CE + (mu/2)||w - w^t||^2 on the received trainable parameters; FedAvg server",
)
