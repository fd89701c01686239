"""Every method, in every mode, uploads only what its server reads.

For each registered method and each combination of its mode options (those of :data:`MODE_AXES` its options
have: FedHPro's ``prototypes``, ``gradient_timing`` and ``classifier_step``, the prototype methods' ``protocol``
and ``prototypes``; every choice each option declares), two clients run the method's own ``Client.fit`` on tiny
synthetic data, and the replies go to the server's ``aggregate`` as the engines hand them over
(:func:`fedhpro.methods.reads.keys_read`: ``new_replies()``, ``append``, ``aggregate``), each a mapping that
records which keys the server looks up. The test fails when a declared key is never read, when a reply holds a
key the layout does not declare (or lacks one it does), and, without privacy, when changing the values of a
declared class tensor changes nothing the server keeps or sends (read only to be checked, not used).

Privacy: ``none``; ``client`` (the uploads privatized as the engines do, :func:`privatize_upload`, summed and
released, the server reading the one released reply, :func:`private_reply`); ``sample`` (DP-SGD, where Opacus is
installed and the method's options allow it).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from conftest import NUM_CLASSES, TinyNet, make_client, make_federation

from fedhpro.config import PrivacyOptions
from fedhpro.engines.chain import Reception
from fedhpro.engines.protocol import client_step
from fedhpro.engines.simulator import Simulator
from fedhpro.errors import ConfigError
from fedhpro.methods import MethodContext, TrainSettings, get_method, method_names
from fedhpro.methods.layout import ClassRows, layout_problem
from fedhpro.methods.reads import keys_read, sent_not_read
from fedhpro.privacy.client import (
    HOLDERS_KEY,
    ClientPrivacy,
    PrivateSum,
    private_reply,
    privatize_upload,
    privatized_layout,
)

#: the options that change what a method's client uploads or its server reads, wherever a method's options
#: have them (method-specific axes: FedHPro's and the prototype methods'); every declared choice is tried
MODE_AXES = ("prototypes", "protocol", "gradient_timing", "classifier_step")
PRIVACY = ("none", "client", "sample")
TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.0, weight_decay=0.0)
#: the two clients' classes: class 2 held by one client only, class 3 by the other only
CLIENT_CLASSES = ([0, 1, 3], [0, 1, 2])


def option_choices(options: type) -> dict[str, tuple[Any, ...]]:
    """The mode axes ``options`` has, each with every choice it declares."""
    return {field.name: tuple(field.metadata["choices"]) for field in dataclasses.fields(options)
            if field.name in MODE_AXES and field.metadata.get("choices")}


def modes() -> list[Any]:
    """``(method, {option: choice}, privacy)`` for every registered method, combination of its mode axes and
    privacy mode."""
    cases = []
    for name in method_names():
        axes = option_choices(get_method(name).options)
        for values in itertools.product(*axes.values()):
            chosen = dict(zip(axes, values, strict=True))
            for privacy in PRIVACY:
                label = ",".join(f"{key}={value}" for key, value in chosen.items()) or "default"
                cases.append(pytest.param(name, chosen, privacy, id=f"{name}-{label}-{privacy}"))
    return cases


def build(name: str, chosen: Mapping[str, Any], train: TrainSettings) -> tuple[Any, Any, Any, Any]:
    """``(spec, options, server, client)`` as the simulator builds them (:func:`fedhpro.engines.simulator.
    build_method`): the global model wrapped as the method says, no weights shared when none travel."""
    spec = get_method(name)
    options = spec.options(**chosen)
    shared = [] if spec.weights_travel is not None and spec.weights_travel(options) == "none" else None

    def context() -> MethodContext:
        torch.manual_seed(0)
        model = TinyNet()
        if spec.model_wrapper is not None:
            model = spec.model_wrapper(model, options, NUM_CLASSES)
        return MethodContext(model=model, num_classes=NUM_CLASSES, options=options, train=train, seed=3,
                             shared_keys=shared)

    return spec, options, lambda: spec.server(context()), spec.client(context())


def client_model(spec, options, k: int) -> torch.nn.Module:
    torch.manual_seed(10 + k)
    model = TinyNet()
    return spec.model_wrapper(model, options, NUM_CLASSES) if spec.model_wrapper is not None else model


def fitted_replies(spec, options, server, client) -> list[dict[str, Any]]:
    """Both clients' replies to the server's first broadcast, from the method's own ``Client.fit``."""
    payload = server.broadcast(0)
    replies = []
    for k, classes in enumerate(CLIENT_CLASSES):
        data = make_client(16, classes, seed=50 + k)
        reply, _ = client.fit(client_model(spec, options, k), payload, data, {}, torch.Generator().manual_seed(k))
        replies.append(reply)
    return replies


def same(a: Any, b: Any) -> bool:
    """Whether two nested dicts / tensors / numbers are equal bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a, b))
    if isinstance(a, Mapping) or isinstance(b, Mapping):
        return isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys() and \
            all(same(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b) and \
            all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def perturbed(reply: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The reply with the rows of ``key`` of the classes its client holds changed (kept non-negative, so that
    probabilities stay probabilities)."""
    rows = reply[key]
    held = (reply["class_counts"] > 0).reshape(-1, *([1] * (rows.dim() - 1)))
    return {**reply, key: torch.where(held, rows * 1.5 + 0.25, rows)}


def outcome(server, round: int, replies: list[dict[str, Any]]) -> tuple[Any, Any]:
    """What the server keeps and sends after aggregating ``replies``."""
    server.aggregate(round, [dict(reply) for reply in replies])
    return server.state_dict(), server.broadcast(round + 1)


@pytest.mark.parametrize("name, chosen, privacy", modes())
def test_every_declared_key_is_read_and_only_declared_keys_are_sent(name, chosen, privacy):
    train = TRAIN
    if privacy == "sample":
        pytest.importorskip("opacus")
        train = dataclasses.replace(TRAIN, dp_clip=1.0, dp_noise_multiplier=0.5)
    try:
        spec, options, new_server, client = build(name, chosen, train)
        server = new_server()
    except ConfigError as error:  # a combination the method refuses (proto-only with hyper, DP-SGD's limits)
        pytest.skip(f"refused: {error}")
    layout = server.reply_layout()
    replies = fitted_replies(spec, options, server, client)
    for reply in replies:
        assert layout_problem(reply, layout) is None, layout_problem(reply, layout)

    if privacy == "client":
        settings = ClientPrivacy(clip=1.0, noise_multiplier=0.0)
        broadcast = server.broadcast(0)["weights"]
        class_keys = [key for key, entry in layout.items()
                      if isinstance(entry, ClassRows) and entry.dtype.is_floating_point]
        uploads = [privatize_upload(reply, broadcast, class_keys, settings, None, NUM_CLASSES) for reply in replies]
        private_layout = privatized_layout(layout, NUM_CLASSES)
        for upload in uploads:
            assert layout_problem(upload, private_layout) is None, layout_problem(upload, private_layout)
        total = PrivateSum(settings, broadcast, layout, NUM_CLASSES, expected_clients=len(uploads))
        for upload in uploads:
            assert total.problem(upload) is None
            total.add(upload)
        released = [private_reply(total.release(None), broadcast, layout)]
        reads, _ = keys_read(server, 0, released)
        # the privacy's own keys are read by the private sum; the method's by its server, from the release
        unread = sorted(set(layout) - reads)
        assert not unread, f"{name} {chosen} privacy=client: declared, never read by the server: {unread}"
        assert HOLDERS_KEY not in layout
        return

    reads, _ = keys_read(server, 0, replies)
    unread = sorted(set(layout) - reads)
    assert not unread, (f"{name} {chosen} privacy={privacy}: the server never reads {unread}; declare a key in "
                        "Server.reply_layout() only where the server reads it, and upload only what it declares")
    assert sent_not_read(replies, reads) == []
    if privacy == "sample":
        return
    # read, and used: changing a class tensor's values changes what the server keeps or sends
    baseline = outcome(new_server(), 0, replies)
    for key, entry in layout.items():
        if isinstance(entry, ClassRows) and entry.dtype.is_floating_point:
            changed = outcome(new_server(), 0, [perturbed(reply, key) for reply in replies])
            assert not same(changed, baseline), (f"{name} {chosen}: the server reads '{key}' but nothing it keeps "
                                                 "or sends depends on it; do not upload it")


def test_the_recorder_sees_what_fedhpro_would_have_sent_unread():
    """The check catches an upload the server does not read: a FedHPro reply with its prototypes under
    ``prototypes=hyper`` (what it sent before) leaves them unread, and the round chain refuses it."""
    spec, options, new_server, client = build("fedhpro", {}, TRAIN)
    server = new_server()
    replies = fitted_replies(spec, options, server, client)
    padded = [{**reply, "prototypes": torch.zeros(NUM_CLASSES, 16)} for reply in replies]
    reads, _ = keys_read(server, 0, padded)
    assert sent_not_read(padded, reads) == ["prototypes"]
    problem = layout_problem(padded[0], server.reply_layout())
    assert problem is not None and "'prototypes'" in problem and "Server.reply_layout()" in problem


@pytest.mark.parametrize("privacy", ["none", "client"])
def test_the_round_chain_refuses_an_undeclared_or_missing_key_in_one_line(privacy):
    """Every engine's round chain (:class:`~fedhpro.engines.replies.LayoutChecks`) refuses a reply whose keys are
    not the declared layout (privatized under ``privacy=client``), naming the key and the fix; an honest reply
    of the same round passes."""
    options = get_method("fedproto").options()
    federation = make_federation([16, 16, 16], classes=[list(c) for c in (*CLIENT_CLASSES, [0, 2])], seed=3)
    sim = Simulator(get_method("fedproto"), options, federation, TinyNet, TRAIN, rounds=1, seed=5,
                    privacy=PrivacyOptions(mode="client", clip=1.0, noise_multiplier=0.5) if privacy == "client"
                    else None)
    current = sim.protocol.open(0)
    replies = []
    for k in range(3):
        reply, _ = client_step(sim.server, sim.client, sim.models.model_for(k), current.payload,
                               federation.clients[k], {}, sim.seed, 0, k, sim.protocol.client_privacy)
        replies.append(reply)
    assert current.receive(0, {**replies[0], "secret": torch.ones(3)}, {}, 16) is Reception.INVALID
    reason = current.dropped[-1]["reason"]
    assert "'secret'" in reason and "Server.reply_layout()" in reason and "\n" not in reason
    missing = "prototypes" if privacy == "none" else HOLDERS_KEY
    assert current.receive(1, {key: value for key, value in replies[1].items() if key != missing}, {}, 16) \
        is Reception.INVALID
    assert f"'{missing}'" in current.dropped[-1]["reason"]
    assert current.receive(2, replies[2], {}, 16) is Reception.ACCEPTED
