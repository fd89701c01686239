"""MOON's options and declaration (:class:`~fedhpro.methods.declaration.MethodDeclaration`): what the
config, ``fedhpro config --keys`` and the reports read. No torch; the method's code is
:mod:`fedhpro.methods.moon`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.methods.declaration import MethodDeclaration
from fedhpro.options import option
from fedhpro.search_space import LogUniform


@dataclass
class MoonOptions:
    mu: float = option(1.0, min=0.0, help="weight mu of the model-contrastive loss (paper C.1: 1.0)",
                       search=LogUniform(0.01, 10.0))
    tau: float = option(0.5, gt=0.0, help="temperature tau of the model-contrastive loss (paper C.1: 0.5)",
                        search=LogUniform(0.05, 1.0))
    projection_head: str = option("none", choices=("none", "authors"),
                                  help="none: contrast the feature z of the common network every method trains; "
                                       "authors: MOON alone gets the authors' head d -> d -> P, classifier on the "
                                       "projection (projection_head=true gives it to every method)")
    projection_dim: int = option(256, min=1, help="output size P of the authors' head d -> d -> P "
                                                  "(moon.projection_head=authors)")


#: ``method=moon`` as the registry declares it (its code, ``fedhpro.methods.moon:METHOD``, loads on first use)
DECLARATION = MethodDeclaration(
    name="moon",
    options=MoonOptions,
    paper_order=2,
    description="MOON: CE + mu * model-contrastive loss (global vs previous local model) on the features "
                "(moon.projection_head=authors: on the authors' projection head)",
)
