"""``fedhpro.run(config) -> RunResult``: one federated run, from Python or the CLI."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from fedhpro import reports
from fedhpro.config import (
    FEDERATION_KEY,
    PYTHON_PREFIX,
    Config,
    RunOptions,
    flatten_keys,
    is_from_python,
    load_config,
    parse_override,
    read_yaml,
)
from fedhpro.data import get_dataset
from fedhpro.data.federation import Federation
from fedhpro.engines import checkpoint, driver
from fedhpro.engines.driver import (  # noqa: F401 (kept importable from here)
    CheckpointSchedule,
    RunRows,
    check_new_run_folder,
    progress_text,
    run_summary,
)
from fedhpro.engines.observers import RoundObserver
from fedhpro.engines.protocol import Aggregation
from fedhpro.engines.simulator import Faults, Simulator
from fedhpro.errors import ConfigError
from fedhpro.files import RunFolderClaim, claim_run_folder, remove_partial_writes
from fedhpro.measurements import observers_for
from fedhpro.methods import MethodSpec, TrainSettings, get_method
from fedhpro.models import build_model, with_projection_head
from fedhpro.runtime import cpu_runtime, resolve_threads, torch_threads


@dataclass
class RunResult:
    """What a run produced: the summary (as in ``summary.json``), every round's metrics and the folder."""

    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    out: Path
    config: Config

    @property
    def accuracy(self) -> float:
        """Final AVG accuracy in percent."""
        return self.summary["accuracy"]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but CUDA is not available here; use device=cpu or device=auto")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={name!r} is not supported; use auto, cpu, cuda or cuda:N")
    return device


def run(config: Config | str | os.PathLike | Mapping[str, Any] | None = None,
        overrides: Iterable[str] | Mapping[str, Any] | None = None, *, echo: bool = False,
        federation: Federation | None = None, **kwargs: Any) -> RunResult:
    """Run one federated training and write its results.

    Args:
        config: a :class:`~fedhpro.config.Config`, a YAML path, a mapping of
            config keys, or None for the defaults (FedHPro on digits-offline).
        overrides: ``["rounds=5", ...]`` or a mapping, applied after ``config``.
        echo: print the final table (the CLI does).
        federation: your own data, a :class:`~fedhpro.data.federation.Federation`
            (``Federation.from_tensors`` / ``Federation.from_datasets``). The
            config's ``dataset``, ``data.*`` and ``partition.*`` are then not
            used (the federation is already split into clients); ``clients=``,
            if set, must equal ``federation.num_clients``. ``config.yaml``
            records ``federation: python:<name>`` and the summary's
            ``dataset`` is ``federation.name``. Resuming such a run
            (``resume=DIR``) needs the same federation passed again.
        **kwargs: more overrides, e.g. ``run(method="fedavg", rounds=5)``;
            dotted keys as ``run(**{"fedhpro.tau": 0.1})``. ``model=`` takes a
            registered name or, from Python only, a callable returning an
            ``nn.Module`` with ``features`` (x -> B x d) and ``classifier``
            (``nn.Linear(d, C)``), e.g. ``fedhpro.models.split(resnet18(), "fc")``;
            it is called with no arguments, or with those of ``num_classes``,
            ``input_shape`` and ``feature_dim`` that it names as parameters.
            ``config.yaml`` records ``model: python:<module>.<name>``;
            resuming needs the same callable passed again.

    On the CPU the run flushes denormal floats to zero and sets glibc's
    allocator to keep freed memory (:mod:`fedhpro.runtime`). The
    flush-denormal state of the calling thread is restored when the run
    returns or raises; the allocator thresholds stay set for the rest of the
    process (glibc cannot read the previous ones back; set
    ``FEDHPRO_KEEP_FREED_MEMORY=0`` before the first run to leave them alone).
    The run uses ``threads`` CPU threads (``torch.set_num_threads``; auto:
    the cores this process may run on, or ``$OMP_NUM_THREADS``), the
    caller's count is put back afterwards.

    The run's folder (``out``, ``resume`` or the default) is claimed for the
    whole run (:func:`fedhpro.files.claim_run_folder`): another run on the
    same folder, in this process or another, is refused in one line naming
    this run's pid and host. A file the run cannot write (disk full) stops it
    with one :class:`~fedhpro.errors.DataError` line naming the newest good
    checkpoint, which is kept, and ``resume=``.

    Returns:
        A :class:`RunResult`; the same numbers are in ``<out>/summary.json``
        and ``<out>/metrics.jsonl``.
    """
    if federation is not None:
        check_federation(federation, None)
    return _run(config, overrides, kwargs, federation, echo)


def _run(config: Config | str | os.PathLike | Mapping[str, Any] | None,
         overrides: Iterable[str] | Mapping[str, Any] | None, kwargs: Mapping[str, Any],
         federation: Federation | None, echo: bool, claim: RunFolderClaim | None = None) -> RunResult:
    """:func:`run` once its arguments are checked: the run's folder is claimed (:func:`claim_run_folder`)
    for the whole run, new or resumed, unless the caller holds its ``claim`` already (:func:`run_or_continue`)."""
    config, model_factory, given = _resolve_run_config(config, overrides, kwargs, federation)
    folder, setting = _run_folder(config, federation)
    with _claimed(folder, setting, claim):
        for where in (folder, checkpoint.checkpoint_dir(folder)):  # what a killed run left half-written
            remove_partial_writes(where)
        if config.run.resume:  # read under the claim: the folder holds no other live run
            config, resume_from = _resume_config(config, federation, model_factory, given)
        else:
            config, resume_from = with_python_objects(config, federation, model_factory), None
            check_new_run_folder(folder)  # before the data are built: fail fast
        device = resolve_device(config.run.device)
        # on the CPU: denormals flushed (restored afterwards), freed memory reused (fedhpro.runtime); the run's
        # thread count set (threads=, auto: the cores this process may run on), the caller's put back afterwards
        with cpu_runtime(enabled=device.type == "cpu"), torch_threads(resolve_threads(config.run.threads)):
            return _run_resolved(config, device, federation, model_factory, resume_from, echo, folder)


def _run_folder(config: Config, federation: Federation | None) -> tuple[Path, str]:
    """The folder the run writes and the key that named it: ``resume=``'s, ``out=``'s or a new
    ``runs/<method>-<data>-<timestamp>``."""
    if config.run.resume:
        return Path(config.run.resume), "resume"
    data_name = federation.name if federation is not None else config.run.dataset
    return _new_run_folder(config.run, data_name), "out"


@contextmanager
def _claimed(folder: Path, setting: str, held: RunFolderClaim | None) -> Iterator[None]:
    """``folder`` claimed for the block (:func:`fedhpro.files.claim_run_folder`), or ``held`` already. A
    ``resume=`` folder that is not there is left to :func:`_resume_config`'s message (nothing to claim)."""
    if held is not None or (setting == "resume" and not folder.is_dir()):
        yield
        return
    with claim_run_folder(folder, setting=setting):
        yield


def _resolve_run_config(config: Config | str | os.PathLike | Mapping[str, Any] | None,
                        overrides: Iterable[str] | Mapping[str, Any] | None, kwargs: Mapping[str, Any],
                        federation: Federation | None
                        ) -> tuple[Config, Callable[..., torch.nn.Module] | None, dict[str, Any] | None]:
    """``(config, model callable or None, the keys the user set)`` of :func:`run`'s arguments (the keys
    only for a resumed run, whose saved config :func:`_resume_config` reads under the folder's claim).

    A ``model`` callable is taken out of the settings (a later source wins, as
    for any other key).
    """
    model_factory = None
    for source in (config, overrides, kwargs):  # a later one wins, as for any other key
        if isinstance(source, Mapping) and "model" in source:
            model_factory = source["model"] if _is_model_callable(source["model"]) else None
    config, overrides = (_without_model_callable(item) for item in (config, overrides))
    kwargs = _without_model_callable(kwargs)
    if not isinstance(config, Config):
        merged: dict[str, Any] = {}
        if overrides is not None:
            merged.update(overrides if isinstance(overrides, Mapping) else map(parse_override, overrides))
        merged.update(kwargs)
        resolved = load_config(config, merged)
        given = _given_settings(config, merged) if resolved.run.resume else None
        config = resolved
    elif overrides or kwargs:
        raise ConfigError("pass overrides with a YAML path or mapping, not with a resolved Config")
    else:
        given = _settings_off_defaults(config) if config.run.resume else None
    return config, model_factory, given


def _run_resolved(config: Config, device: torch.device, federation: Federation | None,
                  model_factory: Callable[..., torch.nn.Module] | None, resume_from: Path | None,
                  echo: bool, out: Path) -> RunResult:
    """The run of a resolved ``config`` (:func:`run` after its checks): build, prepare or resume the folder,
    train with checkpoints, then the summary, the observers' end (t-SNE) and the accuracy plot."""
    options = config.run
    data_name = federation.name if federation is not None else options.dataset
    title = f"{options.method} on {data_name} (seed {options.seed})"
    started = time.perf_counter()
    parts = build_experiment(config, device, federation=federation, model_factory=model_factory)
    simulator = build_simulator(config, parts, device, observers_for(options, out, _warn, title))
    folder = driver.RunFolder(out, options, started=started)
    if resume_from is not None:
        folder.resume(resume_from, simulator.load_state_dict)
    else:
        folder.start(config.to_dict(), parts.federation.partition)
    driver.train(simulator, folder, f"{options.method} on {data_name}", options.progress)
    rows = folder.rows
    seconds = time.perf_counter() - started
    summary = driver.run_summary(options, data_name, parts.federation.num_clients, device, rows.metrics, seconds,
                                 parts.federation.notes, from_python=config.federation is not None)
    folder.finish(summary, simulator.server.state_dict())
    simulator.end_run()
    folder.plot(title)
    if echo:
        print(reports.accuracy_table(driver.final_accuracy(rows.metrics),
                                     f"{options.method} on {data_name}, seed {options.seed}, "
                                     f"{options.rounds} rounds, {seconds:.0f} s — test accuracy (%):"))
        print(f"results in {out}/ (summary.json, metrics.jsonl, timing.jsonl, accuracy.png, config.yaml)")
    return RunResult(summary=summary, metrics=rows.metrics, out=out, config=config)


def _warn(message: str) -> None:
    """One warning line on stderr that leaves the progress bar intact."""
    from tqdm.auto import tqdm

    tqdm.write(f"fedhpro: warning: {message}", file=sys.stderr)


def build_simulator(config: Config, parts: Experiment, device: torch.device,
                    observers: list[RoundObserver] | None = None,
                    on_drop: Callable[[str], None] | None = _warn) -> Simulator:
    """The in-process simulator of ``config`` on the built ``parts``, watched by ``observers`` (also what a
    Flower node and server build in partition mode)."""
    return Simulator(parts.method, config.method_options, parts.federation, parts.model_factory, parts.train,
                     device=device, client_architectures=parts.architectures,
                     architecture_factory=parts.architecture_factory, shared=parts.shared,
                     on_drop=on_drop, observers=observers or [], **protocol_settings(config))


def protocol_settings(config: Config) -> dict[str, Any]:
    """The round protocol's settings of ``config``: sampling, evaluation, faults, robust aggregation and
    ``min_clients``, as keyword arguments that both :class:`Simulator` and
    :class:`~fedhpro.engines.protocol.RoundProtocol` take. The in-process engine and the Flower
    ServerApp both build their protocol from this one place, so both run the same rounds."""
    options = config.run
    return {"rounds": options.rounds, "participation": options.participation, "seed": options.seed,
            "eval_every": options.eval_every, "faults": Faults(**dataclasses.asdict(config.faults)),
            "aggregation": Aggregation(**dataclasses.asdict(config.aggregation)), "min_clients": options.min_clients}


def _new_run_folder(options: RunOptions, data_name: str) -> Path:
    """``out``, or ``runs/<method>-<data>-<timestamp>`` (the folder is made only once the run starts)."""
    if options.out:
        return Path(options.out)
    return Path("runs") / (f"{options.method}-{re.sub(r'[^A-Za-z0-9._-]+', '-', data_name)}-"
                           f"{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}")


@dataclass
class Experiment:
    """Everything an engine needs to run ``config``: built the same way for the simulator and Flower."""

    method: MethodSpec
    federation: Federation
    model_factory: Callable[[], torch.nn.Module]  # the global model (``model=``), wrapped by the method if it wraps
    architecture_factory: Callable[[str], torch.nn.Module]  # any zoo name, wrapped likewise
    architectures: list[str] | None  # per-client architecture names under model heterogeneity, else None
    train: TrainSettings
    shared: str  # which weights travel: "all", "classifier" or "none"


def build_experiment(config: Config, device: torch.device | str = "cpu", federation: Federation | None = None,
                     model_factory: Callable[..., torch.nn.Module] | None = None) -> Experiment:
    """Build the federation (on ``device``), the model factories and the method of ``config``.

    The same seed and config give the same federation and the same initial
    models wherever this is called (the simulator, a Flower node).

    ``federation``: data given from Python, used instead of building the
    config's ``dataset`` (whose ``data.*`` / ``partition.*`` are then unused);
    moved to ``device`` in a shallow copy, the caller's object is left as it is.
    ``model_factory``: a callable building the model instead of the registered
    ``model=`` (see :func:`run`), checked on its first model and one training input.
    """
    options = config.run
    method = get_method(options.method)
    if federation is None:
        dataset = get_dataset(options.dataset)
        federation = dataset.build(config.data, options.clients, options.seed, data_dir=options.data_dir,
                                   progress=options.progress, partition=config.partition)
    else:
        check_federation(federation, options.clients)
        federation = dataclasses.replace(federation)
    federation.to(torch.device(device))
    global_factory, architecture_factory, architectures, shared, train = model_factories(
        config, method, federation.num_classes, federation.input_shape, federation.num_clients,
        user_model=model_factory, sample=federation.clients[0].x[:1])
    return Experiment(method, federation, global_factory, architecture_factory, architectures, train, shared)


def model_factories(config: Config, method: MethodSpec, num_classes: int, input_shape: tuple[int, ...],
                    num_clients: int, user_model: Callable[..., torch.nn.Module] | None = None,
                    sample: torch.Tensor | None = None
                    ) -> tuple[Callable[[], torch.nn.Module], Callable[[str], torch.nn.Module],
                               list[str] | None, str, TrainSettings]:
    """``(model_factory, architecture_factory, architectures, shared, train settings)`` of ``config`` for
    ``num_clients`` clients with inputs of ``input_shape`` and ``num_classes`` classes: everything but the
    data (a Flower server builds exactly this, holding no data).

    ``user_model``: a model callable given from Python, built for ``options.model`` instead of the zoo
    (:func:`user_model_builder`; its first model is checked, on ``sample``, one training input, if given)."""
    options = config.run
    build_user_model = None
    if user_model is not None:
        if options.heterogeneity != "none":
            raise ConfigError(f"heterogeneity={options.heterogeneity} builds the zoo's architectures per client, "
                              "not a model callable; use heterogeneity=none with model=<callable>")
        build_user_model = user_model_builder(user_model, num_classes, input_shape, options.feature_dim, sample)

    def architecture_factory(name: str) -> torch.nn.Module:
        if build_user_model is not None and name == options.model:
            model = build_user_model()
        else:
            try:
                model = build_model(name, num_classes, input_shape, options.feature_dim)
            except ValueError as error:
                raise ConfigError(f"model {name!r} does not fit the data's inputs "
                                  f"{tuple(input_shape)}: {error}") from None
        if options.projection_head:  # every method on the MOON authors' network
            model = with_projection_head(model, num_classes)
        if method.model_wrapper is not None:
            model = method.model_wrapper(model, config.method_options, num_classes)
        return model

    def model_factory() -> torch.nn.Module:
        return architecture_factory(options.model)

    train = TrainSettings(epochs=options.local_epochs, batch_size=options.batch_size, lr=options.lr,
                          momentum=options.momentum, weight_decay=options.weight_decay, amp=options.amp,
                          channels_last=options.channels_last, compile=options.compile)
    architectures = None
    if options.heterogeneity != "none":
        from fedhpro.models.heterogeneity import architecture_for_client

        architectures = [architecture_for_client(options.heterogeneity, k) for k in range(num_clients)]
    return model_factory, architecture_factory, architectures, _shared(config), train


def python_name(obj: Any) -> str:
    """``"python:<module>.<qualified name>"``: how config.yaml records a model callable given from Python."""
    target = getattr(obj, "func", obj)  # functools.partial: the function it wraps
    module = getattr(target, "__module__", None) or type(target).__module__
    name = getattr(target, "__qualname__", None) or type(target).__qualname__
    return f"{PYTHON_PREFIX}{module}.{name}"


def _is_model_callable(value: Any) -> bool:
    """Whether a ``model=`` value is a callable (a Python-only model), not a registered name."""
    if isinstance(value, torch.nn.Module):
        raise ConfigError(f"model= takes a callable that builds a new module (e.g. model=lambda: "
                          f"{type(value).__name__}(...)), not a module instance: every run and client "
                          "builds its own, seeded copy")
    return callable(value) and not isinstance(value, str)


def _without_model_callable(source: Any) -> Any:
    """``source`` without a callable ``model`` entry (a mapping is copied; anything else is returned as is)."""
    if isinstance(source, Mapping) and _is_model_callable(source.get("model")):
        return {key: value for key, value in source.items() if key != "model"}
    return source


def check_federation(federation: Any, clients: int | None) -> None:
    """One-line ConfigError unless ``federation`` is a Federation with ``clients`` clients (when set)."""
    if not isinstance(federation, Federation):
        raise ConfigError(f"federation= takes a fedhpro.data.federation.Federation (build one with "
                          f"Federation.from_tensors or Federation.from_datasets), got {type(federation).__name__}")
    if clients is not None and clients != federation.num_clients:
        raise ConfigError(f"clients={clients} but the federation given has {federation.num_clients} clients; "
                          "drop clients= (the federation decides it)")


def with_python_objects(config: Config, federation: Federation | None,
                        model_factory: Callable[..., torch.nn.Module] | None) -> Config:
    """``config`` recording the Python objects of a new run: ``federation: python:<name>``, its client count,
    and ``model: python:<name>``; a config that says they came from Python needs them passed."""
    if federation is None and config.federation is not None:
        raise ConfigError(f"this config's data came from Python ({FEDERATION_KEY}: {config.federation}); pass "
                          "that federation again: fedhpro.run(..., federation=...)")
    if model_factory is None and is_from_python(config.run.model):
        raise ConfigError(f"this config's model came from Python (model: {config.run.model}); pass that "
                          "callable again: fedhpro.run(..., model=...)")
    run_options = config.run
    recorded = config.federation
    if federation is not None:
        check_federation(federation, run_options.clients)
        run_options = dataclasses.replace(run_options, clients=federation.num_clients)
        recorded = f"{PYTHON_PREFIX}{federation.name}"
    if model_factory is not None:
        run_options = dataclasses.replace(run_options, model=python_name(model_factory))
    return dataclasses.replace(config, run=run_options, federation=recorded)


def user_model_builder(factory: Callable[..., torch.nn.Module], num_classes: int, input_shape: tuple[int, ...],
                       feature_dim: int, sample: torch.Tensor | None = None) -> Callable[[], torch.nn.Module]:
    """A zero-argument builder calling ``factory`` with the arguments it names, its first model checked.

    ``factory`` receives those of ``num_classes``, ``input_shape`` and
    ``feature_dim`` that it names as parameters; a required parameter beyond
    them is a ConfigError. The first model built is checked by
    :func:`check_user_model` (on ``sample``, one input, when given).
    """
    name = python_name(factory).removeprefix(PYTHON_PREFIX)
    offered = {"num_classes": num_classes, "input_shape": tuple(input_shape), "feature_dim": feature_dim}
    try:
        parameters = dict(inspect.signature(factory).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: call it bare
        parameters = {}
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    arguments = {key: value for key, value in offered.items()
                 if key in parameters and parameters[key].kind in named}
    missing = [p.name for p in parameters.values() if p.default is inspect.Parameter.empty and p.name not in arguments
               and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if missing:
        raise ConfigError(f"model={name} needs the argument(s) {', '.join(missing)}; fedhpro passes only "
                          "num_classes, input_shape and feature_dim by keyword: give the others defaults")
    checked = False

    def build() -> torch.nn.Module:
        nonlocal checked
        model = factory(**arguments)
        if not checked:
            check_user_model(model, num_classes, sample, name)
            checked = True
        return model

    return build


def check_user_model(model: Any, num_classes: int, sample: torch.Tensor | None, name: str) -> None:
    """One-line ConfigError naming the fix unless ``model`` has fedhpro's form.

    The form: ``features`` (a module, x -> 1 x d for one input), ``classifier``
    (an ``nn.Linear(d, num_classes)``) and ``model(x) == classifier(features(x))``;
    the shapes are checked by a forward pass on ``sample`` when given.
    """
    nn = torch.nn
    split_hint = "or wrap a torchvision-style model: fedhpro.models.split(model, head='fc')"
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={name} returned a {type(model).__name__}, not an nn.Module; return the model")
    features = getattr(model, "features", None)
    if not isinstance(features, nn.Module):
        raise ConfigError(f"model={name} has no `features` module; give it features (x -> B x d) and classifier "
                          f"(nn.Linear(d, C)), {split_hint}")
    classifier = getattr(model, "classifier", None)
    if not isinstance(classifier, nn.Linear):
        what = "no `classifier`" if classifier is None else f"a `classifier` of type {type(classifier).__name__}"
        raise ConfigError(f"model={name} has {what}; it needs classifier = nn.Linear(d, C) applied to features(x), "
                          f"{split_hint}")
    if classifier.out_features != num_classes:
        raise ConfigError(f"model={name}'s classifier has {classifier.out_features} outputs but the data have "
                          f"{num_classes} classes; build it with num_classes outputs (take a num_classes argument)")
    d = classifier.in_features
    declared = getattr(model, "feature_dim", None)
    if isinstance(declared, int) and declared != d:
        raise ConfigError(f"model={name}.feature_dim is {declared} but classifier.in_features is {d}; make them "
                          "equal (methods read feature_dim)")
    if sample is None:
        return
    parameter = next(model.parameters(), None)
    x = sample.to(parameter.device) if parameter is not None else sample.cpu()
    was_training = model.training
    model.eval()
    try:
        z = _dry_forward(features, x, name, "features")
        if not isinstance(z, torch.Tensor) or tuple(z.shape) != (1, d):
            shape = tuple(z.shape) if isinstance(z, torch.Tensor) else type(z).__name__
            raise ConfigError(f"model={name}'s features give {shape} for one input; they must give 1 x d with "
                              f"d = classifier.in_features = {d} (flatten them, or fix the classifier's in_features)")
        logits = _dry_forward(model, x, name, "forward")
        with torch.no_grad():
            expected = classifier(z)
    finally:
        model.train(was_training)
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (1, num_classes) or not torch.allclose(
            logits, expected, rtol=1e-4, atol=1e-5):
        raise ConfigError(f"model={name}(x) is not classifier(features(x)); methods train the two parts, so the "
                          "forward must be exactly classifier(features(x))")


def _dry_forward(module: torch.nn.Module, x: torch.Tensor, name: str, part: str) -> Any:
    """``module(x)`` without gradients; a failure becomes a one-line ConfigError naming the input shape."""
    try:
        with torch.no_grad():
            return module(x)
    except Exception as error:  # the user's network on an input it was not built for
        reason = (str(error).strip().splitlines() or [""])[0]
        raise ConfigError(f"model={name} ({part}) fails on one training input of shape {tuple(x.shape[1:])} "
                          f"({type(error).__name__}: {reason}); build it for that input shape "
                          "(take an input_shape argument)") from None


def _shared(config: Config) -> str:
    """Which weights travel: prototype-only protocols send none; heterogeneous models the classifier."""
    if getattr(config.method_options, "protocol", "dagger") == "proto-only":
        return "none"
    return "classifier" if config.run.heterogeneity != "none" else "all"


#: settings a resumed run may change (how it runs, not what it computes)
_RESUME_SETTINGS = {"resume", "progress", "device", "threads", "checkpoint_every", "checkpoint_minutes",
                    "keep_checkpoints", "tensorboard", "tsne"}


def run_or_continue(config: Config, folder: str | os.PathLike) -> dict[str, Any]:
    """The summary of ``config`` run in ``folder``, for drivers of many runs (compare, reproduce).

    A finished run there is read back; an interrupted one continues from its newest checkpoint; one
    interrupted before its first checkpoint has its files removed and starts again. The caller makes
    sure that the folder's ``config.yaml``, if any, is ``config``'s.
    """
    folder = Path(folder)
    with claim_run_folder(folder) as claim:  # read, cleared and run by this one process
        done = folder / "summary.json"
        if done.is_file():
            return json.loads(done.read_text())
        if (folder / "config.yaml").is_file() and checkpoint.latest(folder) is not None:
            return _run(None, {"resume": str(folder), "progress": config.run.progress,
                               "threads": config.run.threads}, {}, None, False, claim).summary
        for name in driver.RUN_FILES:
            path = folder / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, out=str(folder)))
        return _run(config, None, {}, None, False, claim).summary


def _given_settings(source: str | os.PathLike | Mapping[str, Any] | None,
                    overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The keys the user set (``section.knob`` form) and their values: those of ``source`` (a YAML file or a
    mapping), then ``overrides``; what they did not set is not in it, whatever its value."""
    given = dict(read_yaml(source) if source is not None and not isinstance(source, Mapping)
                 else flatten_keys(source or {}, "config"))
    given.update(flatten_keys(overrides, "overrides"))
    return given


def _settings_off_defaults(config: Config) -> dict[str, Any]:
    """The keys of a resolved ``config`` whose values differ from the defaults (those of its data set, and
    ``dataset`` itself): which keys were set cannot be known from a resolved Config, so these stand for them."""
    defaults = load_config({"dataset": config.run.dataset})
    given = {key: _setting(config, key) for key in _setting_keys(config)
             if _setting(config, key) != _setting(defaults, key)}
    if config.run.dataset != load_config(None).run.dataset:
        given["dataset"] = config.run.dataset
    return given


def _setting_keys(config: Config) -> list[str]:
    """Every key of ``config`` in ``section.knob`` form (run keys bare)."""
    sections = {**config.methods, "data": config.data, "faults": config.faults, "partition": config.partition,
                "aggregation": config.aggregation}
    return [f.name for f in dataclasses.fields(config.run)] + [
        f"{name}.{f.name}" for name, options in sections.items() for f in dataclasses.fields(options)]


def _setting(config: Config, key: str) -> Any:
    """The value of ``key`` (``rounds``, ``fedhpro.tau``, ``data.clients_per_domain.mnist``) in ``config``;
    an entry of a mapping is compared as the whole mapping."""
    section, _, rest = key.partition(".")
    if not rest:
        return config.federation if key == FEDERATION_KEY else getattr(config.run, key)
    sections = {"data": config.data, "faults": config.faults, "partition": config.partition,
                "aggregation": config.aggregation}
    return getattr(sections.get(section) or config.methods[section], rest.partition(".")[0])


def _changed_on_resume(stored: Mapping[str, Any], given: Mapping[str, Any]) -> list[str]:
    """The keys of ``given`` (bar :data:`_RESUME_SETTINGS`) that would change the saved config ``stored``.

    Each key is resolved against the saved config, as the run would read it
    (``tau=0.1`` and ``tau=1e-1`` are the same value), and compared with the
    saved value; a key the saved run cannot take (a data set's knob after a
    ``dataset=`` change) counts as changed.
    """
    saved = load_config(stored)
    changed = []
    for key, value in given.items():
        if key in _RESUME_SETTINGS:
            continue
        try:
            changes = _setting(load_config(stored, {key: value}), key) != _setting(saved, key)
        except ConfigError:
            changes = True
        if changes:
            changed.append(key)
    return sorted(changed)


def resumed_config(config: Config, source: Mapping[str, Any] | None = None,
                   overrides: Mapping[str, Any] | None = None) -> tuple[Config, Path]:
    """The saved config of the run in ``config.run.resume`` and its newest checkpoint, by :func:`run`'s rule:
    the keys set in ``source`` and ``overrides`` that a resumed run may not change are refused (one line).
    What the Flower ServerApp resumes with (its base settings and run config)."""
    return _resume_config(config, given=_given_settings(source, overrides or {}))


def _resume_config(config: Config, federation: Federation | None = None,
                   model_factory: Callable[..., torch.nn.Module] | None = None,
                   given: Mapping[str, Any] | None = None) -> tuple[Config, Path]:
    """The saved config of the run to resume (with the allowed settings of ``config``) and its newest checkpoint.

    ``given``: the keys the user set and their values (:func:`_given_settings`;
    None: those of ``config`` that differ from the defaults). Any of them that
    differs from the saved config, other than :data:`_RESUME_SETTINGS`, is
    refused: the resumed run would silently use the saved value instead.

    A run whose data or model came from Python (``federation: python:<name>``,
    ``model: python:<name>`` in its config.yaml) needs the same objects passed
    again; passing them to a run that did not use them is refused too.
    """
    assert config.run.resume is not None, "called only for a run with resume= set"
    run_dir = Path(config.run.resume)
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"resume={str(run_dir)!r}: no config.yaml there; give the folder of an earlier run")
    stored = read_yaml(saved)
    model = stored.pop("model", None) if is_from_python(stored.get("model")) else None
    changed = _changed_on_resume(stored, _settings_off_defaults(config) if given is None else given)
    if changed:
        raise ConfigError(f"resume takes its settings from {saved}; remove {', '.join(changed)} "
                          f"(only {', '.join(sorted(_RESUME_SETTINGS - {'resume'}))} may change)")
    keep = {name: getattr(config.run, name) for name in _RESUME_SETTINGS}
    resumed = load_config(stored, keep)
    where = f"resume={str(run_dir)!r}"
    if resumed.federation is not None:
        if federation is None:
            raise ConfigError(f"{where}: that run's data came from Python ({resumed.federation}); pass the same "
                              "federation again: fedhpro.run(resume=..., federation=...)")
        if f"{PYTHON_PREFIX}{federation.name}" != resumed.federation or (
                resumed.run.clients is not None and resumed.run.clients != federation.num_clients):
            raise ConfigError(f"{where}: that run used {resumed.federation} with {resumed.run.clients} clients, "
                              f"not python:{federation.name} with {federation.num_clients}; pass the same federation")
    elif federation is not None:
        raise ConfigError(f"{where}: that run used dataset={resumed.run.dataset}, not a federation from Python; "
                          "drop federation= (a resumed run keeps its data)")
    if model is not None:
        if model_factory is None:
            raise ConfigError(f"{where}: that run's model came from Python ({model}); pass the same callable "
                              "again: fedhpro.run(resume=..., model=...)")
        if python_name(model_factory) != model:
            raise ConfigError(f"{where}: that run's model was {model}, this call passes "
                              f"{python_name(model_factory)}; pass the same callable")
        resumed = dataclasses.replace(resumed, run=dataclasses.replace(resumed.run, model=model))
    elif model_factory is not None:
        raise ConfigError(f"{where}: that run used model={resumed.run.model}, not a callable; drop model=")
    newest = checkpoint.latest(run_dir)
    if newest is None:
        raise ConfigError(f"resume={str(run_dir)!r}: the run has no checkpoint yet; start it again instead")
    return resumed, newest

