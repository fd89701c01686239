"""The keys of ``fedhpro reproduce NAME`` (:mod:`fedhpro.reproduce`), besides the sweep's (:class:`~.sweep.Sweep`)
and the run keys it hands to every run. Torch-free, as every option declaration."""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.command_options.keys import command_option

#: a target's scales: the paper's settings, or its ``smoke`` section (minutes on 2 CPU cores)
SCALES = ("paper", "smoke")


@dataclass(frozen=True)
class ReproduceOptions:
    """At which scale and seeds ``fedhpro reproduce`` runs a target, and where it writes."""

    scale: str = command_option("paper", choices=SCALES,
                                help="paper: the paper's settings; smoke: the target's smoke section, shrunk to "
                                     "minutes on 2 CPU cores")
    seeds: list[int] | None = command_option(None, refuse="must be integers, e.g. seeds=[0,1,2]",
                                             help="the seeds of every run; unset: the target's")
    out: str | None = command_option(None, help="the folder of the tables and figures (its runs in out/runs); "
                                                "unset: runs/reproduce/SCALE")
