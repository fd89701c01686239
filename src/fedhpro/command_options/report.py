"""The keys of ``fedhpro report`` (besides its run folders). Torch-free, as every option declaration."""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.command_options.keys import command_option

#: head and tail classes only when the largest class has at least this many times the smallest's training
#: samples (``fedhpro report ... tail_ratio=R``); below it the classes count as balanced
DEFAULT_TAIL_RATIO = 2.0


@dataclass(frozen=True)
class ReportOptions:
    """Where ``fedhpro report`` writes, and what it adds."""

    out: str | None = command_option(
        None, help="the report's folder; unset: report in the comparison's folder, or in the folder the given "
                   "runs share")
    force: bool = command_option(False, refuse="is not a boolean; use force=true to replace an earlier report",
                                 help="replace an earlier report in out")
    per_class: bool = command_option(False, refuse="is not a boolean; use per_class=true to add per-class accuracy",
                                     help="add per-class accuracy: per_class.md and .csv, with head, middle and "
                                          "tail classes, and each method's confusion figure")
    tail_ratio: float = command_option(
        DEFAULT_TAIL_RATIO, min=1.0,
        refuse="is not a number of at least 1; use e.g. tail_ratio=2 (head and tail classes only when the largest "
               "class has at least twice the smallest's training samples)",
        help="with per_class=true: head and tail classes only when the largest class has at least tail_ratio "
             "times the smallest's training samples")
