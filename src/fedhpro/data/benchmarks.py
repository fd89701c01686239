"""The paper's benchmarks: a data set (:mod:`fedhpro.data.loaders`) plus a partition, as its tables compose them.

=====================  ============================  ==========================================================
benchmark              data                          partition (``partition=``; default first)
=====================  ============================  ==========================================================
``digits``             MNIST, USPS, SVHN, SYN        domains M:3 U:7 SV:6 SY:4, 1% of a domain per client
``office-caltech``     Caltech, Webcam, Amazon,      domains C:3 W:1 A:2 D:4, 20% per client
                       DSLR
``cifar10``            CIFAR-10                      dirichlet (alpha 0.5, K=10) | nid2 (K=7) | iid | longtail
``cifar100``           CIFAR-100                     same
``ham10000``           HAM10000 (224 px)             same
``tinyimagenet``       TinyImageNet (AutoAugment)    same
``cifar10-lt``         CIFAR-10                      longtail (rho, default 100; then dirichlet 0.5)
``cifar100-lt``        CIFAR-100                     longtail
``tinyimagenet-lt``    TinyImageNet                  longtail
``ag-news``            AG News (tokens)              ag-nid (K=10: AG-NID_K10; clients=50: AG-NID_K50)
``sun397``             SUN397                        dirichlet, K=100, 20% participation
=====================  ============================  ==========================================================

Images become float tensors normalised per channel (the statistics in
:data:`PRESETS`) at the paper's size. Only the samples some client holds and
the test sets are converted; the rest of a large set stays in its
memory-mapped ``uint8`` cache. Test sets are the official ones (the long-tail
benchmarks keep them balanced); where none exists (Office-Caltech, HAM10000,
SUN397) a seeded per-class split holds out ``data.test_fraction``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from fedhpro.bounded import read_json_file
from fedhpro.data.benchmark_options import (  # noqa: F401 (the options: kept importable here)
    BENCHMARK_DECLARATIONS,
    DigitsOptions,
    ImageOptions,
    OfficeCaltechOptions,
    TextOptions,
    code_attribute,
)
from fedhpro.data.federation import Augment, ClientData, Federation, domains_without_clients_note
from fedhpro.data.loaders import (  # noqa: F401 (HALF, IMAGENET_*: kept importable here)
    HALF,
    IMAGENET_MEAN,
    IMAGENET_STD,
    LOADERS,
    AGNews,
    Preset,
    image_arrays,
    open_loader,
    split_indices,
)
from fedhpro.data.partition import (
    LABEL_SCHEMES,
    Partition,
    PartitionError,
    PartitionOptions,
    chosen_scheme,
    domains,
    label_partition,
)
from fedhpro.data.spec import DatasetSpec, ImageInput, preset_image
from fedhpro.errors import ConfigError, DataError

# --------------------------------------------------------------------------- transforms


#: per image source: the paper's image size and the usual per-data-set channel statistics (declared with the
#: source's loader, :data:`fedhpro.data.loaders.LOADERS`)
PRESETS: dict[str, Preset] = {name: spec.preset for name, spec in LOADERS.items() if spec.preset is not None}


def to_float(images: np.ndarray, preset: Preset, size: int, chunk: int = 2048) -> Tensor:
    """``uint8`` N x C x H x W -> float32 N x 3 x size x size, normalised by ``preset``.

    Grey images are repeated to 3 channels; other sizes are resized
    (bilinear, antialiased). Converted in chunks, so a memory-mapped source
    is read once and never copied whole.
    """
    n = images.shape[0]
    out = torch.empty((n, 3, size, size), dtype=torch.float32)
    mean = torch.tensor(preset.mean).view(1, 3, 1, 1)
    std = torch.tensor(preset.std).view(1, 3, 1, 1)
    for start in range(0, n, chunk):
        batch = torch.from_numpy(np.array(images[start:start + chunk], dtype=np.uint8)).float().div_(255.0)
        if batch.shape[1] == 1:
            batch = batch.expand(-1, 3, -1, -1)
        if batch.shape[-2:] != (size, size):
            batch = F.interpolate(batch, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
            batch = batch.clamp_(0.0, 1.0)
        out[start:start + chunk] = (batch - mean) / std
    return out


class AutoAugmentBatch:
    """Per-sample AutoAugment (ImageNet policy, Cubuk et al. 2019) on a normalised float batch.

    Each image gets its own policy draw. torchvision's AutoAugment draws from
    the global CPU generator, so it runs under :func:`torch.random.fork_rng`
    seeded from the client's training generator: the run stays reproducible
    and the global RNG is left as it was.
    """

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        from torchvision.transforms import AutoAugment, AutoAugmentPolicy

        self.policy = AutoAugment(AutoAugmentPolicy.IMAGENET)
        self.mean = torch.tensor(mean).view(1, 3, 1, 1)
        self.std = torch.tensor(std).view(1, 3, 1, 1)

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        mean, std = self.mean.to(x.device), self.std.to(x.device)
        # the policy runs on the CPU (a 64-image uint8 batch is small): the same images on every device
        pixels = ((x * std + mean) * 255.0).round_().clamp_(0, 255).to("cpu", torch.uint8)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            pixels = torch.stack([self.policy(image) for image in pixels])
        return (pixels.to(x.device).float().div_(255.0) - mean) / std

    def __repr__(self) -> str:
        return "AutoAugmentBatch(imagenet)"


# --------------------------------------------------------------------------- options

#: the loaders whose files are checked against torchvision's published md5 (``data.verify``)
VERIFIED = ("cifar10", "cifar100", "svhn")


def data_root(data_dir: str | Path | None) -> Path:
    """Where real data sets live: ``data_dir`` if given, else ``$FEDHPRO_DATA_DIR`` or ``~/.cache/fedhpro``."""
    if data_dir:
        return Path(data_dir).expanduser()
    from fedhpro.data.digits_offline import default_data_dir

    return default_data_dir()


def normalisation(preset: Preset, options: ImageOptions) -> Preset:
    """``preset`` with the channel statistics ``data.mean``/``data.std`` set (each one that is set)."""
    def three(values: list[float] | None, kept: tuple[float, float, float]) -> tuple[float, float, float]:
        return kept if values is None else (values[0], values[1], values[2])  # 3 values: checked when set

    return dataclasses.replace(preset, mean=three(options.mean, preset.mean), std=three(options.std, preset.std))


# --------------------------------------------------------------------------- shared steps


def _partition_rng(seed: int, options: PartitionOptions) -> np.random.Generator:
    return np.random.default_rng(seed if options.seed is None else options.seed)


def _load_partition(load: str, num_samples: int | dict[str, int]) -> Partition:
    """The partition saved at ``load`` (``partition.load``), its indices checked against ``num_samples``."""
    path = Path(load).expanduser()
    if not path.is_file():
        raise ConfigError(f"partition.load={load!r}: no such file; give the partition.json of an earlier run")
    return Partition.load(path, num_samples=num_samples)


def _record(partition: Partition, name: str, labels: Any, num_classes: int, seed: int | None,
            options: PartitionOptions) -> dict[str, Any]:
    if options.load:  # the seed that drew the loaded partition, not this run's
        saved = read_json_file(Path(options.load).expanduser(), DataError)
        seed = saved.get("seed") if isinstance(saved, dict) else None
    record = {"dataset": name, **partition.to_json(labels, num_classes, seed)}
    if options.load:
        record["loaded_from"] = str(options.load)
    return record


def _scheme(options: PartitionOptions, default: str, allowed: tuple[str, ...], name: str) -> str:
    """The scheme ``partition=`` asks for, checked against ``allowed``; a label-skew benchmark (one whose
    schemes are all label schemes) also takes every registered or installed label-skew partitioner."""
    if all(scheme in LABEL_SCHEMES for scheme in allowed):
        return chosen_scheme(options, default, allowed, name)
    scheme = default if options.scheme == "auto" else options.scheme
    if scheme not in allowed:
        raise ConfigError(f"partition={scheme} does not apply to {name}; choose one of: {', '.join(allowed)}")
    return scheme


def _size(image_size: int | None, preset: Preset) -> int:
    return preset.size if image_size is None else int(image_size)


# --------------------------------------------------------------------------- label skew (images and text)


@dataclass(frozen=True)
class LabelSkewBenchmark:
    """One data set split among K clients by a label-skew partitioner (paper Tables 1, A1, A2, A10)."""

    name: str
    source: str  # a loader name
    num_classes: int
    scheme: str = "dirichlet"  # the default partition
    schemes: tuple[str, ...] = ("dirichlet", "nid2", "iid", "longtail")
    clients: int = 10  # K (nid2's default is 7, as the paper)
    augment: bool = False  # AutoAugment by default
    test_fraction: float | None = None  # no official test set: hold this share out
    description: str = ""

    def build(self, options: ImageOptions, clients: int | None, seed: int, data_dir: Any = None,
              progress: bool = False, partition: PartitionOptions | None = None) -> Federation:
        partition = partition or PartitionOptions()
        scheme = _scheme(partition, self.scheme, self.schemes, self.name)
        preset = normalisation(PRESETS[self.source], options)
        size = _size(options.image_size, preset)
        root = data_root(data_dir)
        cache = root / ".fedhpro-cache" / self.source
        test_fraction = options.test_fraction if options.test_fraction is not None else self.test_fraction
        loader_options: dict[str, Any] = {}
        if self.source == "ham10000":
            loader_options = {"test_fraction": test_fraction, "split_seed": options.split_seed}
        if self.source in VERIFIED:
            loader_options = {"verify": options.verify}
        train = open_loader(self.source, root, True, options.download, **loader_options)
        train_x, train_y = image_arrays(train, size, cache, progress)
        if self.source == "sun397":  # one folder, no official split
            if test_fraction is None:
                raise ConfigError(f"{self.name} has no official test set; set data.test_fraction (e.g. 0.2)")
            train_index, test_index = split_indices(train_y, test_fraction, options.split_seed)
            test_x, test_y = train_x, train_y
        else:
            test = open_loader(self.source, root, False, options.download, **loader_options)
            test_x, test_y = image_arrays(test, size, cache, progress)
            train_index, test_index = np.arange(len(train_y)), np.arange(len(test_y))
        labels = train_y[train_index]

        k = clients or (7 if scheme == "nid2" else self.clients)
        if partition.load:
            split = _load_partition(partition.load, len(labels))
        else:
            split = label_partition(partition, scheme, labels, k, _partition_rng(seed, partition), self.num_classes)
        augment = options.augment if options.augment is not None else self.augment
        hook: Augment | None = AutoAugmentBatch(preset.mean, preset.std) if augment else None
        client_data = []
        for ix in split.client_indices:
            rows = train_index[ix]
            client_data.append(ClientData(to_float(train_x[rows], preset, size), torch.from_numpy(labels[ix]).clone(),
                                          self.num_classes, hook))
        test_rows = test_index
        test_sets = {"all": (to_float(test_x[test_rows], preset, size), torch.from_numpy(test_y[test_rows]).clone())}
        notes = [f"{self.name}: {split.scheme} partition over {split.num_clients} clients, {size}x{size} images"]
        if augment:
            notes.append("AutoAugment (ImageNet policy) on every training batch")
        if options.mean is not None or options.std is not None:
            notes.append(f"{self.name}: inputs normalised with mean {list(preset.mean)} and std {list(preset.std)} "
                         f"(data.mean/data.std; the data set's own: {list(PRESETS[self.source].mean)}, "
                         f"{list(PRESETS[self.source].std)})")
        record = _record(split, self.name, labels, self.num_classes, partition.seed if partition.seed is not None
                         else seed, partition)
        return Federation(self.name, self.num_classes, (3, size, size), client_data, [""] * len(client_data),
                          test_sets, record, notes)


@dataclass(frozen=True)
class TextBenchmark:
    """AG News with TextCNN token inputs, split by ``ag-nid`` (paper Table A10)."""

    name: str = "ag-news"
    num_classes: int = 4
    scheme: str = "ag-nid"
    schemes: tuple[str, ...] = ("ag-nid", "dirichlet", "iid")
    clients: int = 10

    def build(self, options: TextOptions, clients: int | None, seed: int, data_dir: Any = None,
              progress: bool = False, partition: PartitionOptions | None = None) -> Federation:
        partition = partition or PartitionOptions()
        scheme = _scheme(partition, self.scheme, self.schemes, self.name)
        root = data_root(data_dir)
        train = cast(AGNews, open_loader("ag_news", root, True, max_length=options.max_length,
                                         vocab_size=options.vocab_size))
        test = cast(AGNews, open_loader("ag_news", root, False, max_length=options.max_length, vocab=train.vocab))
        labels = train.targets.numpy()
        if partition.load:
            split = _load_partition(partition.load, len(labels))
        else:
            split = label_partition(partition, scheme, labels, clients or self.clients,
                                    _partition_rng(seed, partition), self.num_classes)
        client_data = []
        for ix in split.client_indices:
            rows = torch.from_numpy(ix)
            client_data.append(ClientData(train.tokens[rows].clone(), train.targets[rows].clone(), self.num_classes))
        record = _record(split, self.name, labels, self.num_classes,
                         partition.seed if partition.seed is not None else seed, partition)
        record["vocab_size"] = len(train.vocab) + 2
        return Federation(self.name, self.num_classes, (options.max_length,), client_data, [""] * len(client_data),
                          {"all": (test.tokens, test.targets)}, record,
                          [f"ag-news: {split.scheme} partition over {split.num_clients} clients, "
                           f"{len(train.vocab) + 2} token ids"])


# --------------------------------------------------------------------------- domain skew


@dataclass(frozen=True)
class DomainBenchmark:
    """Several domains, each client sampling a fraction of one domain (paper Tables 2, A3)."""

    name: str
    domains: tuple[tuple[str, str, dict], ...]  # (domain, loader name, loader options), in the paper's order

    def build(self, options: Any, clients: int | None, seed: int, data_dir: Any = None, progress: bool = False,
              partition: PartitionOptions | None = None) -> Federation:
        partition = partition or PartitionOptions()
        _scheme(partition, "domains", ("domains",), self.name)
        names = [d for d, _, _ in self.domains]
        layout = dict(options.clients_per_domain)
        unknown = sorted(set(layout) - set(names))
        if unknown:
            raise ConfigError(f"data.clients_per_domain names unknown domains {unknown}; "
                              f"the domains of {self.name} are: {', '.join(names)}")
        if clients is not None:  # spread K clients over the domains in the paper's order, round robin
            layout = {d: 0 for d in names}
            for k in range(clients):
                layout[names[k % len(names)]] += 1
        layout = {d: layout.get(d, 0) for d in names if layout.get(d, 0) > 0}
        if not layout and not partition.load:
            raise ConfigError(f"{self.name} needs at least one client; set clients=K or data.clients_per_domain")

        root = data_root(data_dir)
        train, test = {}, {}
        for domain, source, extra in self.domains:
            if domain not in layout and not partition.load:
                continue
            preset = PRESETS[source]
            size = _size(options.image_size, preset)
            loader_options = dict(extra)
            if source == "office-caltech":
                loader_options.update(test_fraction=options.test_fraction, split_seed=options.split_seed)
            if source in VERIFIED:
                loader_options["verify"] = getattr(options, "verify", True)
            download = getattr(options, "download", False)
            cache = root / ".fedhpro-cache" / f"{source}-{domain}"
            train[domain] = image_arrays(open_loader(source, root, True, download, **loader_options), size, cache,
                                         progress)
            test[domain] = image_arrays(open_loader(source, root, False, download, **loader_options), size, cache,
                                        progress)
        labels = {d: y for d, (_, y) in train.items()}
        if partition.load:
            split = _load_partition(partition.load, {d: len(y) for d, y in labels.items()})
        else:
            try:
                split = domains({d: np.arange(len(y)) for d, y in labels.items()},
                                [(d, n, options.fraction) for d, n in layout.items()], _partition_rng(seed, partition))
            except PartitionError as error:
                raise ConfigError(f"{self.name}: {error} (data.fraction / data.clients_per_domain)") from None
        owners = split.client_domains
        if owners is None:  # only a loaded partition can lack them: domains() records every client's domain
            raise ConfigError(f"partition.load={partition.load!r} has no client domains; {self.name} needs a "
                              "domains partition")
        source_of = {d: s for d, s, _ in self.domains}
        client_data = []
        for ix, domain in zip(split.client_indices, owners):
            preset = PRESETS[source_of[domain]]
            x, y = train[domain]
            client_data.append(ClientData(to_float(x[ix], preset, _size(options.image_size, preset)),
                                          torch.from_numpy(y[ix]).clone(), 10))
        used = [d for d in names if d in set(owners)]
        test_sets = {}
        for d in used:
            preset = PRESETS[source_of[d]]
            x, y = test[d]
            test_sets[d] = (to_float(x, preset, _size(options.image_size, preset)), torch.from_numpy(y).clone())
        size = _size(options.image_size, PRESETS[self.domains[0][1]])
        record = _record(split, self.name, {d: labels[d] for d in used}, 10,
                         partition.seed if partition.seed is not None else seed, partition)
        record["fraction"] = options.fraction
        notes = [f"{self.name}: " + ", ".join(f"{d} {owners.count(d)}" for d in used)]
        if not partition.load:  # a domain without a client is neither trained on nor tested: said, never silent
            zero = [d for d, n in options.clients_per_domain.items() if n == 0] if clients is None else []
            dropped = domains_without_clients_note(self.name, names, layout, clients, zero)
            notes += [dropped] if dropped else []
        return Federation(self.name, 10, (3, size, size), client_data, list(owners), test_sets, record, notes)


# --------------------------------------------------------------------------- the benchmarks


def _spec(benchmark: Any) -> DatasetSpec:
    """The spec of ``benchmark``: its declaration (:data:`BENCHMARK_DECLARATIONS`) and its code."""
    return DatasetSpec.of(BENCHMARK_DECLARATIONS[benchmark.name], benchmark.build, _preset_input(benchmark))


def _preset_input(benchmark: Any) -> ImageInput | None:
    """How a new image becomes the benchmark's input: normalised by its sources' one preset (mean and std),
    never resized; None for a benchmark without images or whose domains normalise differently (no one
    preprocessing fits an image of unknown domain: its inputs are then given to predict as tensors)."""
    sources = ([source for _, source, _ in benchmark.domains] if hasattr(benchmark, "domains")
               else [getattr(benchmark, "source", None)])
    presets = {(PRESETS[s].mean, PRESETS[s].std) for s in sources if s in PRESETS}
    if len(presets) != 1:
        return None
    preset = PRESETS[next(s for s in sources if s in PRESETS)]

    def image_input(options: Any, partition: Any, size: int) -> dict[str, Any]:
        chosen = normalisation(preset, options) if isinstance(options, ImageOptions) else preset
        return preset_image(benchmark.name, size, chosen.mean, chosen.std)

    return image_input


def _label(name: str, source: str, classes: int, **kwargs: Any) -> LabelSkewBenchmark:
    return LabelSkewBenchmark(name, source, classes, **kwargs)


_LT = dict(scheme="longtail", schemes=("longtail",))

# each benchmark's spec, the constant :func:`code_attribute` names (``fedhpro.data`` declares each as
# ``dataset=<name>`` with its declaration, :data:`BENCHMARK_DECLARATIONS`, and this code)
DIGITS = _spec(DomainBenchmark("digits", (("mnist", "mnist", {}), ("usps", "usps", {}), ("svhn", "svhn", {}),
                                          ("syn", "syn", {}))))
OFFICE_CALTECH = _spec(DomainBenchmark("office-caltech", tuple((d, "office-caltech", {"domain": d})
                                                               for d in ("caltech", "webcam", "amazon", "dslr"))))
CIFAR10 = _spec(_label("cifar10", "cifar10", 10))
CIFAR100 = _spec(_label("cifar100", "cifar100", 100))
HAM10000 = _spec(_label("ham10000", "ham10000", 7, test_fraction=0.11))
TINYIMAGENET = _spec(_label("tinyimagenet", "tinyimagenet", 200, augment=True))
CIFAR10_LT = _spec(_label("cifar10-lt", "cifar10", 10, **_LT))
CIFAR100_LT = _spec(_label("cifar100-lt", "cifar100", 100, **_LT))
TINYIMAGENET_LT = _spec(_label("tinyimagenet-lt", "tinyimagenet", 200, augment=True, **_LT))
AG_NEWS = _spec(TextBenchmark())
SUN397 = _spec(_label("sun397", "sun397", 397, clients=100, test_fraction=0.2))


def _factory(spec: DatasetSpec) -> Callable[[], DatasetSpec]:
    return lambda: spec


#: name -> factory of its spec, every declared benchmark (:data:`BENCHMARK_DECLARATIONS`, in its order)
BENCHMARKS: dict[str, Callable[[], DatasetSpec]] = {
    name: _factory(globals()[code_attribute(name)]) for name in BENCHMARK_DECLARATIONS}
