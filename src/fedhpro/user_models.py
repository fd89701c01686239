"""Models and data given from Python: a ``model=`` callable (how ``config.yaml`` records it, how it is called
and checked for fedhpro's form) and a ``federation=`` (checked, recorded in the run's config)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fedhpro.config import (
    FEDERATION_KEY,
    PYTHON_PREFIX,
    Config,
    is_from_python,
)
from fedhpro.data.federation import Federation
from fedhpro.errors import ConfigError


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
