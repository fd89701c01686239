"""The ``faults.*`` keys: the client faults a run injects (:class:`FaultOptions`), declared beside their code
(:mod:`fedhpro.engines.faults`, which imports torch) in a torch-free module of their own, so that ``fedhpro config
--keys`` and a refused ``faults.*`` value answer before torch loads."""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.errors import ConfigError
from fedhpro.options import option

#: the config section of these options
FAULTS_SECTION = "faults"


@dataclass
class FaultOptions:
    dropout: float = option(0.0, min=0.0, max=1.0, help="probability that a sampled client does not answer")
    corrupt: float = option(0.0, min=0.0, max=1.0,
                            help="probability that an answering client's reply arrives with NaN weights (a "
                                 "transmission fault: it is dropped, the client keeps the state it computed)")
    scale: float = option(0.0, min=0.0, max=1.0,
                          help="probability that an answering client is hostile and sends w_global + "
                               "scale_factor * Delta (Delta = its update w_k - w_global) and its class tensors "
                               "(prototypes, class gradients, soft predictions) times scale_factor")
    scale_factor: float = option(100.0, help="what a hostile client of faults.scale multiplies its update by")
    sign_flip: float = option(0.0, min=0.0, max=1.0,
                              help="probability that an answering client is hostile and sends w_global - Delta "
                                   "and its class tensors negated (faults.scale + faults.sign_flip <= 1)")

    def __post_init__(self) -> None:
        if self.scale + self.sign_flip > 1.0:
            raise ConfigError(f"faults.scale={self.scale} + faults.sign_flip={self.sign_flip} exceeds 1 (one draw "
                              "decides which a client is); lower one of them")


__all__ = ["FAULTS_SECTION", "FaultOptions"]
