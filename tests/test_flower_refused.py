"""A Flower node whose reply the server refused goes back to its state from before that fit.

The simulator restores a client's state when the server rejects its update
(an invalid reply); on Flower the state lives on the node, so the server
names the refused round in the client's next message and the node restores
the backup it kept before that fit. Reference: the same node, fed the same
payloads, that simply never ran the refused round.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("flwr", reason="the Flower engine needs the flower extra: pip install -e '.[flower]'")

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict  # noqa: E402

from test_flower import tiny_config  # noqa: E402

from fedhpro.config import load_config  # noqa: E402
from fedhpro.flower import client as client_app  # noqa: E402
from fedhpro.flower import records  # noqa: E402
from fedhpro.flower.engine import build_engine, config_text  # noqa: E402
from fedhpro.flower.server import HEADER  # noqa: E402


@pytest.fixture(autouse=True)
def _inside_a_run(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # outside a run, flwr refuses to address a Message
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def moon_state(context: Context) -> dict[str, torch.Tensor]:
    return records.decode_payload(context.state, "cpu", prefix=client_app.STATE_PREFIX)["previous_weights"]


def test_a_node_restores_its_state_when_the_server_refused_its_reply(digits_data_dir):
    config = load_config(tiny_config(digits_data_dir, method="moon"))
    text = config_text(config)
    engine = build_engine(config)
    payloads = [records.encode_payload(engine.server.broadcast(r)) for r in range(3)]

    def train(context: Context, round: int, refused: int = -1) -> None:
        header = ConfigRecord({"config": text, "round": round, "client": 0, "num-clients": 3,
                               "refused-round": refused})
        message = Message(RecordDict({**payloads[round], HEADER: header}), 7, MessageType.TRAIN)
        reply = client_app.train(message, context)
        assert not reply.has_error(), reply.error.reason

    def node() -> Context:
        return Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 3},
                       state=RecordDict(), run_config={})

    refused, reference = node(), node()
    train(refused, 0)
    train(reference, 0)
    after_round_0 = moon_state(refused)
    train(refused, 1)  # the server refuses this reply ...
    assert not all(torch.equal(after_round_0[k], v) for k, v in moon_state(refused).items())
    train(refused, 2, refused=1)  # ... and says so with the next message
    train(reference, 2)  # never ran round 1
    assert all(torch.equal(moon_state(reference)[k], v) for k, v in moon_state(refused).items())
    # once: a later message naming the same round does not restore again
    before = moon_state(refused)
    client_app._restore_if_refused(refused, 1)
    assert all(torch.equal(before[k], v) for k, v in moon_state(refused).items())
