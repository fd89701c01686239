"""Model heterogeneity (the paper's Appendix, Table A9): HtFE_X assigns client k the architecture k mod X."""

from __future__ import annotations

#: the paper's heterogeneous-feature-extractor lists (Appendix C, "Impact of Model Heterogeneity")
HTFE: dict[str, list[str]] = {
    "htfe2": ["cnn4", "resnet18"],
    "htfe3": ["resnet10", "resnet18", "resnet34"],
    "htfe5": ["googlenet", "resnet10", "resnet18", "resnet34", "resnet50"],
    "htfe8": ["cnn4", "googlenet", "mobilenetv2", "resnet10", "resnet18", "resnet34", "resnet50", "resnet101"],
}


def architecture_for_client(heterogeneity: str, k: int) -> str:
    """The registered model name of client ``k`` under ``heterogeneity`` (``HTFE[heterogeneity][k mod X]``)."""
    try:
        names = HTFE[heterogeneity]
    except KeyError:
        raise KeyError(f"unknown model heterogeneity {heterogeneity!r}; choose one of {sorted(HTFE)}") from None
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"client index must be an int >= 0, got {k!r}")
    return names[k % len(names)]
