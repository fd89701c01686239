"""What a config, ``fedhpro config --keys``, a listing and the reports read of a method without running it.

A :class:`MethodDeclaration` holds a method's name, its options class (the ``<name>.<knob>`` keys), its
description, its recipes and the other facts a config or a report reads (its place in the paper's tables, whether
it is the comparisons' baseline, how ``privacy.clipping=auto`` clips its upload, ...). This module imports no
torch, nor does any method's declaration module (``fedhpro.methods.fedavg_options``, ...,
``fedhpro.methods.fedhpro.options``), so the config checks every key and value before torch loads; the method's
code (its :class:`~fedhpro.methods.base.MethodSpec`: server, client, model wrapper, inference rule) is imported on
the first lookup of its name (``REGISTRY.declare(name, DECLARATION, "module:METHOD")`` in
:mod:`fedhpro.methods`). A built-in's ``METHOD`` is built from its ``DECLARATION``
(:meth:`~fedhpro.methods.base.MethodSpec.from_declaration`), and every spec gives its declaration back
(:attr:`~fedhpro.methods.base.MethodSpec.declaration`), a plug-in's registered whole too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedhpro.errors import ConfigError

__all__ = ["DP_CLIPPINGS", "MethodDeclaration", "check_dp_clipping"]

#: what a method may declare as its ``dp_clipping`` (:attr:`MethodDeclaration.dp_clipping`)
DP_CLIPPINGS = ("joint", "per-group")


def check_dp_clipping(kind: str, name: str, dp_clipping: object) -> None:
    """ConfigError (one line) unless ``dp_clipping`` is one of :data:`DP_CLIPPINGS`; ``kind`` names the class
    being built (``MethodSpec``, ``MethodDeclaration``) in the message."""
    if dp_clipping not in DP_CLIPPINGS:
        raise ConfigError(f"{kind}(name={name!r}, dp_clipping={dp_clipping!r}): say 'joint' or 'per-group'")


@dataclass(frozen=True)
class MethodDeclaration:
    """A method as a config reads it: everything but its code (which is in its
    :class:`~fedhpro.methods.base.MethodSpec`)."""

    #: the method's name (``method=<name>``, the ``<name>.<knob>`` keys)
    name: str
    #: the options dataclass: its fields are the ``<name>.<knob>`` keys, each with a default
    options: type
    #: one line, led by the name as the paper writes it ("FedAvg: ..."): ``fedhpro methods``, the figures
    description: str = ""
    #: named recipes: recipe name -> the settings ``<name>.recipe=<recipe>`` applies before the user's (the
    #: options need a ``recipe`` field); fedhpro.config applies whatever recipe a method declares
    recipes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: optional ``options -> "all" | "none"``: which model weights travel between server and clients under
    #: these options ("none": every client keeps its own model and only the method's other payloads travel,
    #: e.g. the prototype methods' protocol=proto-only); without it, "all". The engines send the classifier
    #: only when the clients' architectures differ (heterogeneity=), whatever the method declares.
    weights_travel: Callable[[Any], str] | None = None
    #: why the server's step needs each client's own upload, not only their sums (FedTGP trains on every
    #: client's prototypes); "" (the default): a function of sums, weighted as the reply layout declares
    #: (:attr:`~fedhpro.methods.layout.ClassRows.averaged`). Secure aggregation refuses a method that says why,
    #: quoting it.
    needs_each_upload: str = ""
    #: the method's place in the paper's tables (FedAvg, FedProx, MOON, FedProto, FedTGP, FedGMKD, FedRCL,
    #: FedSA, FedHPro): a default ``fedhpro compare`` runs every registered method, these in this order and
    #: the others (plug-ins) after them by name; None: not in the paper
    paper_order: int | None = None
    #: the method a comparison's gain column is measured against (one method: FedAvg)
    baseline: bool = False
    #: how ``privacy=client`` clips this method's upload under ``privacy.clipping=auto`` (the default): "joint" (the
    #: whole upload to the clip) or "per-group" (the weight update and each class tensor to clip/sqrt(groups)), the
    #: choice measured for the method (docs/how-to/privacy.md): a method whose raw class rows (prototypes) are far
    #: longer than its update loses the update's signal under a joint clip
    dp_clipping: str = "joint"

    def __post_init__(self) -> None:
        where = f"{type(self).__name__}(name={self.name!r})"
        if not isinstance(self.options, type) or not dataclasses.is_dataclass(self.options):
            raise ConfigError(f"{where}: options must be a dataclass class (the {self.name}.<knob> keys), got "
                              f"{self.options!r}")
        try:
            self.options()
        except TypeError:
            raise ConfigError(f"{where}: every field of {self.options.__name__} needs a default (a run may leave "
                              "every knob unset)") from None
        check_dp_clipping(type(self).__name__, self.name, self.dp_clipping)
