"""The options every prototype method (FedProto, FedTGP, FedGMKD, FedSA) shares, and what their declarations
share: the clipping of their raw prototypes and which weights travel under their protocol. No torch: the methods'
declarations (``fedhpro.methods.fedproto_options``, ...) build on it, and the config reads them before torch loads;
the code the four methods share is :mod:`fedhpro.methods.prototypes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.options import option

PROTOCOLS = ("dagger", "proto-only")
PROTOTYPE_SOURCES = ("local", "hyper")
INFERENCE = ("head", "nearest-prototype")


@dataclass
class PrototypeOptions:
    """The options of every prototype method; each method's options dataclass extends this one."""

    protocol: str = option("dagger", choices=PROTOCOLS,
                           help="dagger: exchange model weights (FedAvg) and prototypes (the paper's default); "
                                "proto-only: exchange prototypes only, every client keeps its own model (Table A7)")
    prototypes: str = option("local", choices=PROTOTYPE_SOURCES,
                             help="local: the method's own global prototypes; hyper: the averaged hyper-prototypes "
                                  "H learned by FedHPro's gradient matching (plug-and-play, Table 3; needs "
                                  "protocol=dagger)")
    inference: str = option("head", choices=INFERENCE,
                            help="how the evaluated models classify: head (the model's own classifier) or "
                                 "nearest-prototype (argmin_c ||f(x) - P_c||_2 over the server's global "
                                 "prototypes, FedProto's inference; useful with protocol=proto-only)")
    num_hyper: int = option(5, min=1, help="|I|, hyper-prototypes per class (prototypes=hyper only)")
    match_steps: int = option(30, min=0, help="M, gradient-matching steps per round (prototypes=hyper only)")
    hyper_lr: float = option(0.1, gt=0.0, help="step size of gradient matching (prototypes=hyper only)")


#: the ``dp_clipping`` of the methods that upload raw prototypes (FedProto, FedTGP, FedSA): under privacy=client
#: their prototypes (norm far above the update) share a joint clip with the update and drown it; per-group
#: clipping measured 78-81 % against 22-54 % joint (docs/how-to/privacy.md)
RAW_PROTOTYPES_CLIPPING = "per-group"


def weights_travel(options: PrototypeOptions) -> str:
    """:attr:`~fedhpro.methods.declaration.MethodDeclaration.weights_travel` of the prototype methods: proto-only
    sends prototypes only (every client keeps its own model), dagger the weights too."""
    return "none" if options.protocol == "proto-only" else "all"


__all__ = ["INFERENCE", "PROTOCOLS", "PROTOTYPE_SOURCES", "RAW_PROTOTYPES_CLIPPING", "PrototypeOptions",
           "weights_travel"]
