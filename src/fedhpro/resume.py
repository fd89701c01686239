"""Resuming a run (``resume=DIR``): its saved config, what a resumed run may change (how it runs, not what it
computes), the Python objects it needs again, its newest checkpoint."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from fedhpro.config import (
    PYTHON_PREFIX,
    RESUMABLE_KEYS,
    Config,
    is_from_python,
    load_config,
    read_yaml,
    setting_value,
)
from fedhpro.data.federation import Federation
from fedhpro.engines import checkpoint
from fedhpro.engines.lifecycle import check_new_run_folder
from fedhpro.errors import ConfigError
from fedhpro.user_models import python_name, with_python_objects

#: settings a resumed run may change (how it runs, not what it computes)
#: the run keys a resumed run may change: those tagged "resumable" in RunOptions
_RESUME_SETTINGS = RESUMABLE_KEYS


def _changed_on_resume(stored: Mapping[str, Any], given: Mapping[str, Any], saved: Config) -> list[str]:
    """The keys of ``given`` (bar :data:`_RESUME_SETTINGS`) that would change the saved config ``stored``, whose
    resolved form is ``saved`` (with resumable keys of the resume line only, which no other key depends on).

    Each key is resolved against the saved config, as the run would read it
    (``tau=0.1`` and ``tau=1e-1`` are the same value), and compared with the
    saved value; a key the saved run cannot take (a data set's knob after a
    ``dataset=`` change) counts as changed.
    """
    keys = {key: value for key, value in given.items() if key not in _RESUME_SETTINGS}
    if not keys:  # the usual resume: nothing more to load
        return []
    try:  # all at once: nothing changed costs one load; else each key on its own, to name it
        together = load_config(stored, keys)
        if all(setting_value(together, key) == setting_value(saved, key) for key in keys):
            return []
    except ConfigError:
        pass
    changed = []
    for key, value in keys.items():
        try:
            changes = setting_value(load_config(stored, {key: value}), key) != setting_value(saved, key)
        except ConfigError:
            changes = True
        if changes:
            changed.append(key)
    return sorted(changed)


def claimed_config(config: Config, folder: Path | None, federation: Federation | None = None,
                   model_factory: Callable[..., torch.nn.Module] | None = None) -> tuple[Config, Path | None]:
    """The config a run goes on with once its ``folder`` is claimed (every engine's last step of resolving
    it, before the folder is opened): with ``resume=``, the saved config of the run there (the keys the user
    set, :meth:`~fedhpro.config.Config.set_keys`, checked against it: :func:`_resume_config`) and its newest
    checkpoint; a new run's config
    recording the Python objects it was given (:func:`~fedhpro.user_models.with_python_objects`), its
    ``folder`` checked to hold no other run's files (one line, before any data are built), and None."""
    if config.run.resume:
        return _resume_config(config, federation, model_factory)
    config = with_python_objects(config, federation, model_factory)
    if folder is not None:
        check_new_run_folder(folder)
    return config, None


def _resume_config(config: Config, federation: Federation | None = None,
                   model_factory: Callable[..., torch.nn.Module] | None = None) -> tuple[Config, Path]:
    """The saved config of the run to resume (with the allowed settings of ``config``) and its newest checkpoint.

    The keys the user set (:meth:`~fedhpro.config.Config.set_keys`) are checked
    against the saved config: any of them that differs from it, other than
    :data:`_RESUME_SETTINGS`, is refused (the resumed run would silently use
    the saved value instead).

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
    given = config.set_keys()
    # the saved run's own values of the resumable keys, except those set again on the resume line: a key left
    # unset there (tensorboard, progress, parallel_clients, ...) keeps what the run had, not the default
    keep = {name: getattr(config.run, name) for name in _RESUME_SETTINGS if name in given or name == "resume"}
    resumed = load_config(stored, keep)  # the saved config, loaded once: what the checks compare with, and the run's
    changed = _changed_on_resume(stored, given, resumed)
    if changed:
        raise ConfigError(f"resume takes its settings from {saved}; remove {', '.join(changed)} "
                          f"(only {', '.join(sorted(_RESUME_SETTINGS - {'resume'}))} may change)")
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
