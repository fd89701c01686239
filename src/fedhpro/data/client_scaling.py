"""The standardisation of ``dataset=clients``' float ``N x F`` features (``data.standardize``): each client
by its own training mean and std, or every site by one shared scaling (given as ``data.feature_mean`` and
``data.feature_std``, or combined from the sites' sums: :mod:`fedhpro.data.feature_statistics`), and the
warning where per-site scaling meets sites of different classes. What a site reads of its own folder for it is
with the folders (:func:`~fedhpro.data.clients.site_feature_sums`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from fedhpro.data.clients_options import ClientsOptions
from fedhpro.data.feature_statistics import FEDERATED, SharedScaling, feature_sums, shared_scaling
from fedhpro.errors import ConfigError, DataError


class NamedClient(Protocol):
    """What the shared scaling reads of a client's description (a :class:`~fedhpro.data.clients.ClientInfo`):
    its name."""

    @property
    def name(self) -> str: ...


def standardized(train: tuple[Tensor, Tensor], test: tuple[Tensor, Tensor], mode: str,
                 shared: tuple[Tensor, Tensor] | None = None) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Float ``N x F`` features scaled to mean 0 and std 1 per feature, the same map applied to the test
    data: ``mode="client"`` by the client's own training mean and (population) std (a feature constant in
    training is only centred), ``mode="federated"`` by ``shared``, the ``(mean, std)`` every site uses
    (:mod:`fedhpro.data.feature_statistics`). Other inputs (images, integer token ids), and
    ``mode="none"``, are returned as they are (the same objects)."""
    x, y = train
    if mode == "none" or not scales(x):
        return train, test
    if mode == FEDERATED:
        if shared is None:
            raise DataError("data.standardize=federated but no shared scaling was given for these features (a "
                            "node of another fedhpro version?); run the same fedhpro on the server and every node")
        mean, std = shared
        if mean.numel() != x.shape[1] or std.numel() != x.shape[1]:
            raise DataError(f"the shared scaling has {mean.numel()} features but these rows have {x.shape[1]}; "
                            "give every site the same feature columns")
    else:
        mean, std = feature_statistics(x)
    return (apply_statistics(x, mean, std), y), (apply_statistics(test[0], mean, std), test[1])


def applied_mode(mode: str) -> str:
    """The scaling ``data.standardize=mode`` applies to data: ``auto`` is ``federated`` here (a run under
    privacy has already resolved it: :func:`fedhpro.config.applied_data_options`)."""
    return FEDERATED if mode == "auto" else mode


def given_scaling(options: ClientsOptions) -> tuple[Tensor, Tensor] | None:
    """``(data.feature_mean, data.feature_std)`` as float64 tensors, checked (as long as each other, every std
    > 0), or None when not given."""
    mean, std = options.feature_mean, options.feature_std
    if mean is None and std is None:
        return None
    if mean is None or std is None or len(mean) != len(std) or not mean:
        raise ConfigError("data.feature_mean and data.feature_std go together, as two lists of one number per "
                          "feature; give both (or neither: the sites' sums give them)")
    if any(not value > 0 for value in std):
        raise ConfigError("data.feature_std holds a value <= 0; each feature's std must be > 0 (1 for a "
                          "constant feature)")
    return torch.tensor(mean, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)


def federation_scaling(infos: Sequence[NamedClient], train: Sequence[tuple[Tensor, Tensor]], options: ClientsOptions,
                       columns: Sequence[str] | None = None) -> SharedScaling | None:
    """``data.standardize=federated`` over loaded clients: the scaling of ``data.feature_mean`` /
    ``feature_std`` when given, else combined from each scaled client's :func:`feature_sums` (each counting
    as its rows: the simulator knows its clients), with ``data.statistics_limit``'s guard; None when no
    client holds features to scale."""
    given = given_scaling(options)
    names = [info.name for info, (x, _) in zip(infos, train) if scales(x)]
    if not names:
        return None
    if given is not None:
        return SharedScaling(given[0], given[1], names, given="data.feature_mean and data.feature_std")
    parts = {info.name: feature_sums(x) for info, (x, _) in zip(infos, train) if scales(x)}
    return shared_scaling(parts, limit=options.statistics_limit, columns=columns)



#: how far (total variation) a site's class distribution may be from the federation's before per-site scaling
#: is warned about: a site of one class among three is 0.67 away; a Dirichlet 0.5 split's sites 0.3 to 0.6
SKEW_WARNING = 0.5


def skewed_scaling_warning(names: Sequence[str], labels: Sequence[Tensor], num_classes: int) -> list[str]:
    """``data.standardize=client`` where sites' class distributions differ: one warning line naming the
    sites whose classes are furthest from the federation's (per-site scaling maps a site of one class onto the
    others' classes), or none."""
    counts = [torch.bincount(y.long(), minlength=num_classes).double() for y in labels if y.numel()]
    if len(counts) < 2:
        return []
    total = torch.stack(counts).sum(dim=0)
    pooled = total / total.sum()
    far = []
    for name, count in zip([n for n, y in zip(names, labels) if y.numel()], counts):
        distance = 0.5 * float((count / count.sum() - pooled).abs().sum())
        if distance > SKEW_WARNING:
            far.append(f"{name} ({distance:.2f})")
    if not far:
        return []
    return [f"warning: data.standardize=client scales each site by its own statistics, but the class "
            f"distributions of {', '.join(far[:5])}{' and more' if len(far) > 5 else ''} are far from the "
            f"federation's (total variation above {SKEW_WARNING:g}): per-site scaling maps their classes onto "
            "the others'; data.standardize=federated shares one scaling"]


def scales(x: Tensor) -> bool:
    """Whether ``data.standardize=client`` scales these training features (float ``N x F``, N >= 1)."""
    return x.dim() == 2 and x.is_floating_point() and bool(x.shape[0])


def feature_statistics(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(mean, std)`` per feature of float ``N x F`` training features, in float64: the population std, 1
    where a feature is constant (it is then only centred)."""
    column = x.double()
    mean = column.mean(dim=0)
    std = column.std(dim=0, unbiased=False)
    return mean, torch.where(std > 0, std, torch.ones_like(std))


def apply_statistics(values: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """``(values - mean) / std`` computed in float64, as float32: the map :func:`standardized` applies."""
    return ((values.double() - mean) / std).float()
