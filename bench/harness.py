"""Shared timing harness for the benchmarks in ``bench/``: interleaved repeats, medians, spreads, machine info.

Every benchmark compares variants measured side by side in one process. On a
shared machine the load changes from second to second, so a variant is never
timed in a block of its own: repeat ``r`` runs every variant once, starting
with variant ``r mod n`` (A B C, B C A, C A B, ...), and a ratio is taken
within each repeat (its two variants ran seconds apart, under about the same
load) before the median over repeats is reported with its min-max spread.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping

import torch


def machine_info() -> dict[str, str]:
    """The machine, the software and the load right now (for RESULTS.md)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "cpu": f"{cpu}, {os.cpu_count()} logical cores",
        "torch": f"{torch.__version__}, {torch.get_num_threads()} threads, nice {os.nice(0)}",
        "load": "load average {:.1f} / {:.1f} / {:.1f} (1 / 5 / 15 min)".format(*load),
    }


def print_header(title: str) -> None:
    print(title)
    for key, value in machine_info().items():
        print(f"  {key:6s} {value}")


def interleaved(variants: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1,
                on_repeat: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, list[float]]:
    """Wall seconds of each variant over ``repeats`` interleaved repeats (after ``warmup`` uncounted ones).

    The order rotates every repeat so no variant always runs first (after a
    pause) or last. ``on_repeat(r, seconds)`` is called after each counted
    repeat (progress output).
    """
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(warmup + repeats):
        shift = repeat % len(names)
        this_repeat: dict[str, float] = {}
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            variants[name]()
            this_repeat[name] = time.perf_counter() - start
        if repeat >= warmup:
            for name in names:
                times[name].append(this_repeat[name])
            if on_repeat is not None:
                on_repeat(repeat - warmup, this_repeat)
    return times


def spread(values: list[float]) -> str:
    """``median [min - max]`` of a list of numbers."""
    return f"{statistics.median(values):.3f} [{min(values):.3f} - {max(values):.3f}]"


def paired_ratios(times: Mapping[str, list[float]], numerator: str, denominator: str) -> list[float]:
    """The ratio numerator / denominator within each repeat (the two ran back to back)."""
    return [a / b for a, b in zip(times[numerator], times[denominator])]


def report_ratio(times: Mapping[str, list[float]], numerator: str, denominator: str, label: str,
                 target: float | None = None) -> float:
    """Print ``label = median [min - max]`` of the per-repeat ratios (and the target); return the median."""
    ratios = paired_ratios(times, numerator, denominator)
    median = statistics.median(ratios)
    verdict = ""
    if target is not None:
        verdict = f"  target <= {target:.2f}: {'met' if median <= target else 'NOT met'}"
    print(f"  {label:34s} {spread(ratios)}  (median [min - max] over {len(ratios)} paired repeats){verdict}")
    return median


def report_times(times: Mapping[str, list[float]], samples: int | None = None) -> None:
    """One line per variant: median [min - max] seconds, and samples/s at the median."""
    for name, values in times.items():
        rate = f"  {samples / statistics.median(values):8.0f} samples/s" if samples else ""
        print(f"  {name:34s} {spread(values)} s{rate}")


def digits_federation(num_clients: int | None = None, data_dir: str | None = None):
    """The default federation (digits-offline, seed 0), optionally only its first ``num_clients`` clients."""
    import dataclasses

    from fedhpro.config import load_config
    from fedhpro.data import get_dataset

    config = load_config(None, [f"data_dir={data_dir}"] if data_dir else [])
    federation = get_dataset("digits-offline").build(config.data, None, 0, data_dir=config.run.data_dir,
                                                      progress=False)
    if num_clients is not None and num_clients < federation.num_clients:
        federation = dataclasses.replace(federation, clients=federation.clients[:num_clients],
                                         client_domains=federation.client_domains[:num_clients])
    return federation, config


def sample_passes(federation, epochs: int, batch_size: int) -> int:
    """Samples seen in one round of E epochs (a trailing batch of one sample is skipped, as train_epochs does)."""
    total = 0
    for client in federation.clients:
        n = len(client)
        dropped = 1 if n % batch_size == 1 and n > 1 else 0
        total += (n - dropped) * epochs
    return total


def prepare_torch(threads: int | None) -> None:
    """``threads`` torch threads (None: torch's choice) and the process settings ``fedhpro run`` uses on the CPU."""
    from fedhpro.runtime import configure_cpu_runtime

    if threads:
        torch.set_num_threads(threads)
    configure_cpu_runtime()


def add_digits_arguments(parser: argparse.ArgumentParser, clients: int, epochs: int, repeats: int) -> None:
    """``--clients --epochs --repeats --threads --data-dir`` of the benchmarks that train on digits-offline."""
    parser.add_argument("--clients", type=int, default=clients,
                        help="use the first N clients of digits-offline (20 in all)")
    parser.add_argument("--epochs", type=int, default=epochs, help="E, local epochs")
    parser.add_argument("--repeats", type=int, default=repeats, help="counted repeats (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--data-dir", default=None)


def cnn_factory(federation) -> Callable[[], torch.nn.Module]:
    """A factory of the default model (``cnn``, d = 512) for ``federation``'s inputs."""
    from fedhpro.models import build_model

    def factory() -> torch.nn.Module:
        return build_model("cnn", federation.num_classes, federation.input_shape, 512)

    return factory
