"""FedSA's options and declaration (:class:`~fedhpro.methods.declaration.MethodDeclaration`): what the
config, ``fedhpro config --keys`` and the reports read. No torch; the method's code is
:mod:`fedhpro.methods.fedsa`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.methods.declaration import MethodDeclaration
from fedhpro.methods.prototype_options import RAW_PROTOTYPES_CLIPPING, PrototypeOptions, weights_travel
from fedhpro.options import option
from fedhpro.search_space import LogUniform


@dataclass
class FedSAOptions(PrototypeOptions):
    lambda1: float = option(0.1, min=0.0, help="weight of the classifier calibration CE(h(A), [0..C-1])",
                            search=LogUniform(0.01, 10.0))
    lambda2: float = option(0.9, min=0.0, help="weight of MSE(z, A_y)", search=LogUniform(0.01, 10.0))
    lambda3: float = option(1.0, min=0.0, help="weight of the margin-enhanced contrastive CE",
                            search=LogUniform(0.01, 10.0))
    anchor_momentum: float = option(0.9999, min=0.0, max=1.0,
                                    help="m in A <- m A + (1 - m) Pbar after each round")


#: ``method=fedsa`` as the registry declares it (its code, ``fedhpro.methods.fedsa:METHOD``, loads on first use)
DECLARATION = MethodDeclaration(
    name="fedsa",
    options=FedSAOptions,
    paper_order=7,
    dp_clipping=RAW_PROTOTYPES_CLIPPING,
    description="FedSA: fixed random semantic anchors (EMA of prototypes), calibration + MSE + margin CE",
    weights_travel=weights_travel,  # protocol=proto-only: every client keeps its own model
)
