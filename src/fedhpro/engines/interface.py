"""What an engine is, for the run around its rounds (:mod:`fedhpro.engines.lifecycle`): the :class:`Engine`
protocol, the :class:`InProcessEngine` that holds the whole federation (what the observers use), and the
:class:`EngineKind` a run's checkpoints and summary name. The kinds are told apart by their attributes, never by
comparing names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from fedhpro.engines.protocol import RoundProtocol, RoundRecord

if TYPE_CHECKING:
    from fedhpro.data.federation import Federation


@dataclass(frozen=True)
class EngineKind:
    """A kind of engine as a run's files record it: ``name`` (in each checkpoint's state and, for an engine
    whose clients train outside this process, in summary.json's ``engine``), ``in_process`` (the clients train
    in this process, ``parallel_clients`` side by side) and ``resume_hint``, the line that says how to resume a
    run whose checkpoint this kind wrote (``{where}``, ``{out}`` filled in)."""

    name: str
    in_process: bool
    resume_hint: str


#: the in-process simulator (``fedhpro run``, :func:`fedhpro.run`, ``fedhpro tune``)
SIMULATOR = EngineKind("simulator", in_process=True,
                       resume_hint="{where}: its checkpoint was written by fedhpro run (the in-process simulator); "
                                   "resume it with fedhpro run resume=...")
#: the Flower ServerApp driving SuperNodes
FLOWER = EngineKind("flower", in_process=False,
                    resume_hint="{where}: its checkpoint was written by the Flower ServerApp; resume it on Flower "
                                "(flwr run ... --run-config 'resume=\"{out}\"')")
#: every kind by the name its files carry
ENGINE_KINDS = {kind.name: kind for kind in (SIMULATOR, FLOWER)}


def kind_named(name: Any) -> EngineKind:
    """The kind of engine whose ``name`` a checkpoint's state carries; the simulator for a checkpoint that names
    none (written before engines were named) or an unknown one."""
    return ENGINE_KINDS.get(name, SIMULATOR) if isinstance(name, str) else SIMULATOR


class Engine(Protocol):
    """What :func:`~fedhpro.engines.lifecycle.execute`, the run around the rounds, needs of an engine: its round
    protocol, its method's server part, its clients' models and device, one round at a time, its state
    (checkpoints) and its end. The in-process simulator and the Flower ServerApp
    (:class:`fedhpro.flower.strategy.FlowerEngine`) are engines; so is ``tests/sequential_engine.py``."""

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
