"""The keys of a sweep (``fedhpro compare``, ``fedhpro reproduce``): how many runs at a time, and where they run
(:mod:`fedhpro.sweeps` runs them). Torch-free, as every option declaration."""

from __future__ import annotations

from dataclasses import dataclass

from fedhpro.command_options.keys import command_option

#: where a sweep's runs execute: this machine's worker processes, or one Ray task per run
EXECUTORS = ("local", "ray")


@dataclass(frozen=True)
class Sweep:
    """How a sweep's runs execute: ``jobs`` at a time, on ``executor`` (``ray_address``: None starts a local Ray)."""

    jobs: int = command_option(1, min=1, refuse="is not valid; give the number of runs at a time, e.g. jobs=4",
                               help="runs at a time: 1 runs them one after the other in this process; N in N "
                                    "worker processes (or N Ray tasks with executor=ray), each run pinned to its "
                                    "threads (threads=auto: this machine's cores divided by N)")
    executor: str = command_option("local", choices=EXECUTORS,
                                   help="where the runs execute: local (this machine) or ray (one Ray task per "
                                        "run, asking for num_cpus = its threads)")
    ray_address: str | None = command_option(None, key="ray.address",
                                             help="with executor=ray: auto or HOST:PORT of a running Ray cluster; "
                                                  "unset: a local Ray, started for the sweep on 127.0.0.1")

    @property
    def sequential(self) -> bool:
        """Whether the runs go one after the other in this process (today's behaviour)."""
        return self.jobs == 1 and self.executor == "local"
