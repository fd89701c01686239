"""The in-process simulator: all clients in one process, data resident as tensors.

One round: sample the participants (seeded), broadcast the server's payload,
run each participant's ``fit`` on a reused working model, aggregate the
replies, evaluate the global model every ``eval_every`` rounds. Every random
draw comes from a generator derived from ``(seed, round, client)``, so the
same seed and config give the same numbers on the CPU, whatever ran before.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import copy
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from fedhpro import runtime
from fedhpro.data.federation import Federation
from fedhpro.engines.chain import Reception
from fedhpro.engines.client_tests import ClientTests, FineTune
from fedhpro.engines.fault_options import FaultOptions
from fedhpro.engines.interface import SIMULATOR, EngineKind
from fedhpro.engines.observers import RoundObserver, measurements, watching
from fedhpro.engines.one_round import RoundClock, round_extra
from fedhpro.engines.protocol import (
    INIT,
    SERVER,
    OpenRound,
    RoundProtocol,
    RoundRecord,
    client_step,
)
from fedhpro.errors import ConfigError, DataError, TrainingDiverged
from fedhpro.methods.base import MethodContext, MethodSpec, lends_weights
from fedhpro.methods.no_grad import extract_features
from fedhpro.methods.training import TrainSettings
from fedhpro.metrics import class_means
from fedhpro.robust.options import AggregationOptions
from fedhpro.seeds import derive_seed


def _seeded(factory: Callable[[], nn.Module], seed: int, device: torch.device) -> nn.Module:
    with torch.random.fork_rng(devices=[]):  # seed the initial weights without touching the caller's RNG
        torch.manual_seed(seed)
        return factory().to(device)


def load_in_place(model: nn.Module, weights: dict[str, Tensor]) -> None:
    """``model.load_state_dict(weights)`` (strict: the same keys) without its per-call bookkeeping: each
    entry copied into the model's own tensor, under ``no_grad``. The same bits; no tensor is allocated."""
    state = model.state_dict()
    if state.keys() != weights.keys():
        model.load_state_dict(weights)  # names the missing and unexpected keys
        return
    with torch.no_grad():
        for key, target in state.items():
            value = weights[key]
            if target.shape != value.shape:
                model.load_state_dict(weights)  # names the shape mismatch
                return
            target.copy_(value)


class ClientModels:
    """The models of a run: the global model and, with personal models, each client's own.

    One architecture (``shared="all"``): a global model and one working model
    that every client trains in turn (no per-client allocation). Personal
    models (``client_architectures``, or ``shared`` ``"classifier"``/``"none"``):
    client ``k``'s model starts from its own seeded initialisation and keeps
    its weights across rounds; the global model is client 0's initial model,
    of which only ``shared_keys`` travel.

    ``clients`` limits the personal models built to those clients (a Flower
    node builds its own, the server none); the initial weights do not depend
    on which are built.
    """

    def __init__(self, model_factory: Callable[[], nn.Module], *, num_clients: int, seed: int,
                 device: torch.device, client_architectures: Sequence[str] | None = None,
                 architecture_factory: Callable[[str], nn.Module] | None = None, shared: str | None = None,
                 clients: Sequence[int] | None = None):
        if shared is None:
            shared = "all" if client_architectures is None else "classifier"
        if shared not in ("all", "classifier", "none"):
            raise ValueError(f"shared must be all, classifier or none, got {shared!r}")
        if shared == "all" and client_architectures is not None:
            raise ConfigError("different client architectures cannot share all their weights")
        if shared != "all" and client_architectures is None:
            client_architectures = ["model"] * num_clients
            architecture_factory = lambda name: model_factory()  # noqa: E731
        self.shared = shared
        self.device = device
        architectures = list(client_architectures) if client_architectures is not None else None
        self.architectures = architectures
        self.shared_keys: list[str] | None = None
        if architectures is None:
            self.global_model = _seeded(model_factory, derive_seed(seed, INIT), device)
            self.working_model = copy.deepcopy(self.global_model)  # reused by every client
            self.eval_model = copy.deepcopy(self.global_model)
            return
        if len(architectures) != num_clients:
            raise ValueError(f"{len(architectures)} architectures for {num_clients} clients")
        if architecture_factory is None:
            raise ValueError("client_architectures needs an architecture_factory")
        self.working_models: dict[str, nn.Module] = {}
        self.client_weights: dict[int, dict[str, Tensor]] = {}
        for k in (range(num_clients) if clients is None else clients):
            name = architectures[k]
            model = _seeded(functools.partial(architecture_factory, name), derive_seed(seed, INIT, k), device)
            self.working_models.setdefault(name, model)
            self.client_weights[k] = {key: v.detach().clone() for key, v in model.state_dict().items()}
        if 0 in self.client_weights:  # client 0's initial model, as built above
            self.global_model = copy.deepcopy(self.working_models[architectures[0]])
            self.global_model.load_state_dict(self.client_weights[0])
        else:
            self.global_model = _seeded(functools.partial(architecture_factory, architectures[0]),
                                        derive_seed(seed, INIT, 0), device)
        self.shared_keys = ([key for key in self.global_model.state_dict() if key.startswith("classifier.")]
                            if shared == "classifier" else [])
        shapes = {name: [tuple(m.state_dict()[key].shape) for key in self.shared_keys]
                  for name, m in self.working_models.items()}
        shapes[architectures[0]] = [tuple(self.global_model.state_dict()[key].shape) for key in self.shared_keys]
        if len({tuple(v) for v in shapes.values()}) != 1:
            raise ConfigError(f"the client models' classifiers differ in shape {shapes}; "
                              "every architecture must produce the same feature_dim")

    @property
    def personal(self) -> bool:
        """Whether each client keeps a model of its own (heterogeneous or prototype-only)."""
        return self.architectures is not None

    def model_for(self, k: int, weights: dict[str, Tensor] | None = None, slot: int = 0) -> nn.Module:
        """The model client ``k`` trains or is tested with: the shared working model, or its own personal
        model (``weights``, else its stored ones) loaded into its architecture's working model. ``slot``: which
        set of working models (one per client trained at once; slot 0 is :attr:`working_model` /
        :attr:`working_models`, the others their copies, made on first use)."""
        if self.architectures is None:  # one shared working model (not personal)
            return self.working_model if slot == 0 else self._slot_models(slot)[""]
        name = self.architectures[k]
        model = self.working_models[name] if slot == 0 else self._slot_models(slot)[name]
        load_in_place(model, weights if weights is not None else self.client_weights[k])
        return model

    def prepare_slots(self, count: int) -> None:
        """Slots ``1 .. count - 1`` made now, while no client trains (a copy of a model in training would copy
        what training attaches to it: a per-sample-gradient hook, a half-done step)."""
        for slot in range(1, count):
            self._slot_models(slot)

    def _slot_models(self, slot: int) -> dict[str, nn.Module]:
        """Slot ``slot``'s working models by architecture (``""``: the one shared architecture), each a copy of
        slot 0's, made by :meth:`prepare_slots`: the same class and shapes; its weights are loaded before every
        use."""
        slots = self.__dict__.setdefault("_slots", {})
        if slot not in slots:
            originals = {"": self.working_model} if self.architectures is None else self.working_models
            slots[slot] = {name: copy.deepcopy(model) for name, model in originals.items()}
        return slots[slot]

    def keep(self, k: int, model: nn.Module) -> None:
        """Client ``k``'s personal model persists to its next round."""
        if self.personal:
            self.keep_state(k, self.snapshot(model))

    def snapshot(self, model: nn.Module) -> dict[str, Tensor]:
        """A copy of ``model``'s state, for :meth:`keep_state` after the model has been reused."""
        return {key: v.detach().clone() for key, v in model.state_dict().items()}

    def keep_state(self, k: int, state: dict[str, Tensor]) -> None:
        """Client ``k``'s personal model (a :meth:`snapshot`) persists to its next round."""
        if self.personal:
            self.client_weights[k] = state


def build_method(method: MethodSpec, options: Any, models: ClientModels, num_classes: int, train: TrainSettings,
                 seed: int, device: torch.device) -> tuple[Any, Any]:
    """``(server part, client part)`` of ``method`` for these models (the same on every engine)."""
    context = MethodContext(model=models.global_model, num_classes=num_classes, options=options, train=train,
                            seed=derive_seed(seed, SERVER), device=device, shared_keys=models.shared_keys)
    return method.server(context), method.client(context)


class Simulator:
    """Runs one method on one federation for a number of rounds."""

    kind: ClassVar[EngineKind] = SIMULATOR

    def __init__(self, method: MethodSpec, options: Any, federation: Federation,
                 model_factory: Callable[[], nn.Module], train: TrainSettings, *, rounds: int,
                 participation: float = 1.0, seed: int = 0, eval_every: int = 1,
                 device: torch.device | str = "cpu", client_architectures: Sequence[str] | None = None,
                 architecture_factory: Callable[[str], nn.Module] | None = None, shared: str | None = None,
                 faults: FaultOptions | None = None, min_clients: int = 1, on_drop: Callable[[str], None] | None = None,
                 count_flops: bool = False, prototype_distance: bool = False,
                 observers: Sequence[RoundObserver] = (), aggregation: AggregationOptions | None = None,
                 privacy: Any = None, ledger: Any = None, parallel_clients: int = 1,
                 client_threads: int | None = None, unseen_finetune: int = 0):
        """``client_architectures`` (one name per client, built by ``architecture_factory``) switches on
        heterogeneous feature extractors: each client keeps its own model across rounds and only the
        classifier (``classifier.*``) is exchanged and aggregated; evaluation then averages each
        client's model (its feature extractor with the global classifier) on its own test data.

        ``shared`` says which weights travel: ``"all"`` (default for one architecture), ``"classifier"``
        (default with ``client_architectures``) or ``"none"`` (prototype-only protocols: every client
        keeps its whole model, evaluated on its own test data).

        ``observers`` (:class:`~fedhpro.engines.observers.RoundObserver`) watch every round: opt-in
        measurements, each costing compute, none changing the training. ``count_flops`` and
        ``prototype_distance`` are short for the two that add keys to the round's record (in front
        of ``observers``): the FLOPs of every client's ``fit`` and of the server step, counted with
        ``torch.utils.flop_counter`` (Table 4), and, at each evaluated round, the L2 distance of the
        server's prototypes and of the mean of the clients' class means to the centralized
        prototypes, the class means of all training data under the global model (Figure 2).

        ``faults`` injects client faults and ``aggregation`` a robust rule before the method's own
        (:class:`~fedhpro.engines.protocol.RoundProtocol`); ``privacy`` (the ``privacy.*`` options) and
        ``ledger`` (its privacy ledger) switch differential privacy on: under ``privacy=client`` each
        client's reply is privatized on the client's side, right after its ``fit``.

        ``parallel_clients``: how many clients train at once (on the CPU), each on its own working model in a
        thread of its own with ``client_threads`` torch threads (None: the caller's count). The replies are
        handed to the round in the participants' order whatever order they finish in, and every random draw
        is the client's own, so the numbers depend on ``client_threads``, not on ``parallel_clients`` or on
        timing. Clients train one at a time (with the same ``client_threads``) on a GPU, with
        ``train.compile`` and under an observer that watches clients but is not
        :attr:`~fedhpro.engines.observers.RoundObserver.concurrent_clients`.

        ``unseen_finetune``: local epochs each unseen client (``federation.unseen``) fine-tunes a copy of the
        global model before the last round's test of it (0: the global model only)."""
        self.device = torch.device(device)
        if int(parallel_clients) < 1 or (client_threads is not None and int(client_threads) < 1):
            raise ValueError(f"parallel_clients and client_threads must be >= 1, got {parallel_clients}, "
                             f"{client_threads}")
        self.parallel_clients = int(parallel_clients)
        if client_threads is None and self.parallel_clients > 1:  # the caller's threads, shared out
            client_threads = max(1, torch.get_num_threads() // self.parallel_clients)
        self.client_threads = None if client_threads is None else int(client_threads)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.train = train
        self.models = ClientModels(model_factory, num_clients=federation.num_clients, seed=seed, device=self.device,
                                   client_architectures=client_architectures,
                                   architecture_factory=architecture_factory, shared=shared)
        self.shared = self.models.shared
        self.method = method
        self.federation = federation
        self.server, self.client = build_method(method, options, self.models, federation.num_classes, train, seed,
                                                self.device)
        self.protocol = RoundProtocol(self.server, federation.num_clients, rounds=rounds, participation=participation,
                                      seed=seed, eval_every=eval_every, faults=faults, min_clients=min_clients,
                                      on_drop=on_drop, aggregation=aggregation, privacy=privacy, ledger=ledger,
                                      client_sizes=[len(data) for data in federation.clients],
                                      dp_clipping=method.dp_clipping)
        self.tests = ClientTests(federation, self.models, self.server, self.protocol, train.amp,
                                 finetune=FineTune(train, unseen_finetune, seed))
        self.client_states: list[dict[str, Any]] = [{} for _ in range(federation.num_clients)]
        self.history: list[RoundRecord] = []
        self.observers = measurements(flops=count_flops, prototype_distance=prototype_distance) + list(observers)
        for observer in self.observers:
            observer.attach(self)

    # the run's settings, as the protocol holds them
    rounds = property(lambda self: self.protocol.rounds)
    seed = property(lambda self: self.protocol.seed)
    eval_every = property(lambda self: self.protocol.eval_every)
    participation = property(lambda self: self.protocol.participation)
    faults = property(lambda self: self.protocol.faults)
    min_clients = property(lambda self: self.protocol.min_clients)

    @property
    def heterogeneous(self) -> bool:
        """Whether each client keeps a model of its own (heterogeneous or prototype-only)."""
        return self.models.personal

    @property
    def client_names(self) -> list[str] | None:
        """The clients' names (their folders), None for partitions of a named data set."""
        return self.federation.client_names

    @property
    def client_architectures(self) -> list[str] | None:
        return self.models.architectures

    @property
    def working_model(self) -> nn.Module:
        return self.models.working_model

    @property
    def eval_model(self) -> nn.Module:
        return self.models.eval_model

    @property
    def working_models(self) -> dict[str, nn.Module]:
        return self.models.working_models

    @property
    def client_weights(self) -> list[dict[str, Tensor]]:
        return [self.models.client_weights[k] for k in range(self.federation.num_clients)]

    def sample_clients(self, round: int) -> list[int]:
        """The participants of ``round``: a seeded draw without replacement, sorted."""
        return self.protocol.sample_clients(round)

    def evaluate_global(self) -> dict[str, float]:
        """Test accuracy (%) per test set and AVG: the global model, or (heterogeneous) each client's
        model with the global classifier on its own test data, pooled per domain and over domains."""
        return self.evaluate_clients()[0]

    # the clients' tests (engines.client_tests), as this engine's
    client_test = property(lambda self: self.tests.client_test)
    pooled_test_sizes = property(lambda self: self.tests.pooled_test_sizes)
    evaluate_client = property(lambda self: self.tests.evaluate_client)
    evaluate_clients = property(lambda self: self.tests.evaluate_clients)

    def server_prototypes(self) -> tuple[Tensor, Tensor, str] | None:
        """The server's global prototypes ``(C x d, mask C, kind)``: ``kind`` is ``"hyper"`` for the
        averaged hyper-prototypes H (FedHPro, ``prototypes=hyper``) and ``"global"`` for a method's own
        (FedProto's P, FedSA's anchors); None for a method without any (FedAvg). What the method
        exposes (:meth:`~fedhpro.methods.base.Server.exposed_prototypes`)."""
        return self.server.exposed_prototypes()

    def centralized_prototypes(self) -> tuple[Tensor, Tensor]:
        """Class means of all clients' training features under the global model (Figure 2's reference)."""
        self.eval_model.load_state_dict(self.server.global_weights())
        num_classes = self.federation.num_classes
        sums, counts = None, torch.zeros(num_classes, dtype=torch.float64)
        for data in self.federation.clients:
            means, _ = class_means(extract_features(self.eval_model, data.x), data.y, num_classes)
            n = torch.bincount(data.y.cpu(), minlength=num_classes)[:num_classes].double()
            part = means.double().cpu() * n.unsqueeze(1)
            sums = part if sums is None else sums + part
            counts += n
        if sums is None:
            raise DataError("centralized prototypes need a federation with at least one client")
        return (sums / counts.clamp(min=1).unsqueeze(1)).float(), counts > 0

    @torch.no_grad()
    def test_features(self, per_test_set: int = 300) -> tuple[Tensor, Tensor, list[str]]:
        """``(features N x d, labels N, test-set name of each row)``: the global model's features of
        the first ``per_test_set`` samples of every test set (t-SNE of Figures 3 and 6)."""
        if self.shared != "all":
            raise ConfigError("test features need one shared global model; not available with heterogeneous "
                              "models or protocol=proto-only")
        self.eval_model.load_state_dict(self.server.global_weights())
        features, labels, names = [], [], []
        for name, (x, y) in self.federation.test_sets.items():
            features.append(extract_features(self.eval_model, x[:per_test_set]).cpu())
            labels.append(y[:per_test_set].cpu())
            names += [name] * int(labels[-1].shape[0])
        return torch.cat(features), torch.cat(labels), names

    def run_round(self, round: int) -> RoundRecord:
        """Round ``round``: the participants' ``fit``, the server step, the evaluation (every
        ``eval_every`` rounds and the last), each seen by the observers; its record is also kept
        in :attr:`history`."""
        current = self.protocol.open(round)
        clock = RoundClock(current.started)
        evaluating = self.protocol.evaluates(round)
        for observer in self.observers:
            observer.on_round_start(round, evaluating)
        self._fit_clients(current)
        clock.lap("clients")
        server_metrics = current.close(watching([o.watch_server for o in self.observers]) if self.observers else None)
        clock.lap("server")
        accuracy, per_client, validation = None, None, None
        measured: dict[str, Any] = {}
        evaluated: dict[str, Any] = {}
        for observer in self.observers:
            measured.update(observer.training_measurements())
        if evaluating:
            accuracy, per_client = self.evaluate_clients()
            validation = self.tests.evaluate_validation() if self.tests.validates else None
            unseen = self.tests.evaluate_unseen(last=round + 1 == self.protocol.rounds)
            for observer in self.observers:
                evaluated.update(observer.evaluation_measurements())
        extra = round_extra(measured, per_client, evaluated, validation=validation)
        if evaluating:
            extra.update(unseen)
        clock.lap("eval")
        record = current.record(server_metrics, accuracy, clock.seconds, extra)
        self.history.append(record)
        for observer in self.observers:
            observer.on_round_end(record)
        return record

    def side_by_side(self, clients: int) -> int:
        """How many of a round's ``clients`` train at once: ``parallel_clients`` where the clients can (see
        :meth:`__init__`), else 1."""
        watching_clients = any((_overrides(o, "watch_client") or _overrides(o, "client_trained"))
                               and not o.concurrent_clients for o in self.observers)
        if self.device.type != "cpu" or self.train.compile or watching_clients:
            return 1
        return max(1, min(self.parallel_clients, clients))

    def _fit_clients(self, current: OpenRound) -> None:
        """Every participant's ``fit`` in ``current``, its reply handed to the round in the participants' order."""
        clients = list(current.to_ask)
        workers = self.side_by_side(len(clients))
        if workers > 1:
            self._fit_side_by_side(current, clients, workers)
            return
        views = lends_weights(self.client)
        with runtime.intra_op_threads(self.client_threads):
            for k in clients:
                self._settle(current, self._train_client(current, k, 0, views), borrowed=views)

    def _fit_side_by_side(self, current: OpenRound, clients: list[int], workers: int) -> None:
        """The clients' ``fit`` on ``workers`` threads, each with a slot of working models of its own.

        A slot is handed the next client once its reply has been received (the reply's weights may be the
        slot's own tensors). A client that finishes before one ahead of it in the order has its reply copied
        and its slot freed at once (at most ``4 * workers`` such copies wait), unless an observer needs the
        trained model itself. The engine's thread only receives, with one torch thread meanwhile."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.parallel_clients,
                                                               thread_name_prefix="fedhpro-client")
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        self.models.prepare_slots(workers)
        views = lends_weights(self.client)
        flush = runtime.denormals_flushed()  # per thread (the CPU's control register): each worker as this one
        copies_allowed = not any(_overrides(o, "client_trained") for o in self.observers)
        free = list(range(workers - 1, -1, -1))  # slot 0 first
        waiting = collections.deque(clients)
        running: collections.deque[_Running] = collections.deque()
        try:
            with runtime.intra_op_threads(1):
                while waiting or running:
                    while free and waiting:
                        slot, k = free.pop(), waiting.popleft()
                        context = contextvars.copy_context()  # the caller's context variables, one copy a task
                        future = self._pool.submit(context.run, self._train_client, current, k, slot, views, flush)
                        running.append(_Running(k, slot, future))
                    ahead, *behind = running
                    watched = [ahead.future] + [task.future for task in behind
                                                if copies_allowed and not task.copied and not task.future.done()]
                    concurrent.futures.wait(watched, return_when=concurrent.futures.FIRST_COMPLETED)
                    while running and running[0].future.done():
                        task = running.popleft()
                        self._settle(current, task.future.result(), borrowed=views and not task.copied)
                        if not task.copied:
                            free.append(task.slot)
                    copied = sum(task.copied for task in running)
                    for task in list(running)[1:]:
                        if not copies_allowed or copied >= 4 * workers:
                            break
                        if not task.copied and task.future.done():
                            task.future.result().copy_reply(self.models)
                            task.copied = True
                            copied += 1
                            free.append(task.slot)
        except BaseException:
            for task in running:
                task.future.cancel()
            raise

    def _train_client(self, current: OpenRound, k: int, slot: int, views: bool,
                      flush_denormal: bool | None = None) -> _Trained:
        """Client ``k``'s ``fit`` in ``current`` on slot ``slot``'s working model, watched by the observers,
        on the calling thread with :attr:`client_threads` threads and, if given, denormals flushed or not as
        ``flush_denormal`` says (both are the thread's own: a worker thread is set as the engine's). ``views``:
        the reply's weights are the working model's own tensors (:func:`~fedhpro.methods.base.lends_weights`):
        received, so folded into the round's sum or copied, before the model changes."""
        if self.client_threads is not None and torch.get_num_threads() != self.client_threads:
            torch.set_num_threads(self.client_threads)  # this thread's own count (OpenMP's is per thread)
        if flush_denormal is not None and runtime.denormals_flushed() != flush_denormal:
            torch.set_flush_denormal(flush_denormal)
        model = self.models.model_for(k, slot=slot)
        state_before = copy.deepcopy(self.client_states[k]) if self.client_states[k] else {}
        observe = (watching([functools.partial(o.watch_client, k) for o in self.observers])  # they only observe
                   if self.observers else contextlib.nullcontext())
        try:
            with observe:
                reply, metrics = client_step(self.server, self.client, model, current.payload,
                                             self.federation.clients[k], self.client_states[k], self.seed,
                                             current.round, k, self.protocol.client_privacy, reply_views=views)
        except (KeyboardInterrupt, SystemExit, MemoryError):
            raise
        except Exception as error:  # a crashing client is a dropped client
            return _Trained(k, None, {}, state_before, None, error)
        return _Trained(k, reply, metrics, state_before, model, None)

    def _settle(self, current: OpenRound, trained: _Trained, borrowed: bool) -> None:
        """The fate of client ``trained.k``'s ``fit``: a client that raised is dropped; an accepted reply keeps
        its personal model and is shown to the observers; the client's own invalid update rolls its state back.
        ``borrowed``: the reply's weights are still the working model's tensors."""
        k = trained.k
        if isinstance(trained.error, TrainingDiverged):  # the run's lr or cap, not the client: the run stops
            raise trained.error.at(k, current.round + 1) from None
        if trained.error is not None:
            self.client_states[k] = trained.state_before
            current.fail(k, f"raised {type(trained.error).__name__}: {trained.error}", trained.error)
            return
        assert trained.reply is not None
        reception = current.receive(k, trained.reply, trained.metrics, len(self.federation.clients[k]),
                                    borrowed=borrowed)
        if not reception:
            # the client's own invalid update rolls its state back, as a raise does (else a MOON client's
            # NaN previous model would spoil all its later rounds); a transmission fault (faults.corrupt)
            # spoiled a good update after the client computed it, so the client keeps its new state
            if reception is Reception.INVALID:
                self.client_states[k] = trained.state_before
            return
        if trained.model is None:  # its slot was freed early: the copy of its personal model
            if trained.kept is not None:
                self.models.keep_state(k, trained.kept)
            return
        self.models.keep(k, trained.model)  # a personal model persists to the client's next round
        for observer in self.observers:
            observer.client_trained(k, trained.model)

    def close(self) -> None:
        """Stops the threads that train clients side by side (the next round starts new ones)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def end_run(self) -> None:
        """The run is over: the client threads stop, the observers finish (t-SNE drawn, TensorBoard closed)."""
        self.close()
        for observer in self.observers:
            observer.on_run_end()

    def state_dict(self) -> dict[str, Any]:
        """Everything a later round depends on (all randomness is derived from seed, round and client)."""
        state = {"server": self.server.state_dict(), "client_states": self.client_states}
        if self.heterogeneous:
            state["client_weights"] = self.client_weights
        protocol = self.protocol.state_dict()
        if protocol:  # adaptive clipping's clip; absent otherwise (those checkpoints keep their bytes)
            state["protocol"] = protocol
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.protocol.load_state_dict(state.get("protocol") or {})
        self.server.load_state_dict(state["server"])
        self.client_states = [dict(s) for s in state["client_states"]]
        if self.heterogeneous:
            self.models.client_weights = {k: dict(w) for k, w in enumerate(state["client_weights"])}


def _overrides(observer: RoundObserver, hook: str) -> bool:
    """Whether ``observer``'s class overrides :class:`RoundObserver`'s ``hook``."""
    return getattr(type(observer), hook) is not getattr(RoundObserver, hook)


@dataclass
class _Trained:
    """One client's ``fit`` as it came back: its reply and metrics, or the error it raised; its state before;
    the working model it trained (None once the reply was copied and the slot freed: then ``kept`` holds a
    copy of its personal model, if it has one)."""

    k: int
    reply: dict[str, Any] | None
    metrics: dict[str, float]
    state_before: dict[str, Any]
    model: nn.Module | None
    error: Exception | None
    kept: dict[str, Tensor] | None = None

    def copy_reply(self, models: ClientModels) -> None:
        """Make the reply independent of the working model, which another client trains next: its weights
        copied, and the personal model's state."""
        if self.reply is not None and self.model is not None:
            weights = self.reply.get("weights")
            if isinstance(weights, dict):
                self.reply = {**self.reply, "weights": {key: value.detach().clone() if isinstance(value, Tensor)
                                                        else value for key, value in weights.items()}}
            if models.personal:
                self.kept = models.snapshot(self.model)
        self.model = None


@dataclass
class _Running:
    """A client being trained on a slot; ``copied``: its reply was copied and the slot freed."""

    k: int
    slot: int
    future: concurrent.futures.Future[_Trained]
    copied: bool = False
