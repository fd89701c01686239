"""The keys of ``fedhpro tune`` (:mod:`fedhpro.tune`), besides the run keys each trial runs with. Torch-free, as
every option declaration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from fedhpro.command_options.keys import command_option
from fedhpro.errors import ConfigError
from fedhpro.search_space import SHARED, LogUniform

#: Optuna's pruners a tuning may use: the median pruner, or none
PRUNERS = ("median", "none")
#: where ``lr`` is searched when ``lr_range=`` is not given
DEFAULT_LR_SPACE = cast(LogUniform, SHARED["lr"])


@dataclass(frozen=True)
class TuneOptions:
    """What ``fedhpro tune`` searches, with which budget, and where the studies are stored."""

    methods: list[str] = command_option(
        default_factory=lambda: ["fedavg"],
        help="the methods to tune, one study each (registered names whose options declare a search space)")
    trials: int = command_option(20, min=1, refuse="gives no trial; give the trials per method, a whole number "
                                                   ">= 1, e.g. trials=20",
                                 help="trials per method, the same budget each")
    out: str = command_option("runs/tune", help="the tuning's folder: study.db, a folder per method (trials.csv, "
                                                "best.yaml), tuned.yaml and tuning.md")
    jobs: int = command_option(1, min=1, refuse="is not valid; give the worker processes, a whole number >= 1, "
                                                "e.g. jobs=2",
                               help="worker processes sharing each study through the storage")
    storage: str | None = command_option(None, help="Optuna's storage, an RDB URL (several machines: the same "
                                                    "URL each); unset: SQLite in out/study.db")
    pruner: str = command_option("median", choices=PRUNERS,
                                 help="median: a trial below the median of the finished ones at the same round "
                                      "stops; none: every trial runs its rounds")
    lr_range: list[float] = command_option(
        default_factory=lambda: [DEFAULT_LR_SPACE.low, DEFAULT_LR_SPACE.high],
        refuse="is not a range of learning rates; give [low, high] with 0 < low < high, e.g. lr_range=[0.0001,0.01]",
        help="[low, high]: where lr is searched, on a log scale (lr= given fixes it instead)")

    def __post_init__(self) -> None:
        low_high = self.lr_range
        if len(low_high) != 2 or not 0 < low_high[0] < low_high[1]:
            raise ConfigError(f"lr_range={low_high!r} is not a range of learning rates; give [low, high] with "
                              "0 < low < high, e.g. lr_range=[0.0001,0.01]")

    @property
    def lr_space(self) -> LogUniform:
        """Where ``lr`` is searched."""
        return LogUniform(self.lr_range[0], self.lr_range[1])
