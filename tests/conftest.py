"""Shared fixtures: tiny synthetic federations, tiny models, and one cached digits-offline build.

Everything here is small on purpose (a few clients of a few dozen 3x8x8
images, a linear-tanh feature extractor) so the engine and method tests run
in well under a second each on one CPU thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import network_guard
import pytest
import torch
from filelock import FileLock  # a dependency of torch
from finished_runs import FinishedRuns
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
# every name lookup and connection of this process outside loopback is refused and recorded from here on
# (tests/network_guard.py); a test that reached out fails (_no_network), one that looks at the record itself
# asks for the network_attempts fixture
network_guard.install()


# ---------------------------------------------------------------------------- parallel runs (pytest-xdist)
# pyproject's addopts run the suite on the usable cores (-n auto --dist loadgroup): each test is a work unit
# of its own, except the groups below, whose tests run one after another on one worker. Every test still
# runs alone as well (python -m pytest -n 0 tests/x.py::test_y).

#: tests marked ``deploy`` start a Flower deployment on loopback (a SuperLink, SuperNodes and their
#: flwr-clientapp processes, nginx): one at a time. Their readiness limits are sized for one deployment on a
#: busy 2-core machine, test_flower_node_failure bounds a round's wall time, and two at once would share the
#: cores.
DEPLOYMENT_GROUP = "flower-deployment"
#: tests marked ``ray`` start Ray (Flower's simulation engine run_simulation, executor=ray, ray.init): one Ray
#: instance at a time (each one's dashboard agent wants the same fixed port, and each spawns workers).
RAY_GROUP = "ray"
#: the helpers that start a deployment, as imported from their modules: a test whose own code calls one must be
#: marked ``deploy`` (collection stops naming it otherwise, so that a lost mark cannot put two deployments
#: side by side)
DEPLOYMENT_HELPERS = {"Loopback": "test_flower_deployment", "loopback_run": "test_flower_deployment",
                      "Deployment": "test_flower_secure"}
#: modules whose tests share state beyond a fixture: a last test checks counts the others accumulated
SHARED_STATE_MODULES = {"test_fuzz_data.py", "test_fuzz_messages.py"}
#: above this many workers the one-at-a-time deployment group (~40% of the serial time) is the whole wall
#: time, and every worker holds its own torch and flwr (about 1 GB); PYTEST_XDIST_AUTO_NUM_WORKERS overrides
MAX_AUTO_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: the cores this process may use (its CPU affinity, e.g. 2 on a 2-core CI machine), at most
    :data:`MAX_AUTO_WORKERS`."""
    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if chosen:
        return int(chosen)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(usable, MAX_AUTO_WORKERS))


def _code_names(code) -> set[str]:
    """The global and attribute names a function's code (nested functions included) refers to."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _code_names(constant)
    return names


def _module_shares_fixtures(item: pytest.Item) -> bool:
    """Whether the item uses a module-, class- or package-scoped fixture of its own module: the tests using it
    share what it built (or changed), and each worker would build it again. (A session-scoped one is built
    once per worker anyway: its users stay free, so that e.g. test_docs' pages spread over the workers.)"""
    module_id = item.nodeid.split("::")[0]
    for definitions in item._fixtureinfo.name2fixturedefs.values():
        for definition in definitions:
            if definition.baseid == module_id and definition.scope in ("module", "class", "package"):
                return True
    return False


def calls_a_deployment_helper(item: pytest.Item) -> bool:
    """Whether the test's own code (nested functions included) calls one of :data:`DEPLOYMENT_HELPERS`."""
    function = getattr(item, "function", None)
    if not hasattr(function, "__code__"):
        return False
    return any(getattr(function.__globals__.get(name), "__module__", None) == DEPLOYMENT_HELPERS[name]
               for name in _code_names(function.__code__) & DEPLOYMENT_HELPERS.keys())


def xdist_group_of(item: pytest.Item) -> str | None:
    """The group whose tests run one after another on one worker, or None (a work unit of its own)."""
    module = item.nodeid.split("::")[0].rsplit("/", 1)[-1]  # test_x.py
    if item.get_closest_marker("deploy"):
        return DEPLOYMENT_GROUP
    if item.get_closest_marker("ray"):
        return RAY_GROUP
    if module in SHARED_STATE_MODULES or _module_shares_fixtures(item):
        return module.removesuffix(".py")
    return None


def _group_mark(item: pytest.Item) -> str | None:
    """The item's xdist group as xdist names it (its marks' names, sorted and joined), or None."""
    names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                    for mark in item.iter_markers("xdist_group")})
    return "_".join(names) or None


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    """Refuse a test that starts a deployment without the ``deploy`` mark; put each test in its xdist group,
    unless it names one itself."""
    unmarked = [item.nodeid for item in items
                if not item.get_closest_marker("deploy") and calls_a_deployment_helper(item)]
    if unmarked:
        raise pytest.UsageError(f"{', '.join(unmarked)} start(s) a Flower deployment without the deploy mark; "
                                "add @pytest.mark.deploy (tests/conftest.py: one deployment at a time)")
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if _group_mark(item) is None:
            group = xdist_group_of(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)  # before xdist sends the worker's collection to its scheduler
def pytest_collection_finish(session):
    """On an xdist worker under --dist loadgroup: the group in each grouped test's id, and the order of the
    work units.

    xdist (3.8.0) tells its scheduler a test's group by appending "@group" to the test's id, which it writes
    to ``item._nodeid``; pytest 9.2 keeps the id in ``item._id``, so the groups were silently lost
    (pytest-xdist issue #1386, fix pending): the suffix is written here where xdist's did not take.

    Order: the deployment group first, then Ray's, then the other groups by size, then single tests in
    file order, so that the long one-at-a-time group starts at once and no big group is left for the end
    (xdist's own reordering, by number of tests only, is off in addopts)."""
    config, items = session.config, session.items
    if not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return
    sizes: dict[str, int] = {}
    groups: dict[int, str | None] = {}
    for item in items:
        group = _group_mark(item)
        groups[id(item)] = group
        if group is None:
            continue
        sizes[group] = sizes.get(group, 0) + 1
        if not item.nodeid.endswith(f"@{group}") and hasattr(item, "_id"):
            item._id = type(item._id).parse(f"{item.nodeid}@{group}")
    position = {id(item): index for index, item in enumerate(items)}

    def order(item: pytest.Item) -> tuple:
        group = groups[id(item)]
        if group is None:
            return (3, 0, "", position[id(item)])
        return ({DEPLOYMENT_GROUP: 0, RAY_GROUP: 1}.get(group, 2), -sizes[group], group, position[id(item)])

    items.sort(key=order)


@pytest.fixture(autouse=True)
def _denormals_as_by_default():
    """Every test starts with denormal floats kept, the process default: a Flower app run in this process
    (run_simulation) flushes them for the rest of its process (fedhpro.runtime.configure_cpu_runtime, as a
    Flower node or ServerApp process should), which would change later tests' floats and break hypothesis'
    float draws (it refuses to run where subnormals cannot be represented)."""
    yield
    torch.set_flush_denormal(False)


@pytest.fixture
def network_attempts():
    """The lookups and connections outside loopback the network guard refused during the test (a list of
    :class:`network_guard.Attempt`, filled as they happen); a test that asks for it checks them itself."""
    network_guard.take()
    return network_guard.attempts


@pytest.fixture(autouse=True)
def _no_network(request):
    """A test fails when it (or a thread of a library it drove) tried to reach a host outside loopback: the
    guard refused it, and this names it."""
    network_guard.take()
    yield
    if "network_attempts" in request.fixturenames:
        network_guard.take()
        return
    reached = network_guard.take()
    if reached:
        pytest.fail("reached outside loopback (refused by the network guard): "
                    + ", ".join(sorted({str(attempt) for attempt in reached})), pytrace=False)


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


def test_run_folder(tmp_path_factory) -> Path:
    """A folder of this test run that its xdist workers share (the parent of their temporary folders; without
    xdist, the session's own): never an earlier run's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def digits_data_dir(tmp_path_factory):
    """A data_dir holding a cached digits-offline build (syn_size=DIGITS_SYN_SIZE), built once per test run: the
    first worker to ask builds it, under a file lock, and the others read it."""
    from fedhpro.data.digits_offline import build_digits_offline
    shared = test_run_folder(tmp_path_factory)
    root = shared / "digits-data"  # nothing else in it: a data_dir holding other files is refused as the user's
    with FileLock(str(shared / "digits-data.lock")):
        build_digits_offline(root, seed=DIGITS_BUILD_SEED, test_fraction=DIGITS_TEST_FRACTION,
                             syn_size=DIGITS_SYN_SIZE)  # reads the cache once it is there
    return root


@pytest.fixture(scope="session")
def finished_runs(tmp_path_factory, digits_data_dir) -> FinishedRuns:
    """Tiny finished runs (tests/finished_runs.py) on ``digits_data_dir``, built once per test run and shared by
    the xdist workers. ``finished_runs.copy("image", tmp_path)`` gives a test its own copy."""
    return FinishedRuns(test_run_folder(tmp_path_factory) / "finished-runs", digits_data_dir)


def run_flower_simulation(server_app, client_app, num_supernodes: int = 3) -> None:
    """``flwr.simulation.run_simulation`` of ``server_app`` with ``num_supernodes`` nodes of ``client_app`` on
    Ray bound to 127.0.0.1 with one CPU. Flower's Ray backend sets ``os.environ["PYTHONPATH"]`` to this
    process's whole sys.path and leaves it set: it is put back, or every subprocess later tests start would
    inherit pytest's import path."""
    from flwr.simulation import run_simulation

    from fedhpro.flower.engine import RAY_LOOPBACK_INIT_ARGS

    pythonpath = os.environ.get("PYTHONPATH")
    try:
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=num_supernodes,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": 1, **RAY_LOOPBACK_INIT_ARGS}})
    finally:
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath
