"""Resuming a run (``resume=DIR``): its saved config, what a resumed run may change (how it runs, not what it
computes), the Python objects it needs again, its newest checkpoint."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from fedhpro.config import (
    FEDERATION_KEY,
    PYTHON_PREFIX,
    RESUMABLE_KEYS,
    Config,
    flatten_keys,
    is_from_python,
    load_config,
    read_yaml,
)
from fedhpro.data.federation import Federation
from fedhpro.engines import checkpoint
from fedhpro.engines.driver import check_new_run_folder
from fedhpro.errors import ConfigError
from fedhpro.user_models import python_name, with_python_objects

#: settings a resumed run may change (how it runs, not what it computes)
#: the run keys a resumed run may change: those tagged "resumable" in RunOptions
_RESUME_SETTINGS = RESUMABLE_KEYS


def given_settings(source: str | os.PathLike | Mapping[str, Any] | None,
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
    return [f.name for f in dataclasses.fields(config.run)] + [
        f"{name}.{f.name}" for name, options in config.sections().items() for f in dataclasses.fields(options)]


def _setting(config: Config, key: str) -> Any:
    """The value of ``key`` (``rounds``, ``fedhpro.tau``, ``data.clients_per_domain.mnist``) in ``config``;
    an entry of a mapping is compared as the whole mapping."""
    section, _, rest = key.partition(".")
    if not rest:
        return config.federation if key == FEDERATION_KEY else getattr(config.run, key)
    return getattr(config.sections()[section], rest.partition(".")[0])


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


def claimed_config(config: Config, folder: Path | None, given: Mapping[str, Any] | None = None,
                   federation: Federation | None = None,
                   model_factory: Callable[..., torch.nn.Module] | None = None) -> tuple[Config, Path | None]:
    """The config a run goes on with once its ``folder`` is claimed (every engine's last step of resolving
    it, before the folder is opened): with ``resume=``, the saved config of the run there (the user's
    ``given`` keys checked against it, :func:`_resume_config`) and its newest checkpoint; a new run's config
    recording the Python objects it was given (:func:`~fedhpro.user_models.with_python_objects`), its
    ``folder`` checked to hold no other run's files (one line, before any data are built), and None."""
    if config.run.resume:
        return _resume_config(config, federation, model_factory, given)
    config = with_python_objects(config, federation, model_factory)
    if folder is not None:
        check_new_run_folder(folder)
    return config, None


def _resume_config(config: Config, federation: Federation | None = None,
                   model_factory: Callable[..., torch.nn.Module] | None = None,
                   given: Mapping[str, Any] | None = None) -> tuple[Config, Path]:
    """The saved config of the run to resume (with the allowed settings of ``config``) and its newest checkpoint.

    ``given``: the keys the user set and their values (:func:`given_settings`;
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
    given = _settings_off_defaults(config) if given is None else given
    changed = _changed_on_resume(stored, given)
    if changed:
        raise ConfigError(f"resume takes its settings from {saved}; remove {', '.join(changed)} "
                          f"(only {', '.join(sorted(_RESUME_SETTINGS - {'resume'}))} may change)")
    # the saved run's own values of the resumable keys, except those set again on the resume line: a key left
    # unset there (tensorboard, progress, parallel_clients, ...) keeps what the run had, not the default
    keep = {name: getattr(config.run, name) for name in _RESUME_SETTINGS if name in given or name == "resume"}
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
