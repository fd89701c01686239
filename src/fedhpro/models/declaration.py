"""What a config and :func:`fedhpro.models.build_model` read of a model before its code (and torch) is imported:
its :class:`ModelDeclaration`."""

from __future__ import annotations

from dataclasses import dataclass

#: what a model takes: ``image`` (input_shape = C x H x W), ``tokens`` (input_shape = (L,), LongTensor token
#: ids) or ``any`` (the constructor checks the shape itself, e.g. ``mlp``: any float shape, flattened)
INPUT_KINDS = ("image", "tokens", "any")


@dataclass(frozen=True)
class ModelDeclaration:
    """A model known by name before its code is imported: the inputs it takes (one of :data:`INPUT_KINDS`, the
    constructor's ``input_kind``) and a one-line description."""

    input_kind: str = "image"
    description: str = ""

    def __post_init__(self) -> None:
        if self.input_kind not in INPUT_KINDS:
            raise ValueError(f"ModelDeclaration.input_kind={self.input_kind!r}: choose one of "
                             f"{', '.join(INPUT_KINDS)}")


__all__ = ["INPUT_KINDS", "ModelDeclaration"]
