"""Measurements of a federated run, as pure functions (no engine, no method, no file I/O).

* :mod:`.fairness` -- per-client accuracy statistics of the paper's Table A8 (Li et al., 2020c).
* :mod:`.communication` -- bytes and parameter counts of a payload (Table 4's Upload and Comm.).
* :mod:`.convergence` -- R_acc, the first round reaching an accuracy, and the speed-up vs FedAvg (Table A4).
* :mod:`.prototypes` -- class means and L2 distances to the centralized prototypes (Figure 2).
* :mod:`.flops` -- FLOPs of a call with ``torch.utils.flop_counter`` (Table 4's FLOPs).
* :mod:`.embedding` -- a 2-D t-SNE embedding of features (Figures 3 and 6).

Engines and reports import this package; of ``fedhpro`` it imports only :mod:`fedhpro.functional`
(:mod:`.prototypes` builds on its class means) and :mod:`fedhpro.errors`.
"""

from fedhpro.metrics.communication import payload_bytes, payload_parameters
from fedhpro.metrics.convergence import rounds_to_accuracy, speedup
from fedhpro.metrics.fairness import fairness_statistics
from fedhpro.metrics.flops import FlopCounter
from fedhpro.metrics.prototypes import class_means, mean_client_prototypes, prototype_distance

__all__ = ["FlopCounter", "class_means", "fairness_statistics", "mean_client_prototypes", "payload_bytes",
           "payload_parameters", "prototype_distance", "rounds_to_accuracy", "speedup"]
