"""``aggregation=mean`` (the default): the method's own rule. The replies reach the method as they came, folded
into its running sum as they arrive; every number is the method's alone."""

from __future__ import annotations

from fedhpro.robust.base import RobustRule


class Mean(RobustRule):
    """The method's own aggregation, unchanged (needs nothing of each client's own update)."""

    needs = ""


__all__ = ["Mean"]
