"""``fedhpro.run(config) -> RunResult``: one federated run, from Python or the CLI.

The run's jobs live in their own modules: building the experiment and the one run setup of every entry point
(:mod:`fedhpro.experiment`), the run around the rounds for every engine (:class:`fedhpro.engines.lifecycle.Run`),
resuming (:mod:`fedhpro.resume`), models or data given from Python (:mod:`fedhpro.user_models`). This module is
the facade: :func:`run`, :class:`RunResult`, :class:`InProcessRun` (the in-process simulator's builder, which
``fedhpro tune`` uses too) and :func:`run_or_continue` for drivers of many runs.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from fedhpro.bounded import read_json_file
from fedhpro.config import Config, RunOptions, load_config, parse_override
from fedhpro.data.federation import Federation
from fedhpro.engines import checkpoint
from fedhpro.engines.lifecycle import RUN_FILES, run_title
from fedhpro.engines.observers import RoundObserver
from fedhpro.engines.printout import ConsoleVoice, warn_line
from fedhpro.engines.simulator import Simulator
from fedhpro.errors import ConfigError, DataError, RunInterrupted
from fedhpro.experiment import EngineRun, RunStart, build_experiment, build_simulator, resolve_device, run_with_engine
from fedhpro.files import RunFolderClaim, claim_run_folder
from fedhpro.measurements import observers_for
from fedhpro.runtime import bf16_note, cpu_runtime, resolve_threads, torch_threads
from fedhpro.trained import MODEL_FILE, TrainedModels, load_model, simulator_models, write_models
from fedhpro.trained.folder import STATISTICS_FILE, STATISTICS_FORMAT
from fedhpro.user_models import _is_model_callable, _without_model_callable, check_federation


@dataclass
class RunResult:
    """What a run produced: the summary (as in ``summary.json``), every round's metrics, the folder and the
    trained model (:attr:`model`; the same is in ``<out>/model.pt``, see :func:`fedhpro.load_model`)."""

    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    out: Path
    config: Config
    #: the run's final models in memory (None: read them back from ``out``)
    trained: TrainedModels | None = field(default=None, repr=False, compare=False)

    @property
    def accuracy(self) -> float | None:
        """Final AVG accuracy in percent (None: no round was evaluated)."""
        return self.summary["accuracy"]

    @property
    def model(self) -> torch.nn.Module:
        """The final global model as an ``nn.Module`` (eval mode, on the CPU): the module the run was tested
        with (a prototype method's ``inference=nearest-prototype`` included); logits = ``model(x)``. A run whose
        clients keep their own models has none (one ConfigError line): see :meth:`client_model`."""
        if self.trained is None:
            return load_model(self.out)
        return self.trained.model(f"the run in {self.out}")

    def client_model(self, k: int) -> torch.nn.Module:
        """Client ``k``'s personal model (runs whose clients keep their own models: ``heterogeneity=``,
        ``protocol=proto-only``), as the run tested it."""
        if self.trained is None:
            return load_model(self.out, client=k)
        return self.trained.client_model(k, f"the run in {self.out}")


def run(config: Config | str | os.PathLike | Mapping[str, Any] | None = None,
        overrides: Iterable[str] | Mapping[str, Any] | None = None, *, echo: bool = False,
        federation: Federation | None = None, observers: Sequence[RoundObserver] = (), **kwargs: Any) -> RunResult:
    """Run one federated training and write its results.

    Args:
        config: a :class:`~fedhpro.config.Config`, a YAML path, a mapping of
            config keys, or None for the defaults (FedHPro on digits-offline).
        overrides: ``["rounds=5", ...]`` or a mapping, applied after ``config``.
        echo: print the final table (the CLI does).
        federation: your own data, a :class:`~fedhpro.data.federation.Federation`
            (``Federation.from_tensors`` / ``Federation.from_datasets``, or
            tables: :func:`fedhpro.from_dataframes`, whose standardisation
            statistics the run writes to standardize.json as a CSV run does). The
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
        observers: callbacks on the run's rounds, as pfl-research's training
            loop takes them: :class:`~fedhpro.engines.observers.RoundObserver`
            objects, each overriding the hooks it needs: ``attach(engine)``
            before the first round (raise a ConfigError to refuse the run),
            ``on_round_start(round, evaluating)``, ``watch_client(k)`` and
            ``client_trained(k, model)`` around each client's training,
            ``watch_server()`` around the aggregation,
            ``training_measurements()`` and ``evaluation_measurements()``
            (keys added to the round's ``metrics.jsonl`` row),
            ``on_round_end(record)`` with the round's
            :class:`~fedhpro.engines.protocol.RoundRecord`, and
            ``on_run_end()`` once the summary is written. They are called
            after those the config switches on (``flops``, ``tensorboard``,
            ...), in the order given. An observer only looks: none may change a
            weight or a random draw, so a run gives the same numbers with any
            observers or none. An exception raised in a hook stops the run
            there (``fedhpro tune``'s pruner stops a trial so), its rows and
            checkpoints so far kept.

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
    return _run(config, overrides, kwargs, federation, echo, observers=observers)


def _run(config: Config | str | os.PathLike | Mapping[str, Any] | None,
         overrides: Iterable[str] | Mapping[str, Any] | None, kwargs: Mapping[str, Any],
         federation: Federation | None, echo: bool, claim: RunFolderClaim | None = None,
         observers: Sequence[RoundObserver] = ()) -> RunResult:
    """:func:`run` once its arguments are checked: the run's folder is claimed (:func:`claim_run_folder`)
    for the whole run, new or resumed, unless the caller holds its ``claim`` already (:func:`run_or_continue`)."""
    config, model_factory = _resolve_run_config(config, overrides, kwargs)
    folder, setting = _run_folder(config, federation)
    build = InProcessRun(federation, model_factory, echo=echo, observers=observers)
    summary, built = run_with_engine(config, folder, setting, build, held=claim, federation=federation,
                                     model_factory=model_factory)
    return RunResult(summary=summary, metrics=built.run.rows.metrics, out=folder, config=built.config,
                     trained=build.trained[0] if build.trained else None)


class InProcessRun:
    """The builder (:data:`~fedhpro.experiment.EngineBuilder`) of a run on the in-process simulator: its
    experiment built (``federation``, ``model_factory``: the data and model given from Python), the simulator
    watched by the observers the config switches on (``config_observers``:
    :func:`~fedhpro.measurements.observers_for`) and then ``observers``, its trained models written
    (``model_files``; kept in :attr:`trained`), ``echo``: notes, the final table and where the results are
    printed. While the rounds run, on the CPU denormal floats are flushed (restored afterwards), freed memory
    reused (:mod:`fedhpro.runtime`) and the run's thread count set (the caller's put back afterwards); Ctrl-C
    is a :class:`~fedhpro.errors.RunInterrupted` naming the folder's newest checkpoint."""

    def __init__(self, federation: Federation | None = None,
                 model_factory: Callable[..., torch.nn.Module] | None = None, *, echo: bool = False,
                 observers: Sequence[RoundObserver] = (), config_observers: bool = True, model_files: bool = True):
        self.federation, self.model_factory, self.echo = federation, model_factory, echo
        self.observers, self.config_observers, self.model_files = list(observers), config_observers, model_files
        #: the run's trained models, once written (``model_files``)
        self.trained: list[TrainedModels] = []

    @contextmanager
    def __call__(self, start: RunStart) -> Iterator[EngineRun]:
        config, out = start.config, start.out
        assert out is not None, "an in-process run always has its folder"
        device = resolve_device(config.run.device)
        try:
            with cpu_runtime(enabled=device.type == "cpu"), torch_threads(resolve_threads(config.run.threads)):
                yield self._built(start, config, out, device)
                if self.echo:
                    saved = MODEL_FILE if self.trained and self.trained[0].global_model is not None \
                        else "models/client_<k>.pt"
                    print(f"results in {out}/ (summary.json, metrics.jsonl, timing.jsonl, accuracy.png, .svg and "
                          f".pdf, config.yaml); trained model: {saved} (fedhpro.load_model, fedhpro predict)")
        except RunInterrupted:
            raise
        except KeyboardInterrupt as interrupt:  # Ctrl-C: the folder and its newest checkpoint, to say how to go on
            saved_rounds = checkpoint.saved_rounds(out)
            raise RunInterrupted(str(out), saved_rounds[-1] if saved_rounds else None) from interrupt

    def _built(self, start: RunStart, config: Config, out: Path, device: torch.device) -> EngineRun:
        options, federation = config.run, self.federation
        data_name = federation.name if federation is not None else options.dataset
        parts = build_experiment(config, device, federation=federation, model_factory=self.model_factory)
        voice = ConsoleVoice(self.echo)
        title = run_title(options.method, options.seed, data_name)
        chosen = observers_for(options, out, warn_line, title, config.to_dict()) if self.config_observers else []
        simulator = build_simulator(config, parts, device, [*chosen, *self.observers])
        # said only: summary.json does not depend on the CPU; decided on the models built (no extra build, no draws)
        hardware = bf16_note(options.amp, device, [simulator.models.global_model,
                                                   *getattr(simulator.models, "working_models", {}).values()])
        if hardware:
            voice.note(hardware)

        def write_model(folder: Path) -> None:
            if self.model_files:
                self.trained.append(with_federation_statistics(
                    simulator_models(config, simulator, parts.federation), parts.federation))
                write_models(folder, self.trained[0])

        return EngineRun(simulator, start.run(simulator.protocol, Simulator.kind), config, data_name,
                         parts.federation.partition, parts.federation.notes, voice, write_model)


def _run_folder(config: Config, federation: Federation | None) -> tuple[Path, str]:
    """The folder the run writes and the key that named it: ``resume=``'s, ``out=``'s or a new
    ``runs/<method>-<data>-<timestamp>``."""
    if config.run.resume:
        return Path(config.run.resume), "resume"
    data_name = federation.name if federation is not None else config.run.dataset
    return _new_run_folder(config.run, data_name), "out"


def _resolve_run_config(config: Config | str | os.PathLike | Mapping[str, Any] | None,
                        overrides: Iterable[str] | Mapping[str, Any] | None, kwargs: Mapping[str, Any]
                        ) -> tuple[Config, Callable[..., torch.nn.Module] | None]:
    """``(config, model callable or None)`` of :func:`run`'s arguments; the config remembers the keys the
    user set (:attr:`~fedhpro.config.Config.given`), which a resumed run checks against its saved config.

    A ``model`` callable is taken out of the settings (a later source wins, as
    for any other key).
    """
    model_factory = None
    for source in (config, overrides, kwargs):  # a later one wins, as for any other key
        if isinstance(source, Mapping) and "model" in source:
            model_factory = source["model"] if _is_model_callable(source["model"]) else None
    config, overrides = (_without_model_callable(item) for item in (config, overrides))
    kwargs = _without_model_callable(kwargs)
    if isinstance(config, Config):
        if overrides or kwargs:
            raise ConfigError("pass overrides with a YAML path or mapping, not with a resolved Config")
        return config, model_factory
    merged: dict[str, Any] = {}
    if overrides is not None:
        merged.update(overrides if isinstance(overrides, Mapping) else map(parse_override, overrides))
    merged.update(kwargs)
    return load_config(config, merged), model_factory


def with_federation_statistics(models: TrainedModels, federation: Federation) -> TrainedModels:
    """``models`` with the standardisation statistics of a federation that carries them
    (``partition["statistics"]``: :func:`fedhpro.from_dataframes` scaled each site's features), recorded as a
    CSV run's are (standardize.json, model.json's ``input``), so that ``fedhpro predict`` scales raw rows
    alike; other runs' models unchanged."""
    found = federation.partition.get("statistics")
    inputs = models.info.get("input", {})
    if not isinstance(found, dict) or models.statistics is not None or inputs.get("kind") != "tensor":
        return models
    info = {**models.info, "input": {**inputs, "standardize": "client", "statistics": STATISTICS_FILE}}
    return dataclasses.replace(models, info=info,
                               statistics={"format": STATISTICS_FORMAT, "standardize": "client", **found})


def _new_run_folder(options: RunOptions, data_name: str) -> Path:
    """``out``, or ``runs/<method>-<data>-<timestamp>`` (the folder is made only once the run starts)."""
    if options.out:
        return Path(options.out)
    return Path("runs") / (f"{options.method}-{re.sub(r'[^A-Za-z0-9._-]+', '-', data_name)}-"
                           f"{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}")


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
            summary = read_json_file(done, DataError)
            if not isinstance(summary, dict):
                raise DataError(f"{done} holds no run summary (a JSON object); remove the folder to run again")
            return summary
        if (folder / "config.yaml").is_file() and checkpoint.latest(folder) is not None:
            return _run(None, {"resume": str(folder), "progress": config.run.progress,
                               "threads": config.run.threads}, {}, None, False, claim).summary
        for name in RUN_FILES:
            path = folder / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        config = dataclasses.replace(config, run=dataclasses.replace(config.run, out=str(folder)))
        return _run(config, None, {}, None, False, claim).summary
