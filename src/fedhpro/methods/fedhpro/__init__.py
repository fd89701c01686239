"""FedHPro: federated hyper-prototype learning via gradient matching (the paper, Algorithm 1), in one package.

Server: FedAvg on the weights, then ``match_steps`` steps of gradient
matching (Eq. 6-9) on the hyper-prototypes S (C x |I| x d), which persist
across rounds. Client: CE + HPCL (Eq. 11-12, with the margin of Eq. 10) +
HPAL (Eq. 13) against S, then the class-wise feature gradients of Eq. 5.

Table 6's ablation, ``prototypes=global|global-hpcl|global-hpal``: the clients
also upload their local prototypes (only then: the method itself never reads
them), and the server aggregates them into the global prototypes P of
Eq. 4 (as printed, so scaled by 1/|A^c|; both losses are scale-free in the
default normalised HPAL) and sends them; clients then use P (as ``C x 1 x d``)
in place of S in both losses, in HPCL only or in HPAL only. A class nobody has
held yet has no P: its samples get no term from the loss that uses P and it is
no negative in HPCL; before the first aggregation (round 0) that loss is off,
as FedProto's prototype term. Classes nobody holds in a later round keep their
previous P.

The authors' published code differs from the paper in a few settings; each is
an option here, and ``recipe=authors`` sets all of them at once
(:data:`~fedhpro.methods.fedhpro.options.AUTHORS_RECIPE`), among them a server step the paper does not
describe, ``classifier_step=synthetic`` (:class:`~fedhpro.methods.fedhpro.hyper.SyntheticClassifier`).

The modules, from the bottom:

- :mod:`~fedhpro.methods.fedhpro.options`: :class:`FedHProOptions`, the authors' recipe, the description and the
  ``DECLARATION`` the registry declares (no torch: config validation and ``fedhpro config --keys`` read them before
  torch loads; so does this ``__init__``);
- :mod:`~fedhpro.methods.fedhpro.equations`: the paper's Eq. 4-13 as pure functions on tensors;
- :mod:`~fedhpro.methods.fedhpro.authors_code`: what the authors' published code computes where it is not the paper;
- :mod:`~fedhpro.methods.fedhpro.hyper`: the hyper-prototype bank (also FedProto's and FedTGP's ``prototypes=hyper``);
- :mod:`~fedhpro.methods.fedhpro.server`, :mod:`~fedhpro.methods.fedhpro.client`: the two sides, each choosing
  its modes once, when it is built;
- :mod:`~fedhpro.methods.fedhpro.method`: ``METHOD``, the registry's entry (built from ``DECLARATION``), imported
  on the first lookup of ``method=fedhpro``.
"""

from fedhpro.methods.fedhpro.options import AUTHORS_RECIPE, FedHProOptions

__all__ = ["AUTHORS_RECIPE", "FedHProOptions"]
