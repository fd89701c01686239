"""What every engine computes the same way in one round: a client's test count (:func:`test_client`), the
keys it adds to the round's row (:func:`round_extra`) and the round's wall times (:class:`RoundClock`)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fedhpro.engines.evaluation import TestCount
from fedhpro.methods import no_grad
from fedhpro.methods.base import load_weights
from fedhpro.methods.no_grad import eval_batch_size, no_grad_pass, no_grad_precision
from fedhpro.metrics import fairness_statistics


@torch.no_grad()
def count_correct(model: nn.Module, x: Tensor, y: Tensor, batch_size: int | None = None) -> int:
    """How many of ``x`` the model classifies as ``y`` (eval mode, batches of ``eval_batch_size``), computed in
    the current :func:`~fedhpro.methods.no_grad.no_grad_precision` (float32 unless one is entered)."""
    model.eval()
    batch_size = batch_size or eval_batch_size(x.device)
    correct = 0
    with no_grad_pass(x.device):
        for start in range(0, x.shape[0], batch_size):
            # through the module: a test's spy on no_grad.eval_forward sees these passes too
            logits = no_grad.eval_forward(model, x[start:start + batch_size])
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
