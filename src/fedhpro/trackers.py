"""Experiment trackers as observers of a run's rounds (``tracker=mlflow|wandb``): the run's config as parameters,
every number of each ``metrics.jsonl`` row as a metric at step ``round + 1`` (TensorBoard's), the privacy ledger
(summary.json's ``privacy``), the final files (summary.json, metrics.jsonl, config.yaml and the model files)
and the run's figures (:func:`figures`: ``accuracy.png`` and its ``.svg`` / ``.pdf``, a t-SNE's ``tsne.png``)
as artifacts; MLflow also gets the trained model as an MLflow model (``model``: ``mlflow.pyfunc.load_model``
loads it, :mod:`fedhpro.trained.mlflow_model`). They only look, so a run gives the same bytes with a tracker
or none.

* MLflow (``pip install fedhpro[mlflow]``): ``tracker_uri`` (default a local SQLite store,
  ``<out>/mlflow.db``, with the artifacts in ``<out>/mlartifacts``: offline; MLflow 3 keeps its plain file store
  only in maintenance), experiment ``tracker_project``, one MLflow run per fedhpro run, written through
  ``MlflowClient`` (no global active run).
* Weights & Biases (``pip install fedhpro[wandb]``): offline unless ``tracker_uri=online``, its files in
  ``<out>/wandb`` (``wandb sync`` uploads them later); project ``tracker_project``.

The libraries are imported only when a tracker is asked for (optional extras, slow to import). Their telemetry
and analytics are off unless the environment turns them on (:data:`QUIET_MLFLOW`, :data:`QUIET_WANDB`, set
before the import where unset): a tracker contacts nothing but the ``tracker_uri`` given (MLflow's local store and
W&B offline: nothing at all)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fedhpro.engines.lifecycle import run_title
from fedhpro.engines.observers import RoundObserver
from fedhpro.errors import ConfigError
from fedhpro.reports.plots import pdf_path, plot_run_accuracy, vector_path

if TYPE_CHECKING:
    from fedhpro.config import OutputOptions
    from fedhpro.engines.protocol import RoundRecord

#: the values of ``tracker=``
TRACKERS = ("none", "mlflow", "wandb")
#: the run's files a tracker keeps as artifacts, where they exist (and its figures: :func:`figures`)
ARTIFACTS = ("config.yaml", "summary.json", "metrics.jsonl", "model.json", "model.pt", "model.safetensors",
             "standardize.json", "partition.json")
#: the artifact path of the MLflow model (``runs:/<run id>/model``)
MLFLOW_MODEL = "model"

#: MLflow's telemetry (a config fetch at import, then usage records) off: read at ``import mlflow`` (MLflow 3);
#: and its progress bars, which saving the model as an MLflow model would print
QUIET_MLFLOW = {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
#: W&B's error reports and OpenTelemetry analytics off (its Python recorder and wandb-core's
#: ``--no-observability``), no code saved, no console lines
QUIET_WANDB = {"WANDB_ERROR_REPORTING": "false", "WANDB_DISABLE_CODE": "true", "WANDB_SILENT": "true"}


def quiet_environment(defaults: Mapping[str, str]) -> None:
    """``defaults`` into ``os.environ`` where unset: a value the user set stays (theirs to turn on)."""
    for key, value in defaults.items():
        os.environ.setdefault(key, value)


def row_metrics(row: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """Every number of a ``metrics.jsonl`` row as ``(name, value)``: nested keys joined with ``/``
    (``accuracy/AVG``, ``train/ce``, ``privacy/epsilon``); the round itself and lists left out."""
    def walk(prefix: str, value: Any) -> Iterator[tuple[str, float]]:
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            yield prefix, float(value)
        elif isinstance(value, Mapping):
            for key, inner in value.items():
                yield from walk(f"{prefix}/{key}" if prefix else str(key), inner)

    for key, value in row.items():
        if key != "round":
            yield from walk(key, value)


def flat_params(config: Mapping[str, Any]) -> dict[str, str]:
    """The config's keys as dotted names and text values (what trackers take as parameters)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            out[prefix] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)

    walk("", config)
    return out


class MlflowTracker(RoundObserver):
    """The run in MLflow (module doc): created at the first round, metrics every round, artifacts at the end."""

    def __init__(self, out: Path, uri: str, project: str, config: Mapping[str, Any], name: str):
        quiet_environment(QUIET_MLFLOW)  # before the import, which starts MLflow's telemetry
        try:
            from mlflow.entities import Metric, Param  # an optional extra; a slow import
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ConfigError("tracker=mlflow needs MLflow; pip install 'fedhpro[mlflow]'") from None
        self.out, self.name = Path(out), name
        self.local = not uri
        self.uri = uri or f"sqlite:///{(Path(out) / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=self.uri)
        self.metric, self.param = Metric, Param
        self.project, self.config = project, dict(config)
        self.run_id: str | None = None

    def _start(self) -> str:
        self.out.mkdir(parents=True, exist_ok=True)
        found = self.client.get_experiment_by_name(self.project)
        location = (self.out / "mlartifacts").resolve().as_uri() if self.local else None
        experiment = (found.experiment_id if found is not None
                      else self.client.create_experiment(self.project, artifact_location=location))
        run = self.client.create_run(experiment, run_name=self.name, tags={"fedhpro.out": str(self.out)})
        params = [self.param(key[:250], value[:6000]) for key, value in flat_params(self.config).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(run.info.run_id, params=params[start:start + 100])
        return str(run.info.run_id)

    def on_round_end(self, record: RoundRecord) -> None:
        self.log_row(record.to_json())

    def log_row(self, row: Mapping[str, Any]) -> None:
        """One ``metrics.jsonl`` row's numbers at step ``round + 1``."""
        if self.run_id is None:
            self.run_id = self._start()
        stamp = int(time.time() * 1000)
        step = int(row["round"]) + 1
        metrics = [self.metric(name, value, stamp, step) for name, value in row_metrics(row)]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def on_run_end(self) -> None:
        self.finish()

    def finish(self) -> None:
        """The privacy ledger and the final files, then the run marked finished."""
        if self.run_id is None:
            self.run_id = self._start()
        summary = _summary(self.out)
        for name, value in row_metrics({"privacy": summary.get("privacy") or {}}):
            self.client.log_metric(self.run_id, name, value)
        for name in ARTIFACTS:
            if (self.out / name).is_file():
                self.client.log_artifact(self.run_id, str(self.out / name))
        with tempfile.TemporaryDirectory(prefix="fedhpro-tracker-") as scratch:
            for path in figures(self.out, self.config, Path(scratch)):
                self.client.log_artifact(self.run_id, str(path))
            self._log_model(Path(scratch) / MLFLOW_MODEL)
        self.client.set_terminated(self.run_id)

    def _log_model(self, scratch: Path) -> None:
        """The trained model as an MLflow model, artifact ``model``, where the run has one model that rebuilds
        from its folder (a tag says why not otherwise)."""
        assert self.run_id is not None
        if not (self.out / "model.json").is_file():
            return
        # imported here: it imports mlflow.pyfunc, which only this tracker needs
        from fedhpro.trained.mlflow_model import mlflow_model_note, save_mlflow_model

        note = mlflow_model_note(self.out)
        if note is not None:
            self.client.set_tag(self.run_id, "fedhpro.model", f"not logged as an MLflow model: {note}")
            return
        save_mlflow_model(self.out, scratch)
        self.client.log_artifacts(self.run_id, str(scratch), MLFLOW_MODEL)


class WandbTracker(RoundObserver):
    """The run in Weights & Biases, offline by default (module doc)."""

    def __init__(self, out: Path, uri: str, project: str, config: Mapping[str, Any], name: str):
        self.mode: Literal["online", "offline"] = "online" if uri == "online" else "offline"
        # offline in W&B's process-wide settings too, not only the run's: its analytics are set up from those,
        # and would otherwise probe W&B's servers from an offline run
        quiet_environment({**QUIET_WANDB, **({"WANDB_MODE": "offline"} if self.mode == "offline" else {})})
        try:
            import wandb  # an optional extra; a slow import
        except ImportError:
            raise ConfigError("tracker=wandb needs Weights & Biases; pip install 'fedhpro[wandb]'") from None
        self.wandb, self.out = wandb, Path(out)
        self.project, self.config, self.name = project, dict(config), name
        self.run: Any = None

    def _start(self) -> Any:
        self.out.mkdir(parents=True, exist_ok=True)
        return self.wandb.init(project=self.project, name=self.name, dir=str(self.out), mode=self.mode,
                               config=self.config, reinit="create_new",
                               settings=self.wandb.Settings(console="off", x_disable_stats=True))

    def on_round_end(self, record: RoundRecord) -> None:
        self.log_row(record.to_json())

    def log_row(self, row: Mapping[str, Any]) -> None:
        if self.run is None:
            self.run = self._start()
        self.run.log(dict(row_metrics(row)), step=int(row["round"]) + 1)

    def on_run_end(self) -> None:
        if self.run is None:
            self.run = self._start()
        summary = _summary(self.out)
        for name, value in row_metrics({"privacy": summary.get("privacy") or {}}):
            self.run.summary[name] = value
        artifact = self.wandb.Artifact(f"fedhpro-{self.run.id}", type="model")
        for name in ARTIFACTS:
            if (self.out / name).is_file():
                artifact.add_file(str(self.out / name))
        with tempfile.TemporaryDirectory(prefix="fedhpro-tracker-") as scratch:
            for path in figures(self.out, self.config, Path(scratch)):
                artifact.add_file(str(path))  # copied into W&B's staging area here
            self.run.log_artifact(artifact)
        self.run.finish()


def figures(out: Path, config: Mapping[str, Any], scratch: Path) -> list[Path]:
    """The run's figures: ``accuracy.png`` (with its ``.svg`` and ``.pdf``) drawn into ``scratch`` from the
    run's metrics.jsonl and title as the run draws it into its folder (after the observers' end, so after a
    tracker's: its own copy would be missing, or a resumed run's earlier one), and the other PNG figures the
    folder holds (a t-SNE's ``tsne.png``)."""
    found = [path for path in sorted(out.glob("*.png")) if path.name != "accuracy.png"]
    rows = _rows(out)
    summary = _summary(out)
    if any("accuracy" in row for row in rows):
        method, seed = str(config.get("method", summary.get("method", ""))), config.get("seed", summary.get("seed", 0))
        title = run_title(method, seed, str(summary.get("dataset", config.get("dataset", ""))))
        drawn = scratch / "accuracy.png"
        plot_run_accuracy(rows, drawn, title=title)
        found = [drawn, *(path for path in (vector_path(drawn), pdf_path(drawn)) if path.is_file()), *found]
    return found


def _rows(out: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows (an unreadable line skipped: a figure of what can be read)."""
    path = out / "metrics.jsonl"
    rows = []
    for line in (path.read_text(encoding="utf-8").splitlines() if path.is_file() else []):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("round"), int):
            rows.append(row)
    return rows


def _summary(out: Path) -> dict[str, Any]:
    path = out / "summary.json"
    try:
        value = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def tracker_for(options: OutputOptions, out: Path, config: Mapping[str, Any], name: str) -> RoundObserver | None:
    """The tracker ``options.tracker`` names (``tracker.uri``, ``tracker.project``), or None."""
    kind = str(getattr(options, "tracker", "none"))
    if kind == "none":
        return None
    makers: dict[str, Callable[..., RoundObserver]] = {"mlflow": MlflowTracker, "wandb": WandbTracker}
    if kind not in makers:
        raise ConfigError(f"tracker={kind!r} is not a tracker; use one of {', '.join(TRACKERS)}")
    return makers[kind](out, str(getattr(options, "tracker_uri", "") or ""),
                        str(getattr(options, "tracker_project", "fedhpro") or "fedhpro"), config, name)


__all__ = ["ARTIFACTS", "MLFLOW_MODEL", "MlflowTracker", "QUIET_MLFLOW", "QUIET_WANDB", "TRACKERS", "WandbTracker",
           "figures", "flat_params", "quiet_environment", "row_metrics", "tracker_for"]
