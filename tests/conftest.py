"""Shared fixtures: tiny synthetic federations, tiny models, and one cached digits-offline build.

Everything here is small on purpose (a few clients of a few dozen 3x8x8
images, a linear-tanh feature extractor) so the engine and method tests run
in well under a second each on one CPU thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from fedhpro.data.federation import ClientData, Federation

# keep the test run light: the machine is shared, and tiny tensors gain nothing from threads. The variable
# also makes threads=auto one thread in every run the tests start, here and in subprocesses, so that the
# simulator and Flower's workers (one thread each) sum in the same order and give the same bits
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# no listening socket outside 127.0.0.0/8 and no call home in any test: Ray (Flower's simulation engine,
# executor=ray) binds to 127.0.0.1 only with this set before ray is imported (ray 2.55 reads it at import);
# flwr's telemetry and update check stay off in every process the tests start
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")



@pytest.fixture(autouse=True)
def _denormals_as_by_default():
    """Every test starts with denormal floats kept, the process default: a Flower app run in this process
    (run_simulation) flushes them for the rest of its process (fedhpro.runtime.configure_cpu_runtime, as a
    Flower node or ServerApp process should), which would change later tests' floats and break hypothesis'
    float draws (it refuses to run where subnormals cannot be represented)."""
    yield
    torch.set_flush_denormal(False)


NUM_CLASSES = 4
IMAGE_SHAPE = (3, 8, 8)
FEATURE_DIM = 16

# digits-offline build used by the end-to-end tests (built once per session, then read from the cache)
DIGITS_SYN_SIZE = 200
DIGITS_TEST_FRACTION = 0.05  # small test sets keep evaluation cheap (pass data.test_fraction to match)
DIGITS_BUILD_SEED = 0  # the default of data.build_seed


class TinyNet(nn.Module):
    """``features``: flatten -> linear(d) -> tanh; ``classifier``: linear(d, C)."""

    def __init__(self, num_classes: int = NUM_CLASSES, input_shape: Sequence[int] = IMAGE_SHAPE,
                 feature_dim: int = FEATURE_DIM):
        super().__init__()
        flat = 1
        for size in input_shape:
            flat *= size
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(flat, feature_dim), nn.Tanh())
        self.classifier = nn.Linear(feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class TinyBNNet(nn.Module):
    """Like :class:`TinyNet` with a convolution and a BatchNorm2d (running stats + num_batches_tracked)."""

    def __init__(self, num_classes: int = NUM_CLASSES, input_shape: Sequence[int] = IMAGE_SHAPE,
                 feature_dim: int = FEATURE_DIM):
        super().__init__()
        channels, height, width = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(channels, 4, kernel_size=3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(4 * height * width, feature_dim),
            nn.Tanh(),
        )
        self.classifier = nn.Linear(feature_dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def make_client(n: int, classes: Sequence[int], seed: int, *, shift: float = 0.0,
                num_classes: int = NUM_CLASSES, shape: Sequence[int] = IMAGE_SHAPE,
                dtype: torch.dtype = torch.float32) -> ClientData:
    """``n`` images whose labels cycle through ``classes`` (every listed class present when n >= len),
    shuffled, with a class-dependent pattern plus noise (learnable) and an optional client shift."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor([classes[i % len(classes)] for i in range(n)], dtype=torch.long)
    labels = labels[torch.randperm(n, generator=g)]
    patterns = torch.randn(num_classes, *shape, generator=torch.Generator().manual_seed(12345))
    x = patterns[labels] + 0.7 * torch.randn(n, *shape, generator=g) + shift
    return ClientData(x.to(dtype), labels, num_classes)


def make_federation(sizes: Sequence[int], *, classes: Sequence[Sequence[int]] | None = None,
                    shifts: Sequence[float] | None = None, seed: int = 0, test_size: int = 24,
                    num_classes: int = NUM_CLASSES, dtype: torch.dtype = torch.float32) -> Federation:
    """A federation of ``len(sizes)`` clients and two test sets ("a", "b")."""
    clients = []
    for k, n in enumerate(sizes):
        held = classes[k] if classes is not None else list(range(num_classes))
        shift = shifts[k] if shifts is not None else 0.0
        clients.append(make_client(n, held, seed=1000 * seed + k, shift=shift, num_classes=num_classes,
                                   dtype=dtype))
    test_a = make_client(test_size, list(range(num_classes)), seed=1000 * seed + 900, num_classes=num_classes,
                         dtype=dtype)
    test_b = make_client(test_size // 2, list(range(num_classes)), seed=1000 * seed + 901, shift=0.5,
                         num_classes=num_classes, dtype=dtype)
    return Federation(
        name="tiny",
        num_classes=num_classes,
        input_shape=IMAGE_SHAPE,
        clients=clients,
        client_domains=[f"d{k % 2}" for k in range(len(sizes))],
        test_sets={"a": (test_a.x, test_a.y), "b": (test_b.x, test_b.y)},
    )


@pytest.fixture
def tiny_federation() -> Callable[..., Federation]:
    """Factory: ``tiny_federation(sizes, classes=..., shifts=..., seed=...)``."""
    return make_federation


@pytest.fixture(scope="session")
def digits_data_dir(tmp_path_factory):
    """A data_dir holding a cached digits-offline build (syn_size=DIGITS_SYN_SIZE), built once per session."""
    from fedhpro.data.digits_offline import build_digits_offline
    root = tmp_path_factory.mktemp("digits-data")
    build_digits_offline(root, seed=DIGITS_BUILD_SEED, test_fraction=DIGITS_TEST_FRACTION,
                         syn_size=DIGITS_SYN_SIZE)
    return root
