"""The run's SuperNodes: who holds which client, found at the start and kept through restarts.

:func:`discover_nodes` (partition mode: each node's ``partition-id``) and :func:`discover_own_data`
(own-data mode: each node's description of its own folder, ordered by name as the simulator orders
client folders) ask every node what it holds, once, and check its answer
(:mod:`fedhpro.flower.answers`); a node with a malformed or unwelcome answer is refused, not the run.
:class:`Nodes` is the result: ``{client index: node id}`` with what recognises a client's node when it
comes back with a new node id (:meth:`Nodes.rejoin`, before every step).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Container, Mapping
from logging import INFO, WARNING
from typing import Any, TypeVar

from flwr.app import ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore import log

from fedhpro.config import Config
from fedhpro.data.clients import ClientInfo, resolve_classes
from fedhpro.data.feature_statistics import FeatureSums, sums_problem
from fedhpro.errors import ConfigError, DataError, UpdateError
from fedhpro.flower.answers import client_info, max_classes, partition_answer, sums_answer
from fedhpro.flower.engine import config_text
from fedhpro.flower.records import HEADER, NODE_RECORD
from fedhpro.flower.roster import load_roster
from fedhpro.flower.settings import FlowerSettings

#: why a client is dropped when its node is gone: the SuperLink no longer lists it, or it stopped sending
#: heartbeats while a message waited for it
NODE_OFFLINE = "node offline"
#: seconds a round waits for newly connected SuperNodes to say which client they hold (a restarted node)
REJOIN_WAIT = 120.0
#: the fewest data-holding nodes an own-data run goes on with when some of those it waited for were refused
#: (unless ``flower.min-clients`` says otherwise): one node's "federation" is that node's model
MIN_FEDERATION = 2
#: how many names (classes, sites) one warning or error line shows
MAX_SHOWN = 10


class Nodes(dict[int, int]):
    """``{client index: Flower node id}`` of a run, and what recognises a client's node when it comes back:
    in own-data mode each client's ClientInfo (``infos``, in client order; None in partition mode, where a
    node's partition-id says it), ``client_keys`` (each client's node's public key as the SuperLink listed
    it at discovery; empty: none), ``client_of`` (node id -> client), ``strangers`` (node ids asked once
    that hold no client of this run: not asked again), ``waiting`` (new node id -> the client it
    claims, whose node was still online: it takes over once that node is gone) and ``refused`` (node id -> why
    it was refused at discovery: the run's record of the nodes left out)."""

    def __init__(self, nodes: Mapping[int, int], infos: list[Any] | None = None,
                 keys: Mapping[int, bytes] | None = None):
        super().__init__(nodes)
        self.infos = infos
        self.client_keys = dict(keys or {})
        self.client_of = {node: k for k, node in nodes.items()}
        self.strangers: set[int] = set()
        #: data.standardize=federated: the feature sums of the admitted clients (by name), and why a client's
        #: sums were left out of the shared scaling (malformed, or not those of its declared rows)
        self.feature_sums: dict[str, FeatureSums] = {}
        self.sums_refused: dict[str, str] = {}
        self.waiting: dict[int, int] = {}
        #: node id -> why it was refused at discovery (partition.json's ``refused``; empty: none)
        self.refused: dict[int, str] = {}

    def rejoin(self, grid: Grid, config_json: str, classes_bound: int, node_auth: bool = False) -> set[int]:
        """The node ids the SuperLink lists as online, after mapping any new node back to its client.

        A restarted SuperNode connects with a new node id. Before a round's messages go out, every
        node not seen before is asked what it holds, as at the start (partition mode: its partition-id;
        own-data mode: its folder's description, recognised by name and folder), and its answer is
        validated as at discovery. It takes over that client from the old node id only once the old node
        is no longer listed online (until then it waits; one warning), and, with ``flower.node-auth``,
        only with the public key the client's node had at discovery. A node that holds no client of this
        run, or answers malformed, or shows another key, is warned about once and not asked again; one that
        does not answer within :data:`REJOIN_WAIT` is asked again before the next step. ``config_json``: the
        run's config (the own-data query carries it), ``classes_bound``: its ``data.max_classes``,
        ``node_auth``: ``flower.node-auth``.
        """
        online = set(grid.get_node_ids())
        for node, claimed in sorted(self.waiting.items()):  # claims that waited for their client's node to leave
            if node not in online:
                del self.waiting[node]
            elif self[claimed] not in online:
                del self.waiting[node]
                self.hand_over(claimed, node)
        seen = set(self.client_of) | self.strangers | set(self.waiting)
        if online <= seen:
            return online
        query = {"query": "data", "config": config_json} if self.infos is not None else {"query": "partition"}
        errors: dict[int, str] = {}
        answers = _ask_new_nodes(grid, seen, query, time.monotonic() + REJOIN_WAIT, errors)
        for node, reason in sorted(errors.items()):
            self.drop_node(node, f"it cannot take part: {reason}")
        for node in sorted(online - seen - set(answers) - set(errors)):  # asked again before the next step
            log(WARNING, "fedhpro: node %d did not say what it holds within %.0f s", node, REJOIN_WAIT)
        keys = node_keys(grid) if answers and node_auth else {}
        for node, answer in sorted(answers.items()):
            k, problem = self.client_of_answer(answer, classes_bound)
            if k is None:
                self.drop_node(node, problem)
            elif node_auth and (not keys.get(node) or keys.get(node) != self.client_keys.get(k)):
                self.drop_node(node, f"it claims client {k} but its public key is not the one client {k}'s node "
                                     "had at the start of the run (flower.node-auth)")
            elif any(claimed == k for claimed in self.waiting.values()) or self[k] in online:
                holder = self[k]
                log(WARNING, "fedhpro: node %d claims client %d, whose node %d is still online (or claimed first): "
                    "it takes the client over only once that node is gone", node, k, holder)
                self.waiting[node] = k
            else:
                self.hand_over(k, node)
        return online

    def hand_over(self, k: int, node: int) -> None:
        """Client ``k`` is now on ``node`` (its old node is gone: it is not asked again)."""
        old = self[k]
        log(WARNING, "fedhpro: client %d is now on node %d (node %d left; a restarted SuperNode)", k, node, old)
        self.strangers.add(old)
        del self.client_of[old]
        self[k], self.client_of[node] = node, k

    def client_of_answer(self, answer: ConfigRecord | None, classes_bound: int) -> tuple[int | None, str]:
        """``(client index, "")`` for a new node's answer to the rejoin query, or ``(None, why not)``."""
        if self.infos is None:
            try:
                partition, count = partition_answer(answer)
            except UpdateError as error:
                return None, f"its answer to the query is malformed: {error}"
            if count != len(self):
                return None, f"it holds partition {partition} of {count}, but this run has {len(self)} clients"
            return partition, ""
        try:
            info = client_info(answer, classes_bound)
        except UpdateError as error:
            return None, f"its answer to the query is malformed: {error}"
        names = [known.name for known in self.infos]
        if info.name not in names:
            shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
            return None, f"it holds a client named {info.name!r}, not one of this run's ({shown})"
        k = names.index(info.name)
        if info != self.infos[k]:
            return None, f"its folder {info.name!r} is not the one client {k} had at the start of the run"
        return k, ""

    def drop_node(self, node: int, why: str) -> None:
        """``node`` takes no part in this run: one warning saying why, and it is not asked again."""
        log(WARNING, "fedhpro: node %d takes no part in this run: %s", node, why)
        self.strangers.add(node)


def node_keys(grid: Grid) -> dict[int, bytes]:
    """``{node id: public key}`` of the nodes the SuperLink lists (``Grid.get_nodes()``: flwr 1.42's
    ``NodeInfo.public_key``); empty where the grid gives none."""
    get_nodes = getattr(grid, "get_nodes", None)
    if get_nodes is None:
        return {}
    return {int(info.node_id): bytes(info.public_key) for info in get_nodes() if info.public_key}


def discover_nodes(grid: Grid, clients: int | None, settings: FlowerSettings) -> tuple[dict[int, int], int]:
    """``({partition-id: node id}, number of clients)``: ask every node which partition it holds.

    Waits up to ``settings.node_wait`` seconds for all partitions to connect. One node cannot deny the
    run: a node that answers with an error or a malformed answer, that holds a partition of another count
    than ``clients`` (or beyond it), or a partition another node answered for first, is refused with a
    warning and never asked again. Raises ConfigError (one line, naming the refused nodes) when by the
    deadline the nodes do not cover the partitions ``0..K-1`` of a ``K``-client federation, or, with
    ``clients`` unset, when the nodes disagree on ``num-partitions`` (``clients=K`` then decides).
    """
    deadline = time.monotonic() + settings.node_wait
    known: dict[int, tuple[int, int]] = {}  # node id -> (partition-id, num-partitions), well-formed answers
    refused: dict[int, str] = {}  # node id -> why it takes no part: warned about once, not asked again
    by_partition: dict[int, int] = {}  # partition -> node (the first to answer for it keeps it)
    while True:
        errors: dict[int, str] = {}
        answers = _ask_new_nodes(grid, set(known) | set(refused), {"query": "partition"}, deadline, errors)
        for node, reason in sorted(errors.items()):
            _refuse(node, f"it answered with an error: {reason}", refused)
        for node, answer in sorted(answers.items()):
            try:
                known[node] = partition_answer(answer)
            except UpdateError as error:
                _refuse(node, f"its answer to the query is malformed: {error}", refused)
        counts = {count for node, (_, count) in known.items() if node not in refused}
        if clients is None and len(counts) > 1:
            raise ConfigError(f"the nodes disagree on num-partitions ({sorted(counts)}); give every SuperNode "
                              "the same num-partitions, or set clients=K (nodes of another count are then refused)")
        expected = clients if clients is not None else (counts.pop() if counts else None)
        if expected is not None:
            held = set(by_partition.values())
            for node, (partition, count) in sorted(known.items()):
                if node in refused or node in held:
                    continue
                if count != expected or partition >= expected:
                    _refuse(node, f"it holds partition {partition} of {count}, but the federation has clients="
                                  f"{expected}; set clients={count} or run {expected} SuperNodes with "
                                  f"num-partitions={expected}", refused)
                elif partition in by_partition:
                    _refuse(node, f"nodes {by_partition[partition]} and {node} both hold partition-id={partition} "
                                  "(the first to answer keeps it)", refused)
                else:
                    by_partition[partition] = node
            if len(by_partition) == expected:  # in node order, as the nodes were listed
                return {partition: node for node, partition in sorted(
                    (node, partition) for partition, node in by_partition.items())}, expected
        if time.monotonic() > deadline:
            have = sorted(by_partition) if expected is not None else []
            raise ConfigError(f"after {settings.node_wait:.0f} s only partitions {have} of "
                              f"{expected if expected is not None else '?'} have a node{_refused_text(refused)}; "
                              "start the missing SuperNodes or raise flower.node-wait")
        time.sleep(0.2)


def needed_nodes(expected: int, accounted: int, min_clients: int | None) -> int:
    """How many admitted data-holding nodes let an own-data run go on once ``flower.node-wait`` has passed
    without all ``expected``: ``flower.min-clients`` when set, else ``expected`` less the places refused
    nodes account for (``accounted``: nodes whose answer was malformed or an error, whoever they were, and
    roster sites whose only claimants were refused), but at least 2 (a federation of one is one site's
    model; SecAgg+ needs two) and never more than ``expected``. A run whose every missing node was refused
    goes on; one missing a node nobody accounts for (a site not started) stops, as it always did."""
    if min_clients is not None:
        return min_clients
    return min(expected, max(MIN_FEDERATION, expected - accounted))


def discover_own_data(grid: Grid, config: Config,
                      settings: FlowerSettings) -> tuple[Nodes, list[Any], list[str]]:
    """Own-data mode: ``({client index: node id}, the nodes' ClientInfo in client order, class names)``.

    Asks every node to describe its own folder (nothing but counts, names and
    shapes leaves it), waits until ``clients`` nodes have answered (with a
    roster, ``flower.roster``: until every site of the roster has), orders them
    by name (the simulator's order of client folders) and resolves the class
    list over all of them.

    One participant cannot deny the run: a node that answers with an error or a
    malformed description, that the roster does not know (another name, sizes
    beyond its tolerance, another key than the one it pins), that answers with
    a name another node already holds (an impostor: the first to answer keeps
    the name; a roster that pins keys decides instead), or that answers once the
    run has its ``clients`` nodes (a surplus node) is refused with a warning and
    never asked again; the others go on. When ``flower.node-wait`` passes with
    fewer than ``clients`` nodes admitted, the run goes on with those admitted
    if they are at least :func:`needed_nodes` (one warning naming the refused
    nodes and the roster's sites without a node), else it stops with one line
    naming them. A node whose data do not fit the others' (:func:`misfits`: a
    kind or input shape other than the strict majority's, a class list adding
    more classes than the bound, classes outside ``data.classes``) is refused
    in the same way once the waiting is over, and the run goes on while
    :func:`needed_nodes` remain; no strict majority of kind and input shape
    stops the run with one line. Classes only one node holds are named in one
    warning (honest label skew has them). Other one-line errors name the nodes
    that do not fit together (classes.txt, label ranges).
    """
    roster = load_roster(settings.roster) if settings.roster else None
    expected = config.run.clients
    if roster is not None:
        if expected is not None and expected != len(roster.sites):
            raise ConfigError(f"clients={expected} but flower.roster names {len(roster.sites)} sites; set "
                              f"clients={len(roster.sites)} or leave clients unset")
        expected = len(roster.sites)
    if expected is None:
        raise ConfigError("dataset=clients on Flower needs clients=K, the number of SuperNodes that hold data "
                          "(the server waits for that many), or flower.roster=<file> naming the sites")
    if settings.min_clients is not None and settings.min_clients > expected:
        raise ConfigError(f"flower.min-clients={settings.min_clients} is more than the {expected} data-holding "
                          f"SuperNodes the run waits for; set flower.min-clients to at most {expected}")
    deadline = time.monotonic() + settings.node_wait
    known: dict[int, ClientInfo] = {}  # node id -> what it holds (admitted)
    said: dict[int, ConfigRecord | None] = {}  # node id -> its answer (admitted): its feature sums are read at the end
    by_name: dict[str, int] = {}
    ignored: dict[int, str] = {}  # node id -> why it takes no part: warned about once, not asked again
    # refused nodes that may stand for a missing place: None (who they are is unknown: an error or a
    # malformed answer) or the roster site they claimed (their sizes or key did not agree with it)
    places: dict[int, str | None] = {}
    # data.standardize=federated: the nodes' feature sums come with their answers, unless SecAgg+ adds them up
    query = {"query": "data", "config": config_text(config),
             "feature-sums": settings.secure_aggregation != "secagg+"}
    keys = node_keys(grid) if roster is not None and any(site.key for site in roster.sites.values()) else {}
    while len(known) < expected:
        errors: dict[int, str] = {}
        answers = _ask_new_nodes(grid, set(known) | set(ignored), query, deadline, errors)
        for node, reason in sorted(errors.items()):
            _refuse(node, f"it answered with an error: {reason}", ignored)
            places[node] = None
        if roster is not None and any(site.key for site in roster.sites.values()) and set(answers) - set(keys):
            keys = node_keys(grid)  # nodes that connected since
        for node, answer in sorted(answers.items()):
            try:
                info = client_info(answer, max_classes(config))
            except UpdateError as error:
                _refuse(node, f"its answer to the query is malformed: {error}", ignored)
                places[node] = None
                continue
            problem = roster.problem(info.name, info.train_size, info.test_size, keys.get(node)) \
                if roster is not None else None
            if problem is not None and roster is not None and info.name in roster.sites:
                places[node] = info.name  # a roster site's claimant: it counts unless the site is admitted
            if problem is None and info.name in by_name:
                problem = f"node {by_name[info.name]} already holds the client named {info.name!r} (an impostor?)"
            if problem is None and len(known) >= expected:
                problem = f"the run already has its {expected} data-holding SuperNodes (a surplus node)"
            if problem is not None:
                _refuse(node, problem, ignored)
                continue
            known[node], by_name[info.name] = info, node
            said[node] = answer
        if len(known) < expected and time.monotonic() > deadline:
            break
        if len(known) < expected:
            time.sleep(0.2)
    waited = time.monotonic() > deadline
    refusals = misfits(known, config.data)  # after admission: the majority is known
    untrained = untrained_tests({node: info for node, info in known.items() if node not in refusals})
    if untrained and config.data.untrained_classes == "keep":
        shown = "; ".join(f"{known[node].name}: {_shown(names)}" for node, names in sorted(untrained.items())[:5])
        log(WARNING, "fedhpro: test samples of classes no admitted node trains (%s): never learned, they count "
            "as errors (data.untrained_classes=keep)", shown)
    elif untrained:  # the node whose test data the model cannot learn is left out, not the run
        refusals.update({node: (f"its test samples hold {len(names)} class{'es' if len(names) > 1 else ''} that no "
                                f"admitted node trains ({_shown(names)}): the model never learns them; give a site "
                                "training samples of them, drop those test samples, or set "
                                "data.untrained_classes=keep to test on them anyway")
                         for node, names in untrained.items()})
    for node, why in sorted(refusals.items()):
        _refuse(node, why, ignored)
        name = known.pop(node).name
        del by_name[name]
        places[node] = name if roster is not None and name in roster.sites else None
    if len(known) < expected:
        accounted = sum(1 for claim in places.values() if claim is None) + \
            len({claim for claim in places.values() if claim is not None and claim not in by_name})
        needed = needed_nodes(expected, accounted, settings.min_clients)
        missing = sorted(set(roster.sites) - set(by_name)) if roster is not None else []
        shown = ", ".join(missing[:10]) + (", ..." if len(missing) > 10 else "")
        absent = f"; the roster's sites without a node: {shown}" if missing else ""
        after = f"after {settings.node_wait:.0f} s " if waited else ""  # else: every node answered, some refused
        if len(known) < needed:
            raise ConfigError(f"{after}only {len(known)} of {expected} data-holding "
                              f"SuperNodes answered ({', '.join(sorted(by_name)) or 'none'}; at least {needed} "
                              f"needed){_refused_text(ignored)}{absent}; start the missing SuperNodes, set "
                              "clients= to the number running, or raise flower.node-wait")
        log(WARNING, "fedhpro: %s%d of %d data-holding SuperNodes were admitted (%s); the run goes on "
            "without the others (at least %d needed, flower.min-clients)%s%s", after, len(known),
            expected, ", ".join(sorted(by_name)), needed, _refused_text(ignored), absent)
    single = single_holders(list(known.values()))
    if single:
        shown = ", ".join(f"{c!r} ({name})" for c, name in single[:MAX_SHOWN])
        more = f" (and {len(single) - MAX_SHOWN} more)" if len(single) > MAX_SHOWN else ""
        log(WARNING, "fedhpro: classes only one node holds: %s%s; not refused (honest label skew has them), but "
            "only that node's data speak for them", shown, more)
    names = sorted(by_name)
    infos = [known[by_name[name]] for name in names]
    try:
        classes = resolve_classes(infos, config.data)
    except DataError as error:
        raise ConfigError(f"the nodes' data do not fit together: {error}") from None
    if len(classes) > max_classes(config):
        raise ConfigError(f"the nodes hold {len(classes)} classes together, more than data.max_classes="
                          f"{max_classes(config)}; raise data.max_classes if that many is right")
    nodes = Nodes({k: by_name[name] for k, name in enumerate(names)}, infos)
    for name in names:  # the feature sums of data.standardize=federated: a bad release is left out, not its node
        node, info = by_name[name], known[by_name[name]]
        try:
            sums = sums_answer(said[node], int(info.input_shape[0]))
        except UpdateError as error:
            nodes.sums_refused[name] = f"its feature sums are malformed: {error}"
            continue
        problem = None if sums is None else sums_problem(sums, info.train_size)
        if problem is not None:
            nodes.sums_refused[name] = problem
        elif sums is not None:
            nodes.feature_sums[name] = sums
    nodes.strangers.update(ignored)  # refused at discovery: not asked again when a round looks for new nodes
    nodes.refused.update(ignored)
    return nodes, infos, classes


def node_classes(info: ClientInfo) -> set[str]:
    """The classes a node's description names: its class folders or label names, its ``classes.txt``, and for
    tensors labelled by index ``"0"`` ... ``max_label`` (what the federation's class count grows to with it)."""
    names = set(info.class_names or []) | set(info.declared_classes or [])
    if info.class_names is None and info.declared_classes is None and info.max_label is not None:
        names |= {str(label) for label in range(info.max_label + 1)}
    return names


def class_bound(counts: list[int]) -> int:
    """The most classes a node may add that no node of at most that many classes names: the lower median of
    the admitted nodes' class counts, at least 1 (at least half the nodes hold no more; a minority cannot move
    it above an honest node's count)."""
    return max(1, int(statistics.median_low(counts))) if counts else 1


#: what the nodes vote by: their data's (kind, input shape), or their classes.txt
Vote = TypeVar("Vote")


def _outvoted(groups: Mapping[Vote, list[int]], why: Callable[[Vote, Vote, int, int], str]) -> dict[int, str] | None:
    """``{node id: why}`` for the nodes outside the group holding a strict majority of all the nodes in ``groups``
    (vote -> node ids); ``why(their vote, the majority's vote, the majority's size, all nodes)`` says why; None
    when no group holds a strict majority."""
    agreed, held = max(groups.items(), key=lambda item: len(item[1]))
    voters = sum(len(nodes) for nodes in groups.values())
    if 2 * len(held) <= voters:
        return None
    return {node: why(vote, agreed, len(held), voters) for vote, nodes in groups.items() if vote != agreed
            for node in nodes}


def misfits(known: Mapping[int, ClientInfo], options: Any) -> dict[int, str]:
    """``{node id: why}`` for the admitted nodes (``known``: node id -> description) whose data do not fit the
    others', each left out of the run (not the run refused):

    * a data kind or input shape other than that of a strict majority of the admitted nodes (none has one: a
      one-line ConfigError naming the groups, since nobody can say who is right);
    * with ``data.classes`` (``options``: the run's ``data.*``): a class, or an index label, outside that list;
      with ``data.num_classes`` (tensors labelled by index): a label at or above it;
    * without ``data.classes``, a ``classes.txt`` other than that of a strict majority of the nodes that have one
      (none has one: :func:`~fedhpro.data.clients.resolve_classes` names them in one line);
    * otherwise a class list adding more than ``M`` classes (:func:`class_bound`: the lower median of the
      admitted nodes' class counts) that no other node of at most ``M`` classes names. Such nodes are at least
      half of all; a node of at most ``M`` classes is never refused, so honest label skew (a class only one
      node holds) passes, and liars sharing their invented names gain nothing by it.
    """
    refused: dict[int, str] = {}
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for node, info in sorted(known.items()):
        groups.setdefault((info.kind, tuple(info.input_shape)), []).append(node)
    if len(groups) > 1:
        outvoted = _outvoted(groups, lambda other, major, held, voters: (
            f"its data ({other[0]} of shape {list(other[1])}) differ from those of the strict majority of the "
            f"admitted nodes ({major[0]} of shape {list(major[1])}, {held} of {voters}); give it the same kind of "
            "data and features"))
        if outvoted is None:
            largest = sorted(groups.items(), key=lambda item: -len(item[1]))
            listing = "; ".join(f"{k} of shape {list(s)}: " + _shown([known[n].name for n in nodes], quote=False)
                                for (k, s), nodes in largest[:MAX_SHOWN])
            more = f"; and {len(largest) - MAX_SHOWN} more" if len(largest) > MAX_SHOWN else ""
            raise ConfigError(f"the admitted nodes' data differ in kind or input shape and no strict majority agrees "
                              f"({listing}{more}); give every SuperNode the same kind of data and features")
        refused.update(outvoted)
    fitting = {node: info for node, info in known.items() if node not in refused}
    if options.classes is not None:
        allowed = [str(c) for c in options.classes]
        for node, info in fitting.items():
            outside = sorted(set(info.class_names or []) - set(allowed))
            if outside:
                refused[node] = (f"it names {len(outside)} classes that data.classes does not list "
                                 f"({_shown(outside)}); add them to data.classes or fix its labels")
            elif info.class_names is None and info.max_label is not None and info.max_label >= len(allowed):
                refused[node] = (f"its labels go up to {info.max_label} but data.classes lists {len(allowed)} "
                                 "classes; fix its labels or list its classes")
        return refused
    if options.num_classes is not None:  # the bound of labels by index; named classes are bounded below
        for node, info in fitting.items():
            if info.class_names is None and info.max_label is not None and info.max_label >= options.num_classes:
                refused[node] = (f"its labels go up to {info.max_label} but data.num_classes={options.num_classes}; "
                                 "fix its labels or raise data.num_classes")
        fitting = {node: info for node, info in fitting.items() if node not in refused}
    declared: dict[tuple[str, ...], list[int]] = {}
    for node, info in sorted(fitting.items()):
        if info.declared_classes is not None:
            declared.setdefault(tuple(info.declared_classes), []).append(node)
    if len(declared) > 1:  # no strict majority: resolve_classes names the nodes whose classes.txt differ
        outvoted = _outvoted(declared, lambda listed, agreed, held, voters: (
            f"its classes.txt ({len(listed)} classes) differs from that of the strict majority of the nodes that "
            f"have one ({len(agreed)} classes, {held} of {voters}); give it the same class list, or set data.classes"))
        if outvoted is not None:
            refused.update(outvoted)
            fitting = {node: info for node, info in fitting.items() if node not in refused}
    classes = {node: node_classes(info) for node, info in fitting.items()}
    bound = class_bound([len(names) for names in classes.values()])
    within = [node for node, names in classes.items() if len(names) <= bound]
    for node, names in sorted(classes.items()):
        if len(names) <= bound:
            continue
        known_elsewhere = set().union(*(classes[other] for other in within if other != node))
        added = sorted(names - known_elsewhere)
        if len(added) > bound:
            refused[node] = (f"it names {len(added)} classes that no node of at most {bound} classes names "
                             f"({_shown(added)}), more than {bound} (the lower median of the admitted nodes' class "
                             "counts); if they are right, list the federation's classes in data.classes")
    return refused


def untrained_tests(known: Mapping[int, ClientInfo]) -> dict[int, list[str]]:
    """``{node id: classes}``: for each node (``known``: node id -> description) the classes its test split
    holds that no node of ``known`` holds in its training split (class names, or labels by index as text),
    sorted; nodes without such classes are left out. The model never learns those classes, so their test
    samples can only count as errors (``data.untrained_classes``)."""
    trained = set().union(*(set(info.train_classes or []) for info in known.values()))
    found = {node: sorted(set(info.test_classes or []) - trained) for node, info in known.items()}
    return {node: names for node, names in found.items() if names}


def single_holders(infos: list[ClientInfo]) -> list[tuple[str, str]]:
    """``[(class, node's client name)]``, sorted: the named classes (class folders or label names) exactly one
    of ``infos`` holds, when there are at least two."""
    if len(infos) < 2:
        return []
    holders: dict[str, list[str]] = {}
    for info in infos:
        for name in set(info.class_names or []):
            holders.setdefault(name, []).append(info.name)
    return sorted((name, held[0]) for name, held in holders.items() if len(held) == 1)


def _shown(names: list[str], most: int = 5, quote: bool = True) -> str:
    """The first ``most`` names, cut to 40 characters each (quoted unless ``quote`` is false), and how many more."""
    shown = ", ".join(repr(name[:40]) if quote else name[:40] for name in names[:most])
    return shown + (f", ... {len(names) - most} more" if len(names) > most else "")


def _refused_text(refused: Mapping[int, str], most: int = 5) -> str:
    """``"; refused: node N: why; ..."`` for the first ``most`` refused nodes (empty when none)."""
    if not refused:
        return ""
    shown = "; ".join(f"node {node}: {why}" for node, why in sorted(refused.items())[:most])
    more = f" (and {len(refused) - most} more)" if len(refused) > most else ""
    return f"; refused: {shown}{more}"


def _refuse(node: int, why: str, ignored: dict[int, str]) -> None:
    """A node that takes no part in the run: one warning naming it and why; it is not asked again."""
    log(WARNING, "fedhpro: node %d is refused: %s", node, why)
    ignored[node] = why


def _ask_new_nodes(grid: Grid, known: Container[int], query: dict[str, Any], deadline: float,
                   errors: dict[int, str]) -> dict[int, ConfigRecord | None]:
    """Send ``query`` to every connected node not in ``known``; ``{node id: its answer}`` (its
    ``fedhpro.node`` ConfigRecord, None if its reply holds none: the caller validates the answer).

    A node that answers with an error, or whose reply is not bound to the message it got
    (:func:`match_replies`), is put into ``errors`` with the reason. Replies are matched to the nodes asked
    by the message they answer: an error the SuperLink writes for an offline node comes from the SuperLink.
    """
    new = [node for node in grid.get_node_ids() if node not in known]
    if not new:
        return {}
    messages = [Message(RecordDict({HEADER: ConfigRecord(query)}), node, MessageType.QUERY) for node in new]
    replies = list(grid.send_and_receive(messages, timeout=max(1.0, deadline - time.monotonic())))
    answers = {}
    unbound: dict[int, str] = {}
    for node, reply in match_replies(list(zip(new, messages, strict=True)), replies, unbound).items():
        if not reply.has_error():
            answers[node] = reply.content.config_records.get(NODE_RECORD)
        else:
            errors[node] = _first_line(reply.error.reason) or f"error code {reply.error.code}"
    errors.update(unbound)
    return answers


def _first_line(text: Any, most: int = 500) -> str:
    """The first line of a node's text (an error reason), at most ``most`` characters: it goes into a log."""
    line = (str(text or "").strip().splitlines() or [""])[0]
    return line if len(line) <= most else line[:most] + "..."


def error_reason(error: Error) -> str:
    """One line for an error reply: the SuperLink's own for a node that stopped sending heartbeats while
    the message waited, else the node's reason (``raised <Error>: <message>``)."""
    if error.code == ErrorCode.NODE_UNAVAILABLE:
        return f"{NODE_OFFLINE} (no heartbeat for 2 intervals)"
    return _first_line(error.reason) or f"error code {error.code}"


def match_replies(sent: list[tuple[Any, Message]], replies: list[Message],
                  refused: dict[Any, str] | None = None, distinct: bool = False) -> dict[Any, Message]:
    """``{key: reply}`` for ``sent``, a list of ``(key, message)`` with unique keys (node ids, clients).

    A reply is bound to the message it answers: its message id, set when the grid pushed it (a message
    made without a grid, as in tests, has none: then the node it came from says it). A reply (not an error:
    the SuperLink writes those for an offline node) that comes from another node than the one its message
    went to is refused, and so,
    with ``distinct`` (a round's training replies, keyed by client), is a reply whose content is byte for
    byte that of an earlier reply to another message (one node replaying another's reply: the first keeps
    it): ``refused`` gets ``{key: why}`` for them. Stray replies (a message of an earlier round answered
    late, a second reply to one message) are left out."""
    by_id = {message.metadata.message_id: (key, message) for key, message in sent if message.metadata.message_id}
    by_node = {message.metadata.dst_node_id: (key, message) for key, message in sent
               if not message.metadata.message_id}
    matched: dict[Any, Message] = {}
    digests: dict[bytes, Any] = {}
    for reply in replies:
        target = by_id.get(reply.metadata.reply_to_message_id) if reply.metadata.reply_to_message_id \
            else by_node.get(reply.metadata.src_node_id)
        if target is None:
            continue
        key, message = target
        if key in matched or (refused is not None and key in refused):
            continue
        asked, source = message.metadata.dst_node_id, reply.metadata.src_node_id
        why = None
        if reply.has_error():  # an error counts for nothing; the SuperLink writes one for an offline node
            pass
        elif source != asked:
            why = f"its reply came from node {source}, not from node {asked} that was asked"
        elif distinct:
            digest = content_digest(reply.content)
            if digest in digests:
                why = (f"its reply is a byte-for-byte copy of client {digests[digest]}'s reply this round "
                       f"(node {asked} replayed another node's reply)")
            else:
                digests[digest] = key
        if why is None:
            matched[key] = reply
        elif refused is not None:
            refused[key] = why
    return matched


def content_digest(content: RecordDict) -> bytes:
    """SHA-256 over every record of ``content``: names, array metadata and bytes, config and metric entries
    (equal for two replies only when their contents are equal byte for byte)."""
    digest = hashlib.sha256()

    def put(*parts: Any) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else repr(part).encode()
            digest.update(len(data).to_bytes(8, "little") + data)

    for name, record in sorted(content.array_records.items()):
        put("array", name)
        for key, array in record.items():
            put(key, array.dtype, tuple(array.shape), array.stype, bytes(array.data))
    for name, config in sorted(content.config_records.items()):
        put("config", name, *(part for item in config.items() for part in item))
    for name, metrics in sorted(content.metric_records.items()):
        put("metric", name, *(part for item in metrics.items() for part in item))
    return digest.digest()


def _client_keys(grid: Grid, nodes: Mapping[int, int], settings: FlowerSettings) -> dict[int, bytes]:
    """Each client's node's public key as the SuperLink lists it now, and one line saying what a client's
    identity rests on. ``flower.node-auth=true`` (the SuperLink runs with ``--enable-supernode-auth``):
    on those keys, so every node must have one. Otherwise on its partition-id, or its name and folder:
    without authentication a SuperNode draws a new key pair at every start (flwr 1.42 registers it with
    that key), so a key says nothing about who restarted."""
    keys = node_keys(grid)
    by_client = {k: keys[node] for k, node in nodes.items() if node in keys}
    if settings.node_auth:
        keyless = sorted(node for node in nodes.values() if node not in keys)
        if keyless:
            raise ConfigError(f"flower.node-auth=true but the SuperLink lists no public key for node(s) "
                              f"{', '.join(map(str, keyless[:10]))}; start the SuperLink with "
                              "--enable-supernode-auth, or set flower.node-auth=false")
        log(INFO, "fedhpro: node keys recorded (flower.node-auth): a SuperNode that comes back with a new node "
            "id takes its client back only with the same key, once the client's node is offline")
    else:
        log(WARNING, "fedhpro: node keys are not checked (flower.node-auth=false): a client's identity rests on "
            "the partition-id (own data: the name and folder description) its node reports; a node reporting "
            "those of a client whose node is offline takes that client over. With --enable-supernode-auth on "
            "the SuperLink, set flower.node-auth=true")
    return by_client

