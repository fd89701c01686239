"""FedGMKD's options and declaration (:class:`~fedhpro.methods.declaration.MethodDeclaration`): what the
config, ``fedhpro config --keys`` and the reports read. No torch; the method's code is
:mod:`fedhpro.methods.fedgmkd`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.methods.declaration import MethodDeclaration
from fedhpro.methods.prototype_options import PrototypeOptions, weights_travel
from fedhpro.options import option
from fedhpro.search_space import LogUniform


@dataclass
class FedGMKDOptions(PrototypeOptions):
    lam: float = option(0.6, min=0.0, help="lambda, weight of KL(S^ || softmax(h(P)/T)) (paper C.1: 0.6)",
                        search=LogUniform(0.05, 5.0))
    gamma: float = option(0.5, min=0.0, help="weight of MSE(z, P_y) (paper C.1: 0.5)", search=LogUniform(0.05, 5.0))
    temperature: float = option(0.6, gt=0.0, help="T of the soft predictions", search=LogUniform(0.1, 5.0))
    kl_reduction: str = option("mean", choices=("mean", "batchmean"),
                               help="mean: KL averaged over held classes and the C outputs (KL / C), as the "
                                    "authors' nn.KLDivLoss() with which lam = 0.6 was tuned; batchmean: the "
                                    "textbook KL summed over outputs, averaged over classes (C times stronger)")
    max_components: int = option(6, min=1, help="GMM components tried: 1..min(n_c, max_components), lowest BIC")
    max_samples: int = option(500, min=0, help="at most this many random samples per class enter the GMM (0: all)")
    covariance: str = option("diag", choices=("full", "diag", "tied", "spherical"),
                             help="GMM covariance type. The prototype (the mixture mean) equals the class mean "
                                  "whatever the type, so the default is the fast diag; the authors use full "
                                  "(~10x slower at d=512), which only changes the BIC-selected component count")
    dat_a: float = option(0.4, min=0.0, help="DAT discrepancy coefficient a")
    dat_b: float = option(0.2, min=0.0, help="DAT offset b")


#: ``method=fedgmkd`` as the registry declares it (its code, ``fedhpro.methods.fedgmkd:METHOD``, loads on first use)
DECLARATION = MethodDeclaration(
    name="fedgmkd",
    options=FedGMKDOptions,
    paper_order=5,
    # privacy=client: its raw prototypes and soft predictions share a joint clip with the update and drown it;
    # per-group clipping measured 75.6-80.9 % against 15.9-22.3 % joint (docs/how-to/privacy.md)
    dp_clipping="per-group",
    description="FedGMKD: GMM prototypes + soft-label distillation, discrepancy-aware (DAT) aggregation",
    weights_travel=weights_travel,
    needs_each_upload="its DAT step weights each client by the discrepancy of that client's own soft predictions",
)
