"""Client-level differential privacy (``privacy=client``): the sensitivity of the privatized sum for every
method, the noise's scale, the release's closed form, Poisson sampling, the refused combinations and
runs end to end.

References: the clip bound ``C`` itself (one client's data moves the noiseless sum by at most ``2C``
when replaced, ``C`` when removed: the adjacency the accountant uses), ``sigma x C`` against the sample
std of 2,000 draws (its standard error is ``1 / sqrt(2 n)``), the release recomputed by hand in float64
from the clipped vectors, NumPy's uniform draws read independently, and dp-accounting called directly.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION, TinyBNNet, TinyNet, make_federation

from fedhpro.config import PrivacyOptions, load_config
from fedhpro.data.federation import ClientData
from fedhpro.engines.class_rows import declared_class_keys
from fedhpro.engines.protocol import train_generator
from fedhpro.engines.simulator import Simulator, derive_seed
from fedhpro.errors import ConfigError
from fedhpro.experiment import protocol_settings
from fedhpro.methods import BUILTIN_METHODS, METHODS, TrainSettings
from fedhpro.methods.layout import ClassRows
from fedhpro.privacy import (
    HOLDERS_KEY,
    ClientPrivacy,
    PrivacyError,
    PrivateSum,
    client_privacy,
    privatize_upload,
    privatized_layout,
    upload_noise_generator,
)
from fedhpro.privacy.client import poisson_participants, private_reply

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=0.0)
SIZES = [24, 32, 40, 28]
CLASSES = [[0, 1], [1, 2, 3], [0, 2], [0, 1, 2, 3]]
SAMPLE_STREAM = 2  # derive_seed(seed, 2, round): the protocol's documented sampling stream

#: every registered method, plus the variants that upload more (hyper class gradients, the synthetic classifier
#: step's classifier gradients, proto-only without weights, FedHPro's global prototypes)
VARIANTS = [(name, {}) for name in BUILTIN_METHODS] + [
    ("fedproto", {"prototypes": "hyper", "match_steps": 1}),
    ("fedgmkd", {"protocol": "proto-only"}),
    ("fedhpro", {"classifier_step": "synthetic", "match_steps": 1}),
    ("fedhpro", {"prototypes": "global", "match_steps": 1}),
]


def _options(method: str, changes: dict):
    options = METHODS[method].options()
    if method in ("fedhpro",) and "match_steps" not in changes:
        changes = {**changes, "match_steps": 1}
    if method == "fedtgp":
        changes = {**changes, "server_epochs": 2}
    return dataclasses.replace(options, **changes)


def _simulator(method: str, changes: dict, privacy: PrivacyOptions, model=TinyNet, participation: float = 1.0):
    options = _options(method, changes)
    shared = "none" if getattr(options, "protocol", "dagger") == "proto-only" else None
    federation = make_federation(SIZES, classes=CLASSES, seed=3)
    return Simulator(METHODS[method], options, federation, model, TRAIN, rounds=3, seed=5, shared=shared,
                     privacy=privacy, participation=participation)


def _fit(sim: Simulator, k: int, data: ClientData, payload: dict) -> dict:
    """Client ``k``'s reply of round 0 on ``data`` (its own state and model untouched)."""
    model = sim.models.model_for(k)
    reply, _ = sim.client.fit(model, payload, data, copy.deepcopy(sim.client_states[k]),
                              train_generator(sim.seed, 0, k))
    return reply


def _random_data(data: ClientData, seed: int) -> ClientData:
    """Arbitrary data of the same input shape: random inputs, random labels of a random class subset."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(8, 48, (1,), generator=g))
    held = torch.randperm(data.num_classes, generator=g)[:int(torch.randint(1, data.num_classes + 1, (1,),
                                                                            generator=g))]
    y = held[torch.randint(0, held.numel(), (n,), generator=g)]
    x = 3.0 * torch.randn(n, *data.x.shape[1:], generator=g)
    return ClientData(x, y, data.num_classes)


def _sum(sim: Simulator, settings: ClientPrivacy, payload: dict, uploads: list[dict]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The noiseless sum of the uploads (the server's code) and of their holder vectors."""
    private = PrivateSum(settings, payload.get("weights") or {}, sim.server.reply_layout(),
                         sim.federation.num_classes, len(uploads))
    for upload in uploads:
        assert private.problem(upload) is None
        private.add(upload)
    return private.flat_sum(), private.holder_sum.clone()


@pytest.mark.parametrize(("method", "changes"), VARIANTS, ids=[f"{m}-{'-'.join(map(str, c.values())) or 'default'}"
                                                                 for m, c in VARIANTS])
@pytest.mark.parametrize("clipping", ["joint", "per-group"])
def test_one_clients_data_moves_the_noiseless_sum_by_at_most_2C_replaced_and_C_removed(method, changes, clipping):
    clip = 0.05
    privacy = PrivacyOptions(mode="client", clip=clip, clipping=clipping, noise_multiplier=1.0)
    sim = _simulator(method, changes, privacy, model=TinyBNNet if method == "fedavg" else TinyNet)
    settings = sim.protocol.client_privacy
    assert settings is not None and settings.clip == clip
    payload = sim.server.broadcast(0)
    keys = declared_class_keys(sim.server)
    classes = sim.federation.num_classes

    def private(reply: dict) -> dict:
        return privatize_upload(reply, payload.get("weights") or {}, keys, settings, None, classes)

    raw_settings = dataclasses.replace(settings, clip=1e12)
    replies = [_fit(sim, k, sim.federation.clients[k], payload) for k in range(len(SIZES))]
    uploads = [private(reply) for reply in replies]
    total, holders = _sum(sim, settings, payload, uploads)
    j = 1
    without, holders_without = _sum(sim, settings, payload, uploads[:j] + uploads[j + 1:])
    assert float((total - without).norm()) <= clip * (1 + 1e-6)
    assert float((holders - holders_without).norm()) <= math.sqrt(classes) + 1e-9
    largest_raw = 0.0
    for trial in range(3):
        replaced = _fit(sim, j, _random_data(sim.federation.clients[j], seed=100 + trial), payload)
        upload = private(replaced)
        # nothing but the privatized vector and the holders depends on the data: the rest is public constants
        public = {key: value for key, value in upload.items() if key not in ("weights", HOLDERS_KEY, *keys)}
        original = {key: value for key, value in uploads[j].items() if key not in ("weights", HOLDERS_KEY, *keys)}
        assert public.keys() == original.keys()
        for key in public:
            assert torch.equal(torch.as_tensor(public[key]), torch.as_tensor(original[key])), key
        moved, holders_moved = _sum(sim, settings, payload, uploads[:j] + [upload] + uploads[j + 1:])
        assert float((total - moved).norm()) <= 2 * clip * (1 + 1e-6)
        assert float((holders - holders_moved).norm()) <= math.sqrt(classes) + 1e-9
        raw_old = privatize_upload(replies[j], payload.get("weights") or {}, keys, raw_settings, None, classes)
        raw_new = privatize_upload(replaced, payload.get("weights") or {}, keys, raw_settings, None, classes)
        old_sum, _ = _sum(sim, raw_settings, payload, [raw_old])
        new_sum, _ = _sum(sim, raw_settings, payload, [raw_new])
        largest_raw = max(largest_raw, float((old_sum - new_sum).norm()))
    # the bound holds because of the clipping, not because the updates are small anyway
    assert largest_raw > 2 * clip


def test_the_privatized_reply_keeps_the_methods_layout_with_public_counts():
    privacy = PrivacyOptions(mode="client", clip=0.5, noise_multiplier=1.0)
    sim = _simulator("fedhpro", {}, privacy)
    payload = sim.server.broadcast(0)
    reply = _fit(sim, 0, sim.federation.clients[0], payload)
    settings = sim.protocol.client_privacy
    upload = privatize_upload(reply, payload["weights"], declared_class_keys(sim.server), settings, None, 4)
    layout = privatized_layout(sim.server.reply_layout(), 4)
    assert set(upload) == set(layout)
    assert upload["num_examples"] == 1
    assert torch.equal(upload["class_counts"], torch.zeros(4, dtype=torch.int64))
    assert torch.equal(upload[HOLDERS_KEY], torch.tensor([1.0, 1.0, 0.0, 0.0]))  # client 0 holds classes 0, 1
    assert layout[HOLDERS_KEY] == ClassRows((4,), torch.float32)
    assert not bool(upload["class_gradients"][2:].any())
    assert "prototypes" not in upload  # fedhpro.prototypes=hyper: the server reads none, so none share the clip
    norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in upload["weights"].values())
                     + sum(float(upload[k].double().pow(2).sum()) for k in declared_class_keys(sim.server)))
    assert norm == pytest.approx(0.5, rel=1e-6)  # the raw update is longer: clipped to exactly C
    private = PrivateSum(settings, payload["weights"], sim.server.reply_layout(), 4, 4.0)
    assert private.problem(upload) is None
    assert "not privatized" in private.problem(reply)  # a raw reply: its weights are a model, not an update
    with pytest.raises(PrivacyError, match="'secret'"):
        privatize_upload({**reply, "secret": torch.ones(3)}, payload["weights"], declared_class_keys(sim.server),
                         settings)


def test_release_without_noise_is_the_clipped_sum_over_public_denominators():
    settings = ClientPrivacy(clip=1.0, noise_multiplier=0.0)
    broadcast = {"w": torch.tensor([1.0, 2.0]), "count": torch.tensor(7)}
    layout = {"weights": {"w": ((2,), torch.float32), "count": ((), torch.int64)}, "num_examples": int,
              "rows": ClassRows((3, 2), torch.float32), "class_counts": ClassRows((3,), torch.int64)}
    replies = [
        {"weights": {"w": torch.tensor([4.0, 6.0]), "count": torch.tensor(9)}, "num_examples": 12,
         "rows": torch.tensor([[0.0, 0.0], [0.5, 0.0], [0.0, 0.0]]), "class_counts": torch.tensor([0, 5, 0])},
        {"weights": {"w": torch.tensor([1.0, 2.5]), "count": torch.tensor(8)}, "num_examples": 3,
         "rows": torch.tensor([[0.0, 0.2], [0.0, 0.0], [9.0, 9.0]]), "class_counts": torch.tensor([3, 0, 0])},
    ]
    uploads = [privatize_upload(r, broadcast, ["rows"], settings, None, 3) for r in replies]
    private = PrivateSum(settings, broadcast, layout, 3, expected_clients=4.0)
    for upload in uploads:
        private.add(upload)
    release = private.release(None)
    # by hand: client 0's vector (3, 4, 0.5) has norm sqrt(25.25) -> scaled by 1/sqrt(25.25); client 1's
    # (0, 0.5, 0.2) has norm sqrt(0.29) < 1 and its unheld rows (class 2's 9, 9) are zeroed
    s0 = 1.0 / math.sqrt(25.25)
    expected_update = torch.tensor([3.0 * s0 + 0.0, 4.0 * s0 + 0.5], dtype=torch.float64) / 4.0
    assert torch.allclose(release.update["w"], expected_update, atol=1e-12)
    assert torch.equal(release.counts, torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64))
    assert release.held.tolist() == [True, True, False]
    assert torch.allclose(release.rows["rows"], torch.tensor([[0.0, 0.2], [0.5 * s0, 0.0], [0.0, 0.0]],
                                                             dtype=torch.float64), atol=1e-7)
    reply = private_reply(release, broadcast, layout)
    assert torch.allclose(reply["weights"]["w"], broadcast["w"] + expected_update.float())
    assert torch.equal(reply["weights"]["count"], broadcast["count"])  # counters are not released
    assert reply["num_examples"] == 1 and reply["class_counts"].tolist() == [1, 1, 0]


def test_noise_std_is_sigma_times_clip_over_2000_draws_central_and_local():
    draws, sigma, clip, classes = 2000, 0.7, 0.3, 5
    settings = ClientPrivacy(clip=clip, noise_multiplier=sigma)
    broadcast = {"w": torch.zeros(3)}
    layout = {"weights": {"w": ((3,), torch.float32)}, "rows": ClassRows((classes, 2), torch.float32)}
    update, rows, counts = [], [], []
    for i in range(draws):
        release = PrivateSum(settings, broadcast, layout, classes, expected_clients=1.0).release(
            upload_noise_generator(settings, seed=i, round=0))
        update.append(release.update["w"])
        counts.append(release.counts)
        rows.append(release.rows["rows"] * release.counts.clamp(min=1).unsqueeze(1) * release.held.unsqueeze(1))
    bound = 5.0 / math.sqrt(2 * draws)  # five standard errors of a sample std
    update_std = torch.stack(update).std(0)
    assert torch.all((update_std / (sigma * clip) - 1).abs() < bound), update_std
    assert torch.all((torch.stack(counts).std(0) / (sigma * math.sqrt(classes)) - 1).abs() < bound)
    held_rows = torch.stack(rows)[torch.stack(counts) >= 0.5]  # noise of the held rows' sums
    assert held_rows.shape[0] > draws  # each class is released in roughly half the draws
    assert abs(float(held_rows.std()) / (sigma * clip) - 1) < bound * 2
    assert torch.all(torch.stack(update).mean(0).abs() < 5 * sigma * clip / math.sqrt(draws))

    local = dataclasses.replace(settings, noise="local")
    reply = {"weights": {"w": torch.tensor([0.1, 0.0, 0.0])}, "rows": torch.zeros(classes, 2),
             "class_counts": torch.tensor([1, 0, 2, 0, 0])}
    noise, holder_noise = [], []
    for i in range(draws):
        upload = privatize_upload(reply, broadcast, ["rows"], local, upload_noise_generator(local, 0, 0, client=i),
                                  classes)
        noise.append(torch.cat([upload["weights"]["w"] - torch.tensor([0.1, 0.0, 0.0]), upload["rows"].flatten()]))
        holder_noise.append(upload[HOLDERS_KEY] - torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0]))
    std = torch.stack(noise).double().std(0)
    assert torch.all((std / (sigma * clip) - 1).abs() < bound), std
    assert torch.all((torch.stack(holder_noise).double().std(0) / (sigma * math.sqrt(classes)) - 1).abs() < bound)
    # every row is noised, held or not: a zero row would tell which classes a client does not hold
    assert bool((torch.stack(noise)[:, 3:] != 0).all())


def test_local_noise_leaves_the_server_nothing_to_add_and_seeds_each_client_apart():
    settings = ClientPrivacy(clip=1.0, noise_multiplier=1.0, noise="local")
    a = upload_noise_generator(settings, 7, 2, client=0).initial_seed()
    b = upload_noise_generator(settings, 7, 2, client=1).initial_seed()
    server = upload_noise_generator(settings, 7, 2).initial_seed()
    assert len({a, b, server}) == 3
    assert a == derive_seed(7, 6, 2, 0) and server == derive_seed(7, 7, 2)
    private = PrivateSum(settings, {"w": torch.zeros(2)}, {"weights": {}}, 0, 1.0)
    private.add({"weights": {"w": torch.tensor([5.0, 0.0])}})  # noised by the client: the server cannot clip it
    assert torch.equal(private.release(upload_noise_generator(settings, 7, 2)).update["w"],
                       torch.tensor([5.0, 0.0], dtype=torch.float64))
    secure = dataclasses.replace(settings, secure_noise=True)
    assert (upload_noise_generator(secure, 7, 2, 0).initial_seed()
            != upload_noise_generator(secure, 7, 2, 0).initial_seed())


def test_poisson_sampling_draws_each_client_with_the_participation_rate():
    privacy = PrivacyOptions(mode="client", clip=1.0, noise_multiplier=1.0)
    sim = _simulator("fedavg", {}, privacy, participation=0.5)
    for round in range(40):
        uniforms = np.random.default_rng(derive_seed(5, SAMPLE_STREAM, round)).random(len(SIZES))
        assert sim.protocol.sample_clients(round) == [k for k in range(len(SIZES)) if uniforms[k] < 0.5]
    sizes = [len(poisson_participants(derive_seed(1, SAMPLE_STREAM, r), 200, 0.1)) for r in range(200)]
    assert abs(np.mean(sizes) - 20.0) < 5 * math.sqrt(200 * 0.1 * 0.9 / 200)
    assert sim.protocol.ledger.sampling_rate == 0.5
    assert poisson_participants(0, 4, 1.0) == [0, 1, 2, 3]


def test_the_methods_aggregate_of_the_release_is_the_privatized_value():
    privacy = PrivacyOptions(mode="client", clip=0.5, noise_multiplier=0.8)
    sim = _simulator("fedproto", {}, privacy)
    captured = {}
    release = PrivateSum.release

    def spy(self, generator):
        captured["release"] = out = release(self, generator)
        return out

    before = {key: value.clone() for key, value in sim.server.weights.items()}
    PrivateSum.release = spy
    try:
        record = sim.run_round(0)
    finally:
        PrivateSum.release = release
    out = captured["release"]
    for key, value in sim.server.weights.items():
        assert torch.allclose(value.double(), before[key].double() + out.update[key], atol=1e-6)
    held = out.held
    assert torch.allclose(sim.server.prototypes[held].double(), out.rows["prototypes"][held], atol=1e-6)
    assert record.train == {}  # the clients' losses are not collected under client-level DP
    assert record.to_json()["privacy"]["epsilon"] > 0


def test_refused_combinations_say_why_in_one_line():
    for extra, word in ((["aggregation=median"], "median"), (["aggregation=trimmed-mean"], "trimmed-mean"),
                        (["aggregation=norm-clip"], "norm-clip"), (["min_clients=2"], "min_clients")):
        with pytest.raises(ConfigError, match=word) as error:  # refused as the config is read (before torch)
            load_config(None, ["privacy=client", *extra])
        assert "\n" not in str(error.value) and "privacy=client" in str(error.value)
        # and by the run itself for a config changed after it was read
        key, value = extra[0].split("=")
        private = load_config(None, ["privacy=client"])
        changed = (dataclasses.replace(private, aggregation=dataclasses.replace(private.aggregation, rule=value))
                   if key == "aggregation" else
                   dataclasses.replace(private, run=dataclasses.replace(private.run, min_clients=int(value))))
        with pytest.raises(ConfigError, match=word):
            protocol_settings(changed)
    protocol_settings(load_config(None, ["privacy=client"]))
    protocol_settings(load_config(None, ["aggregation=median"]))


@pytest.mark.parametrize("method", ["fedavg", "fedhpro"])
def test_a_privacy_client_run_writes_epsilon_rows_and_a_summary(method, digits_data_dir, tmp_path):
    from dp_accounting import ComposedDpEvent, GaussianDpEvent, PoissonSampledDpEvent
    from dp_accounting.rdp import RdpAccountant

    from fedhpro.api import run

    out = tmp_path / "run"
    result = run(overrides=[f"method={method}", "rounds=2", "clients=4", "data.fraction=0.02",
                            f"data.syn_size={DIGITS_SYN_SIZE}", f"data.test_fraction={DIGITS_TEST_FRACTION}",
                            "feature_dim=16", "local_epochs=1", "seed=1", "progress=false", "threads=1",
                            f"data_dir={digits_data_dir}", "privacy=client", "privacy.clip=0.5",
                            "privacy.noise_multiplier=1.2", "fedhpro.match_steps=2", f"out={out}"], echo=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    delta = 1.0 / 4 ** 1.1
    gaussians = [GaussianDpEvent(1.2)] * (2 if method == "fedhpro" else 1)  # + the holder counts
    for r, row in enumerate(rows):
        accountant = RdpAccountant()
        accountant.compose(PoissonSampledDpEvent(1.0, ComposedDpEvent(gaussians)), r + 1)
        assert row["privacy"]["epsilon"] == pytest.approx(accountant.get_epsilon(delta), rel=1e-9)
        assert row["privacy"]["delta"] == pytest.approx(delta)
        assert row["train"] == {}
    summary = json.loads((out / "summary.json").read_text())
    assert summary == result.summary
    privacy = summary["privacy"]
    assert privacy["mode"] == "client" and privacy["clip"] == 0.5 and privacy["noise_multiplier"] == 1.2
    assert privacy["sampling_rate"] == 1.0 and privacy["epsilon"] == rows[-1]["privacy"]["epsilon"]
    assert "RdpAccountant" in privacy["accountant"] and privacy["rounds_run"] == 2
    assert "privacy" in (out / "config.yaml").read_text()


def test_under_central_noise_the_server_clips_again_so_a_hostile_upload_weighs_at_most_C():
    settings = ClientPrivacy(clip=0.5, noise_multiplier=1.0)
    layout = {"weights": {"w": ((3,), torch.float32)}, "rows": ClassRows((2, 2), torch.float32)}
    honest = privatize_upload({"weights": {"w": torch.tensor([3.0, 0.0, 4.0])}, "rows": torch.ones(2, 2),
                               "class_counts": torch.tensor([1, 1])}, {"w": torch.zeros(3)}, ["rows"], settings)
    scaled = {**honest, "weights": {"w": 100 * honest["weights"]["w"]}, "rows": 100 * honest["rows"],
              HOLDERS_KEY: torch.tensor([100.0, -3.0])}
    private = PrivateSum(settings, {"w": torch.zeros(3)}, layout, 2, 1.0)
    private.add(scaled)
    assert float(private.flat_sum().norm()) == pytest.approx(0.5, rel=1e-9)
    assert private.holder_sum.tolist() == [1.0, 0.0]  # projected into [0, 1]
    local = PrivateSum(dataclasses.replace(settings, noise="local"), {"w": torch.zeros(3)}, layout, 2, 1.0)
    local.add(scaled)  # a noised upload cannot be re-clipped: local noise rests on the clients' honesty
    assert float(local.flat_sum().norm()) == pytest.approx(50.0, rel=1e-6)


def test_a_round_nobody_takes_part_in_releases_noise_only():
    privacy = PrivacyOptions(mode="client", clip=0.5, noise_multiplier=1.0)
    sim = _simulator("fedproto", {}, privacy, participation=0.05)
    empty = next(r for r in range(200) if not sim.protocol.sample_clients(r))
    before = {key: value.clone() for key, value in sim.server.weights.items()}
    record = sim.run_round(empty)
    assert record.participants is None and record.extra["num_participants"] == 0  # who took part stays out
    assert not record.skipped and record.bytes_up == 0
    assert any(not torch.equal(before[key], value) for key, value in sim.server.weights.items())  # the noise
    assert record.to_json()["privacy"]["epsilon"] >= 0.0  # (with 4 clients' delta of 0.22, possibly 0)


@pytest.mark.parametrize("noise", ["central", "local"])
def test_secure_noise_unset_or_false_is_the_seeded_noise_true_the_operating_systems(noise):
    """privacy.secure_noise unset (None: the simulator's default) draws the same noise as false, from the run's
    seed; true draws a different noise each time, central (the server's) and local (a client's) alike."""
    reply = {"weights": {"w": torch.tensor([3.0, 4.0])}, "num_examples": 5}
    broadcast = {"w": torch.zeros(2)}

    def draw(secure_noise):
        options = PrivacyOptions(mode="client", noise=noise, secure_noise=secure_noise, clipping="joint")
        settings = client_privacy(options, 1.0)
        client = None if noise == "central" else 3
        generator = upload_noise_generator(settings, 11, 4, client)
        if noise == "local":
            return privatize_upload(reply, broadcast, [], settings, generator)["weights"]["w"]
        private = PrivateSum(settings, broadcast, {"weights": {}}, 0, 1.0)
        private.add(privatize_upload(reply, broadcast, [], settings))
        return private.release(generator).update["w"]

    assert PrivacyOptions().secure_noise is None
    unset, false = draw(None), draw(False)
    assert torch.equal(unset, false) and torch.equal(unset, draw(None))
    assert not torch.equal(draw(True), draw(True)) and not torch.equal(draw(True), unset)
