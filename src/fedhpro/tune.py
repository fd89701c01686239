"""``fedhpro tune``: each method's hyperparameters searched by Optuna on validation accuracy, the same budget each.

For every method, a study (named after the method) in Optuna's storage (``<out>/study.db``, SQLite, or any
RDB URL given as ``storage=``) runs ``trials=`` trials. A trial is one run of the method on the federation
the settings describe, with ``validation=`` (0.2 unless given; 0 is refused) held out of each client's
training data, at the tuning seed (``seed=``, 1000 unless given, apart from ``fedhpro compare``'s 0, 1, 2).
Its value is the last round's validation AVG; test accuracy is never read. The search covers the shared
run keys of :data:`SHARED` (``lr``, in ``lr_range=`` when given, ``local_epochs``, ``max_grad_norm``) and the
method's own knobs that declare ``search=`` (:mod:`fedhpro.search_space`); a key given on the command line is fixed,
not searched. The command's own keys (``methods``, ``trials``, ``out``, ``jobs``, ``storage``, ``pruner``,
``lr_range``) are declared in :mod:`fedhpro.command_options.tune`. The sampler is
TPE; the pruner (``pruner=median``, the default, or ``none``) sees every evaluated round's validation AVG
(:class:`ValidationReporter`, an observer of the trial's run).

The study resumes where it stopped: a trial counts once finished (complete or pruned) or running; one
whose process died is failed by Optuna's heartbeat after :data:`GRACE_SECONDS` and its place is run
again. ``jobs=N`` starts ``N`` worker processes sharing each study through the storage (several machines:
the same command with one ``storage=`` URL each); a lock around "count, then start a trial" keeps the
total at the budget on one machine, and a trial started past it anyway (another machine won the race) is
failed at once, before it runs, and not counted.

A trial whose run diverged counts in the budget as validation :data:`DIVERGED_VALUE` and is recorded as
diverged (the trial's ``diverged`` user attribute, why): the local training's divergence check stopped it (an
:class:`~fedhpro.errors.UpdateError`), or :class:`ValidationReporter` did: a round's mean training loss was NaN or
infinite, or an evaluated round's models give NaN or infinite outputs on the validation data, or one output for
every input (their features died). It is never chosen as the best.

Written (atomically): ``<out>/<method>/trials.csv`` (every trial: number, state (complete, diverged, pruned,
failed), why, value, its settings), ``<out>/<method>/best.yaml``, ``<out>/tuned.yaml`` (``methods``: each
method's best settings, and ``tuning``: how they were found, with each method's trials counted by outcome), which
``fedhpro compare tuned=<out>/tuned.yaml`` runs on the test set, and ``<out>/tuning.md`` (the counts, the best
trials, the diverged trials apart).
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import math
import multiprocessing
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy
import torch
import yaml
from torch import Tensor

from fedhpro.api import InProcessRun
from fedhpro.command_options.keys import read, take
from fedhpro.command_options.tune import DEFAULT_LR_SPACE, TuneOptions
from fedhpro.compare import setting_differences
from fedhpro.config import Config, load_config, parse_override
from fedhpro.engines.observers import RoundObserver
from fedhpro.engines.protocol import RoundRecord
from fedhpro.errors import ConfigError, UpdateError
from fedhpro.experiment import run_with_engine
from fedhpro.files import spreadsheet_cell, write_atomic
from fedhpro.methods import declared_method
from fedhpro.methods.base import all_finite, load_weights
from fedhpro.methods.no_grad import eval_forward, no_grad_pass, no_grad_precision
from fedhpro.options import fields_of
from fedhpro.runtime import resolve_threads
from fedhpro.search_space import SHARED, Categorical, IntRange, LogUniform, Space, Uniform, contains, declared, describe

#: the validation share a tuning holds out when the settings give none
DEFAULT_VALIDATION = 0.2
#: the tuning runs' seed when the settings give none: apart from compare's default seeds 0, 1, 2
TUNING_SEED = 1000
#: Optuna's heartbeat: a running trial whose process stopped beating this long ago is failed (and run again)
HEARTBEAT_SECONDS = 10
GRACE_SECONDS = 60
STUDY_FILE = "study.db"
TUNED_FILE = "tuned.yaml"
SUMMARY_FILE = "tuning.md"
#: the value the sampler sees for a diverged trial: below any accuracy, so that TPE learns the region is bad. Not a
#: failed state: TPE leaves failed trials out (it would draw the diverging learning rates again), and a failed trial
#: does not count in the budget (its place would be run again); the trial stays complete, with its ``diverged``
#: user attribute, and is shown apart and never chosen as the best
DIVERGED_VALUE = 0.0
#: a trial's outcomes, in the order trials.csv's ``state``, tuning.md and tuned.yaml's ``outcomes`` count them;
#: complete, diverged and pruned trials count in the budget, failed ones were run again in their place
OUTCOMES = ("complete", "diverged", "pruned", "failed", "running")
#: validation samples of each client the models are run on at each evaluated round to find a diverged model
FINITE_CHECK_SAMPLES = 64


@dataclass(frozen=True)
class Tuning:
    """What a tuning was asked: the methods, the budget, the fixed settings (run keys), where it is stored."""

    methods: tuple[str, ...]
    trials: int
    settings: Mapping[str, Any]
    out: Path
    source: str | None = None
    jobs: int = 1
    storage: str | None = None
    pruner: str = "median"
    lr_space: LogUniform = DEFAULT_LR_SPACE  # where lr is searched (unless the settings fix it)

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.out / STUDY_FILE).resolve()}"


def space_of(method: str, fixed: Mapping[str, Any] | None = None,
             lr_space: LogUniform = DEFAULT_LR_SPACE) -> dict[str, Space]:
    """``{config key: space}`` searched for ``method``: :data:`SHARED` (``lr`` in ``lr_space``) and the knobs its
    options declare (``method.knob``), less the keys ``fixed`` sets. A ConfigError for a method whose options
    declare none (a method without options has only the shared keys to search)."""
    spec = declared_method(method)  # a ConfigError naming the registered ones for an unknown name
    own = declared(spec.options)
    if fields_of(spec.options) and not own:
        raise ConfigError(f"method {method!r} declares no search space; give some of its options search= "
                          "(fedhpro.search_space, e.g. option(0.1, search=LogUniform(0.01, 1.0))) or leave it out "
                          "of methods=")
    space = {**SHARED, "lr": lr_space,
             **{f"{method}.{name}": knob for name, knob in own.items()}}  # search_space.searched's
    return {key: knob for key, knob in space.items() if key not in (fixed or {})}


def suggest(trial: Any, key: str, space: Space) -> Any:
    """``trial``'s value for ``key`` drawn from ``space`` (an Optuna trial)."""
    if isinstance(space, LogUniform):
        return trial.suggest_float(key, space.low, space.high, log=True)
    if isinstance(space, Uniform):
        return trial.suggest_float(key, space.low, space.high)
    if isinstance(space, IntRange):
        return trial.suggest_int(key, space.low, space.high, step=space.step)
    if isinstance(space, Categorical):
        return trial.suggest_categorical(key, list(space.choices))
    raise TypeError(f"not a search space: {space!r}")


def _optuna() -> Any:
    # lazy: optuna (and SQLAlchemy under it) loads only when a tuning runs, so `import fedhpro` stays light
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # the heartbeat (fail_stale_trials, heartbeat_interval) is marked experimental since Optuna 2.9: said once here
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    return optuna


class ValidationReporter(RoundObserver):
    """Reports each evaluated round's validation AVG to the Optuna ``trial`` and raises ``TrialPruned`` when
    its pruner says so before ``last_round`` (0-based; the run then stops; its folder keeps the rounds it ran).

    Before that it stops, with :class:`RunDiverged`, a run that diverged without the local training's check
    stopping it: a round whose mean training loss is NaN or infinite, an evaluated round whose models
    (:func:`diverged_models`) give NaN or infinite outputs, or a last round whose models give one output for every
    input. Both read as a chance-level validation AVG, not as an error: the argmax of NaN logits is a constant
    guess, and so is a model whose features died (steps too large drove every unit of a layer below zero). An
    explosion in the last round is caught only so: no later round's first batch is there to stop the run."""

    def __init__(self, trial: Any, last_round: int | None = None) -> None:
        self.trial = trial
        self.last_round = last_round
        self.curve: list[tuple[int, float]] = []

    def on_round_end(self, record: RoundRecord) -> None:
        losses = {name: value for name, value in record.train.items() if isinstance(value, float)}
        bad = [name for name, value in losses.items() if not math.isfinite(value)]
        if bad:
            raise RunDiverged(f"its mean training loss ({bad[0]}) was {losses[bad[0]]} in round {record.round + 1}")
        validation = record.extra.get("validation")
        if not validation:
            return
        # NaN never recovers: stopped at once; dead features may come back to life in a later round (momentum,
        # the other clients' updates): judged on the last round's models only
        last = self.last_round is None or record.round == self.last_round
        diverged = diverged_models(self.simulator, record.round, collapse=last)
        if diverged is not None:
            raise RunDiverged(diverged)
        if validation.get("AVG") is None or not math.isfinite(validation["AVG"]):
            return
        value = float(validation["AVG"])
        self.curve.append((record.round, value))
        self.trial.report(value, step=record.round)
        # the last round is never pruned: its run is done, and its value is the trial's, complete
        if record.round != self.last_round and self.trial.should_prune():
            raise _optuna().TrialPruned(f"pruned after round {record.round + 1} at validation {value:.2f}")


class RunDiverged(UpdateError):
    """A trial's run diverged without the local training's check stopping it (:class:`ValidationReporter`)."""


def nonfinite_outputs(outputs: Tensor) -> bool:
    """Whether a model's outputs (logits, one row a sample) hold what a diverged model gives: a NaN or +inf
    anywhere, or a row without any finite value. ``-inf`` alone is no sign: a nearest-prototype rule gives it to
    the classes without a prototype."""
    if not outputs.is_floating_point() or all_finite(outputs):
        return False
    rows = outputs.reshape(outputs.shape[0], -1)
    return bool(torch.isnan(rows).any() or torch.isposinf(rows).any() or (~torch.isfinite(rows)).all(dim=1).any())


def collapsed_outputs(outputs: Tensor, inputs: Tensor) -> bool:
    """Whether a model gives exactly the same output for every one of ``inputs`` (at least two different ones):
    its features died, every input gets one prediction. A model that only learned little still tells inputs
    apart; one whose every unit of a layer is stuck at zero cannot."""
    flat = inputs.reshape(inputs.shape[0], -1)
    if flat.shape[0] < 2 or bool((flat == flat[0]).all()):
        return False
    rows = outputs.reshape(outputs.shape[0], -1)
    return bool((rows == rows[0]).all())


def diverged_models(simulator: Any, round: int, collapse: bool = True) -> str | None:
    """Why the run's models diverged by ``round`` (0-based), or None. Each client's validation samples (the first
    :data:`FINITE_CHECK_SAMPLES`) go through the model it is validated with (the global one, or its personal model
    with the global shared part) and the server's inference rule, in the run's evaluation precision: diverged when
    one client's outputs are :func:`nonfinite_outputs` (exploded weights, or finite ones so large that the logits
    overflow) or, with ``collapse``, when they are :func:`collapsed_outputs` for every client together (the global
    model: one output for every sample of every client; personal models: each client's for all its samples). A
    model dead on one domain's inputs but alive on the others' still learned something. No validation parts:
    None (a tuning always holds some out)."""
    parts = simulator.federation.client_validation
    if parts is None:
        return None
    models, server = simulator.models, simulator.server
    shared = server.global_weights()
    if not models.personal:
        models.eval_model.load_state_dict(shared)
    seen: list[tuple[Tensor, Tensor]] = []
    for k, (x, _) in enumerate(parts):
        if not len(x):
            continue
        model = models.model_for(k) if models.personal else models.eval_model
        if models.personal:
            load_weights(model, dict(shared))
        model.eval()
        inputs = x[:FINITE_CHECK_SAMPLES]
        with torch.no_grad(), no_grad_precision(simulator.tests.amp, x.device), no_grad_pass(x.device):
            outputs = eval_forward(server.inference_model(model), inputs)
        if nonfinite_outputs(outputs):
            which = f"client {k}'s personal model" if models.personal else "the global model"
            return (f"after round {round + 1} {which} gives NaN or infinite outputs on client {k}'s validation data "
                    "(its weights exploded)")
        seen.append((outputs, inputs))
    if not collapse or not seen:
        return None
    if models.personal:
        if all(collapsed_outputs(outputs, inputs) for outputs, inputs in seen):
            return (f"after round {round + 1} every client's personal model gives one output for all its validation "
                    "samples (their features died: one prediction for every input)")
        return None
    if collapsed_outputs(torch.cat([outputs for outputs, _ in seen]), torch.cat([inputs for _, inputs in seen])):
        return (f"after round {round + 1} the global model gives the same output for every validation sample of "
                "every client (its features died: one prediction for every input)")
    return None


def trial_run(config: Config, folder: Path, observer: RoundObserver) -> dict[str, Any]:
    """``config`` run in the new ``folder`` with ``observer`` watching its rounds; its summary.

    :func:`fedhpro.run`'s setup and in-process engine (:class:`~fedhpro.api.InProcessRun`) with ``observer``
    as the only one (the config's measurements are not a trial's) and no model written."""
    build = InProcessRun(observers=[observer], config_observers=False, model_files=False)
    summary, _ = run_with_engine(config, folder, "out", build)
    return summary


def _fixed_settings(tuning: Tuning, method: str) -> dict[str, Any]:
    """The settings every trial of ``method`` shares (what the study records and a resumed one must match)."""
    return {"source": tuning.source, "method": method, **{k: tuning.settings[k] for k in sorted(tuning.settings)},
            "space": {key: describe(space)
                      for key, space in space_of(method, tuning.settings, tuning.lr_space).items()}}


def trial_config(tuning: Tuning, method: str, values: Mapping[str, Any], folder: Path) -> Config:
    """The config of one trial: the fixed settings, the trial's ``values``, quiet, in ``folder``."""
    config = load_config(tuning.source, {**tuning.settings, **values, "method": method, "out": str(folder),
                                         "progress": False, "checkpoint_every": 0})
    return replace(config, run=replace(config.run, threads=str(resolve_threads(config.run.threads, tuning.jobs))))


@contextmanager
def _locked(path: Path) -> Iterator[Any]:
    """An exclusive ``flock`` on ``path`` (made if needed) while the block runs; yields the open file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield handle


def _study(tuning: Tuning, method: str, worker: int) -> Any:
    """``method``'s study in the storage, made (with its fixed settings recorded) or loaded and checked; one
    process at a time on this machine (SQLite cannot make the same tables twice at once)."""
    optuna = _optuna()
    with _locked(tuning.out / ".storage.lock"):
        storage = optuna.storages.RDBStorage(tuning.storage_url, heartbeat_interval=HEARTBEAT_SECONDS,
                                             grace_period=GRACE_SECONDS)
        config = load_config(tuning.source, dict(tuning.settings))
        # median: a trial stops when its validation AVG at a round is below the median of the finished trials' at
        # that round, after 3 finished trials and not in the first third of the rounds (slow starters get a chance)
        pruner = (optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=config.run.rounds // 3)
                  if tuning.pruner == "median" else optuna.pruners.NopPruner())
        study = optuna.create_study(study_name=method, storage=storage, pruner=pruner, direction="maximize",
                                    load_if_exists=True)
        # the sampler's seed: the tuning's, this worker's index and the trials already there, so that a resumed
        # study or another worker does not draw the same first settings again (TPE's first trials are random)
        seed = int(config.run.seed)
        entropy = numpy.random.SeedSequence([seed, worker, len(study.get_trials(deepcopy=False))])
        study.sampler = optuna.samplers.TPESampler(seed=int(entropy.generate_state(1)[0]), constant_liar=True,
                                                   n_startup_trials=5)
        fixed = json.loads(json.dumps(_fixed_settings(tuning, method), default=str))
        stored = study.user_attrs.get("settings")
        if stored is None:
            study.set_user_attr("settings", fixed)
    if stored is not None and stored != fixed:
        differences = setting_differences(stored, fixed)
        raise ConfigError(f"the study of {method} in {tuning.storage_url} was tuned with other settings "
                          f"({'; '.join(differences[:4])}); give another out= (or storage=) or delete it")
    return study


def _counts(study: Any) -> tuple[int, int, int]:
    """``(finished, running, failed)`` trials of ``study`` (finished: complete or pruned)."""
    states = [trial.state.name for trial in study.get_trials(deepcopy=False)]
    return (states.count("COMPLETE") + states.count("PRUNED"), states.count("RUNNING"), states.count("FAIL"))


def tune_method(tuning: Tuning, method: str, worker: int = 0, echo: bool = True) -> None:
    """Run trials of ``method``'s study until ``tuning.trials`` are finished (this and any other worker's)."""
    optuna = _optuna()
    study = _study(tuning, method, worker)
    space = space_of(method, tuning.settings, tuning.lr_space)
    lock_path = tuning.out / method / ".trials.lock"
    held: list[Any] = []

    def objective(trial: Any) -> float:
        for handle in held:  # the trial is in the storage now (running): another worker may count it
            fcntl.flock(handle, fcntl.LOCK_UN)
        held.clear()
        finished, running, _ = _counts(study)
        if finished + running > tuning.trials:  # started past the budget (another machine won the race)
            trial.set_user_attr("over_budget", True)
            raise _OverBudget()
        values = {key: suggest(trial, key, knob) for key, knob in space.items()}
        folder = tuning.out / method / f"trial-{trial.number:04d}"
        config = trial_config(tuning, method, values, folder)
        reporter = ValidationReporter(trial, last_round=config.run.rounds - 1)
        try:
            summary = trial_run(config, folder, reporter)
        except UpdateError as error:  # the settings diverged (TrainingDiverged, RunDiverged): a result, the worst one
            trial.set_user_attr("diverged", str(error))
            return DIVERGED_VALUE
        finally:
            trial.set_user_attr("curve", reporter.curve)
        validation = summary.get("validation", {}).get("accuracy")
        return 0.0 if validation is None else float(validation)  # a run no client could be tested on: 0

    def said(study: Any, trial: Any) -> None:
        if not echo or trial.user_attrs.get("over_budget"):
            return
        outcome = f"{trial.state.name.lower()}, validation " + ("-" if trial.value is None else f"{trial.value:.2f}")
        if outcome_of(trial) == "diverged":
            outcome = f"diverged ({trial.user_attrs['diverged']}), counted as validation {DIVERGED_VALUE:g}"
        if trial.state.name == "PRUNED" and trial.intermediate_values:
            step = max(trial.intermediate_values)
            outcome = f"pruned after round {step + 1}, validation {trial.intermediate_values[step]:.2f}"
        shown = ", ".join(f"{k}={_short(v)}" for k, v in trial.params.items())
        done = _counts(study)[0]
        print(f"{method} trial {trial.number} ({done}/{tuning.trials}): {outcome} ({shown})", flush=True)

    failures_allowed = tuning.trials
    while True:
        with _locked(lock_path) as handle:
            optuna.storages.fail_stale_trials(study)
            finished, running, failed = _counts(study)
            if finished >= tuning.trials:
                return
            if failed > failures_allowed:
                raise ConfigError(f"{failed} trials of {method} failed; see the errors above, fix the settings "
                                  f"and run again (the study in {tuning.storage_url} keeps its finished trials)")
            if finished + running >= tuning.trials:  # the others' last trials are running: wait for them
                wait = True
            else:
                wait = False
                held.append(handle)
                try:
                    study.optimize(objective, n_trials=1, callbacks=[said], catch=(_OverBudget,))
                finally:
                    held.clear()
        if wait:
            time.sleep(1.0)


class _OverBudget(Exception):
    """A trial started past the budget (failed at once, not run, not counted)."""


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _worker(tuning: Tuning, worker: int) -> None:
    """One worker process of ``jobs=N``: every method's study in turn, quiet but for its trials' lines."""
    for method in tuning.methods:
        tune_method(tuning, method, worker)


def tune(tuning: Tuning, echo: bool = True) -> dict[str, Any]:
    """Run the tuning (``jobs`` workers, each study to its budget), then write every method's trials table and
    best settings and ``tuned.yaml``; returns ``tuned.yaml``'s content."""
    check(tuning)
    tuning.out.mkdir(parents=True, exist_ok=True)
    if tuning.jobs == 1:
        for method in tuning.methods:
            tune_method(tuning, method, 0, echo)
    else:
        for method in tuning.methods:  # the storage's tables and each study made (or checked) once, here
            _study(tuning, method, 0)
        context = multiprocessing.get_context("spawn")  # torch and fork do not mix
        workers = [context.Process(target=_worker, args=(tuning, index)) for index in range(tuning.jobs)]
        for process in workers:
            process.start()
        for process in workers:
            process.join()
        failed = [index for index, process in enumerate(workers) if process.exitcode != 0]
        if failed:
            raise ConfigError(f"tuning worker{'s' if len(failed) > 1 else ''} {failed} stopped with an error (above); "
                              "run the same command again to go on from the study")
    return write_results(tuning, echo)


def check(tuning: Tuning) -> None:
    """Refuse, in one line each, what a tuning cannot run: before any trial."""
    if not tuning.methods:
        raise ConfigError("methods= is empty; give e.g. methods=[fedavg,fedprox]")
    for method in tuning.methods:
        space_of(method, tuning.settings, tuning.lr_space)  # unknown method, a method without a space
    # a Tuning made in Python is checked as the command line's keys are
    read(TuneOptions, {"trials": tuning.trials, "jobs": tuning.jobs, "pruner": tuning.pruner})
    for forbidden in ("method", "resume"):
        if forbidden in tuning.settings:
            raise ConfigError(f"{forbidden}= is set by tune for each trial; remove it")
    config = load_config(tuning.source, {**tuning.settings, "method": tuning.methods[0]})  # every key checked
    if config.run.validation <= 0:
        raise ConfigError("validation=0 leaves no validation data to tune on (tuning never reads test accuracy); "
                          f"give validation={DEFAULT_VALIDATION} or leave validation= out")


def check_trials(tuning: Tuning, method: str, trials: Sequence[Any]) -> None:
    """Refuse, in one line, a study whose trials hold a key this tuning does not search or a value outside its
    space (a study this tuning did not write: a tracker or any other setting in it would go into best.yaml,
    tuned.yaml and trials.csv, and from there into the runs of ``fedhpro compare tuned=``)."""
    space = space_of(method, tuning.settings, tuning.lr_space)
    for trial in trials:
        for key, value in trial.params.items():
            if key not in space or not contains(space[key], value):
                shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
                what = (f"{key}={shown} outside its space ({describe(space[key])})" if key in space else
                        f"{key}=, a key it does not search (searched: {', '.join(space)})")
                raise ConfigError(f"the study of {method} in {tuning.storage_url} was not written by this tuning: "
                                  f"its trial {trial.number} holds {what}; give another out= (or storage=) or "
                                  "delete the study")


def outcome_of(trial: Any) -> str:
    """A trial's outcome (:data:`OUTCOMES`): ``diverged`` for a complete trial whose run diverged (its
    ``diverged`` user attribute), else its Optuna state (``fail`` named ``failed``)."""
    state = trial.state.name
    if state == "COMPLETE":
        return "diverged" if trial.user_attrs.get("diverged") else "complete"
    return {"PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running"}.get(state, state.lower())


def why_of(trial: Any) -> str:
    """Why a trial ended as it did, in a few words (empty for a complete one): what diverged, the round its
    pruner stopped it, why it failed."""
    outcome = outcome_of(trial)
    if outcome == "diverged":
        return f"{trial.user_attrs['diverged']} (counted as validation {DIVERGED_VALUE:g})"
    if outcome == "pruned" and trial.intermediate_values:
        step = max(trial.intermediate_values)
        return f"stopped by the pruner after round {step + 1} at validation {trial.intermediate_values[step]:.2f}"
    if outcome == "failed":
        if trial.user_attrs.get("over_budget"):
            return "started past the budget (another worker's trial took its place); not run, not counted"
        return "its process stopped before it finished; not counted, its place was run again"
    return ""


def outcome_counts(trials: Sequence[Any]) -> dict[str, int]:
    """``{"trials": the ones the budget counts (complete, diverged, pruned), each outcome: how many}``."""
    outcomes = [outcome_of(trial) for trial in trials]
    counts = {outcome: outcomes.count(outcome) for outcome in OUTCOMES}
    return {"trials": counts["complete"] + counts["diverged"] + counts["pruned"], **counts}


def counts_line(counts: Mapping[str, int]) -> str:
    """``5 trials: 3 complete, 2 diverged`` (outcomes with none left out, complete always said; failed trials,
    not counted in the budget, after a semicolon)."""
    said = [f"{counts['complete']} complete"] + [f"{counts[outcome]} {outcome}" for outcome in ("diverged", "pruned")
                                                 if counts[outcome]]
    line = f"{counts['trials']} trial{'s' if counts['trials'] != 1 else ''}: {', '.join(said)}"
    extra = [f"{counts[outcome]} {outcome}" for outcome in ("failed", "running") if counts[outcome]]
    return line + (f"; {', '.join(extra)} (not counted)" if extra else "")


def _settings_text(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{key}={_short(value)}" for key, value in params.items())


def _markdown_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def summary_markdown(tuning: Tuning, config: Config, results: Mapping[str, Mapping[str, Any]]) -> str:
    """``tuning.md``: each method's trials counted by outcome and its best trial, then the diverged trials apart
    (each with why and its settings), every column explained."""
    lines = [f"# Tuning of {', '.join(tuning.methods)}", "",
             f"{tuning.trials} trials per method (the budget: complete, diverged and pruned trials count; a failed "
             f"one was run again), seed {config.run.seed}, validation={config.run.validation}; a trial's value is "
             "its last round's validation AVG (%). Columns: *trials*, the trials the budget counted; *complete*, "
             "runs that finished; *diverged*, runs whose training exploded (the divergence check stopped them, or "
             "their loss or their model's outputs became NaN or infinite, or the model gave one output for every "
             "input), counted as validation "
             f"{DIVERGED_VALUE:g} and never chosen; *pruned*, runs the pruner stopped below the median; *failed*, "
             "runs whose process stopped (not counted); *best validation*, *best trial* and *best settings*, the "
             "complete trial of highest validation AVG (what tuned.yaml holds).", "",
             "| method | trials | complete | diverged | pruned | failed | best validation | best trial "
             "| best settings |",
             "|---|---|---|---|---|---|---|---|---|"]
    for method, result in results.items():
        counts, top = result["counts"], result["best"]
        best_cells = ([f"{top.value:.2f}", str(top.number), _markdown_cell(_settings_text(top.params))]
                      if top is not None else ["–", "–", "no complete trial: nothing chosen"])
        lines.append(f"| {method} | {counts['trials']} | {counts['complete']} | {counts['diverged']} | "
                     f"{counts['pruned']} | {counts['failed']} | " + " | ".join(best_cells) + " |")
    diverged = [(method, trial) for method, result in results.items() for trial in result["trials"]
                if outcome_of(trial) == "diverged"]
    lines += ["", "## Diverged trials", ""]
    if not diverged:
        lines.append("None: no trial diverged.")
    else:
        lines += ["Each diverged trial: its method, its number (its run in `<method>/trial-NNNN/`), why it counts "
                  "as diverged, and the settings it ran.", "",
                  "| method | trial | why | settings |", "|---|---|---|---|"]
        lines += [f"| {method} | {trial.number} | {_markdown_cell(trial.user_attrs['diverged'])} | "
                  f"{_markdown_cell(_settings_text(trial.params))} |" for method, trial in diverged]
    return "\n".join(lines) + "\n"


def write_results(tuning: Tuning, echo: bool = True) -> dict[str, Any]:
    """Every method's ``trials.csv`` and ``best.yaml``, ``tuned.yaml`` and ``tuning.md``, from the studies as they
    are now. A diverged trial is ``diverged`` in trials.csv (its ``why`` says what exploded), counted apart
    (tuned.yaml's ``tuning.outcomes``, tuning.md, the printed lines) and never the best: the best is the complete
    trial of highest validation AVG; a method without one (every trial diverged or was pruned) has no best
    settings, and tuned.yaml leaves it out."""
    optuna = _optuna()
    best: dict[str, dict[str, Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    for method in tuning.methods:
        study = optuna.load_study(study_name=method, storage=tuning.storage_url)
        trials = study.get_trials(deepcopy=False)
        check_trials(tuning, method, trials)
        keys = sorted({key for trial in trials for key in trial.params})
        buffer = io.StringIO()
        writer = csv.writer(buffer)
        writer.writerow(["number", "state", "why", "validation", "rounds_reported", *keys])
        for trial in trials:  # a categorical choice of text may start like a formula: escaped as every table's
            outcome = outcome_of(trial)
            shown_value = "" if trial.value is None or outcome == "diverged" else f"{trial.value:.4f}"
            writer.writerow([trial.number, outcome, spreadsheet_cell(why_of(trial)), shown_value,
                             len(trial.intermediate_values),
                             *[spreadsheet_cell(trial.params.get(key, "")) for key in keys]])
        write_atomic(tuning.out / method / "trials.csv", buffer.getvalue())
        counts = outcome_counts(trials)
        complete = [trial for trial in trials if outcome_of(trial) == "complete"]
        top = max(complete, key=lambda trial: (trial.value, -trial.number)) if complete else None  # earliest of equals
        results[method] = {"counts": counts, "best": top, "trials": trials}
        if top is None:
            if echo:
                print(f"{method}: {counts_line(counts)}; no complete trial, no best settings (a diverged trial is "
                      "never chosen): lower the lr range (lr_range=[low,high], or fix it: lr=) or set "
                      "max_grad_norm=10 and tune again", flush=True)
            continue
        best[method] = dict(top.params)
        write_atomic(tuning.out / method / "best.yaml", yaml.safe_dump(
            {"settings": best[method], "validation": top.value, "trial": top.number,
             "trials": counts_line(counts)}, sort_keys=False))
        if echo:
            print(f"{method}: {counts_line(counts)}; best validation {top.value:.2f} (trial {top.number}): "
                  f"{_settings_text(top.params)}", flush=True)
    config = load_config(tuning.source, {**tuning.settings, "method": tuning.methods[0]})
    tuned = {"tuning": {"trials": tuning.trials, "seed": config.run.seed, "validation": config.run.validation,
                        "storage": tuning.storage_url if tuning.storage else STUDY_FILE,
                        # where lr was searched, when not the default range (a default tuning's file is as before)
                        **({"lr_range": [tuning.lr_space.low, tuning.lr_space.high]}
                           if tuning.lr_space != DEFAULT_LR_SPACE else {}),
                        "settings": {k: tuning.settings[k] for k in sorted(tuning.settings)},
                        "objective": "last round's validation AVG",
                        "outcomes": {method: {**result["counts"], "summary": counts_line(result["counts"])}
                                     for method, result in results.items()}},
             "methods": best}
    write_atomic(tuning.out / TUNED_FILE, yaml.safe_dump(json.loads(json.dumps(tuned, default=str)),
                                                         sort_keys=False))
    write_atomic(tuning.out / SUMMARY_FILE, summary_markdown(tuning, config, results))
    if echo:
        print(f"written: {tuning.out / TUNED_FILE} (fedhpro compare tuned={tuning.out / TUNED_FILE} ...), "
              f"{tuning.out / SUMMARY_FILE}")
    return tuned


def parse(arguments: Sequence[str]) -> Tuning:
    """A :class:`Tuning` of the command line ``[CONFIG.yaml] methods=[...] trials=N out=DIR [jobs=N]
    [storage=URL] [pruner=median|none] [lr_range=[low,high]] KEY=VALUE ...`` (the command's keys:
    :class:`~fedhpro.command_options.tune.TuneOptions`)."""
    items = list(arguments)
    source = items.pop(0) if items and "=" not in items[0] else None
    pairs = dict(map(parse_override, items))
    lr_range_given = "lr_range" in pairs
    options = take(TuneOptions, pairs)  # what stays in pairs: the run keys every trial runs with
    if lr_range_given and "lr" in pairs:
        raise ConfigError("lr= fixes the learning rate, so lr_range= (where it is searched) has nothing to do; "
                          "give one of them")
    if "validation" in pairs:
        try:
            given = float(pairs["validation"])
        except (TypeError, ValueError):
            given = None
        if given == 0:
            raise ConfigError("validation=0 leaves no validation data to tune on (tuning never reads test "
                              f"accuracy); give validation={DEFAULT_VALIDATION} or leave validation= out")
    elif load_config(source, {}).run.validation <= 0:
        pairs["validation"] = DEFAULT_VALIDATION
    pairs.setdefault("seed", TUNING_SEED)
    return Tuning(tuple(options.methods), options.trials, pairs, Path(options.out), source, options.jobs,
                  options.storage, options.pruner, options.lr_space)


def main(arguments: Sequence[str]) -> int:
    """CLI: ``fedhpro tune [CONFIG.yaml] methods=[a,b] trials=20 out=DIR [jobs=N] [storage=URL] KEY=VALUE``."""
    tune(parse(arguments))
    return 0

