"""Is a part's data set here? Checked from its files on disk, without building the federation.

A paper benchmark (:data:`fedhpro.data.benchmarks.BENCHMARKS`) reads its files through the loaders of
:mod:`fedhpro.data.loaders`; each loader first looks for the files listed in :data:`LOADER_FILES`. The
check looks for the same files of the loaders the run would open (a Digits run with ``clients=2``
opens MNIST and USPS only), and says what is missing with the loader's own one-line message
(:func:`fedhpro.data.loaders.missing`). ``digits-offline`` is built from the Python packages and is
always available; a data set of the user's own files (``clients``, ``imagefolder``, ``huggingface``)
reports a missing file when its run starts.

At ``scale=smoke`` a Digits part whose data is absent falls back to ``digits-offline``
(:data:`FALLBACKS`), said in the output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fedhpro.config import load_config
from fedhpro.data import DATASETS, declared_dataset, get_dataset
from fedhpro.data.benchmarks import DomainBenchmark, LabelSkewBenchmark, TextBenchmark, data_root
from fedhpro.data.loaders import LOADERS, missing

#: the benchmark a smoke run may fall back to, and what it says about it
FALLBACKS = {"digits": ("digits-offline", "the real Digits benchmark (MNIST, USPS, SVHN, SYN) is not available "
                                          "here; ran on digits-offline, where optdigits stands in for USPS and "
                                          "mnistm for SVHN, with far fewer rounds than the paper")}

_CIFAR10 = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch",
            "batches.meta")

#: loader (fedhpro.data.loaders.LOADERS) -> the files it opens under ``<data_dir>/<its folder>``: alternatives,
#: each a tuple of paths that must all be there (a trailing ``/``: a folder; ``{domain}``: the domain)
LOADER_FILES: dict[str, tuple[tuple[str, ...], ...]] = {
    "mnist": (tuple(f"MNIST/raw/{name}-ubyte" for name in ("train-images-idx3", "train-labels-idx1",
                                                            "t10k-images-idx3", "t10k-labels-idx1")),
              ("MNIST/processed/training.pt", "MNIST/processed/test.pt")),  # torchvision's older layout
    "usps": (("usps.bz2", "usps.t.bz2"),),
    "svhn": (("train_32x32.mat", "test_32x32.mat"),),
    "cifar10": (tuple(f"cifar-10-batches-py/{name}" for name in _CIFAR10),),
    "cifar100": (("cifar-100-python/train", "cifar-100-python/test", "cifar-100-python/meta"),),
    "sun397": (("SUN397/ClassName.txt",),),
    "syn": (("train/", "val/"), ("train/", "test/")),
    "office-caltech": (("office_caltech_10/{domain}/",),),
    "tinyimagenet": (("wnids.txt", "val/val_annotations.txt"),),
    "ham10000": (("HAM10000_metadata.csv",),),
    "ag_news": (("train.csv", "test.csv"),),
}


def filter_data_keys(settings: dict[str, Any], dataset: str) -> tuple[dict[str, Any], list[str]]:
    """Drop ``data.*`` keys the data set does not have (smoke sizes written for one benchmark)."""
    known = {f.name for f in dataclasses.fields(declared_dataset(dataset).options)}
    kept, dropped = {}, []
    for key, value in settings.items():
        if key.startswith("data.") and key.split(".")[1] not in known:
            dropped.append(key)
        else:
            kept[key] = value
    return kept, dropped


def _present(root: Path, alternatives: tuple[tuple[str, ...], ...], domain: str) -> bool:
    def there(relative: str) -> bool:
        path = root / relative.format(domain=domain)
        return path.is_dir() if relative.endswith("/") else path.is_file()

    return any(all(there(relative) for relative in paths) for paths in alternatives)


def loaders_used(config) -> list[tuple[str, str]] | None:
    """``(loader, domain)`` of every loader a run of ``config`` opens, in the order it opens them; None for a
    data set that is not read through fedhpro.data.loaders (digits-offline, the user's own data)."""
    benchmark = getattr(get_dataset(config.run.dataset).build, "__self__", None)
    if isinstance(benchmark, LabelSkewBenchmark):
        return [(benchmark.source, "")]
    if isinstance(benchmark, TextBenchmark):
        return [("ag_news", "")]
    if not isinstance(benchmark, DomainBenchmark):
        return None
    names = [domain for domain, _, _ in benchmark.domains]
    if config.partition.load:
        used = names
    elif config.run.clients is not None:  # K clients spread round robin: the first min(K, domains) domains
        used = names[:config.run.clients]
    else:
        used = [d for d in names if config.data.clients_per_domain.get(d, 0) > 0]
    return [(source, domain) for domain, source, _ in benchmark.domains if domain in used]


def missing_data(settings: dict[str, Any]) -> str | None:
    """Why the data set of run ``settings`` cannot be used here (one line), or None when its files are here
    (or will be downloaded: ``data.download=true`` for a loader torchvision can fetch)."""
    dataset = settings.get("dataset", "digits-offline")
    if dataset not in DATASETS:
        return f"data set {dataset!r} is not registered in this fedhpro (fedhpro.data.DATASETS)"
    config = load_config(None, {**filter_data_keys(settings, dataset)[0], "progress": False})
    download = bool(getattr(config.data, "download", False))
    for name, domain in loaders_used(config) or []:
        spec = LOADERS[name]
        root = data_root(config.run.data_dir)
        root = root / spec.folder if spec.folder else root
        if not (download and spec.download) and not _present(root, LOADER_FILES[name], domain):
            return str(missing(name, root))
    return None


def resolve_data(part_name: str, settings: dict[str, Any], scale: str) -> tuple[dict[str, Any] | None, str]:
    """``(settings, note)``: the settings to run a part with (``data.*`` keys its data set lacks dropped, and
    at ``scale=smoke`` a Digits part without its data moved to digits-offline, said in ``note``), or None
    and the one line saying which data set is missing."""
    problem = missing_data(settings)
    dataset = settings.get("dataset", "digits-offline")
    if problem is None:
        return filter_data_keys(settings, dataset)[0], ""
    if scale == "smoke" and dataset in FALLBACKS:
        fallback, note = FALLBACKS[dataset]
        candidate = {**settings, "dataset": fallback}
        if missing_data(candidate) is None:
            return filter_data_keys(candidate, fallback)[0], f"{note} ({problem.split(';')[0]})"
    hint = " (at scale=smoke the Digits tables fall back to digits-offline)" if dataset in FALLBACKS else ""
    return None, (f"{part_name}: needs data set {dataset!r}, which is not available here: "
                  f"{problem.split(';')[0]}; skipped{hint}")


__all__ = ["FALLBACKS", "LOADER_FILES", "filter_data_keys", "loaders_used", "missing_data",
           "resolve_data"]
