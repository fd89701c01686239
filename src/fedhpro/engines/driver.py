"""The run around the rounds, written once for every engine.

An engine only moves messages: the in-process simulator calls its clients in turn, the Flower ServerApp
sends them to SuperNodes. What a run does around its rounds is the same on both and lives here:

* :class:`Run`: the run's life in its folder: open (a new run's config.yaml and partition.json, or a
  resumed run's checkpoint), the round it ends before (``privacy.max_epsilon``), each round's rows and
  checkpoints, and the close (model, summary.json with its privacy block, server_state.pt, accuracy.png);
  :func:`claimed_run_folder` holds the folder for the run; :func:`train` is the loop of an engine that
  runs its own rounds (:class:`Engine`); Flower's strategy calls the same :class:`Run` from its rounds;
* a round's row: :func:`round_extra` and :class:`RunRows`; evaluating one client: :func:`test_client`;
* summary.json: :func:`run_summary`; a file that cannot be written stops the run with one line
  (:func:`stop_on_write_error`).

:class:`~fedhpro.engines.simulator.Simulator` is an :class:`Engine`, and so is the sequential engine of
``tests/sequential_engine.py``.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from fedhpro import reports, runtime
from fedhpro.aggregation import lower_median
from fedhpro.config import AggregationOptions, Config, channels_last_setting
from fedhpro.data.federation import few_batches_note
from fedhpro.engines import checkpoint
from fedhpro.engines.protocol import RoundProtocol, RoundRecord, TestCount
from fedhpro.engines.replies import weight_cap
from fedhpro.errors import ConfigError, DataError
from fedhpro.files import claim_run_folder, remove_partial_writes
from fedhpro.methods.base import load_weights
from fedhpro.methods.no_grad import eval_batch_size, eval_forward, no_grad_pass, no_grad_precision
from fedhpro.metrics import fairness_statistics
from fedhpro.privacy import noise_cohort_warnings, privacy_warnings
from fedhpro.reports.plots import display_name, plot_run_accuracy

if TYPE_CHECKING:
    from fedhpro.data.federation import Federation


class Engine(Protocol):
    """What :func:`execute`, the run around the rounds, needs of an engine: its round protocol, its method's
    server part, its clients' models and device, one round at a time, its state (checkpoints) and its end.
    The in-process simulator and the Flower ServerApp (:class:`fedhpro.flower.strategy.FlowerEngine`) are
    engines; so is ``tests/sequential_engine.py``."""

    protocol: RoundProtocol
    server: Any  # the method's server part
    models: Any  # the clients' models (engines.simulator.ClientModels: the working model, personal ones)
    device: torch.device

    def run_round(self, round: int) -> RoundRecord:
        """Round ``round`` (from 0): its record."""
        ...

    def pooled_test_sizes(self) -> list[tuple[str, int]]:
        """Each client's ``(test-set name, size)`` where the clients' test counts are pooled, else ``[]``."""
        ...

    @property
    def client_names(self) -> list[str] | None:
        """The clients' names (their folders, their sites), None where they have none."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def end_run(self) -> None: ...


class InProcessEngine(Engine, Protocol):
    """An engine that holds the whole federation in this process: what the observers (FLOPs, prototype
    distances, t-SNE) and a Flower node in partition mode use of it besides the run's needs."""

    federation: Federation
    history: list[RoundRecord]
    seed: int
    client: Any  # the method's client part

    @property
    def shared(self) -> str:
        """Which weights travel: ``"all"``, ``"classifier"`` or ``"none"``."""
        ...

    def evaluate_clients(self) -> tuple[dict[str, float], list[float | None]]:
        """``(accuracy per test set and AVG, accuracy of each client; None: a client not tested)``."""
        ...

    def client_test(self, k: int) -> tuple[str, tuple[Tensor, Tensor]]:
        """``(test-set name, (x, y))`` client ``k`` is tested on."""
        ...

    def server_prototypes(self) -> tuple[Tensor, Tensor, str] | None: ...

    def centralized_prototypes(self) -> tuple[Tensor, Tensor]: ...

    def test_features(self, per_test_set: int = 300) -> tuple[Tensor, Tensor, list[str]]: ...


class Voice(Protocol):
    """How a run speaks to its user: :class:`ConsoleVoice` prints (``fedhpro run``), the Flower ServerApp logs."""

    def note(self, line: str) -> None:
        """A note of the run's start (how the data were read), kept in summary.json's notes too."""
        ...

    def warning(self, line: str) -> None:
        """A warning: said before the first round (and kept in summary.json's notes), or a dropped client."""
        ...

    def stopped(self, line: str) -> None:
        """The line of a run that ``privacy.max_epsilon`` ended before its last round (a normal end)."""
        ...

    def printout(self, text: str) -> None:
        """The run's final table (:func:`final_printout`)."""
        ...


def warn_line(message: str) -> None:
    """One warning line on stderr that leaves the progress bar intact."""
    tqdm.write(f"fedhpro: warning: {message}", file=sys.stderr)


@dataclass(frozen=True)
class ConsoleVoice:
    """``fedhpro run``'s voice: warnings on stderr always; with ``echo`` notes and the final table on stdout."""

    echo: bool = False

    def note(self, line: str) -> None:
        if self.echo:
            print(f"note: {line}")

    def warning(self, line: str) -> None:
        warn_line(line)

    def stopped(self, line: str) -> None:
        tqdm.write(f"fedhpro: {line}", file=sys.stderr)  # below a progress bar, if one is shown

    def printout(self, text: str) -> None:
        if self.echo:
            print(text)


# ---------------------------------------------------------------------------- one client, one round


@torch.no_grad()
def count_correct(model: nn.Module, x: Tensor, y: Tensor, batch_size: int | None = None) -> int:
    """How many of ``x`` the model classifies as ``y`` (eval mode, batches of ``eval_batch_size``), computed in
    the current :func:`~fedhpro.methods.no_grad.no_grad_precision` (float32 unless one is entered)."""
    model.eval()
    batch_size = batch_size or eval_batch_size(x.device)
    correct = 0
    with no_grad_pass(x.device):
        for start in range(0, x.shape[0], batch_size):
            logits = eval_forward(model, x[start:start + batch_size])
            correct += int((logits.argmax(1) == y[start:start + batch_size]).sum())
    return correct


def test_client(server: Any, model: nn.Module, name: str, test: tuple[Tensor, Tensor],
                shared: Mapping[str, Tensor] | None = None, personal: bool = False, amp: str = "off") -> TestCount:
    """One client's test count on its ``test`` set ``name``: ``model`` (with the global ``shared`` weights
    loaded first when given: into its shared part for a ``personal`` model, else the whole model) through
    the server's inference rule, its forward passes in the precision of the run's training (``amp``, as
    :func:`~fedhpro.methods.no_grad.no_grad_precision` says). What the simulator and a Flower node compute for a
    client."""
    if shared is not None:
        if personal:
            load_weights(model, dict(shared))
        else:
            model.load_state_dict(shared)
    x, y = test
    with no_grad_precision(amp, x.device):
        return TestCount(name, count_correct(server.inference_model(model), x, y), int(y.shape[0]))


def round_extra(measured: Mapping[str, Any] | None = None, per_client: Sequence[float | None] | None = None,
                evaluated: Mapping[str, Any] | None = None,
                missing: Sequence[Mapping[str, Any]] = (), validation: Mapping[str, float] | None = None
                ) -> dict[str, Any]:
    """The keys an engine adds to a round's record (:meth:`OpenRound.record`), in the row's order: the
    observers' training measurements (FLOPs), each client's accuracy and their fairness (at an evaluated
    round), the accuracy on the clients' validation parts (``validation=``), the observers' evaluation
    measurements (prototype distances), the clients not evaluated. A client without a test split has accuracy
    None (not tested) and is left out of the fairness statistics."""
    extra = dict(measured or {})
    if per_client:
        extra["client_accuracy"] = list(per_client)
        tested = [accuracy for accuracy in per_client if accuracy is not None]
        if tested:
            extra["fairness"] = fairness_statistics(tested)
    if validation is not None:
        extra["validation"] = dict(validation)
    extra.update(evaluated or {})
    if missing:
        extra["not_evaluated"] = list(missing)
    return extra


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

#: how to resume a run whose checkpoint another engine wrote (keyed by the engine that wrote it)
_OTHER_ENGINE = {
    "flower": "{where}: its checkpoint was written by the Flower ServerApp; resume it on Flower "
              "(flwr run ... --run-config 'resume=\"{out}\"')",
    "simulator": "{where}: its checkpoint was written by fedhpro run (the in-process simulator); resume it with "
                 "fedhpro run resume=...",
}


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
    ``protocol`` the engine's :class:`~fedhpro.engines.protocol.RoundProtocol` and ``engine`` the name its
    checkpoints and summary carry (``"simulator"``, ``"flower"``). A file that cannot be written stops the run
    with one line (:func:`stop_on_write_error`)."""

    def __init__(self, out: Path | None, options: Any, protocol: RoundProtocol, engine: str = "simulator",
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
        written_by = state.get("engine", "simulator") if isinstance(state, Mapping) else "simulator"
        if written_by != self.engine:
            raise ConfigError(_OTHER_ENGINE[written_by if written_by in _OTHER_ENGINE else "simulator"].format(
                where=f"resume={out}", out=out))
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
        checkpoint.save(self.out, completed, {**state(), "engine": self.engine}, self.rows.metrics,
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


def train(engine: Engine, run: Run, label: str, progress: bool, voice: Voice = ConsoleVoice()) -> None:
    """Rounds ``run.first_round`` up to :meth:`Run.last_round` of ``engine``: after each, :meth:`Run.round_done`
    and the progress bar (``label``); a run stopped at ``privacy.max_epsilon`` says its line (``voice``,
    below the bar)."""
    rows = run.rows
    last = run.last_round()
    bar = _progress(run.options.rounds, label, progress, rows.first_round)
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


def final_printout(summary: Mapping[str, Any], title: str) -> str:
    """What a run prints at its end (``summary``: its summary.json): ``title``, the pooled accuracy per test
    set and AVG (or that no round was evaluated), the clients' own accuracies' unweighted mean and median and,
    with privacy on, the (epsilon, delta) spent. Where sizes are claims (``size_claims``) it leads with the
    median site's accuracy, which one site cannot carry, and says how the pooled figure is bounded."""
    if summary["accuracy"] is None:
        lines = [f"{title} no round evaluated"]
    else:
        lines = [reports.accuracy_table({**summary["per_domain"], "AVG": summary["accuracy"]}, title)]
        if "site_accuracy" in summary:
            lines.append(site_accuracy_line(summary["site_accuracy"], summary["clients"]))
        claims = summary.get("size_claims")
        if claims is not None:
            lines = [lines[-1] + " (one site cannot move the median)"] + lines[:-1]
            bounds = ([f"{claims['max_ratio']:g} x the median site's"] if claims["max_ratio"] > 0 else []) + (
                [f"{claims['max_share']:g} of a test set's total"] if claims["max_share"] < 1 else [])
            lines.append("pooled accuracy: the sites' test sizes are claims; "
                         + (f"each counts as at most {' and '.join(bounds)}" if bounds else "nothing bounds them"))
    if summary.get("validation", {}).get("best_round") is not None:
        lines.append(validation_line(summary["validation"]))
    if "unseen" in summary:
        unseen = summary["unseen"]
        shown = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
        lines.append(f"unseen clients (never trained): global model AVG {shown(unseen['accuracy']['AVG'])}"
                     + (f"; after fine-tuning AVG {shown(unseen['finetuned']['AVG'])}" if "finetuned" in unseen
                        else ""))
    if "privacy" in summary:
        lines.append(privacy_line(summary["privacy"]))
    return "\n".join(lines)


def validation_line(validation: Mapping[str, Any]) -> str:
    """The printout's line of summary.json's ``validation``: the final validation AVG, and the round chosen on
    it with its test AVG."""
    final = validation["accuracy"]
    test = validation["test_at_best"]
    return (f"validation (held out of training): AVG {'-' if final is None else f'{final:.2f}'}; best round "
            f"{validation['best_round'] + 1} by validation ({validation['best_accuracy']:.2f}), test AVG there "
            f"{'-' if test is None else f'{test:.2f}'}")


def privacy_summary(settings: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """summary.json's ``privacy``: the ledger's ``settings`` and the epsilon and delta of the last row (0 before
    any round)."""
    last = next((row["privacy"] for row in reversed(rows) if "privacy" in row), None)
    out = dict(settings)
    out["epsilon"] = float(last["epsilon"]) if last is not None else 0.0
    if last is not None:
        out["delta"] = float(last["delta"])
    out["rounds_run"] = len(rows)
    return out


def _progress(total: int, description: str, enabled: bool, initial: int = 0) -> Any:
    if not enabled:
        return None
    return tqdm(total=total, initial=initial, desc=description, unit="round", file=sys.stderr, dynamic_ncols=True,
                bar_format="{desc}: round {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}{postfix}")


def progress_text(train: Mapping[str, float], accuracy: Mapping[str, float] | None,
                  privacy: Mapping[str, float] | None = None) -> str:
    """The progress bar's text after a round: the clients' mean cross-entropy (``ce`` in metrics.jsonl's
    ``train``) when the method reports it, else its whole training loss, each labelled (the whole loss can
    hold constant terms, such as HPCL's, that make it climb while training improves); then the last AVG;
    with privacy on, the (epsilon, delta) spent so far."""
    shown = next(((label, train[name]) for name, label in (("ce", "train CE"), ("loss", "train loss"))
                  if name in train), None)
    loss = f"{shown[0]} {shown[1]:.3f}  " if shown is not None else ""
    text = loss + "AVG " + (f"{accuracy['AVG']:.2f}%" if accuracy else "-")
    if privacy is not None:
        text += f"  eps {privacy['epsilon']:.3g} (delta {privacy['delta']:.2g})"
    return text


# ---------------------------------------------------------------------------- the summary


def final_accuracy(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The accuracy of the last evaluated row; ``{"AVG": None}`` when no round had one (every evaluation lost,
    or ``privacy.max_epsilon`` stopped the run before its first round): summary.json stays strict JSON, which
    has no NaN."""
    return next((row["accuracy"] for row in reversed(rows) if "accuracy" in row), {"AVG": None})


def validation_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's ``validation`` (runs with ``validation=``; ``{}`` otherwise): the last evaluated round's
    accuracy on the clients' validation parts, and the model selection made on them: the round (0-based, as
    ``metrics.jsonl``) with the best validation AVG (the earliest of equals) and the test accuracy there,
    the figure to report when the best round is chosen (never the best test accuracy, which is chosen on the
    test set)."""
    validated = [row for row in rows if "validation" in row and "accuracy" in row]
    if not validated:
        return {}
    final = validated[-1]
    finite = [row for row in validated if _finite(row["validation"]["AVG"]) is not None]
    out: dict[str, Any] = {"accuracy": _finite(final["validation"]["AVG"]),
                           "per_domain": {k: v for k, v in final["validation"].items() if k != "AVG"}}
    if finite:
        best = max(finite, key=lambda row: row["validation"]["AVG"])  # max keeps the first of equals
        out.update({"best_round": best["round"], "best_accuracy": best["validation"]["AVG"],
                    "test_at_best": _finite(best["accuracy"]["AVG"])})
    return {"validation": out}


def unseen_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's ``unseen`` (runs with clients that never trained; ``{}`` otherwise): the last evaluated
    round's accuracy of the global model on them (``accuracy``: per test set and AVG) and, when they
    fine-tuned, ``finetuned``."""
    final = next((row for row in reversed(rows) if "unseen" in row), None)
    if final is None:
        return {}
    out: dict[str, Any] = {"accuracy": {k: _finite(v) for k, v in final["unseen"].items()}}
    if "unseen_finetuned" in final:
        out["finetuned"] = {k: _finite(v) for k, v in final["unseen_finetuned"].items()}
    return {"unseen": out}


def _finite(value: float | None) -> float | None:
    """``value``, or None for NaN and infinities (a round whose every client was untested has AVG NaN), which
    strict JSON cannot hold."""
    return value if value is not None and math.isfinite(value) else None


def site_accuracy(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """summary.json's ``site_accuracy``: the last evaluated round's ``client_accuracy`` (each client's accuracy
    on its own test distribution, in percent; None: a client not tested) as ``per_client``, and the unweighted
    ``mean`` and ``median`` over the ``tested`` clients (None when none was). The pooled ``accuracy`` weights
    every client by its test-set size, a size a client declares; these weight every tested client alike, so
    one client claiming a huge test set cannot carry them."""
    final: Mapping[str, Any] = next((row for row in reversed(rows) if "accuracy" in row), {})
    per_client = list(final.get("client_accuracy") or [])
    tested = [float(value) for value in per_client if value is not None]
    return {"mean": statistics.fmean(tested) if tested else None,
            "median": float(statistics.median(tested)) if tested else None,
            "tested": len(tested), "per_client": per_client}


def site_accuracy_line(site: Mapping[str, Any], clients: int) -> str:
    """The printout's line of :func:`site_accuracy` for a run of ``clients`` clients."""
    tested = site["tested"]
    counted = f"{tested} tested" if tested == clients else f"{tested} of {clients} tested"
    if site["mean"] is None:
        return f"per client (unweighted): no client tested ({counted})"
    return f"per client (unweighted, {counted}): mean {site['mean']:.1f}, median {site['median']:.1f}"


def privacy_line(privacy: Mapping[str, Any]) -> str:
    """The printout's line of summary.json's ``privacy``: the (epsilon, delta) the run spent, and whether
    ``privacy.max_epsilon`` stopped it (printed whatever ``progress`` is: the progress bar is not a record)."""
    delta = privacy.get("delta")
    rounds = privacy.get("rounds_run")
    text = (f"privacy ({privacy.get('mode', 'on')}): (epsilon, delta) = ({float(privacy['epsilon']):.4g}, "
            + (f"{float(delta):.3g}" if delta is not None else "-") + ")"
            + (f" after {rounds} round{'s' if rounds != 1 else ''}" if rounds is not None else ""))
    if privacy.get("stopped"):
        text += "; stopped at privacy.max_epsilon"
    if privacy.get("noise_cohort"):
        text += f", as if {privacy['noise_cohort']} clients took part a round (privacy.noise_cohort: simulated)"
    return text


def pooled_share_warnings(test_sizes: Sequence[tuple[str, int]], max_share: float) -> list[str]:
    """One warning line per client holding more than ``max_share`` (``aggregation.max_share``) of the test
    samples pooled for its test set, whose pooled accuracy (and so AVG) then leans on that one client.
    ``test_sizes[k]``: client ``k``'s ``(test-set name, size)``, for the clients whose test counts are pooled
    (a test size is what a client declares). A test set only one client is tested on pools nothing: left out."""
    totals: dict[str, int] = {}
    holders: dict[str, int] = {}
    for name, size in test_sizes:
        totals[name] = totals.get(name, 0) + int(size)
        holders[name] = holders.get(name, 0) + (int(size) > 0)
    lines = []
    for k, (name, size) in enumerate(test_sizes):
        total = totals[name]
        if holders[name] < 2 or int(size) <= max_share * total:
            continue
        lines.append(f"client {k} holds {int(size)} of the {total} test samples of test set {name!r} "
                     f"({100.0 * int(size) / total:.1f}%), more than aggregation.max_share={max_share:g}: the pooled "
                     f"accuracy of {name!r} leans on that one client; compare summary.json's site_accuracy (each "
                     "client's accuracy, their unweighted mean and median)")
    return lines


#: a site whose claimed size is more than this many times the median site's is named in a warning at start,
#: whether or not a bound caps it: a claim just under a cap buys the most a bound allows and would otherwise
#: leave no trace (the default aggregation.max_ratio, 2, caps claims above twice the median)
FAR_ABOVE_MEDIAN = 1.5


def claims_line(aggregation: AggregationOptions) -> str:
    """The line a deployment without a roster says at start: its sizes are claims, what bounds them, how to
    pin them."""
    bound = (f"each site counts as at most aggregation.max_ratio={aggregation.max_ratio:g} x the median site's "
             "size and " if aggregation.max_ratio > 0 else "")
    return (f"sizes are claims: without flower.roster the training and test sizes the nodes declare are trusted: "
            f"{bound}at most aggregation.max_share={aggregation.max_share:g} of the total; to pin each site's name, "
            "sizes and key, give flower.roster=<file> (see the deployment guide)")


def claimed_size_warnings(names: Sequence[str], sizes: Sequence[int], what: str,
                          aggregation: AggregationOptions) -> list[str]:
    """One warning line per site whose claimed ``sizes`` (``what``: "training samples", ...) is more than
    :data:`FAR_ABOVE_MEDIAN` times the median claim (:func:`~fedhpro.aggregation.lower_median`), saying what it
    counts as under the run's bounds (:func:`~fedhpro.engines.replies.weight_cap` of claimed sizes). Fewer than
    two sites: none."""
    if sum(int(n) > 0 for n in sizes) < 2:
        return []
    median = lower_median(sizes)
    cap = weight_cap(aggregation, sizes, claimed=True)
    lines = []
    for name, size in zip(names, sizes):
        if int(size) > FAR_ABOVE_MEDIAN * median:
            counts = (f"it counts as {max(1, math.floor(cap))}" if size > cap
                      else "under the bounds, it counts in full")
            lines.append(f"site {name!r} claims {int(size)} {what}, {size / median:.1f}x the median site's "
                         f"{median:g}: {counts}; if that size is right, vouch for it in flower.roster")
    return lines


def size_claims(protocol: RoundProtocol, test_sizes: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """summary.json's ``size_claims`` of a run whose sizes are claims: the bounds, the most weight a site's
    training claim buys (None: no cap binds) and, per test set, the most test samples a site's claim counts
    as in the pooled accuracy."""
    aggregation = protocol.aggregation
    by_set: dict[str, list[int]] = {}
    for name, size in test_sizes:
        by_set.setdefault(name, []).append(int(size))
    train_cap = protocol.weight_cap()
    test_caps = {name: weight_cap(aggregation, sizes, claimed=True) for name, sizes in by_set.items()}
    return {"max_ratio": aggregation.max_ratio, "max_share": aggregation.max_share,
            "train_cap": math.floor(train_cap) if math.isfinite(train_cap) else None,
            "test_caps": {name: math.floor(cap) if math.isfinite(cap) else None for name, cap in test_caps.items()}}


def summary_measurements(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's share of the per-round measurements: final fairness (Table A8), parameters
    sent (Table 4's Upload) and, when counted, training FLOPs (Table 4)."""
    final: dict[str, Any] = next((row for row in reversed(rows) if "accuracy" in row), {})
    out: dict[str, Any] = {}
    if "fairness" in final:
        out["fairness"] = final["fairness"]
        out["client_accuracy"] = final["client_accuracy"]
    if all("params_up" in row for row in rows):
        out["params_up"] = sum(row["params_up"] for row in rows)
        out["params_down"] = sum(row["params_down"] for row in rows)
    if all("flops_train" in row for row in rows):
        out["flops_train"] = sum(row["flops_train"] for row in rows)
        out["flops_server"] = sum(row["flops_server"] for row in rows)
    return out


def run_summary(options: Any, data_name: str, clients: int, device: torch.device | str, rows: list[dict[str, Any]],
                seconds: float, notes: list[str], from_python: bool = False,
                engine: str | None = None, models: Sequence[nn.Module] = ()) -> dict[str, Any]:
    """``summary.json`` of a finished run (``options``: its RunOptions): its settings, the final and best AVG
    (None when no round was evaluated), the final per-domain accuracy, the final per-client accuracies with
    their unweighted mean and median (:func:`site_accuracy`), the wall time, the machine and the totals of the
    per-round measurements; ``engine`` names an engine other than the simulator, ``from_python`` data given
    from Python.

    ``machine`` (:func:`fedhpro.runtime.machine_record`): this process's CPU and its instruction sets, the GPU
    of a CUDA ``device``, torch's thread count now (call it inside the run's thread setting), the precision
    local training ran in on ``device`` and its memory format, resolved for ``models``, the models the clients
    train (``channels_last=auto`` with amp on depends on whether they have a Conv2d; without models it reads
    ``"auto"``). It describes the machine, not the result."""
    amp = str(getattr(options, "amp", "off"))
    machine = runtime.machine_record(
        device, runtime.amp_precision(amp, torch.device(device)),
        runtime.memory_format(channels_last_setting(getattr(options, "channels_last", "auto")), amp, models),
        # clients side by side: the in-process simulator's (a Flower node trains its own one at a time)
        parallel_clients=getattr(options, "parallel_clients", 1) if engine is None else 1)
    final = final_accuracy(rows)
    return {
        "method": options.method,
        "dataset": data_name,
        **({"data_source": "python"} if from_python else {}),
        "seed": options.seed,
        "rounds": options.rounds,
        "clients": clients,
        "accuracy": _finite(final["AVG"]),
        "per_domain": {name: value for name, value in final.items() if name != "AVG"},
        "best_accuracy": max((row["accuracy"]["AVG"] for row in rows
                              if "accuracy" in row and _finite(row["accuracy"]["AVG"]) is not None), default=None),
        **validation_summary(rows),
        **unseen_summary(rows),
        "site_accuracy": site_accuracy(rows),
        "seconds": seconds,
        "device": str(device),
        **({"engine": engine} if engine is not None else {}),
        "machine": machine,
        "bytes_up": sum(row["bytes_up"] for row in rows),
        "bytes_down": sum(row["bytes_down"] for row in rows),
        "notes": notes,
        **summary_measurements(rows),
    }


# ---------------------------------------------------------------------------- the run, once for every engine


def run_title(options: Any, data_name: str) -> str:
    """The run's title (its accuracy plot's): ``FedHPro on digits-offline (seed 0)``."""
    return f"{display_name(options.method)} on {data_name} (seed {options.seed})"


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
    other_engine = run.engine if run.engine != "simulator" else None
    summary = run_summary(options, data_name, engine.protocol.num_clients, engine.device, run.rows.metrics,
                          run.seconds(), [*notes, *warnings], from_python=config.federation is not None,
                          engine=other_engine, models=trained_models(engine.models))
    if engine.protocol.sizes_claimed:
        summary["size_claims"] = size_claims(engine.protocol, engine.pooled_test_sizes())
    run.close(summary, engine.server.state_dict(), write_model, run_title(options, data_name), end=engine.end_run)
    voice.printout(final_printout(summary, f"{options.method} on {data_name}, seed {options.seed}, "
                                           f"{options.rounds} rounds, {summary['seconds']:.0f} s — test accuracy (%):"))
    return summary


class RoundClock:
    """A round's wall times, as every engine records them: ``clients`` from the round's opening to the last
    reply, ``server`` the close (aggregation), ``eval`` the evaluation."""

    def __init__(self, started: float):
        self.seconds: dict[str, float] = {}
        self._last = started

    def lap(self, name: str) -> None:
        """The part ``name`` just ended: its seconds since the previous part ended (or the round opened)."""
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now

    def start(self) -> None:
        """A part starts now (the time since the previous one ended is not counted)."""
        self._last = time.perf_counter()
