"""A Flower Grid whose nodes run the real ClientApp in this process, one node per site folder.

For trying a deployment's server side without a SuperLink: ``run_server(LocalGrid(folders, state), settings)``
runs the real ServerApp code over nodes that run fedhpro's real ClientApp on their own data folders, each
message and reply deep-copied as if it crossed the wire. ``forge`` rewrites a node's answers on their way out
(a hostile node, as the tests and ``bench/liar_sites.py`` make one), ``keys`` gives nodes the public keys the
SuperLink would list. Flower refuses to address a message outside a run; :func:`inside_a_run` makes this
process play the run's task.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from fedhpro.flower import client as client_app
from fedhpro.flower.records import HEADER

#: ``(message type, the query's header record or None, the node's reply, the message) -> the reply it sends``
Forge = Callable[[str, Any, Message, Message], Message]


@dataclasses.dataclass
class NodeInfo:
    """What ``Grid.get_nodes`` lists of a node (flwr 1.42's NodeInfo: its id and public key)."""

    node_id: int
    public_key: bytes


def inside_a_run(run_id: int = 1) -> None:
    """Let this process address Flower messages as the ServerApp of run ``run_id`` does (outside a run flwr
    refuses to): for a :class:`LocalGrid` driven from a script or a test."""
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = run_id, 0, 1


class LocalGrid:
    """Flower's Grid for :func:`fedhpro.flower.server.run_server`: node ``n`` runs the real ClientApp on
    ``folders[n]`` (its ``data-dir``) with its state under ``state/n``; a node whose ClientApp raises answers
    with an error, as Flower does. ``forge``: ``{node: Forge}``; ``keys``: ``{node: public key}``.
    ``timeouts`` records ``(message type, timeout)`` of every ``send_and_receive``."""

    def __init__(self, folders: Mapping[int, Path], state: Path, forge: Mapping[int, Forge] | None = None,
                 keys: Mapping[int, bytes] | None = None):
        self.contexts = {node: Context(run_id=1, node_id=node, state=RecordDict(), run_config={},
                                       node_config={"data-dir": str(folder), "state-dir": str(state / str(node))})
                         for node, folder in folders.items()}
        self.forge = dict(forge or {})
        self.keys = dict(keys or {})
        self.timeouts: list[tuple[str, float | None]] = []

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def get_nodes(self) -> list[NodeInfo]:
        return [NodeInfo(node, key) for node, key in self.keys.items()]

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        if messages:
            self.timeouts.append((messages[0].metadata.message_type, timeout))
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            try:
                reply = client_app.app(copy.deepcopy(message), self.contexts[node])
            except Exception as error:  # noqa: BLE001 - Flower answers a raising ClientApp with an error
                reply = Message(Error(code=2, reason=f"{type(error).__name__}: {error}"), reply_to=message)
            if node in self.forge and not reply.has_error():
                header = message.content.config_records.get(HEADER)
                reply = self.forge[node](message.metadata.message_type, header, reply, message)
            replies.append(copy.deepcopy(reply))
        return replies
