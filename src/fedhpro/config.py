"""Run configuration: defaults, a YAML file, then ``KEY=VALUE`` overrides, all validated.

Keys are flat words for the run (``rounds=20``) and ``section.knob`` for a
method's knobs (``fedhpro.tau=0.1``) and the data set's layout
(``data.fraction=0.1``). YAML files may nest sections or use dotted keys.
Every bad key or value raises :class:`~fedhpro.errors.ConfigError` with one
line naming the problem and the valid choices.

The methods (``method=`` choices and the ``<method>.<knob>`` keys), data sets
(``dataset=`` and its ``data.*`` keys), models (``model=``) and partitioners
(``partition=`` and their ``partition.*`` knobs) are read from their
registries (:mod:`fedhpro.registry`) at each load, not fixed at import: one
registered from Python or installed through an entry point (``fedhpro.methods``,
``fedhpro.datasets``, ``fedhpro.models``, ``fedhpro.partitioners``) is valid
everywhere a config is read. The config sections besides the methods' are one
table, :data:`SECTIONS`; what a run key is (presentation, resumable, observer)
is declared with the key (``option(..., tags=...)``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from fedhpro import options as opt
from fedhpro.bounded import MAX_YAML_CHARS, LimitError, load_yaml
from fedhpro.data import DATASETS, declared_dataset
from fedhpro.data.client_tests import CLIENT_TESTS
from fedhpro.data.partition import PartitionOptions, partition_options_class
from fedhpro.data.standardize_options import FEDERATED, FORMER_FEDERATED, resolved_standardize
from fedhpro.engines.fault_options import FAULTS_SECTION, FaultOptions
from fedhpro.errors import ConfigError
from fedhpro.methods import declared_method, method_declarations, method_names, recipes_of
from fedhpro.models import MODELS
from fedhpro.options import fields_of, option, tagged
from fedhpro.privacy import check_combinations
from fedhpro.privacy.options import PRIVACY_SECTION, PrivacyOptions, is_private
from fedhpro.registry import LiveChoices
from fedhpro.robust import aggregation_options_class
from fedhpro.robust import written as written_aggregation
from fedhpro.robust.options import AGGREGATION_SECTION

DATA_SECTION = "data"
#: ``partition=NAME`` is short for ``partition.scheme=NAME``; ``partition.alpha=0.5`` etc. are its knobs
PARTITION_SECTION = "partition"


#: ``federation: python:<name>`` in a config.yaml: the run's data were a Federation passed from Python
#: (``fedhpro.run(..., federation=...)``); ``model: python:<module.name>`` likewise for a model callable
FEDERATION_KEY = "federation"
PYTHON_PREFIX = "python:"


#: the values of ``channels_last=`` (:func:`channels_last_setting` reads them for the training loop)
CHANNELS_LAST_CHOICES = ("auto", "true", "false")


def channels_last_setting(value: str | bool) -> bool | None:
    """``channels_last=``'s value as :attr:`fedhpro.methods.training.TrainSettings.channels_last` takes it: True or
    False as set, None for auto (on exactly when mixed precision is on and the model has a Conv2d)."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    return text in ("true", "yes", "on", "1")


def numbers_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """A config's top-level settings (``Config.to_dict()`` / a ``config.yaml``) with one spelling for
    equivalent values, for deciding whether two runs have the same numbers: without amp,
    ``channels_last=auto`` trains exactly as ``false`` does (NCHW), and is written ``False``, as every
    config.yaml from before ``auto`` existed says."""
    settings = dict(values)
    if ("channels_last" in settings and settings.get("amp", "off") == "off"
            and channels_last_setting(settings["channels_last"]) is not True):
        settings["channels_last"] = False
    return settings


def is_from_python(value: Any) -> bool:
    """Whether a recorded ``model`` / ``federation`` value says the object came from Python."""
    return isinstance(value, str) and value.startswith(PYTHON_PREFIX)


class MethodChoices(LiveChoices):
    """The valid ``method=`` values, read from the registry at each use.

    A method registered or installed after this module was imported
    (:func:`fedhpro.methods.register`, an entry point) is a valid choice: the
    names are never frozen into the options class.
    """

    def __init__(self) -> None:
        super().__init__(method_names)


if TYPE_CHECKING:
    from fedhpro.robust.options import AggregationOptions
else:
    #: the ``aggregation.*`` section of the built-in rules: the shared bounds and each rule's own knobs (a rule
    #: declares them beside its code, :mod:`fedhpro.robust`); a config holds the class of the rules registered when
    #: it is read (:func:`~fedhpro.robust.aggregation_options_class`), this one when no package adds a rule
    AggregationOptions = aggregation_options_class(builtin=True)


@dataclass
class TrainingOptions:
    """The run keys of what is trained and how: the method, data, model and the federated optimisation (these
    keys decide a run's numbers)."""

    method: str = option("fedhpro", choices=MethodChoices(), help="the federated method (the built-ins, "
                                                                       "and any registered or installed)")
    dataset: str = option("digits-offline", choices=DATASETS.choices, help="the federation's data set")
    model: str = option("cnn", choices=MODELS.choices, help="the model architecture")
    feature_dim: int = option(512, min=1, help="d, the feature dimension")
    heterogeneity: str = option("none", choices=("none", "htfe2", "htfe3", "htfe5", "htfe8"),
                                help="model heterogeneity: htfeX gives client k the architecture k mod X of the "
                                     "paper's HtFE_X list; only the classifier is shared")
    projection_head: bool = option(False, help="give every method's network the MOON authors' projection head: "
                                               "features -> Linear(d, d) -> ReLU -> Linear(d, 256), the classifier "
                                               "on the 256-wide projection (their init_nets does so for FedAvg and "
                                               "FedProx too; the MOON paper's setting)")
    rounds: int = option(10, min=1, help="R, communication rounds (the paper: 100; 10 fits a CPU in minutes)")
    clients: int | None = option(None, min=1, help="K, number of clients (default: the data set's layout)")
    participation: float = option(1.0, gt=0.0, max=1.0, help="fraction of clients sampled each round")
    local_epochs: int = option(5, min=1, help="E, local epochs per round (the paper: 10)")
    batch_size: int = option(64, min=1, help="local mini-batch size")
    lr: float = option(0.01, gt=0.0, help="local SGD learning rate")
    momentum: float = option(0.9, min=0.0, max=1.0, help="local SGD momentum")
    weight_decay: float = option(1e-5, min=0.0, help="local SGD weight decay")
    max_grad_norm: float | None = option(None, min=0.0,
                                         help="cap the local gradient's global L2 norm at this before each SGD "
                                              "step (privacy=sample: the noisy gradient's); 0: off. Cosine losses "
                                              "at a small temperature (FedHPro's HPCL, tau=0.05) have gradients "
                                              "~1/(tau |z|): on small features one step at lr >= 0.05 can blow "
                                              "them up and the cross-entropy with them; 10 stops that (default: "
                                              "unset, the method's own cap: FedRCL 10, as its authors; the others "
                                              "none, as the paper)")
    seed: int = option(0, min=0, help="seed of the model init, partition, client sampling and batches")
    min_clients: int = option(1, min=1, help="a round with fewer valid client updates is skipped")


@dataclass
class EvaluationOptions:
    """The run keys of what is measured and on what: the evaluation schedule, the clients' own tests, unseen
    clients, the validation split and the observers (FLOPs, prototype distance, t-SNE)."""

    eval_every: int = option(1, min=1, help="evaluate the global model every this many rounds (and at the end)")
    client_test: str = option("shared", choices=CLIENT_TESTS,
                              help="what each client's own accuracy (client_accuracy, fairness, site_accuracy) is "
                                   "measured on: shared (the paper's protocol: its domain's test set, the same for "
                                   "every client of a domain) or matched (test samples drawn to follow its "
                                   "training labels); the accuracy per domain and AVG stay on the shared sets")
    unseen_clients: float = option(0.0, min=0.0, max=0.5,
                                   help="share of the clients that never train (at least 1 when > 0), drawn by "
                                        "the seed: each round also tests the global model on them (metrics.jsonl's "
                                        "unseen), each on test samples that follow its training labels (or its own "
                                        "test split)")
    unseen_domain: str | None = option(None, help="leave-one-domain-out: every client of this domain never trains, "
                                                  "its test set leaves the accuracy per domain and AVG and is the "
                                                  "unseen clients' test (metrics.jsonl's unseen)")
    unseen_finetune: int = option(0, min=0, help="at the end, each unseen client also fine-tunes a copy of the "
                                                 "global model for this many local epochs (plain cross-entropy SGD "
                                                 "at the run's lr, momentum, weight decay and batch size) on its own "
                                                 "training data before it is tested (summary.json's unseen.finetuned)"
                                                 "; 0: the global model only")
    validation: float = option(0.0, min=0.0, max=0.5,
                               help="share of each client's training data held out as its validation part, class "
                                    "by class (below 0.5; 0: none): it never trains, every evaluation also tests "
                                    "on it, and the best round is chosen on it instead of the test set")
    flops: bool = option(False, help="count training FLOPs of every client and the server step with "
                                     "torch.utils.flop_counter into metrics.jsonl (Table 4; slows training a little)",
                         tags=("observer",))
    prototype_distance: bool = option(False, help="each evaluated round, the L2 distance of the method's prototypes "
                                                  "to the centralized prototypes (Figure 2; one extra pass over "
                                                  "all training data)", tags=("observer",))
    tsne: bool = option(False, help="at the end, a t-SNE of the global model's test features: tsne.png "
                                    "(Figures 3 and 6; needs scikit-learn)", tags=("resumable", "observer"))


@dataclass
class ExecutionOptions:
    """The run keys of how the run executes on this machine: where its data are read, the device, threads and
    clients side by side, mixed precision, memory format and compilation, and a run resumed."""

    device: str = option("auto", help="auto (CUDA if available), cpu, cuda or cuda:N",
                         tags=("presentation", "resumable"))
    threads: str = option("auto", help="CPU threads of the run (torch.set_num_threads): a whole number >= 1, or "
                                       "auto: the cores this process may run on ($OMP_NUM_THREADS if set), "
                                       "divided among a sweep's jobs; the same seed, config and thread count "
                                       "give the same bytes, another count differs in the last float digits",
                          tags=("presentation", "resumable"))
    parallel_clients: str = option("auto", help="clients the in-process simulator trains at once, each on its own "
                                                "working model with threads/parallel_clients threads: a whole "
                                                "number >= 1 (at most threads), or auto: one a thread on the CPU "
                                                "(small models train faster side by side than on more threads "
                                                "each), one on a GPU; results depend on the threads a client gets, "
                                                "never on the order clients finish in",
                                   tags=("presentation", "resumable"))
    amp: str = option("off", choices=("off", "bf16"),
                      help="mixed precision of local training: off (float32) or bf16 (the forward pass under "
                           "bfloat16 autocast; losses, weights, aggregation and privacy noise float32; with "
                           "channels_last=auto also channels_last for convolutional models). On a CPU with AMX or "
                           "AVX512-BF16 the cnn trains about 2-3x faster per sample, the digits differ from "
                           "float32's; refused on a CPU without native bfloat16 (slower there); on a GPU without "
                           "native bfloat16, float16 autocast with a gradient scaler")
    channels_last: str = option("auto", choices=CHANNELS_LAST_CHOICES,
                                help="train in the channels_last memory format: auto (on exactly when amp=bf16 "
                                     "and the model has a Conv2d layer), true or false (changes results within "
                                     "float rounding)")
    compile: bool = option(False, help="torch.compile the feature extractor once (the first round pays the "
                                       "compilation; needs a C++ compiler on the CPU)")
    resume: str | None = option(None, help="continue the interrupted run in this folder (its config.yaml)",
                                tags=("presentation", "resumable"))
    data_dir: str | None = option(None, help="where data sets are read and cached, each in its own folder "
                                             "(default $FEDHPRO_DATA_DIR, else ~/.cache/fedhpro)")


@dataclass
class OutputOptions:
    """The run keys of where and how the run is written and shown: its folder, progress, checkpoints, TensorBoard
    and an experiment tracker."""

    out: str | None = option(None, help="output folder (default runs/<method>-<dataset>-<timestamp>)",
                             tags=("presentation",))
    progress: bool = option(True, help="show a progress bar", tags=("presentation", "resumable"))
    checkpoint_every: int = option(5, min=0, help="write a checkpoint every this many rounds (0: only at the end)",
                                   tags=("presentation", "resumable"))
    checkpoint_minutes: float = option(5.0, min=0.0, help="also write a checkpoint after a round once this many "
                                                          "minutes passed since the last one (0: off), so a long "
                                                          "run killed early can be resumed",
                                       tags=("presentation", "resumable"))
    keep_checkpoints: int = option(2, min=1, help="keep only the newest this many checkpoints",
                                   tags=("presentation", "resumable"))
    tensorboard: bool = option(False, help="also write TensorBoard logs to <out>/tensorboard (needs the "
                                           "tensorboard package: pip install tensorboard)",
                               tags=("presentation", "resumable"))  # both engines: it reads round records only
    tracker: str = option("none", choices=("none", "mlflow", "wandb"),
                          help="also log the run to an experiment tracker: its config, every round's metrics, the "
                               "privacy ledger and the final files (mlflow: pip install fedhpro[mlflow]; wandb: pip "
                               "install fedhpro[wandb], offline)", tags=("presentation", "resumable"))
    tracker_uri: str = option("", help="tracker=mlflow: the tracking URI (default a SQLite store <out>/mlflow.db, "
                                       "artifacts in <out>/mlartifacts); "
                                       "tracker=wandb: online to upload as the run goes (default offline, in "
                                       "<out>/wandb)", tags=("presentation", "resumable"))
    tracker_project: str = option("fedhpro", help="the tracker's experiment (MLflow) or project (W&B)",
                                  tags=("presentation", "resumable"))


@dataclass
class RunOptions(OutputOptions, ExecutionOptions, EvaluationOptions, TrainingOptions):
    """Every run key, flat (``rounds=20``, ``config.run.rounds``): the four groups' fields, in this order
    (config.yaml and ``fedhpro config --keys`` list them so). A lower floor that reads one group takes that
    group's type (a :class:`TrainingOptions`, an :class:`OutputOptions`, ...), which a RunOptions is."""


#: run keys that change where and how a run is shown or stored, never its numbers
#: (``threads`` too: another thread count changes results only in the last float digits, and the same seed,
#: config and thread count give the same bytes); tagged "presentation" in :class:`RunOptions`
PRESENTATION_KEYS = tagged(RunOptions, "presentation")
#: run keys a resumed run may set to other values than the run it continues (tagged "resumable")
RESUMABLE_KEYS = tagged(RunOptions, "resumable")
#: run keys that switch observers on (tagged "observer"; measured only by the in-process simulator)
OBSERVER_KEYS = tuple(f.name for f in dataclasses.fields(RunOptions) if "observer" in f.metadata["tags"])


@dataclass(frozen=True)
class Section:
    """A config section besides the methods': its keys are ``<name>.<knob>``, the fields of its options class
    (which may depend on the data set: ``data``); ``shorthand``: the knob ``<name>=VALUE`` sets."""

    name: str
    options_for: Callable[[str], type]
    shorthand: str | None = None
    #: the section's values as config.yaml holds them (default: every field)
    written: Callable[[Any], dict[str, Any]] = dataclasses.asdict


#: the config sections besides the methods', in the order config.yaml and ``fedhpro config --keys`` list
#: them; each is an attribute of :class:`Config` of the same name
SECTIONS: tuple[Section, ...] = (
    Section(DATA_SECTION, lambda dataset: declared_dataset(dataset).options),
    Section(FAULTS_SECTION, lambda dataset: FaultOptions),
    Section(PARTITION_SECTION, lambda dataset: partition_options_class(), shorthand="scheme"),
    # the rules' own knobs (aggregation.trim, ...) are declared by each rule (fedhpro.robust)
    Section(AGGREGATION_SECTION, lambda dataset: aggregation_options_class(), shorthand="rule",
            written=written_aggregation),
    Section(PRIVACY_SECTION, lambda dataset: PrivacyOptions, shorthand="mode"),
)
SECTION_NAMES = tuple(section.name for section in SECTIONS)
#: the sections whose bare name is short for one of their knobs: ``partition=dirichlet``, ``aggregation=median``
SHORTHANDS = {section.name: section.shorthand for section in SECTIONS if section.shorthand}


@dataclass
class Config:
    """A resolved configuration: the run's options, every method's knobs and the data set's options."""

    run: RunOptions
    methods: dict[str, Any]
    data: Any
    faults: FaultOptions = dataclasses.field(default_factory=FaultOptions)
    partition: PartitionOptions = dataclasses.field(default_factory=PartitionOptions)
    aggregation: AggregationOptions = dataclasses.field(default_factory=lambda: aggregation_options_class()())
    privacy: PrivacyOptions = dataclasses.field(default_factory=PrivacyOptions)
    #: ``"python:<name>"`` when the run's data were a Federation passed from Python (``run.dataset`` is
    #: then unused), else None; written to config.yaml only when set
    federation: str | None = None
    #: the keys the user set (``section.knob`` form, as written: ``rounds``, ``fedhpro.tau``,
    #: ``data.clients_per_domain.mnist``) and their values, later sources winning: what :func:`load_config`
    #: was given, not a data set's or a recipe's defaults nor the program's own settings (:meth:`updated`).
    #: A resumed run checks them against its saved config and keeps the saved value of every key not among
    #: them; not part of the config's value (equality, ``to_dict``)
    given: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    #: ``to_dict()`` as :func:`load_config` resolved it: a Config changed afterwards (``dataclasses.replace``)
    #: no longer matches, and :meth:`set_keys` then counts the changed keys as set
    _resolved: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def method_options(self) -> Any:
        return self.methods[self.run.method]

    def sections(self) -> dict[str, Any]:
        """Every section's options, by name: the methods' (``<method>.*``), then :data:`SECTIONS`'."""
        return {**self.methods, **{section.name: getattr(self, section.name) for section in SECTIONS}}

    def replaced(self, section: str, **values: Any) -> Config:
        """This config with ``values`` set in one section: ``"run"`` (the run keys), a method's name, or one of
        :data:`SECTIONS` (``config.replaced("data", classes=[...])``: what Flower learns at discovery). Each
        value is checked and converted as :func:`load_config` checks the key (its type, choices and limits, then
        the section's own checks), in one line naming the key; nothing else is rebuilt. The program's own
        settings: the keys the user set (:attr:`given`) stay what they were."""
        run, methods, sections = self.run, self.methods, {entry.name: getattr(self, entry.name) for entry in SECTIONS}
        prefix = "" if section == "run" else f"{section}."
        if section == "run":
            current: Any = run
        elif section in methods:
            current = methods[section]
        elif section in sections:
            current = sections[section]
        else:
            raise ConfigError(f"{section!r} is not a config section; choose run, a method or one of: "
                              f"{', '.join(SECTION_NAMES)}")
        known = opt.fields_of(type(current))
        for name in values:
            if name not in known:
                raise _unknown(prefix + name, self.run.dataset)
        checked = {name: opt.coerce(prefix + name, _checked_value(prefix + name, value), *known[name])
                   for name, value in values.items()}
        changed = dataclasses.replace(current, **checked)
        if section == "run":
            changed.threads = threads_setting(changed.threads)
            changed.parallel_clients = parallel_clients_setting(changed.parallel_clients, changed.threads)
            run = changed
        elif section in methods:
            methods = {**methods, section: changed}
        else:
            sections[section] = changed
        check_aliases(run, methods[run.method])
        config = Config(run=run, methods=methods, **sections, federation=self.federation, given=self.given)
        return dataclasses.replace(config, _resolved=config.to_dict())

    def updated(self, settings: Mapping[str, Any]) -> Config:
        """This config with the program's own ``settings`` applied (``{"data.classes": [...], "clients": 4}``,
        each key checked as :func:`load_config` checks it): :meth:`replaced`, section by section. The keys the
        user set (:attr:`given`) stay what they were."""
        by_section: dict[str, dict[str, Any]] = {}
        for key, value in flatten_keys(settings, "settings").items():
            section, _, knob = key.partition(".")
            knob, _, entry = knob.partition(".")
            values = by_section.setdefault(section if knob else "run", {})
            if entry:  # one entry of a mapping (data.clients_per_domain.mnist): the mapping with that entry set
                current = values.get(knob, getattr(self.sections().get(section), knob, None))
                if not isinstance(current, Mapping):
                    raise _unknown(key, self.run.dataset)
                value = {**current, entry: value}
            values[knob or key] = value
        config = self
        for section, values in by_section.items():
            config = config.replaced(section, **values)
        return config

    def set_keys(self) -> dict[str, Any]:
        """The keys the user set and their values: :attr:`given` and, for a config changed after it was
        resolved (``dataclasses.replace``) or built by hand, every key whose value differs from the defaults
        (those of its data set), since which of them were set can no longer be told."""
        if self._resolved is not None and self.to_dict() == self._resolved:
            return dict(self.given)
        defaults = load_config({"dataset": self.run.dataset})
        changed = {key: setting_value(self, key) for key in setting_keys(self)
                   if setting_value(self, key) != setting_value(defaults, key)}
        if self.run.dataset != RunOptions.dataset:
            changed["dataset"] = self.run.dataset
        return {**changed, **self.given}

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict, as saved to ``config.yaml`` (loadable again by :func:`load_config`)."""
        out = dataclasses.asdict(self.run)
        if self.federation is not None:
            out[FEDERATION_KEY] = self.federation
        for name, options in self.methods.items():
            values = dataclasses.asdict(options)
            if values:
                out[name] = values
        for section in SECTIONS:
            if section.name == PRIVACY_SECTION and self.privacy == PrivacyOptions():
                continue  # privacy off: config.yaml (and all a run writes) stays as before privacy existed
            out[section.name] = section.written(getattr(self, section.name))
        return out


def _run_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(RunOptions)]


def setting_keys(config: Config) -> list[str]:
    """Every key of ``config`` in ``section.knob`` form (run keys bare)."""
    return [f.name for f in dataclasses.fields(config.run)] + [
        f"{name}.{f.name}" for name, options in config.sections().items() for f in dataclasses.fields(options)]


def setting_value(config: Config, key: str) -> Any:
    """The value of ``key`` (``rounds``, ``fedhpro.tau``, ``data.clients_per_domain.mnist``) in ``config``;
    an entry of a mapping is compared as the whole mapping."""
    section, _, rest = key.partition(".")
    if not rest:
        return config.federation if key == FEDERATION_KEY else getattr(config.run, key)
    return getattr(config.sections()[section], rest.partition(".")[0])


def _all_keys(dataset: str) -> list[str]:
    keys = _run_keys()
    for name, declaration in method_declarations().items():
        keys += [f"{name}.{f.name}" for f in dataclasses.fields(declaration.options)]
    for section in SECTIONS:
        keys += [section.name] if section.shorthand else []
        keys += [f"{section.name}.{f.name}" for f in dataclasses.fields(section.options_for(dataset))]
    return keys


def _unknown(key: str, dataset: str) -> ConfigError:
    """One short line: the key, up to three close keys (closest first) and where the full list is."""
    if key.startswith("flower."):  # listed by config --keys too, but read by a Flower run's own settings
        return ConfigError(f"'{key}' is a Flower setting: give it in a Flower run's run config "
                           f"(flwr run --run-config '{key}=...'), not to fedhpro run or its config")
    quoted = [f"'{name}'" for name in difflib.get_close_matches(key, _all_keys(dataset), n=3, cutoff=0.6)]
    choices = ", ".join(quoted[:-1]) + " or " + quoted[-1] if len(quoted) > 1 else "".join(quoted)
    hint = f" (did you mean {choices}?)" if quoted else ""
    listing = "fedhpro config --keys" + ("" if dataset == RunOptions.dataset else f" dataset={dataset}")
    return ConfigError(f"unknown config key '{key}'{hint}; `{listing}` lists every key")


def flatten_keys(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``{"fedhpro": {"tau": 1}}`` and ``{"fedhpro.tau": 1}`` both become ``{"fedhpro.tau": 1}``."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{source} must hold a mapping of config keys, got {type(values).__name__}")
    flat: dict[str, Any] = {}
    sections = set(method_names()) | set(SECTION_NAMES)
    for key, value in values.items():
        key = check_key(str(key) if isinstance(key, (int, float)) and not isinstance(key, bool) else key,
                        source)
        if key in SHORTHANDS and value is not None and not isinstance(value, Mapping):
            flat[f"{key}.{SHORTHANDS[key]}"] = value  # partition=dirichlet, aggregation=median
        elif key in sections and isinstance(value, Mapping):
            for inner, inner_value in value.items():
                flat[f"{key}.{check_key(inner if isinstance(inner, str) else str(inner), source)}"] = inner_value
        elif key in sections and value is None:
            continue
        else:
            flat[key] = value
    return flat


#: the largest whole number a setting may hold (a seed, a count): larger ones overflow torch and NumPy
LARGEST_INTEGER = 2**63 - 1
#: how much of a value a message shows (a value can be any length; a message stays one short line)
_SHOWN = 60
#: what YAML raises besides YAMLError on text it cannot build values from: a whole number of more than
#: 4300 digits (Python's int limit), a date that is not one, nesting deeper than the recursion limit
_YAML_VALUE_ERRORS = (yaml.YAMLError, ValueError, OverflowError, RecursionError, TypeError)


def shown(value: Any) -> str:
    """``value`` as a message shows it: its repr on one line, cut to a few dozen characters (a number of
    thousands of digits by its length)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > LARGEST_INTEGER:
        return f"<a whole number of {len(str(abs(value))) if abs(value) < 10**4000 else 'over 4000'} digits>"
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an int past Python's digit limit inside a container, a deep nest
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


def parse_override(text: str) -> tuple[str, Any]:
    """``"fedhpro.tau=0.1"`` -> ``("fedhpro.tau", 0.1)``; the value is read as YAML (text YAML cannot read is
    kept as text). Anything else, a key that is not one line of printable text included, is one ConfigError."""
    if not isinstance(text, str):
        raise ConfigError(f"{shown(text)} is not KEY=VALUE text (e.g. rounds=10)")
    if "=" not in text:
        raise ConfigError(f"{shown(text)} is not KEY=VALUE (e.g. rounds=10) nor an existing .yaml file")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"{shown(text)} has no key before '='")
    check_key(key, "the command line")
    try:
        value = load_yaml(raw, f"the value of {key}=") if raw.strip() else ""
    except LimitError:
        raise  # text past a bound is refused, not taken as a string: it is no setting either way
    except _YAML_VALUE_ERRORS:
        if raw.strip().lstrip("+-").isdigit():  # past Python's 4300-digit limit
            raise ConfigError(f"{key}=<a whole number of {len(raw.strip())} digits> is too large for any "
                              f"setting (at most {LARGEST_INTEGER})") from None
        value = raw
    return key, value


def check_key(key: Any, source: str) -> str:
    """``key`` if it can name a setting (printable text on one line), else a one-line ConfigError."""
    if not isinstance(key, str) or not key or not key.isprintable():
        raise ConfigError(f"{source} has the key {shown(key)}, which is no config key; "
                          "`fedhpro config --keys` lists every key")
    return key


def read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    """The settings of a YAML config file, flattened (:func:`flatten_keys`). A file that is missing or
    unreadable, not UTF-8 text, not YAML, or not a mapping of settings is one ConfigError naming the fix."""
    path = Path(path)
    where = f"config file {str(path)!r}"
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte
        is_file = False
    if not is_file:
        if path.suffix not in (".yaml", ".yml"):
            raise ConfigError(f"{shown(str(path))} is not KEY=VALUE (e.g. rounds=10) nor an existing .yaml "
                              "config file")
        raise ConfigError(f"{where} does not exist")
    try:
        size = path.stat().st_size
        if size > MAX_YAML_CHARS:  # refused before it is read
            raise ConfigError(f"{where} is {size:,} bytes, over fedhpro's limit of {MAX_YAML_CHARS:,} for YAML; "
                              "give a config file of settings")
        raw = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{where} cannot be read ({error.strerror or type(error).__name__})") from None
    return parse_yaml(raw, where)


def parse_yaml(raw: bytes | str, where: str) -> dict[str, Any]:
    """The flattened settings in the YAML text ``raw`` (bytes must be UTF-8); ``where`` names it in errors."""
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ConfigError(f"{where} is not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start}); "
                              "save it as UTF-8") from None
    else:
        text = raw
    try:
        values = load_yaml(text, where)
    except LimitError:
        raise
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = f" ({error.problem})" if error.problem else ""
        raise ConfigError(f"{where} is not valid YAML{at}{problem}; fix its syntax".replace("\n", " ")) from None
    except _YAML_VALUE_ERRORS as error:
        text = (str(error).strip().splitlines() or [type(error).__name__])[0]
        reason = ("nested too deeply" if isinstance(error, RecursionError)
                  else "a whole number of more than 4300 digits" if "digits" in text else text[:80])
        raise ConfigError(f"{where} is not valid YAML ({reason}); fix its syntax") from None
    if values is None:  # an empty file, or only comments
        return {}
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where} holds a YAML {type(values).__name__}, not a mapping of settings; write one "
                          "'key: value' per line (e.g. rounds: 10)")
    return flatten_keys(values, where)


def load_config(source: str | os.PathLike | Mapping[str, Any] | None = None,
                overrides: Iterable[str] | Mapping[str, Any] | None = None) -> Config:
    """Resolve a configuration.

    Args:
        source: a YAML file, a (nested or dotted) mapping, or None for the defaults.
        overrides: ``["rounds=5", "fedhpro.tau=0.1"]`` or a mapping applied after ``source``.
    """
    layers: list[dict[str, Any]] = []
    if isinstance(source, Mapping):
        layers.append(flatten_keys(source, "config"))
    elif source is not None:
        layers.append(read_yaml(source))
    if overrides is not None:
        pairs = list(overrides.items()) if isinstance(overrides, Mapping) else [parse_override(o) for o in overrides]
        layers.append(flatten_keys(dict(pairs), "overrides"))
    # copies throughout: nothing the caller passed, and no default or recipe of the package, is ever changed
    assignments = [(key, _checked_value(key, value)) for layer in layers for key, value in layer.items()]
    given = copy.deepcopy(dict(assignments))  # what the user set, before any default joins

    dataset = RunOptions.dataset
    for key, value in assignments:
        if key == "dataset":
            dataset = value
    if not isinstance(dataset, str):
        raise ConfigError(f"dataset={shown(dataset)} is not valid; choose one of: {', '.join(DATASETS)}")
    # a benchmark's own run settings (SUN397's 20% participation) come first: anything the user sets wins
    assignments = copy.deepcopy(list(declared_dataset(dataset).run_defaults.items())) + assignments
    # a method's recipe (fedhpro.recipe=authors), whatever the method run: its settings go first (the
    # benchmark's, which never overlap them, come next), so every key the user sets still wins
    assignments = _recipe_settings(assignments, dataset) + assignments

    # applied in order: a later layer beats an earlier one, whether it sets a mapping or one entry of it
    run_values: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for key, value in assignments:
        section, _, knob = key.partition(".")
        if not knob:
            run_values[key] = value
            continue
        knobs = sections.setdefault(section, {})
        inner, _, item = knob.partition(".")
        if not item:
            knobs[inner] = value
            continue
        # data.clients_per_domain.mnist=2 sets one entry of the mapping as it stands
        if inner not in knobs:
            knobs[inner] = copy.deepcopy(_default_of(section, inner, dataset))
        if not isinstance(knobs[inner], dict):
            raise ConfigError(f"'{key}' sets an entry of '{section}.{inner}', which is not a mapping")
        knobs[inner][item] = value

    federation = run_values.pop(FEDERATION_KEY, None)
    if federation is not None and not is_from_python(federation):
        raise ConfigError(f"{FEDERATION_KEY}={federation!r} is not a setting; a federation is passed from Python: "
                          "fedhpro.run(..., federation=Federation.from_tensors(...)); use dataset= here")
    for key in run_values:
        if key not in _run_keys():
            raise _unknown(key, dataset)
    declarations = method_declarations()
    for section, knobs in sections.items():
        if section not in declarations and section not in SECTION_NAMES:
            raise _unknown(f"{section}.{next(iter(knobs))}", dataset)
    if isinstance(run_values.get("method"), str):
        declared_method(run_values["method"])  # an unknown name, or an installed method that failed to load
    if is_from_python(run_values.get("model")):
        raise ConfigError(f"model={run_values['model']!r} was a Python callable; pass it again from Python "
                          "(fedhpro.run(..., model=<callable>)), or give a registered model here: "
                          f"{', '.join(MODELS)}")

    run = _build(RunOptions, run_values, "", dataset)
    run.threads = threads_setting(run.threads)
    run.parallel_clients = parallel_clients_setting(run.parallel_clients, run.threads)
    if "dataset" not in run_values and run.data_dir:
        refuse_data_dir_without_dataset(run.data_dir)
    methods = {name: _build(declaration.options, sections.get(name, {}), f"{name}.", dataset)
               for name, declaration in declarations.items()}
    built = {section.name: _build(section.options_for(dataset), sections.get(section.name, {}),
                                  f"{section.name}.", dataset) for section in SECTIONS}
    check_aliases(run, methods[run.method])
    config = Config(run=run, methods=methods, **built, federation=federation, given=given)
    check_combinations(config)  # privacy=client with a robust rule or min_clients > 1: refused with the keys
    return dataclasses.replace(config, _resolved=config.to_dict())


def check_aliases(run: RunOptions, options: Any) -> None:
    """The knobs of the run's method declared the old spelling of a run key (``option(alias_of=...)``:
    ``fedrcl.max_grad_norm`` of ``max_grad_norm``): one off its default warns once, naming the run key to write
    instead, and is refused in one line beside that run key set (not None) to another value. Told by value, not
    by what was given: a saved config.yaml holds every knob at its value, so a resumed run raises nothing new.
    The method reads the knob as its own default of the run key (:meth:`~fedhpro.methods.base.Client.
    default_max_grad_norm`), which the run key, when set, overrides."""
    for item in dataclasses.fields(options):
        key = item.metadata.get("alias_of")
        value = getattr(options, item.name)
        if key is None or value == item.default:
            continue
        old, run_value = f"{run.method}.{item.name}", getattr(run, key)
        if run_value is not None and run_value != value:
            raise ConfigError(f"{old}={shown(value)} and {key}={shown(run_value)} disagree: {old} is the old "
                              f"spelling of {key}; set only {key}")
        warnings.warn(f"{old} is the old spelling of {key}: write {key}={shown(value)}", FutureWarning,
                      stacklevel=3)


#: what the default data set keeps in a ``data_dir=`` folder (its cache): the only thing it may hold then
DEFAULT_DATASET_FOLDER = "digits-offline"


def refuse_data_dir_without_dataset(data_dir: str) -> None:
    """``data_dir=`` given without ``dataset=``: the default data set would build its own digits there, so a
    folder that holds anything but their cache (``digits-offline/``) is the user's data, meant for another
    data set. One ConfigError then, before anything is written into it."""
    root = Path(data_dir).expanduser()
    if root.suffix.lower() == ".csv":  # a table, never a folder the default data set could build in
        raise ConfigError(f"data_dir={data_dir} is a CSV table but no dataset= is given; did you mean dataset=clients? "
                          "(a site and a split column, or one folder per site with train.csv and test.csv)")
    try:
        held = sorted(p.name for p in root.iterdir()
                      if not p.name.startswith(".") and p.name != DEFAULT_DATASET_FOLDER) if root.is_dir() else []
    except OSError:
        return  # unreadable: the data set's own check names the folder
    if held:
        shown_names = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        raise ConfigError(f"data_dir={data_dir} holds your data ({shown_names}) but no dataset= is given; did you mean "
                          "dataset=imagefolder? (dataset=clients for one folder per client; the default, "
                          f"dataset={RunOptions.dataset}, would build its own digits in it)")


def _checked_value(key: str, value: Any) -> Any:
    """A copy of ``value`` for ``key``, refused in one line where no setting can hold it: a whole number
    past :data:`LARGEST_INTEGER` (anywhere in it), or nesting deeper than Python can copy."""
    def too_large(item: Any, depth: int = 0) -> bool:
        if isinstance(item, int) and not isinstance(item, bool):
            return abs(item) > LARGEST_INTEGER
        if depth < 50 and isinstance(item, Mapping):
            return any(too_large(inner, depth + 1) for pair in item.items() for inner in pair)
        if depth < 50 and isinstance(item, (list, tuple, set, frozenset)):
            return any(too_large(inner, depth + 1) for inner in item)
        return False

    try:
        if too_large(value):
            raise ConfigError(f"{key}={shown(value)} holds a number too large for any setting "
                              f"(at most {LARGEST_INTEGER})")
        return copy.deepcopy(value)
    except RecursionError:
        raise ConfigError(f"{key}= is nested too deeply to be a setting") from None


def _recipe_settings(assignments: list[tuple[str, Any]], dataset: str) -> list[tuple[str, Any]]:
    """The settings of every recipe chosen by ``<method>.recipe=<name>`` among ``assignments`` (copies), in
    the methods' order: each method declares its recipes with its registration (:func:`recipes_of`). A
    recipe's ``data.*`` setting applies to the data sets that have that key (the authors' CIFAR
    normalisation to the image benchmarks that take channel statistics), and is left out for the others:
    their data has no such setting to follow."""
    data_keys = {f"{DATA_SECTION}.{name}" for name in fields_of(declared_dataset(dataset).options)}
    settings: list[tuple[str, Any]] = []
    for name in method_names():
        recipes = recipes_of(name)
        if not recipes:
            continue
        options = declared_method(name).options
        default = next((f.default for f in dataclasses.fields(options) if f.name == "recipe"), None)
        chosen = _last_value(assignments, f"{name}.recipe", default)
        if isinstance(chosen, str) and chosen in recipes:
            settings += [(key, copy.deepcopy(value)) for key, value in recipes[chosen].items()
                         if not key.startswith(f"{DATA_SECTION}.") or key in data_keys]
    return settings


def _last_value(assignments: Iterable[tuple[str, Any]], key: str, default: Any) -> Any:
    """The value the last assignment of ``key`` gives (``default`` when none does)."""
    value = default
    for name, assigned in assignments:
        if name == key:
            value = assigned
    return value


def _auto_or_count(key: str, value: str, example: int) -> str:
    """``key``'s value checked: ``"auto"`` or a whole number >= 1 (as text, e.g. ``"4"``)."""
    text = str(value).strip().lower()
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{key}={value!r} is not valid; give a whole number >= 1 (e.g. {key}={example}) or auto")
    return str(int(text))


def threads_setting(value: str) -> str:
    """``threads=``'s value checked: ``"auto"`` or a whole number >= 1 (as text, e.g. ``"4"``)."""
    return _auto_or_count("threads", value, 4)


def parallel_clients_setting(value: str, threads: str) -> str:
    """``parallel_clients=``'s value checked: ``"auto"`` or a whole number >= 1, at most a whole ``threads``
    (each client gets at least one thread of the run's)."""
    text = _auto_or_count("parallel_clients", value, 2)
    if text != "auto" and threads != "auto" and int(text) > int(threads):
        raise ConfigError(f"parallel_clients={int(text)} needs at least as many threads, but threads={threads}; "
                          f"set threads={int(text)} or parallel_clients={threads}")
    return text


def _default_of(section: str, name: str, dataset: str) -> Any:
    """The default value of ``section.name`` (an empty mapping when it has none)."""
    cls: type[Any] | None
    table = {entry.name: entry for entry in SECTIONS}
    if section in table:
        cls = table[section].options_for(dataset)
    else:
        cls = getattr(method_declarations().get(section), "options", None)
    if cls is None:
        raise _unknown(f"{section}.{name}", dataset)
    defaults = dataclasses.asdict(cls())
    if name not in defaults:
        raise _unknown(f"{section}.{name}", dataset)
    return defaults[name]


def _build(cls: type, values: dict[str, Any], prefix: str, dataset: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    for name in values:
        if name not in known:
            raise _unknown(prefix + name, dataset)
    return opt.build(cls, values, prefix)


def applied_data_options(config: Config) -> Any:
    """``config.data`` as a run applies it: ``data.standardize=auto`` resolved to the data set's ``auto``
    (``STANDARDIZE_AUTO`` on its options: ``none`` for image folders) or to ``federated``, or to ``client``
    under differential privacy (the shared scaling's feature sums carry no noise), and ``federated`` under
    privacy refused in one line (:func:`~fedhpro.data.standardize_options.resolved_standardize`). Other data
    options as they are."""
    data = config.data
    mode = getattr(data, "standardize", None)
    if mode not in ("auto", FEDERATED, FORMER_FEDERATED):
        return data
    resolved, _ = resolved_standardize(mode, is_private(config.privacy),
                                       auto=getattr(type(data), "STANDARDIZE_AUTO", FEDERATED))
    return dataclasses.replace(data, standardize=resolved)
