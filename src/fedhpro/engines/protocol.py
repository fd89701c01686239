"""The round protocol, written once for every engine.

Which clients take part in a round (a seeded draw), which injected faults
they suffer, which replies count (the method's validation), whether the round
counts (``min_clients``), what is measured (bytes and parameters sent, n_k-
weighted training metrics) and how evaluation results pool into per-domain
accuracy and AVG. An engine only moves messages: the in-process simulator
calls the method's ``fit`` directly, the Flower ServerApp sends a message to a
node and hands the reply back here. Both therefore compute the same numbers.

One round, as an engine drives it::

    current = protocol.open(round)          # participants, payload, fault draws
    for k in current.to_ask:                # clients the fault model lets answer
        ... run or ask client k ...
        current.receive(k, reply, metrics, n_k)   # or current.fail(k, reason)
    server_metrics = current.close()        # drops reported, aggregate or skip
    record = current.record(accuracy, seconds, extra)

Every random draw comes from a generator derived from ``(seed, stream, round,
client)`` (:func:`derive_seed`), so the same seed and config give the same
numbers whatever ran before and on whichever engine.

A round is a chain of steps (:mod:`fedhpro.engines.chain`): the protocol composes
one :class:`~fedhpro.engines.chain.RoundChain` per run from the run's options
(:class:`~fedhpro.engines.fault_options.FaultOptions`, :class:`~fedhpro.robust.options.AggregationOptions`,
the privacy options), a list of links the caller may extend (``steps=``, or
``protocol.round_chain.links`` / ``.wrappers``), and each round opens it: every
reply goes through the same per-reply steps in
order, and the accepted ones into one fold, which hands the method what it
aggregates at close. Without privacy::

    LayoutChecks -> SizeChecks -> InjectedFaults -> MethodChecks -> Measured
      [-> RowBound] -> WeightCap -> TrainingMetrics [-> BoundedFold] -> PlainFold | RobustFold(rule)

* :mod:`fedhpro.engines.replies`: the reply's keys must be exactly those the
  method's ``Server.reply_layout()`` declares (an undeclared or missing key is
  refused, on every engine, as the Flower server refuses it before decoding),
  ``num_examples`` and ``class_counts`` must be what the client can hold, the method's own checks, the bytes measured,
  ``aggregation.max_row_norm`` and the weight cap (``aggregation.max_share`` /
  ``max_ratio``);
* :mod:`fedhpro.engines.content`: ``aggregation.update_bound`` (by default on
  where the nodes hold their own data): the accepted replies held until
  close, each one's pull ``n_k ||Delta_k||`` and each class row's scaled to
  at most ``aggregation.update_multiple`` x the round's median, then handed
  to the fold;
* :mod:`fedhpro.engines.faults`: the seeded fault draws and what a hostile
  (``faults.scale``, ``faults.sign_flip``: ``w_global + factor * Delta`` and
  the class tensors times the factor) or corrupted reply is;
* :mod:`fedhpro.engines.robust`: with a robust rule (``aggregation=median|
  trimmed-mean|norm-clip|krum``, any rule of :data:`fedhpro.robust.REGISTRY`)
  the round keeps the accepted replies whole until close, makes them robust
  and hands them to the method's own ``aggregate``, unchanged: the method's
  mean of equal robust values is that value, so every method aggregates
  robustly without knowing;
* :mod:`fedhpro.engines.sampling` and :mod:`fedhpro.engines.private`: the run's
  privacy as objects the protocol holds (:attr:`RoundProtocol.round_privacy`,
  chosen once by :func:`~fedhpro.engines.private.round_privacy`): who takes part
  (:attr:`RoundProtocol.sampling`: a fixed-size draw, a Poisson draw, or a secret
  one), the :attr:`RoundProtocol.accountant` (epsilon after each round, the
  budget stop) and what privacy does to the replies; client-level differential
  privacy (``privacy=client``, :mod:`fedhpro.privacy`) is a chain of its own steps:
  each reply arrives privatized (the engine ran
  :func:`~fedhpro.privacy.client.privatize_upload` on the client's side), the
  same fault and method checks run on it, the privacy's checks follow, and
  the accepted uploads are folded into a
  :class:`~fedhpro.privacy.client.PrivateSum` released with noise at close as
  ONE reply (:func:`~fedhpro.privacy.client.private_reply`). The participants
  are then a Poisson draw (each client with probability ``participation``,
  from the SAMPLE stream: the accountant's sampling rate is the real one; with
  ``privacy.secure_noise`` from the operating system's randomness, since
  amplification by sampling assumes nobody who sees the model knows who took
  part, and ``metrics.jsonl`` then holds only how many did unless
  ``privacy.publish_participants`` asks for their ids). The clients' training
  metrics are not collected then, a round is never skipped for too few
  replies (that count is not released), and every round's row carries
  ``privacy: {epsilon, delta}`` from the run's ledger;
* :mod:`fedhpro.engines.evaluation`: the n_k-weighted training metrics and
  the pooled accuracy.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedhpro.engines.chain import Fold, Incoming, PlainFold, Reception, ReplyStep, RoundChain, RoundState
from fedhpro.engines.class_rows import declared_class_keys
from fedhpro.engines.content import BoundedFold
from fedhpro.engines.evaluation import TestCount, pool_accuracy, weighted_mean
from fedhpro.engines.fault_options import FaultOptions
from fedhpro.engines.faults import InjectedFaults, draw_faults
from fedhpro.engines.private import Accountant, RoundPrivacy, round_privacy
from fedhpro.engines.replies import (
    LayoutChecks,
    Measured,
    MethodChecks,
    RowBound,
    SizeChecks,
    TrainingMetrics,
    WeightCap,
    check_bounds,
)
from fedhpro.engines.replies import weight_cap as claims_cap
from fedhpro.engines.robust import RobustFold
from fedhpro.engines.sampling import SAMPLE, Sampling, round_half_up
from fedhpro.errors import FedHProError
from fedhpro.metrics import payload_bytes, payload_parameters
from fedhpro.privacy.client import ClientPrivacy, privatize_upload, upload_noise_generator
from fedhpro.robust import aggregation_options_class, rule_for
from fedhpro.robust.options import AggregationOptions
from fedhpro.seeds import derive_seed

# stream tags: each kind of randomness gets its own stream (SAMPLE = 2: fedhpro.engines.sampling; FAULT = 5:
# fedhpro.engines.faults)
INIT, TRAIN, SERVER = 1, 3, 4
# (6 and 7, the privacy noise's streams, are fedhpro.privacy.client's PRIVACY and CENTRAL_NOISE)


def train_generator(seed: int, round: int, client: int) -> torch.Generator:
    """Client ``client``'s batch-order generator in ``round`` (the same on every engine)."""
    return torch.Generator().manual_seed(derive_seed(seed, TRAIN, round, client))


def client_step(server: Any, client: Any, model: torch.nn.Module, payload: Mapping[str, Any], data: Any,
                state: dict[str, Any], seed: int, round: int, k: int,
                privacy: ClientPrivacy | None, reply_views: bool = False) -> tuple[dict[str, Any], dict[str, float]]:
    """Client ``k``'s step in ``round`` on every engine: the method's ``fit`` (the shared training loop, batches
    in the ``(seed, round, k)`` order of :func:`train_generator`), then, under ``privacy=client``, its upload
    privatized on the client's side (:func:`~fedhpro.privacy.client.privatize_upload`: clipped, and noised
    from the client's own stream under ``privacy.noise=local``). Returns ``(reply, training metrics)``; the
    metrics of a privatized step stay with the client (computed from its data, they would leave unprotected).
    ``reply_views``: the reply's weights are the model's own tensors, not copies (``fit``'s ``reply_views``; only
    for a client whose ``fit`` is the library's own, :func:`~fedhpro.methods.base.lends_weights`), for an engine
    that hands the reply to :meth:`OpenRound.receive` with ``borrowed=True`` before the model changes again."""
    generator = train_generator(seed, round, k)
    if reply_views:
        reply, metrics = client.fit(model, payload, data, state, generator, reply_views=True)
    else:
        reply, metrics = client.fit(model, payload, data, state, generator)
    if privacy is None:
        return reply, metrics
    return privatize_upload(reply, payload.get("weights") or {}, declared_class_keys(server), privacy,
                            upload_noise_generator(privacy, seed, round, k), int(server.num_classes)), {}


@dataclass
class RoundRecord:
    """Everything measured in one round (one line of ``metrics.jsonl``)."""

    round: int
    #: who took part, in client order; None where the row must not say (privacy=client without
    #: privacy.publish_participants: the row then holds ``num_participants``)
    participants: list[int] | None
    train: dict[str, float]
    server: dict[str, float]
    accuracy: dict[str, float] | None
    bytes_up: int
    bytes_down: int
    seconds: dict[str, float]
    dropped: list[dict[str, Any]] = field(default_factory=list)
    skipped: bool = False
    #: further deterministic measurements (parameters sent, per-client accuracy and fairness,
    #: FLOPs, prototype distances), written as top-level keys of the ``metrics.jsonl`` row
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The deterministic part (same seed, same numbers): a line of ``metrics.jsonl``."""
        out: dict[str, Any] = {"round": self.round}
        if self.participants is not None:
            out["participants"] = self.participants
        out.update({"train": self.train, "server": self.server, "bytes_up": self.bytes_up,
                    "bytes_down": self.bytes_down})
        out.update(self.extra)
        if self.dropped:
            out["dropped"] = self.dropped
        if self.skipped:
            out["skipped"] = True
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        return out


class RoundProtocol:
    """Sampling, fault draws, reply validation, drops, skipped rounds and metrics of every round.

    ``server`` is the method's server part; the protocol calls its
    ``broadcast``, ``new_replies``, ``validate_reply`` and ``aggregate``.
    ``on_drop`` receives one line per dropped client or skipped round.
    ``faults``: the ``faults.*`` options (:class:`~fedhpro.engines.fault_options.FaultOptions`; default: none).
    ``aggregation``: the ``aggregation.*`` options (:class:`~fedhpro.robust.options.AggregationOptions`; default: the
    method's own mean, the default bounds); a robust rule makes the replies robust before the method aggregates
    them (:func:`~fedhpro.engines.robust.robust_replies`). An unknown rule or an impossible bound is a one-line
    ConfigError here.
    ``privacy``: the run's ``privacy.*`` options (:class:`~fedhpro.config.PrivacyOptions`; None or
    ``mode=none``: off); ``ledger``: its privacy ledger (:func:`fedhpro.privacy.ledger_for`; built here for
    ``privacy=client`` when not given, needed for ``privacy=sample``). Both become :attr:`round_privacy`
    (:func:`~fedhpro.engines.private.round_privacy`): the participants' :attr:`sampling`, the
    :attr:`accountant` and what privacy does to the replies.
    ``steps``: reply steps of the caller's own, after the chain's (:attr:`round_chain`, a list it may extend).
    """

    def __init__(self, server: Any, num_clients: int, *, rounds: int, participation: float = 1.0, seed: int = 0,
                 eval_every: int = 1, faults: FaultOptions | None = None, min_clients: int = 1,
                 on_drop: Callable[[str], None] | None = None, aggregation: AggregationOptions | None = None,
                 privacy: Any = None, ledger: Any = None, client_sizes: Sequence[int] | None = None,
                 sizes_claimed: bool = False, content_claimed: bool = False, dp_clipping: str = "joint",
                 steps: Sequence[ReplyStep] = ()):
        """``dp_clipping``: what ``privacy.clipping=auto`` means for this method (its
        :attr:`~fedhpro.methods.base.MethodSpec.dp_clipping`; the engines pass it, protocol_settings resolves it
        for the Flower ServerApp)."""
        self.server = server
        self.num_clients = num_clients
        #: each client's training-set size as the engine knows it (in own-data Flower: what its node
        #: declared), from which a round's weight cap is drawn (:meth:`weight_cap`); None: no cap
        self.client_sizes = list(client_sizes) if client_sizes is not None else None
        #: whether the clients' sizes (training and test) are claims nobody vouches for (a Flower deployment of
        #: nodes holding their own data, without a roster): they are then bounded by the median claim too
        #: (``aggregation.max_ratio``); the simulator and partition mode know every size
        self.sizes_claimed = sizes_claimed
        #: whether each reply's content is a claim nobody can check (a Flower deployment whose nodes train on
        #: their own data, roster or not): ``aggregation.update_bound=auto`` then bounds what it can buy
        self.content_claimed = content_claimed
        self.warned_caps: set[int] = set()  # clients whose capped weight was reported (once each)
        self.rounds = rounds
        self.participation = participation
        self.seed = seed
        self.eval_every = eval_every
        self.faults = faults if faults is not None else FaultOptions()
        self.aggregation = aggregation if aggregation is not None else aggregation_options_class()()
        check_bounds(self.aggregation)
        #: the robust rule the run chose (``aggregation.rule``, from :data:`fedhpro.robust.REGISTRY`)
        self.rule = rule_for(self.aggregation)
        self.min_clients = min_clients
        self.on_drop = on_drop
        #: the run's privacy: who takes part, its accountant, what it does to the replies (off: plain rounds)
        self.round_privacy: RoundPrivacy = round_privacy(
            privacy, ledger, server, seed=seed, num_clients=num_clients, rounds=rounds,
            participation=participation, robust_needs=bool(self.rule.needs), rule_name=self.aggregation.rule,
            dp_clipping=dp_clipping)
        #: the chain every round's replies go through, a list the caller may extend (:class:`RoundChain`)
        self.round_chain: RoundChain = self.round_privacy.chain(self.plain_chain())
        self.round_chain.links.extend(steps)

    @property
    def sampling(self) -> Sampling:
        """Who takes part in each round (:mod:`fedhpro.engines.sampling`)."""
        return self.round_privacy.sampling

    @property
    def accountant(self) -> Accountant:
        """The run's privacy accountant (epsilon, the budget stop; :class:`~fedhpro.engines.private.NoAccountant`
        without privacy)."""
        return self.round_privacy.accountant

    @property
    def ledger(self) -> Any:
        """The run's privacy ledger (None: privacy off)."""
        return self.accountant.ledger

    @property
    def client_privacy(self) -> ClientPrivacy | None:
        """What each client privatizes its upload with before it leaves (``privacy=client``; None: nothing):
        what an engine hands :func:`client_step`."""
        return self.round_privacy.settings

    @property
    def publishes_participants(self) -> bool:
        """Whether a round's row names its participants (and dropped clients): always, except under
        ``privacy=client`` unless ``privacy.publish_participants``."""
        return self.round_privacy.publishes_participants

    def sample_clients(self, round: int) -> list[int]:
        """The participants of ``round``, sorted (:attr:`sampling`'s draw)."""
        return self.sampling.draw(round)

    def weight_cap(self) -> float:
        """The most aggregation weight one client may hold: the water-filling cap
        (:func:`~fedhpro.aggregation.share_cap`) of every client's declared size at
        ``aggregation.max_share``, so that no client stands for more than that share of the federation's
        total weight (of the federation's, not of a round's: a round of few participants would cap honest
        clients) and, where sizes are claims (:attr:`sizes_claimed`), at most ``aggregation.max_ratio``
        times the median claim. inf when nothing binds, the sizes are unknown, or under ``privacy=client``
        (its denominators are public constants, not the clients' counts)."""
        if self.client_sizes is None:
            return math.inf
        return self.round_privacy.weight_cap(claims_cap(self.aggregation, self.client_sizes, self.sizes_claimed))

    def pooled_accuracy(self, counts: Sequence[TestCount], order: Sequence[str] | None = None) -> dict[str, float]:
        """:func:`pool_accuracy` of ``counts`` under this run's bounds on test counts: ``aggregation.max_share``
        and, where sizes are claims, ``aggregation.max_ratio``."""
        return pool_accuracy(counts, order, self.aggregation.max_share,
                             self.aggregation.max_ratio if self.sizes_claimed else 0.0)

    def capped_sizes(self, sizes: Sequence[int]) -> list[int]:
        """``sizes`` (clients' training-set sizes) as the weights they can buy: each at most the
        :meth:`weight_cap` (what a client's update is weighted by when only a sum is seen, as in SecAgg+)."""
        cap = self.weight_cap()
        return [int(n) if n <= cap else max(1, math.floor(cap)) for n in sizes]

    def evaluates(self, round: int) -> bool:
        """Whether ``round`` ends with an evaluation (every ``eval_every`` rounds and the last, and the last
        one ``privacy.max_epsilon`` lets run)."""
        return ((round + 1) % self.eval_every == 0 or round + 1 == self.rounds
                or (round + 1 < self.rounds and self.budget_stop(round + 1) is not None))

    def participations(self, rounds_done: int) -> dict[int, int]:
        """How many of the first ``rounds_done`` rounds each client was sampled in (:attr:`sampling`'s count: the
        seeded draws, so a resumed run counts the same; a secret draw not made in this process counts as
        taken part in by every client)."""
        return self.sampling.participations(rounds_done)

    def epsilon_after(self, round: int) -> float | None:
        """The privacy ledger's epsilon once ``round`` (from 0) is complete; None without privacy."""
        return self.accountant.epsilon_after(round)

    def budget_stop(self, round: int) -> str | None:
        """The line that stops the run before ``round`` when completing it would take epsilon above
        ``privacy.max_epsilon``; None when it may run (or there is no limit)."""
        return self.accountant.budget_stop(round)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs of the protocol besides the seeds: adaptive clipping's current clip (``{}``
        without it, so that other runs' checkpoints keep their bytes)."""
        return self.round_privacy.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (a checkpoint's: a positive finite clip, else a ValueError
        the run's resume turns into one line)."""
        self.round_privacy.load_state_dict(state)

    def privacy_summary(self) -> dict[str, Any] | None:
        """The privacy ledger's settings for ``summary.json`` (None without privacy)."""
        return self.accountant.summary()

    def open(self, round: int) -> OpenRound:
        return OpenRound(self, round)

    def plain_chain(self) -> RoundChain:
        """The chain the run's options compose for replies that are not privatized: the declared layout, the
        size checks, the injected faults, the method's checks, the bytes measured, the row bound
        (``aggregation.max_row_norm > 0``), the weight cap and the training metrics, into the method's running
        sum or, with a robust rule, the replies kept whole for the rule at close; with :attr:`bounds_content`
        that fold behind the bound on each reply's pull (``aggregation.update_bound``), which holds the replies
        until close."""
        # a server without a declared layout (a bare stand-in, not a Server) is checked by its own validate_reply only
        layout = [LayoutChecks()] if hasattr(self.server, "reply_layout") else []
        links: list[ReplyStep] = [*layout, SizeChecks(), InjectedFaults(), MethodChecks(), Measured()]
        if self.aggregation.max_row_norm > 0:  # a class row is a claim about a class: bounded like a size
            links.append(RowBound(None, self.aggregation.max_row_norm))
        links += [WeightCap(), TrainingMetrics()]
        rule = self.rule
        chain = RoundChain(links, (lambda round: RobustFold(round, rule)) if rule.needs else PlainFold)
        if self.bounds_content:  # one reply's content buys at most kappa x the round's median pull
            multiple = self.aggregation.update_multiple
            chain.wrappers.append(lambda round, fold: BoundedFold(round, fold, multiple))
        return chain

    def chain(self, current: RoundState) -> tuple[list[ReplyStep], Fold]:
        """The steps every reply of ``current`` goes through, in order, and the fold the accepted ones go into:
        :attr:`round_chain` made the round's (:meth:`RoundChain.open`)."""
        return self.round_chain.open(current)

    @property
    def bounds_content(self) -> bool:
        """Whether the round bounds each reply's pull at close (:class:`~fedhpro.engines.content.BoundedFold`):
        ``aggregation.update_bound=on``, or ``auto`` where the replies' content is a claim
        (:attr:`content_claimed`); never under ``privacy=client``, whose clip bounds every upload already."""
        mode = self.aggregation.update_bound
        return self.round_privacy.bounds_content(mode == "on" or (mode == "auto" and self.content_claimed))


class OpenRound(RoundState):
    """One round in progress: what to send to whom, and the replies gathered so far, each through the round's
    chain of steps (:meth:`RoundProtocol.chain`) into its fold."""

    def __init__(self, protocol: RoundProtocol, round: int):
        self.started = time.perf_counter()
        participants = protocol.sample_clients(round)
        payload = protocol.server.broadcast(round)
        value = getattr(protocol.server, "num_classes", None)  # read by every reply: once a round
        super().__init__(protocol=protocol, round=round, payload=payload,
                         num_classes=value if isinstance(value, int) else None)
        self.protocol: RoundProtocol = protocol
        self.participants = participants
        self.bytes_down = payload_bytes(payload) * len(participants)
        self.params_down = payload_parameters(payload) * len(participants)
        draws = draw_faults(protocol.faults, protocol.seed, round, participants)
        self.dropped, self.corrupt, self.hostile = draws.dropped, draws.corrupt, draws.hostile
        #: the clients to run or ask, in client order
        self.to_ask = list(self.corrupt)
        #: the most weight one reply may carry this round (aggregation.max_share)
        self.cap = protocol.weight_cap()
        #: the steps every reply goes through, and the fold the accepted ones go into
        self.steps, self.fold = protocol.chain(self)
        #: privacy=client: the round's clip (adaptive clipping's released fraction below it: ``below_clip``)
        self.clip = protocol.round_privacy.clip
        self.failures: list[Exception | str] = []
        self.skipped = False

    @property
    def replies(self) -> Any:
        """The method's container of the round's replies (``server.new_replies()``)."""
        return self.fold.replies

    @property
    def held(self) -> list[dict[str, Any]]:
        """The replies kept whole until :meth:`close` (a robust rule's; none otherwise)."""
        return self.fold.held

    def fail(self, client: int, reason: str, error: Exception | None = None) -> None:
        """Client ``client`` gave no usable reply (it raised, or none came in time): it is dropped."""
        self.dropped.append({"client": client, "reason": reason})
        self.failures.append(error if error is not None else f"client {client}: {reason}")

    def receive(self, client: int, reply: dict[str, Any], metrics: dict[str, float], num_samples: int,
                borrowed: bool = False) -> Reception:
        """Hand in client ``client``'s reply (it holds ``num_samples`` training samples): through the round's
        steps in order (without privacy: the bounds on its ``num_examples`` and ``class_counts``, injected
        hostility and corruption, the method's validation, the row bound and the weight cap), then into the
        fold (kept whole until :meth:`close` with a robust rule; under ``privacy=client`` the reply is the
        client's privatized upload, added to the round's private sum). Returns whether it counts (a
        :class:`Reception`, true only when accepted) and, when not, whose fault it was: the client's own
        update (``INVALID``: an engine rolls the client's state back), a transmission fault (``CORRUPTED``) or
        the injected hostility (``HOSTILE``): the client computed a good update, so its state stands.

        ``borrowed``: the reply's weights are the client's working model's own tensors (the simulator's
        ``client_step(reply_views=True)``), valid only until this call returns: a folded reply is summed
        straight from them, a reply the round keeps whole (a robust rule, a method that does not fold) is
        kept as a copy."""
        lent = reply.get("weights") if borrowed and isinstance(reply, Mapping) else None
        incoming = Incoming(client, reply, metrics, num_samples, int(num_samples),
                            lent if isinstance(lent, Mapping) else None)
        for step in self.steps:
            reason = step.receive(incoming, self)
            if reason is not None:
                self.dropped.append({"client": client, "reason": reason})
                return incoming.refused()
        self.fold.add(incoming, self)
        return Reception.ACCEPTED

    @property
    def accepted(self) -> int:
        """How many replies count so far."""
        return self.fold.count

    def close(self, observe: contextlib.AbstractContextManager | None = None) -> dict[str, float]:
        """After the last reply: report the drops, then the fold's aggregate, or skip a round with fewer than
        ``min_clients`` valid replies (the global model is kept; never under ``privacy=client``, whose count is
        not released). ``observe`` wraps the server step (a FLOP counter). Raises when every participant
        failed: that is a bug or a setting, not a fault."""
        protocol = self.protocol
        position = {k: i for i, k in enumerate(self.participants)}
        self.dropped.sort(key=lambda item: position[item["client"]])
        if self.failures and len(self.failures) == len(self.participants):
            first = self.failures[0]
            if isinstance(first, Exception):
                raise first
            raise FedHProError(f"round {self.round + 1}: every client failed; {first}")
        if protocol.on_drop is not None:
            for item in self.dropped:
                protocol.on_drop(f"round {self.round + 1}: client {item['client']} dropped: {item['reason']}")
        if self.fold.skips:
            self.skipped = self.accepted < protocol.min_clients
            if self.skipped:
                if protocol.on_drop is not None:
                    protocol.on_drop(f"round {self.round + 1}: only {self.accepted} valid updates "
                                     f"(min_clients={protocol.min_clients}); the round is skipped and the global "
                                     "model kept")
                return {}
        with observe if observe is not None else contextlib.nullcontext():
            return self.fold.aggregate(self)

    def record(self, server_metrics: dict[str, float], accuracy: dict[str, float] | None,
               seconds: dict[str, float], extra: dict[str, Any] | None = None) -> RoundRecord:
        """The round's row: what the protocol measured plus the engine's accuracy, times and extras (and,
        with privacy on, ``privacy: {epsilon, delta}`` after this round)."""
        # with privacy on: epsilon and delta after this round (adaptive clipping: the round's clip, the fraction below)
        extra = {**(extra or {}), **self.protocol.round_privacy.round_row(self)}
        if self.capped:  # the weights a cap changed (every other reply weighed its num_examples)
            extra = {**(extra or {}), "capped": self.capped}
        if self.rows_bounded:  # the class rows aggregation.max_row_norm scaled down
            extra = {**(extra or {}), "rows_bounded": self.rows_bounded}
        if self.bounded:  # the updates and class rows aggregation.update_bound scaled down
            extra = {**(extra or {}), "bounded": self.bounded}
        participants: list[int] | None = self.participants
        dropped = self.dropped
        if not self.protocol.publishes_participants:  # who took part stays out of the run folder (DP's sampling)
            extra = {**(extra or {}), "num_participants": len(self.participants)}
            participants, dropped = None, [{"reason": item["reason"]} for item in self.dropped]
        return RoundRecord(round=self.round, participants=participants, train=weighted_mean(self.train_metrics),
                           server=server_metrics, accuracy=accuracy, bytes_up=self.bytes_up,
                           bytes_down=self.bytes_down, seconds=seconds, dropped=dropped, skipped=self.skipped,
                           extra={"params_up": self.params_up, "params_down": self.params_down, **(extra or {})})


__all__ = ["INIT", "SAMPLE", "SERVER", "TRAIN", "OpenRound", "RoundProtocol", "RoundRecord", "client_step",
           "round_half_up", "train_generator"]
