"""FedProto's options and declaration (:class:`~fedhpro.methods.declaration.MethodDeclaration`): what the
config, ``fedhpro config --keys`` and the reports read. No torch; the method's code is
:mod:`fedhpro.methods.fedproto`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.methods.declaration import MethodDeclaration
from fedhpro.methods.prototype_options import RAW_PROTOTYPES_CLIPPING, PrototypeOptions, weights_travel
from fedhpro.options import option
from fedhpro.search_space import LogUniform


@dataclass
class FedProtoOptions(PrototypeOptions):
    lam: float = option(1.0, min=0.0, help="lambda of the prototype MSE term", search=LogUniform(0.01, 10.0))


#: ``method=fedproto`` as the registry declares it (its code, ``fedhpro.methods.fedproto:METHOD``, loads on first use)
DECLARATION = MethodDeclaration(
    name="fedproto",
    options=FedProtoOptions,
    paper_order=3,
    dp_clipping=RAW_PROTOTYPES_CLIPPING,
    description="FedProto: CE + lam * MSE to the unweighted mean of the clients' class prototypes",
    weights_travel=weights_travel,
)
