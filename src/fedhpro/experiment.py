"""Building an experiment: the federation, the model factories, the method and the round protocol's settings
of a config, the same for the in-process simulator and the Flower apps; and the one setup every run goes
through (:func:`run_with_engine`: ``fedhpro.run``, ``fedhpro tune``'s trials and the Flower ServerApp): its
folder claimed, its config resolved, its engine and :class:`~fedhpro.engines.lifecycle.Run` built by the
caller's builder, then the run around the rounds."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedhpro import runtime
from fedhpro.config import Config, applied_data_options, channels_last_setting
from fedhpro.data import get_dataset
from fedhpro.data.federation import Federation
from fedhpro.data.matched_tests import match_client_tests
from fedhpro.data.unseen import hold_out_clients
from fedhpro.data.validation import hold_out_validation
from fedhpro.engines.interface import SIMULATOR, Engine, EngineKind
from fedhpro.engines.lifecycle import Run, claimed_run_folder, execute
from fedhpro.engines.observers import RoundObserver
from fedhpro.engines.printout import Voice, warn_line
from fedhpro.engines.protocol import RoundProtocol
from fedhpro.engines.simulator import Simulator
from fedhpro.errors import ConfigError
from fedhpro.methods import MethodSpec, TrainSettings, get_method
from fedhpro.methods.sample_dp import model_problem, settings_problem
from fedhpro.models import build_model, with_projection_head
from fedhpro.models.heterogeneity import architecture_for_client
from fedhpro.privacy import Ledger, check_combinations, ledger_for, private_train_settings, sample_level
from fedhpro.resume import claimed_config
from fedhpro.user_models import check_federation, user_model_builder


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


def build_simulator(config: Config, parts: Experiment, device: torch.device,
                    observers: list[RoundObserver] | None = None,
                    on_drop: Callable[[str], None] | None = warn_line) -> Simulator:
    """The in-process simulator of ``config`` on the built ``parts``, watched by ``observers`` (also what a
    Flower node and server build in partition mode)."""
    # clients side by side (parallel_clients=), each with its share of the run's threads (set by now)
    workers, client_threads = runtime.client_parallelism(config.run.parallel_clients, torch.get_num_threads(), device)
    return Simulator(parts.method, config.method_options, parts.federation, parts.model_factory, parts.train,
                     device=device, client_architectures=parts.architectures,
                     architecture_factory=parts.architecture_factory, shared=parts.shared,
                     on_drop=on_drop, observers=observers or [], ledger=parts.ledger,
                     parallel_clients=workers, client_threads=client_threads,
                     unseen_finetune=config.run.unseen_finetune, **protocol_settings(config))


def protocol_settings(config: Config) -> dict[str, Any]:
    """The round protocol's settings of ``config``: sampling, evaluation, faults, robust aggregation,
    ``min_clients`` and the privacy options, as keyword arguments that both :class:`Simulator` and
    :class:`~fedhpro.engines.protocol.RoundProtocol` take. The in-process engine and the Flower
    ServerApp both build their protocol from this one place, so both run the same rounds. Settings that
    cannot go with ``privacy=client`` are refused here, in one line (:func:`fedhpro.privacy.check_combinations`)."""
    options = config.run
    check_combinations(config)
    return {"rounds": options.rounds, "participation": options.participation, "seed": options.seed,
            "eval_every": options.eval_every, "faults": config.faults, "aggregation": config.aggregation,
            "min_clients": options.min_clients,
            "privacy": resolved_privacy(config)}


def resolved_privacy(config: Config) -> Any:
    """``config.privacy`` with ``privacy.clipping=auto`` replaced by the run's method's declared choice
    (:attr:`MethodSpec.dp_clipping`), so the protocol, the ledger and summary.json hold joint or per-group."""
    privacy = config.privacy
    if getattr(privacy, "clipping", None) != "auto":
        return privacy
    return dataclasses.replace(privacy, clipping=get_method(config.run.method).dp_clipping)


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
    #: the privacy ledger of privacy=sample (its sigma is in ``train``); privacy=client's is built by the round
    #: protocol (it depends on the method's per-class tensors); None otherwise
    ledger: Ledger | None = None


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
    check_precision(config, torch.device(device))
    if federation is None:
        dataset = get_dataset(options.dataset)
        federation = dataset.build(applied_data_options(config), options.clients, options.seed,
                                   data_dir=options.data_dir, progress=options.progress, partition=config.partition)
    else:
        check_federation(federation, options.clients)
        federation = dataclasses.replace(federation)
    federation = hold_out_clients(federation, options.unseen_clients, options.unseen_domain, options.seed)
    federation = hold_out_validation(federation, options.validation, options.seed)
    if options.client_test == "matched":
        federation = match_client_tests(federation, options.seed)
    federation.to(torch.device(device))
    global_factory, architecture_factory, architectures, shared, train = model_factories(
        config, method, federation.num_classes, federation.input_shape, federation.num_clients,
        user_model=model_factory, sample=federation.clients[0].x[:1])
    ledger = None
    if sample_level(config.privacy):  # DP-SGD's sigma (as given or calibrated) reaches the clients' loop
        # every architecture a client trains, refused here in one line rather than a client dropped every round
        for name in sorted(set(architectures or [options.model])):
            problem = model_problem(architecture_factory(name))
            if problem is not None:
                given = f" (heterogeneity={options.heterogeneity} gives clients it)" if architectures else ""
                raise ConfigError(f"privacy=sample: model {name}{given}: {problem}")
        ledger = ledger_for(config, [len(data) for data in federation.clients], train)
        assert ledger is not None
        train = private_train_settings(config, train, ledger)  # clip, sigma and where the noise comes from
    return Experiment(method, federation, global_factory, architecture_factory, architectures, train, shared,
                      ledger)


def check_precision(config: Config, device: torch.device) -> None:
    """One-line ConfigError where the run's precision settings cannot train on ``device``: under
    ``privacy=sample`` any of amp, channels_last=true or compile (DP-SGD runs in eager float32; channels_last=auto
    is off without amp), else ``amp=bf16`` on a CPU without native bfloat16 (:func:`fedhpro.runtime.precision_problem`).
    :func:`build_experiment` calls it; a Flower node that builds its parts from :func:`model_factories` calls it too."""
    options = config.run
    if sample_level(config.privacy):
        problem = settings_problem(options.amp, bool(channels_last_setting(options.channels_last)), options.compile)
    else:
        problem = runtime.precision_problem(options.amp, device)
    if problem is not None:
        raise ConfigError(problem)


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
                          momentum=options.momentum, weight_decay=options.weight_decay,
                          max_grad_norm=options.max_grad_norm, amp=options.amp,
                          channels_last=channels_last_setting(options.channels_last), compile=options.compile)
    architectures = None
    if options.heterogeneity != "none":
        architectures = [architecture_for_client(options.heterogeneity, k) for k in range(num_clients)]
    return model_factory, architecture_factory, architectures, _shared(config), train


def _shared(config: Config) -> str:
    """Which weights travel: what the method declares for its options (MethodSpec.weights_travel; e.g. none
    under the prototype methods' protocol=proto-only), else all, or the classifier when models differ."""
    declared = get_method(config.run.method).weights_travel
    if declared is not None and declared(config.method_options) == "none":
        return "none"
    return "classifier" if config.run.heterogeneity != "none" else "all"


# ---------------------------------------------------------------------------- the run setup, once for every entry


@dataclass(frozen=True)
class RunStart:
    """A run once its folder is claimed and its config resolved (:func:`run_with_engine`): what an engine's
    builder needs. ``out``: the run's folder (None: a Flower run without ``out=``); ``resume_from``: the
    checkpoint a resumed run continues from (None: a new run); ``started``: when the run started (its
    summary's seconds count from there)."""

    config: Config
    out: Path | None
    resume_from: Path | None
    started: float = field(default_factory=time.perf_counter)

    def run(self, protocol: RoundProtocol, kind: EngineKind = SIMULATOR) -> Run:
        """The :class:`~fedhpro.engines.lifecycle.Run` of an engine of ``kind`` whose round protocol is
        ``protocol`` (built before the engine's rounds are driven: Flower's strategy holds it)."""
        return Run(self.out, self.config.run, protocol, engine=kind, started=self.started)


@dataclass
class EngineRun:
    """What an engine's builder hands :func:`run_with_engine`: the ``engine`` and its ``run``
    (:meth:`RunStart.run`), the ``config`` it runs (the claimed one, or what the engine learned besides: Flower's
    nodes), the data's name, partition.json's record and notes, the ``voice`` the run speaks with and
    ``write_model(out)``, which writes the trained model into the folder (or nothing)."""

    engine: Engine
    run: Run
    config: Config
    data_name: str
    partition: Any
    notes: Sequence[str]
    voice: Voice
    write_model: Callable[[Path], None]


#: an engine's builder: given the claimed run, a context (entered around the rounds) that yields the engine
EngineBuilder = Callable[[RunStart], AbstractContextManager[EngineRun]]


def run_with_engine(config: Config, folder: Path | None, setting: str, build: EngineBuilder, *, held: Any = None,
                    federation: Federation | None = None,
                    model_factory: Callable[..., torch.nn.Module] | None = None) -> tuple[dict[str, Any], EngineRun]:
    """One run, the same setup for every entry point (``fedhpro.run``, ``fedhpro tune``'s trials, the Flower
    ServerApp): ``folder`` (named by the key ``setting``: ``"out"`` or ``"resume"``) claimed for the whole run
    (:func:`~fedhpro.engines.lifecycle.claimed_run_folder`; ``held``: the caller's claim on it already), the
    config resolved under the claim (:func:`~fedhpro.resume.claimed_config`: a resumed run's saved config and
    checkpoint, or a new run's folder checked), the engine and its ``Run`` built by ``build`` (whose context
    stays entered while the rounds run: a CPU runtime, an observer's end), then the run around the rounds
    (:func:`~fedhpro.engines.lifecycle.execute`). Returns ``(summary, what build gave)``."""
    with claimed_run_folder(folder, setting, held):
        # read under the claim: the folder holds no other live run
        config, resume_from = claimed_config(config, folder, federation, model_factory)
        with build(RunStart(config, folder, resume_from)) as built:
            summary = execute(built.engine, built.run, built.config, data_name=built.data_name,
                              partition=built.partition, notes=built.notes, resume_from=resume_from,
                              write_model=built.write_model, voice=built.voice)
        return summary, built
