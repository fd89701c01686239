"""A data set and a partitioner defined outside fedhpro, added through entry points.

``blobs``: a synthetic classification data set, ``num_classes`` Gaussian clusters in ``features``
dimensions, drawn from the run's seed (no files, no download). Its options dataclass gives the ``data.*``
keys; it trains the ``mlp`` model unless the run sets another (``run_defaults``).

``shards``: the label-shard partition of McMahan et al. (2017): the training set sorted by label, cut into
``num_clients * shards_per_client`` equal shards, and each client dealt ``shards_per_client`` of them at
random. Its options dataclass gives the ``partition.shards_per_client`` key. Every label-skew data set
(``blobs``, ``cifar10``, ``imagefolder`` ...) accepts it as ``partition=shards``.

Installed with ``pip install ./examples/own_dataset``, the entry points in ``pyproject.toml`` make
``fedhpro run dataset=blobs partition=shards`` work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedhpro.data import DatasetSpec, Federation
from fedhpro.data.partition import (
    Partition,
    PartitionError,
    PartitionerSpec,
    chosen_scheme,
    label_partition,
    label_schemes,
)
from fedhpro.options import option


@dataclass
class BlobsOptions:
    num_classes: int = option(4, min=2, help="number of classes (one Gaussian cluster each)")
    features: int = option(16, min=1, help="dimension of every sample")
    train_per_class: int = option(60, min=1, help="training samples of each class")
    test_per_class: int = option(20, min=1, help="test samples of each class")
    spread: float = option(1.0, gt=0.0, help="standard deviation of each cluster (centres are ~N(0, 4 I))")
    clients: int = option(4, min=1, help="K, the number of clients when the run's clients= is unset")


def _draw(rng: np.random.Generator, centres: np.ndarray, per_class: int, spread: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    labels = np.repeat(np.arange(len(centres)), per_class)
    points = centres[labels] + spread * rng.standard_normal((len(labels), centres.shape[1]))
    return torch.from_numpy(points.astype(np.float32)), torch.from_numpy(labels.astype(np.int64))


def build(options: BlobsOptions, clients: int | None, seed: int, data_dir=None, progress: bool = False,
          partition=None) -> Federation:
    """The blobs federation: training clusters split among the clients by ``partition=`` (default
    dirichlet), one shared test set."""
    from fedhpro.data.partition import PartitionOptions

    partition = partition if partition is not None else PartitionOptions()
    scheme = chosen_scheme(partition, "dirichlet", label_schemes(), "dataset=blobs")
    rng = np.random.default_rng(seed)
    centres = 2.0 * rng.standard_normal((options.num_classes, options.features))
    x_train, y_train = _draw(rng, centres, options.train_per_class, options.spread)
    x_test, y_test = _draw(rng, centres, options.test_per_class, options.spread)
    labels = y_train.numpy()
    k = clients or options.clients
    split_rng = np.random.default_rng(seed if partition.seed is None else partition.seed)
    split = label_partition(partition, scheme, labels, k, split_rng, options.num_classes)
    train = [(x_train[torch.from_numpy(ix)], y_train[torch.from_numpy(ix)]) for ix in split.client_indices]
    return Federation.from_tensors(train, {"all": (x_test, y_test)}, num_classes=options.num_classes, name="blobs",
                                   partition=split.to_json(labels, options.num_classes, seed),
                                   notes=[f"blobs: {split.scheme} partition over {split.num_clients} clients"])


DATASET = DatasetSpec(name="blobs", options=BlobsOptions, build=build,
                      description="Gaussian blobs, a synthetic data set of a plug-in package",
                      run_defaults={"model": "mlp"})


@dataclass
class ShardOptions:
    shards_per_client: int = option(2, min=1, help="shards: label shards dealt to each client (McMahan et al.)")


def shards(options, labels: np.ndarray, num_clients: int, rng: np.random.Generator,
           num_classes: int | None = None) -> Partition:
    """Sort by label, cut into ``num_clients * shards_per_client`` shards, deal each client its share."""
    per_client = int(options.shards_per_client)
    count = num_clients * per_client
    if count > len(labels):
        raise PartitionError(f"shards: {count} shards of {len(labels)} samples; lower partition.shards_per_client "
                             "or use fewer clients")
    order = np.argsort(np.asarray(labels), kind="stable")
    pieces = np.array_split(order, count)
    dealt = rng.permutation(count)
    parts = [np.concatenate([pieces[s] for s in dealt[k * per_client:(k + 1) * per_client]])
             for k in range(num_clients)]
    return Partition(parts, "shards", {"num_clients": num_clients, "shards_per_client": per_client})


PARTITIONER = PartitionerSpec(name="shards", split=shards, options=ShardOptions,
                              description="label shards (McMahan et al., 2017)")
