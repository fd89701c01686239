"""FedTGP's options and declaration (:class:`~fedhpro.methods.declaration.MethodDeclaration`): what the
config, ``fedhpro config --keys`` and the reports read. No torch; the method's code is
:mod:`fedhpro.methods.fedtgp`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.methods.declaration import MethodDeclaration
from fedhpro.methods.prototype_options import RAW_PROTOTYPES_CLIPPING, PrototypeOptions, weights_travel
from fedhpro.options import option
from fedhpro.search_space import LogUniform


@dataclass
class FedTGPOptions(PrototypeOptions):
    lam: float = option(1.0, min=0.0, help="lambda of the prototype MSE term", search=LogUniform(0.01, 10.0))
    server_epochs: int = option(100, min=0, help="S, epochs of TGP training per round")
    server_lr: float = option(0.01, gt=0.0, help="SGD step size of TGP training", search=LogUniform(1e-3, 0.1))
    server_batch_size: int = option(10, min=1, help="batch size of TGP training")
    margin_cap: float = option(100.0, min=0.0, help="upper bound of the adaptive margin delta")


#: ``method=fedtgp`` as the registry declares it (its code, ``fedhpro.methods.fedtgp:METHOD``, loads on first use)
DECLARATION = MethodDeclaration(
    name="fedtgp",
    options=FedTGPOptions,
    paper_order=4,
    dp_clipping=RAW_PROTOTYPES_CLIPPING,
    description="FedTGP: CE + lam * MSE to trainable global prototypes learned with an adaptive-margin CE",
    weights_travel=weights_travel,
    needs_each_upload="its server trains the global prototypes on every client's own prototypes",
)
