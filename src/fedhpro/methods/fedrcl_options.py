"""FedRCL's options and declaration (:class:`~fedhpro.methods.declaration.MethodDeclaration`): what the
config, ``fedhpro config --keys`` and the reports read. No torch; the method's code is
:mod:`fedhpro.methods.fedrcl`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.methods.declaration import MethodDeclaration
from fedhpro.options import option
from fedhpro.search_space import LogUniform


@dataclass
class FedRCLOptions:
    tau: float = option(0.05, gt=0.0,
                        help="temperature of the relaxed contrastive loss and the penalty (paper C.1: 0.05)",
                        search=LogUniform(0.01, 1.0))
    beta: float = option(1.0, min=0.0, help="weight beta of the divergence penalty (paper C.1: 1.0)",
                         search=LogUniform(0.01, 10.0))
    threshold: float = option(0.7, min=-1.0, max=1.0,
                              help="similarity threshold of the penalty: m' = least similar same-class "
                                   "similarity if >= threshold, else -1 (the authors' 0.7)")
    num_negatives: int = option(2, min=1, help="hardest negatives per sample (the authors' topk_neg = 2)")
    max_grad_norm: float = option(10.0, min=0.0, alias_of="max_grad_norm",
                                  help="FedRCL's own cap on the local gradient's L2 norm (the authors' 10; 0 = no "
                                       "clipping), used when the run key max_grad_norm is unset; the old spelling "
                                       "of max_grad_norm: setting it warns, and both set to different values is "
                                       "refused")


#: ``method=fedrcl`` as the registry declares it (its code, ``fedhpro.methods.fedrcl:METHOD``, loads on first use)
DECLARATION = MethodDeclaration(
    name="fedrcl",
    options=FedRCLOptions,
    paper_order=6,
    description="FedRCL: CE + relaxed supervised contrastive loss and divergence penalty at every backbone stage",
)
