"""The MOON authors' projection head, for any model and any method.

MOON's code (Li, He and Song, CVPR 2021, ``model.py``'s ``ModelFedCon``) puts a
two-layer head between the feature extractor and the classifier: the feature
``r`` (width ``d``) goes through ``Linear(d, d)``, ReLU and ``Linear(d, P)``
(``P = 256`` in their runs) to the projection, and the last layer classifies the
projection. Their ``init_nets`` builds that network for every algorithm they
run, FedAvg and FedProx included, so their tables compare methods on it.

fedhpro's methods see a model as ``features`` (x -> B x d) and ``classifier``
(``nn.Linear(d, C)``). :func:`with_projection_head` keeps that form: the head
joins ``features`` (so ``features(x)`` is the projection, what MOON contrasts and
what prototype methods would average) and ``classifier`` becomes
``Linear(P, C)``. The run key ``projection_head=true`` gives it to every method;
``moon.projection_head=authors`` to MOON alone.
"""

from __future__ import annotations

from typing import cast

from torch import Tensor, nn

#: the projection width of the authors' runs (``--out_dim``'s default, 256)
AUTHORS_PROJECTION_DIM = 256


class ProjectionHeadNet(nn.Module):
    """``features = Sequential(base.features, Linear(d, d), ReLU, Linear(d, P))``, ``classifier = Linear(P, C)``.

    ``base.classifier`` is dropped (the authors' ``l3`` classifies the projection,
    not the feature). The layers are made in the order l1, l2, classifier, so the
    same seed gives the same weights wherever the head is added.
    """

    def __init__(self, base: nn.Module, projection_dim: int, num_classes: int):
        super().__init__()
        width = feature_width(base)
        self.features = nn.Sequential(cast(nn.Module, base.features), nn.Linear(width, width), nn.ReLU(),
                                      nn.Linear(width, projection_dim))
        self.classifier = nn.Linear(projection_dim, num_classes)
        self.base_feature_dim = width
        self.feature_dim = projection_dim
        self.num_classes = num_classes
        self.input_kind = getattr(base, "input_kind", "image")

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


def feature_width(model: nn.Module) -> int:
    """``d``, the width of ``model.features``' output: its ``feature_dim``, else its classifier's input size."""
    declared = getattr(model, "feature_dim", None)
    if declared:
        return int(declared)
    classifier = model.classifier
    assert isinstance(classifier, nn.Linear), "a fedhpro model's classifier is an nn.Linear(d, C)"
    return int(classifier.in_features)


def with_projection_head(model: nn.Module, num_classes: int,
                         projection_dim: int = AUTHORS_PROJECTION_DIM) -> ProjectionHeadNet:
    """``model`` with the authors' head (see :class:`ProjectionHeadNet`); a model that has one already is
    returned as it is, so the run switch and MOON's own setting never stack two heads.

    Raises ``ValueError`` when ``model`` already has a head of another width than ``projection_dim``.
    """
    if isinstance(model, ProjectionHeadNet):
        if model.feature_dim != projection_dim:
            raise ValueError(f"the model already has a projection head of width {model.feature_dim}, "
                             f"not {projection_dim}")
        return model
    return ProjectionHeadNet(model, int(projection_dim), num_classes)

