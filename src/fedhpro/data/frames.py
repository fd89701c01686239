"""Own tabular data as pandas DataFrames from Python: :func:`from_dataframes` gives the federation that the
same rows saved as CSV give to ``dataset=clients`` (the same tensors, standardisation, classes and record),
for ``fedhpro.run(config, federation=...)``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fedhpro.data.clients import STANDARDIZE_CHOICES, UNTRAINED_CHOICES, ClientsOptions, sites_federation
from fedhpro.data.federation import Federation
from fedhpro.data.tables import frames_sites
from fedhpro.errors import ConfigError


def from_dataframes(data: Any, test: Any = None, *, label: str = "label", site: str = "site",
                    split: str | None = "split", classes: Sequence[str] | None = None,
                    standardize: str = "federated", max_classes: int = 100_000,
                    untrained_classes: str = "refuse") -> Federation:
    """The federation of sites given as DataFrames.

    ``data`` is either a mapping site name -> DataFrame, or -> ``(train, test)`` DataFrames (``test`` None:
    the site is not tested), as ``<site>/train.csv`` and ``<site>/test.csv`` folders; or one DataFrame with a
    ``site`` column and a ``split`` column (``train`` or ``test`` per row), or without the split column and
    the test rows in ``test`` (a DataFrame with the same site column), as one CSV table. ``label`` names the
    label column (class indices, or class names mapped to ``classes`` or, by default, their sorted union);
    every other column is a numeric feature. ``standardize``: ``federated`` (every site's features scaled by
    one mean and std per feature, those of all sites' training rows pooled; ``auto`` is the same), ``client``
    (each site's by its own training mean and std) or ``none``; the statistics travel in
    ``federation.partition`` (``scaling``, or ``statistics`` per site) and a run writes them to its folder's
    standardize.json, so that ``fedhpro predict`` scales raw rows as a CSV run's do. ``untrained_classes``:
    ``refuse`` a class with test rows but no training row at any site, or ``keep`` it (a note names it), as
    ``data.untrained_classes``. Bad data is one :class:`~fedhpro.errors.DataError` line naming the site,
    column, row (by index label) and value."""
    if standardize not in STANDARDIZE_CHOICES:
        raise ConfigError(f"standardize={standardize!r}; give one of {', '.join(STANDARDIZE_CHOICES)}")
    if untrained_classes not in UNTRAINED_CHOICES:
        raise ConfigError(f"untrained_classes={untrained_classes!r}; give one of {', '.join(UNTRAINED_CHOICES)}")
    options = ClientsOptions(classes=None if classes is None else [str(c) for c in classes],
                             max_classes=int(max_classes),
                             # the data are all here: "auto" has nothing to hide from (no privacy= is known yet)
                             standardize="federated" if standardize == "auto" else standardize, label_column=label,
                             site_column=site, split_column=split or "split",
                             untrained_classes=untrained_classes)
    split_column = None if isinstance(data, Mapping) else split
    sites = frames_sites(data, test, label, site, split_column)
    return sites_federation(sites, options, None, "python:DataFrame", statistics=True)


__all__ = ["from_dataframes"]
