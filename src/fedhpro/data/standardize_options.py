"""``data.standardize``'s values and how a run resolves them, declared without torch so that a config checks
them before torch loads (the statistics themselves: :mod:`fedhpro.data.feature_statistics`)."""

from __future__ import annotations

from fedhpro.errors import ConfigError

#: ``data.standardize``: ``auto`` (federated, but client-level under privacy, where the sums are not covered), the
#: sites' pooled statistics, each site's own, or the features as saved
STANDARDIZE_CHOICES = ("auto", "federated", "client", "none")
FEDERATED, CLIENT, NONE = "federated", "client", "none"
#: the image-folder data set's former name of ``federated`` (the pooled training images' channel statistics)
FORMER_FEDERATED = "train"
#: ``data.statistics_limit``'s default: how many times a feature's pooled std one site may make it
STATISTICS_LIMIT = 20.0


def resolved_standardize(mode: str, private: bool, secure: bool = False, ranges: bool = False,
                         auto: str = FEDERATED) -> tuple[str, str | None]:
    """``(mode, note)``: ``data.standardize`` as a run applies it. ``auto`` is the data set's ``auto``: ``none``
    for image folders (their fixed [-1, 1] scaling), else ``federated``, or ``client``
    (each site's own statistics: nothing leaves it) where the sums would leave a site outside the run's
    guarantee: under differential privacy (``private``: they carry no noise), or under secure aggregation
    (``secure``) without public feature ranges (``ranges``: ``data.feature_low`` / ``feature_high``, which
    bound what SecAgg+ quantizes; with them the server sees only the sites' sums added up).
    ``federated`` there is refused in one line; ``train`` is the former image-folder name of ``federated``."""
    mode = FEDERATED if mode == FORMER_FEDERATED else mode
    if mode == "auto" and auto != FEDERATED:
        return auto, None
    if mode not in (FEDERATED, "auto"):
        return mode, None
    why = ("privacy (each site's feature sums would leave it without noise, outside the privacy guarantee)"
           if private else
           "secure aggregation without public feature ranges (SecAgg+ sums values within known bounds: give "
           "data.feature_low and data.feature_high, one number per feature)"
           if secure and not ranges else None)
    if why is None:
        return FEDERATED, None
    if mode == FEDERATED:
        raise ConfigError(f"data.standardize=federated is not available under {why}; set data.standardize=client "
                          "(each site scales by its own statistics, nothing leaves it) or data.standardize=none")
    return CLIENT, (f"data: features standardised by each site's own statistics (data.standardize=auto is "
                    f"client-level under {why.split(' (')[0]}: the shared scaling would release each site's "
                    "feature sums)")


__all__ = ["CLIENT", "FEDERATED", "FORMER_FEDERATED", "NONE", "STANDARDIZE_CHOICES", "STATISTICS_LIMIT",
           "resolved_standardize"]
