"""Optional measurements of a run as observers of its rounds.

The simulator trains; what a person may also want to know about that
training (its FLOPs, how far the prototypes are from the centralized ones,
TensorBoard curves, a t-SNE of the final features) is measured by observers
that it calls at fixed points of every round. An observer only looks: none
changes a weight, a random draw or the order of the training's operations,
so a run gives the same numbers with any observers or none.

One round, as the simulator calls its observers::

    on_round_start(round, evaluating)
    for each client asked:  with watch_client(k): fit ...   then, if its update counts: client_trained(k, model)
    with watch_server(): aggregate ...          (not entered when the round is skipped)
    training_measurements()                     -> keys of the metrics.jsonl row (FLOPs)
    [evaluated rounds] accuracy, then evaluation_measurements() -> more keys (prototype distances)
    on_round_end(record)                        (TensorBoard)

and the engine's ``end_run()`` calls ``on_run_end()`` once the summary is written
(t-SNE). The observers that measure (FLOPs, prototype distances) live here;
those that write files through :mod:`fedhpro.reports` (TensorBoard, t-SNE),
and :func:`fedhpro.measurements.observers_for`, which picks them from a run's
config in one place, live in :mod:`fedhpro.measurements`, so that the
engines import nothing above them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from fedhpro.errors import ConfigError
from fedhpro.methods.no_grad import extract_features
from fedhpro.metrics import FlopCounter, class_means, mean_client_prototypes, prototype_distance

if TYPE_CHECKING:
    from fedhpro.engines.interface import InProcessEngine
    from fedhpro.engines.protocol import RoundRecord


class RoundObserver:
    """Watches an engine's rounds (:class:`~fedhpro.engines.interface.InProcessEngine`); every hook does nothing
    unless overridden.

    ``attach`` is called once, by the engine's constructor, before any round:
    the place to refuse an engine the measurement cannot observe (a ConfigError).
    """

    simulator: InProcessEngine  # the engine watched (named for the in-process simulator, the first engine)
    #: whether :meth:`watch_client` may be entered for several clients at once, each on the thread that trains it
    #: (the simulator's ``parallel_clients``; :meth:`client_trained` still comes in client order, on the engine's
    #: thread, with the model the client trained). An observer that overrides either hook and leaves this False
    #: makes the simulator train one client at a time (with the same threads each, so the same numbers).
    concurrent_clients: bool = False

    def attach(self, simulator: InProcessEngine) -> None:
        self.simulator = simulator

    def on_round_start(self, round: int, evaluating: bool) -> None:
        """A round begins; ``evaluating``: it ends with an evaluation."""

    def watch_client(self, k: int) -> contextlib.AbstractContextManager[Any]:
        """A context wrapped around client ``k``'s ``fit`` (it must only observe the operations)."""
        return contextlib.nullcontext()

    def client_trained(self, k: int, model: nn.Module) -> None:
        """Client ``k``'s update was accepted; ``model`` holds the weights it trained."""

    def watch_server(self) -> contextlib.AbstractContextManager[Any]:
        """A context wrapped around the server's aggregation (entered only when the round is not skipped)."""
        return contextlib.nullcontext()

    def training_measurements(self) -> dict[str, Any]:
        """After the server step: keys added to the round's ``metrics.jsonl`` row (before the accuracy's)."""
        return {}

    def evaluation_measurements(self) -> dict[str, Any]:
        """At an evaluated round, after the accuracy: keys added to the round's row (after the accuracy's)."""
        return {}

    def on_round_end(self, record: RoundRecord) -> None:
        """The round's record is complete."""

    def on_run_end(self) -> None:
        """The run is over (its summary written)."""


@contextlib.contextmanager
def watching(contexts: Iterable[Callable[[], contextlib.AbstractContextManager[Any]]]):
    """Enter the context each of ``contexts`` makes (when this is entered, in order) around a block."""
    with contextlib.ExitStack() as stack:
        for make in contexts:
            stack.enter_context(make())
        yield


class FlopCount(RoundObserver):
    """``flops_train`` (every accepted client's ``fit``) and ``flops_server`` (the aggregation; 0 in a
    skipped round) of each round, counted with ``torch.utils.flop_counter``'s formulas (Table 4). Each client's
    count is its own (torch's dispatch modes are per thread), so clients may be watched side by side."""

    concurrent_clients = True

    def on_round_start(self, round: int, evaluating: bool) -> None:
        self.train = 0
        self._clients: dict[int, FlopCounter] = {}
        self._server: FlopCounter | None = None

    def watch_client(self, k: int) -> FlopCounter:
        self._clients[k] = counter = FlopCounter()
        return counter

    def client_trained(self, k: int, model: nn.Module) -> None:
        assert k in self._clients, "client_trained follows watch_client (the simulator's order)"
        self.train += self._clients.pop(k).total

    def watch_server(self) -> FlopCounter:
        self._server = FlopCounter()
        return self._server

    def training_measurements(self) -> dict[str, Any]:
        return {"flops_train": self.train, "flops_server": self._server.total if self._server is not None else 0}


class PrototypeDistance(RoundObserver):
    """``prototype_distance`` at each evaluated round (Figure 2): the L2 distance to the centralized
    prototypes (class means of all training data under the global model) of the server's prototypes,
    if the method has any, and of the unweighted mean of this round's clients' class means."""

    def attach(self, simulator: InProcessEngine) -> None:
        if simulator.shared != "all":
            raise ConfigError("prototype_distance=true needs one shared global model; it is undefined with "
                              "heterogeneous models or protocol=proto-only (set prototype_distance=false)")
        super().attach(simulator)

    def on_round_start(self, round: int, evaluating: bool) -> None:
        self.evaluating = evaluating
        self.local: list[tuple[Tensor, Tensor]] = []

    def client_trained(self, k: int, model: nn.Module) -> None:
        if self.evaluating:  # the client's class means under the model it trained
            data = self.simulator.federation.clients[k]
            self.local.append(class_means(extract_features(model, data.x), data.y,
                                          self.simulator.federation.num_classes))

    def evaluation_measurements(self) -> dict[str, Any]:
        return {"prototype_distance": self.distances()}

    def distances(self) -> dict[str, Any]:
        """Figure 2: distances to the centralized prototypes of the server's prototypes (if any) and
        of the unweighted mean (Eq. 4) of this round's clients' class means."""
        reference, reference_mask = self.simulator.centralized_prototypes()
        out: dict[str, Any] = {"centralized_norm": float(reference[reference_mask].norm(dim=1).mean())}
        held = self.simulator.server_prototypes()
        if held is not None:
            prototypes, mask, kind = held
            out["server"] = {"kind": kind, **prototype_distance(prototypes, mask, reference, reference_mask)}
        if self.local:
            stacked = torch.stack([p.cpu() for p, _ in self.local])
            present = torch.stack([m.cpu() for _, m in self.local])
            mean, mask = mean_client_prototypes(stacked, present)
            out["clients_mean"] = prototype_distance(mean, mask, reference, reference_mask)
        return out


def measurements(flops: bool = False, prototype_distance: bool = False) -> list[RoundObserver]:
    """The observers that add keys to ``metrics.jsonl``: FLOPs, then prototype distances (the row's key order)."""
    return ([FlopCount()] if flops else []) + ([PrototypeDistance()] if prototype_distance else [])
