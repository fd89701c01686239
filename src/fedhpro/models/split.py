"""``split(model, head="fc")``: any network whose last layer is a Linear head, in fedhpro's form.

fedhpro's methods need ``features`` (x -> B x d) and ``classifier``
(``nn.Linear(d, C)``) as two parts: prototype methods read the features,
FedHPro matches gradients of the classifier, heterogeneous federations share
only the classifier. A torchvision-style model has them in one network with
its head as an attribute (``resnet18().fc``, ``mobilenet_v2().classifier[1]``);
:func:`split` takes the head out and puts it back beside the rest.
"""

from __future__ import annotations

import copy

from torch import Tensor, nn

from fedhpro.errors import ConfigError


class SplitModel(nn.Module):
    """``features`` (the body, output flattened to B x d) then ``classifier`` (the head, ``nn.Linear(d, C)``)."""

    def __init__(self, features: nn.Module, classifier: nn.Linear):
        super().__init__()
        self.features = features
        self.classifier = classifier
        self.feature_dim = classifier.in_features
        self.num_classes = classifier.out_features

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x))


def split(model: nn.Module, head: str = "fc", *, num_classes: int | None = None) -> SplitModel:
    """``model`` as fedhpro's ``features`` + ``classifier``, computing the same function.

    Args:
        model: a network whose forward ends with the Linear layer ``head``
            (applied to flat B x d features, nothing after it), e.g.
            ``torchvision.models.resnet18(num_classes=10)``. It is copied: the
            model passed in stays as it was.
        head: the attribute path of that layer: ``"fc"`` (ResNet),
            ``"head"`` (ViT-style), ``"classifier.1"`` (MobileNetV2, an index
            into a Sequential).
        num_classes: a new head with this many outputs (freshly initialised)
            when it differs from the head's; by default the head is kept.

    Returns:
        A :class:`SplitModel`: ``features`` is the copy with its head replaced
        by ``nn.Identity`` (output flattened), ``classifier`` the head, and
        ``forward(x) == classifier(features(x))`` equals ``model(x)``; it has
        ``feature_dim`` and ``num_classes`` like the zoo's models.

    Raises:
        ConfigError: ``head`` does not name an ``nn.Linear`` of ``model``.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"split() takes an nn.Module, got {type(model).__name__}")
    body = copy.deepcopy(model)
    *path, last = head.split(".")
    parent: nn.Module = body
    for depth, part in enumerate(path):
        child = getattr(parent, part, None) if part else None
        if not isinstance(child, nn.Module):
            raise ConfigError(f"split(head={head!r}): {type(model).__name__} has no module "
                              f"{'.'.join(path[:depth + 1])!r}; name the path to its last Linear layer")
        parent = child
    layer = getattr(parent, last, None) if last else None
    if not isinstance(layer, nn.Linear):
        found = "nothing" if layer is None else f"a {type(layer).__name__}"
        inner = [name for name, module in layer.named_modules() if isinstance(module, nn.Linear)] \
            if isinstance(layer, nn.Module) else []
        if inner:
            hint = f"its last Linear layer is head={head + '.' + inner[-1]!r}"
        else:
            hint = f"children of {'.'.join(path) or 'the model'}: " + (
                ", ".join(name for name, _ in parent.named_children()) or "none")
        raise ConfigError(f"split(head={head!r}) found {found}, not an nn.Linear; name the model's last Linear "
                          f"layer ({hint})")
    setattr(parent, last, nn.Identity())
    classifier = layer
    if num_classes is not None and int(num_classes) != layer.out_features:
        if int(num_classes) < 1:
            raise ConfigError(f"split(num_classes={num_classes}): give at least one class")
        classifier = nn.Linear(layer.in_features, int(num_classes), bias=layer.bias is not None,
                               device=layer.weight.device, dtype=layer.weight.dtype)
    return SplitModel(nn.Sequential(body, nn.Flatten(1)), classifier)
