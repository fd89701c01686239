"""The run around the rounds, written once for every engine.

An engine only moves messages: the in-process simulator calls its clients in turn, the Flower ServerApp
sends them to SuperNodes. What a run does around its rounds is the same on both and lives here:

* :class:`Run`: the run's life in its folder: open (a new run's config.yaml and partition.json, or a
  resumed run's checkpoint), the round it ends before (``privacy.max_epsilon``), each round's rows and
  checkpoints, and the close (model, summary.json with its privacy block, server_state.pt, accuracy.png);
  :func:`claimed_run_folder` holds the folder for the run; :func:`train` is the loop of an engine that
  runs its own rounds (:class:`~fedhpro.engines.interface.Engine`); Flower's strategy calls the same
  :class:`Run` from its rounds;
* :func:`execute`: the notes and warnings said at start, the rounds, the summary and the final table;
  a file that cannot be written stops the run with one line (:func:`stop_on_write_error`).

The other jobs live beside it: the engine protocols (:mod:`fedhpro.engines.interface`), summary.json
(:mod:`fedhpro.engines.summary`), the console text (:mod:`fedhpro.engines.printout`), the size-claim warnings
(:mod:`fedhpro.engines.size_claims`) and a round's shared pieces (:mod:`fedhpro.engines.one_round`).
:class:`~fedhpro.engines.simulator.Simulator` is an engine, and so is the sequential engine of
``tests/sequential_engine.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedhpro import reports
from fedhpro.config import Config, RunOptions
from fedhpro.data.federation import few_batches_note
from fedhpro.engines import checkpoint
from fedhpro.engines.interface import SIMULATOR, Engine, EngineKind, kind_named
from fedhpro.engines.printout import QUIET, Voice, final_printout, progress_bar, progress_text
from fedhpro.engines.protocol import RoundProtocol, RoundRecord
from fedhpro.engines.size_claims import claimed_size_warnings, claims_line, pooled_share_warnings, size_claims
from fedhpro.engines.summary import privacy_summary, run_summary
from fedhpro.errors import ConfigError, DataError
from fedhpro.files import claim_run_folder, remove_partial_writes
from fedhpro.privacy import noise_cohort_warnings, privacy_warnings
from fedhpro.reports.plots import display_name, plot_run_accuracy


@dataclass
class RunRows:
    """A run's rows so far: ``metrics.jsonl``'s, ``timing.jsonl``'s (wall times vary run to run, so they
    are kept out of metrics.jsonl) and the first round still to run."""

    metrics: list[dict[str, Any]] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    first_round: int = 0

    def add(self, record: RoundRecord, elapsed: float | None = None) -> None:
        """A finished round's rows (``elapsed``: seconds since the run started, in its timing row)."""
        self.metrics.append(record.to_json())
        self.timings.append({"round": record.round, **record.seconds,
                             **({"elapsed": elapsed} if elapsed is not None else {})})


# ---------------------------------------------------------------------------- the run folder


#: what a run writes into its folder: a new run never writes where any of it is (the two runs' files would mix)
RUN_FILES = ("summary.json", "config.yaml", "metrics.jsonl", "timing.jsonl", "partition.json", "accuracy.png",
             "tsne.png", "tsne.npz", "tensorboard", "checkpoints", "server_state.pt", "model.pt", "model.json",
             "models", "mlflow.db", "mlartifacts", "wandb")

def check_new_run_folder(out: Path) -> None:
    """Raise a one-line ConfigError if ``out`` holds another run's files (used by run and the Flower server)."""
    held = [name for name in RUN_FILES if (out / name).exists()]
    if not held:
        return
    if (out / "summary.json").is_file():
        raise ConfigError(f"out={out} already holds a finished run; give another out= or delete that folder")
    resume = f"continue it with resume={out}, " if checkpoint.latest(out) is not None else ""
    raise ConfigError(f"out={out} already holds an unfinished run ({held[0]}); {resume}"
                      "give another out= or delete that folder")


@contextmanager
def stop_on_write_error(out: Path, path: Path) -> Iterator[None]:
    """A run's file that cannot be written (disk full, file too large, folder no longer writable) stops the
    run with one line: the file, the disk's reason, the newest good checkpoint and how to continue from it.
    The run's files are each written whole or not at all (:mod:`fedhpro.files`), so what is there stands."""
    try:
        yield
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        newest = checkpoint.latest(out)
        kept = (f"its newest good checkpoint is {newest}: fix the disk, then continue with resume={out}"
                if newest is not None else "it has no checkpoint yet: fix the disk, then start it again")
        raise DataError(f"could not write {path} ({reason}); the run stopped; {kept}") from None


@contextmanager
def claimed_run_folder(folder: Path | None, setting: str, held: Any = None) -> Iterator[None]:
    """``folder`` this process's for the block (:func:`fedhpro.files.claim_run_folder`: another run on it is
    refused in one line), cleared of what a killed run left half-written; ``held``: the caller's claim on it
    already. No folder (a Flower run without ``out=``), or a ``resume=`` folder that is not there (left to
    the resume's own message), claims nothing."""
    if folder is None or (setting == "resume" and not folder.is_dir()):
        yield
        return
    with contextlib.nullcontext() if held is not None else claim_run_folder(folder, setting=setting):
        for where in (folder, checkpoint.checkpoint_dir(folder)):
            remove_partial_writes(where)
        yield


def _now() -> float:
    """Seconds on a monotonic clock (the checkpoint schedule's; tests replace it with a fake one)."""
    return time.monotonic()


class CheckpointSchedule:
    """When a checkpoint is written after a round: every ``every`` rounds (0: never by count), once at least
    ``minutes`` minutes passed since the last one or since the run (re)started (0: never by time), and after
    the last of ``rounds`` rounds. Checkpoints only observe: they change no number."""

    def __init__(self, every: int, minutes: float, rounds: int):
        self.every, self.minutes, self.rounds = every, minutes, rounds
        self.last = _now()

    def due(self, completed: int) -> bool:
        """Whether to write one after ``completed`` rounds."""
        return (completed == self.rounds or bool(self.every and completed % self.every == 0)
                or bool(self.minutes > 0 and _now() - self.last >= 60.0 * self.minutes))

    def written(self) -> None:
        self.last = _now()


class Run:
    """One run's life in its folder ``out``, the same for every engine.

    * :meth:`open`: a new run's ``config.yaml`` and ``partition.json``, or a resumed run's newest checkpoint
      loaded into the engine (its rows become this run's);
    * :meth:`last_round`: before the rounds, the round the run ends before: the last one, or the first that
      would take epsilon above ``privacy.max_epsilon`` (the seeded participations make it known in advance,
      :meth:`~fedhpro.engines.protocol.RoundProtocol.budget_stop`), whose line is kept in :attr:`stopped`;
    * :meth:`round_done`: after each round, its rows and, when one is due (:class:`CheckpointSchedule`), a
      checkpoint of the engine's state;
    * :meth:`close`: the trained model, ``summary.json`` (with the privacy block when privacy is on),
      ``server_state.pt`` and ``accuracy.png``/``.svg``.

    :func:`train` drives an engine that runs its own rounds through it; the Flower ServerApp calls the same
    methods around Flower's round loop. ``out`` None: a run that writes no folder (a Flower run without
    ``out=``), its rows kept in memory. ``options`` is the run's :class:`~fedhpro.config.RunOptions`,
    ``protocol`` the engine's :class:`~fedhpro.engines.protocol.RoundProtocol` and ``engine`` its
    :class:`~fedhpro.engines.interface.EngineKind` (whose name its checkpoints and summary carry). A file that
    cannot be written stops the run with one line (:func:`stop_on_write_error`)."""

    def __init__(self, out: Path | None, options: RunOptions, protocol: RoundProtocol, engine: EngineKind = SIMULATOR,
                 started: float | None = None):
        self.out = Path(out) if out is not None else None
        self.options, self.protocol, self.engine = options, protocol, engine
        self.rows = RunRows()
        self.started = time.perf_counter() if started is None else started
        #: a resumed run's seconds before this process took it over (its last kept round's ``elapsed``)
        self.earlier_seconds = 0.0
        self.schedule = CheckpointSchedule(options.checkpoint_every, options.checkpoint_minutes, options.rounds)
        #: summary.json's ``privacy``: the privacy ledger's settings (None: privacy off)
        self.privacy: dict[str, Any] | None = protocol.privacy_summary()
        #: the line that ended the run at ``privacy.max_epsilon`` (:meth:`last_round`), else None
        self.stopped: str | None = None

    @property
    def first_round(self) -> int:
        """The first round still to run (0 for a new run)."""
        return self.rows.first_round

    def open(self, config: Mapping[str, Any], partition: Any, load: Callable[[dict[str, Any]], None],
             resume_from: Path | None = None) -> None:
        """A new run (``resume_from`` None): make the folder with its ``config.yaml`` and ``partition.json``.
        A resumed one: load the checkpoint ``resume_from`` (and the RNGs) through ``load`` (the engine's
        state); the rows of its completed rounds (``timing.jsonl``'s of those rounds too) become this run's.
        A checkpoint of another engine is refused (one line), one that does not fit is a one-line DataError."""
        if self.out is None:
            return
        if resume_from is not None:
            self._resume(self.out, resume_from, load)
            return
        self.out.mkdir(parents=True, exist_ok=True)
        with stop_on_write_error(self.out, self.out / "config.yaml"):
            reports.write_yaml(self.out / "config.yaml", dict(config))
            reports.write_json(self.out / "partition.json", partition)

    def _resume(self, out: Path, newest: Path, load: Callable[[dict[str, Any]], None]) -> None:
        blob = checkpoint.load(newest)
        state = blob[checkpoint.STATE]
        written_by = kind_named(state.get("engine") if isinstance(state, Mapping) else None)
        if written_by is not self.engine:
            raise ConfigError(written_by.resume_hint.format(where=f"resume={out}", out=out))
        try:
            load(state)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError) as error:
            raise DataError(f"checkpoint {newest} does not fit the run saved in {out} "
                            f"({type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}); it may "
                            "be from another version or damaged; move it out of the checkpoints folder to resume "
                            "from the one before") from None
        first = int(blob["completed_rounds"])
        timings = [row for row in reports.read_jsonl(out / "timing.jsonl") if row.get("round", 1e9) < first]
        self.rows.metrics[:], self.rows.timings[:], self.rows.first_round = list(blob["metrics"]), timings, first
        elapsed = timings[-1].get("elapsed") if timings else None
        self.earlier_seconds = float(elapsed) if isinstance(elapsed, (int, float)) and elapsed >= 0 else 0.0

    def last_round(self) -> int:
        """The round the run ends before: ``rounds``, or the first round that would take epsilon above
        ``privacy.max_epsilon`` (its line then in :attr:`stopped` and in summary.json's ``privacy.stopped``:
        a normal end, the rounds run before it are kept)."""
        for round in range(self.first_round, self.options.rounds):
            line = self.protocol.budget_stop(round)
            if line is not None:
                self.stopped = line
                if self.privacy is not None:
                    self.privacy["stopped"] = line
                return round
        return self.options.rounds

    def round_done(self, record: RoundRecord, state: Callable[[], dict[str, Any]]) -> bool:
        """Round ``record`` is over: its rows written, and a checkpoint of ``state()`` when one is due (one
        that cannot be written stops the run: :class:`checkpoint.CheckpointWriteError`, one line naming the
        newest good one, which is kept). Whether a checkpoint was written."""
        self.rows.add(record, self.seconds())
        if self.out is None:
            return False
        with stop_on_write_error(self.out, self.out / "metrics.jsonl"):
            reports.write_jsonl(self.out / "metrics.jsonl", self.rows.metrics)
        with stop_on_write_error(self.out, self.out / "timing.jsonl"):
            reports.write_jsonl(self.out / "timing.jsonl", self.rows.timings)
        completed = len(self.rows.metrics)
        if not self.schedule.due(completed):
            return False
        checkpoint.save(self.out, completed, {**state(), "engine": self.engine.name}, self.rows.metrics,
                        keep=self.options.keep_checkpoints)
        self.schedule.written()
        return True

    def close(self, summary: dict[str, Any], server_state: dict[str, Any] | None,
              write_model: Callable[[Path], None], title: str, end: Callable[[], None] | None = None) -> None:
        """The run is over: its trained model (``write_model(out)``: model.pt and model.json) before
        ``summary.json`` (which marks the run finished; with privacy on it gains ``privacy`` in place: the
        ledger's settings, the final epsilon and delta and, when ``privacy.max_epsilon`` stopped it, the
        line), ``server_state.pt`` (the method's server state, loadable with ``torch.load(weights_only=True)``),
        then ``end()`` (the engine's own end: the observers' t-SNE) and ``accuracy.png``/``.svg`` (``title``)
        when a round was evaluated. A run without a folder writes nothing (``end()`` still runs)."""
        if self.privacy is not None:
            summary["privacy"] = privacy_summary(self.privacy, self.rows.metrics)
        if self.out is None:
            if end is not None:
                end()
            return
        with stop_on_write_error(self.out, self.out / "model.pt"):
            write_model(self.out)
        with stop_on_write_error(self.out, self.out / "summary.json"):
            reports.write_json(self.out / "summary.json", summary)
        if server_state is not None:
            completed = len(self.rows.metrics)
            with stop_on_write_error(self.out, self.out / "server_state.pt"):
                reports.write_atomic_with(self.out / "server_state.pt", lambda handle: torch.save(
                    {"completed_rounds": completed, "server": server_state}, handle))
        if end is not None:
            end()
        if any("accuracy" in row for row in self.rows.metrics):
            with stop_on_write_error(self.out, self.out / "accuracy.png"):
                plot_run_accuracy(self.rows.metrics, self.out / "accuracy.png", title=title)

    def seconds(self) -> float:
        """Seconds since the run started: a resumed run's earlier part (up to its last kept round) and this
        process's."""
        return self.earlier_seconds + time.perf_counter() - self.started


def train(engine: Engine, run: Run, label: str, progress: bool, voice: Voice = QUIET) -> None:
    """Rounds ``run.first_round`` up to :meth:`Run.last_round` of ``engine``: after each, :meth:`Run.round_done`
    and the progress bar (``label``); a run stopped at ``privacy.max_epsilon`` says its line (``voice``,
    below the bar)."""
    rows = run.rows
    last = run.last_round()
    bar = progress_bar(run.options.rounds, label, progress, rows.first_round)
    last_accuracy = next((row["accuracy"] for row in reversed(rows.metrics) if "accuracy" in row), None)
    try:
        for round_index in range(rows.first_round, last):
            record = engine.run_round(round_index)
            run.round_done(record, engine.state_dict)
            if record.accuracy is not None:
                last_accuracy = record.accuracy
            if bar is not None:
                bar.set_postfix_str(progress_text(record.train, last_accuracy, record.extra.get("privacy")))
                bar.update(1)
        if run.stopped is not None:
            voice.stopped(run.stopped)
    finally:  # a run stopped by an error leaves the bar on its own line, the error below it
        if bar is not None:
            bar.close()


# ---------------------------------------------------------------------------- the run, once for every engine


def run_title(method: str, seed: int, data_name: str) -> str:
    """The run's title (its accuracy plot's): ``FedHPro on digits-offline (seed 0)``."""
    return f"{display_name(method)} on {data_name} (seed {seed})"


def trained_models(models: Any) -> list[nn.Module]:
    """The models the clients train, one per architecture, of a :class:`~fedhpro.engines.simulator.ClientModels`
    (summary.json's memory format is resolved on them: ``channels_last=auto`` depends on their Conv2d layers)."""
    if models.personal:
        return list(models.working_models.values()) or [models.global_model]
    return [models.working_model]


def start_notes(config: Config, engine: Engine) -> list[str]:
    """The run's own notes at its start, after the data's: where sizes are claims, what bounds them
    (:func:`claims_line`); a smallest client with fewer than three batches an epoch at ``batch_size``
    (:func:`~fedhpro.data.federation.few_batches_note`)."""
    notes = [claims_line(engine.protocol.aggregation)] if engine.protocol.sizes_claimed else []
    few = few_batches_note(engine.protocol.client_sizes or [], config.run.batch_size, engine.client_names)
    return notes + ([few] if few else [])


#: how a federation's note that is a warning begins (fedhpro.data: the data layer has no voice of its own)
WARNING_NOTE = "warning: "


def start_warnings(config: Config, engine: Engine) -> list[str]:
    """The run's warnings before its first round, kept in summary.json's notes: where sizes are claims, every
    site claiming far more than the median (:func:`claimed_size_warnings`, training and each test set); a client
    holding more than ``aggregation.max_share`` of the test samples pooled for its test set
    (:func:`pooled_share_warnings`); a near-vacuous privacy delta (:func:`fedhpro.privacy.privacy_warnings`); a noise
    cohort's epsilon that is not the run's own (:func:`fedhpro.privacy.noise_cohort_warnings`)."""
    protocol = engine.protocol
    sizes = list(protocol.client_sizes or [])
    pooled = engine.pooled_test_sizes()
    lines: list[str] = []
    if protocol.sizes_claimed:  # a site claiming far more than the others is named, capped or not
        names = engine.client_names or [str(k) for k in range(len(sizes))]
        lines += claimed_size_warnings(names, sizes, "training samples", protocol.aggregation)
        for test_set in dict.fromkeys(name for name, _ in pooled):
            held = [(name, size) for name, (where, size) in zip(names, pooled) if where == test_set]
            lines += claimed_size_warnings([name for name, _ in held], [size for _, size in held],
                                           f"test samples of test set {test_set!r}", protocol.aggregation)
    return (lines + pooled_share_warnings(pooled, config.aggregation.max_share)
            + privacy_warnings(config.privacy, len(sizes), sizes) + noise_cohort_warnings(config, len(sizes)))


def execute(engine: Engine, run: Run, config: Config, *, data_name: str, partition: Any, notes: Sequence[str],
            resume_from: Path | None, write_model: Callable[[Path], None], voice: Voice) -> dict[str, Any]:
    """The run around the rounds, the same for every engine; returns its summary (``summary.json``'s).

    Says the data's ``notes`` and the run's own (:func:`start_notes`), then its warnings
    (:func:`start_warnings`), all kept in the summary; opens ``run`` (a new run's folder, or ``resume_from``'s
    checkpoint loaded into the engine); runs the rounds (:func:`train`); writes the summary (with
    ``size_claims`` where sizes are claims), the trained model (``write_model(out)``), the server's state, the
    engine's end and the accuracy plot (:meth:`Run.close`); says the final table (:func:`final_printout`).
    ``voice`` says it all: printed by ``fedhpro run``, logged by the Flower ServerApp."""
    options = config.run
    # the data's notes that are warnings (a federation's "warning: ..." lines) are said as warnings
    data_warnings = [line.removeprefix(WARNING_NOTE) for line in notes if line.startswith(WARNING_NOTE)]
    notes = [*(line for line in notes if not line.startswith(WARNING_NOTE)), *start_notes(config, engine)]
    for line in notes:
        voice.note(line)
    warnings = data_warnings + start_warnings(config, engine)
    for line in warnings:
        voice.warning(line)
    run.open(config.to_dict(), partition, engine.load_state_dict, resume_from)
    if resume_from is not None:
        voice.note(f"resuming {run.out} from round {run.first_round + 1} of {options.rounds}")
    train(engine, run, f"{options.method} on {data_name}", options.progress, voice)
    summary = run_summary(options, data_name, engine.protocol.num_clients, engine.device, run.rows.metrics,
                          run.seconds(), [*notes, *warnings], from_python=config.federation is not None,
                          engine=run.engine, models=trained_models(engine.models))
    if engine.protocol.sizes_claimed:
        summary["size_claims"] = size_claims(engine.protocol, engine.pooled_test_sizes())
    title = run_title(options.method, options.seed, data_name)
    run.close(summary, engine.server.state_dict(), write_model, title, end=engine.end_run)
    voice.printout(final_printout(summary, f"{options.method} on {data_name}, seed {options.seed}, "
                                           f"{options.rounds} rounds, {summary['seconds']:.0f} s — test accuracy (%):"))
    return summary
