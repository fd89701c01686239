"""Adaptive clipping (``privacy.clip_quantile``, Andrew et al. 2021): the clip follows a quantile of the clients'
update norms, from their noised count below it, and the accountant counts that release.

References: the clip's trajectory on fixed update norms recomputed by hand in plain Python (the fraction of
norms at most the clip, then ``C exp(-lr (fraction - quantile))``); dp-accounting's RDP accountant and
Opacus's on the same composed Gaussians; a run's rows against the update rule; a resumed run against the
uninterrupted one, byte for byte; the Flower engine against the simulator (tests/test_flower_secagg.py).
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from dp_accounting import ComposedDpEvent, GaussianDpEvent, PoissonSampledDpEvent
from dp_accounting.rdp import RdpAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from fedhpro.config import PrivacyOptions
from fedhpro.errors import ConfigError
from fedhpro.privacy import ClientLedger, ClientPrivacy, PrivateSum, privatize_upload
from fedhpro.privacy.client import BELOW_CLIP_KEY, next_clip

WHOLE_ORDERS = list(range(2, 64)) + [128, 256, 512, 1024]


def _upload(norm: float, size: int = 4) -> dict:
    """A reply whose update (against zero weights) has L2 norm ``norm``."""
    direction = torch.ones(size, dtype=torch.float64) / math.sqrt(size)
    return {"weights": {"w": (direction * norm).float()}, "num_examples": 10}


def test_the_clip_follows_the_quantile_on_fixed_norms_as_computed_by_hand():
    norms = [0.3, 0.7, 1.2, 2.5, 4.0]
    quantile, lr, clip = 0.6, 0.2, 0.1
    expected = [clip]
    for _ in range(30):  # by hand: the fraction of norms at most the clip, then the geometric step
        fraction = sum(1 for n in norms if n <= expected[-1]) / len(norms)
        expected.append(expected[-1] * math.exp(-lr * (fraction - quantile)))
    broadcast = {"w": torch.zeros(4)}
    layout = {"weights": {"w": ((4,), torch.float32)}, "num_examples": int}
    clips = [clip]
    for _ in range(30):
        settings = ClientPrivacy(clip=clips[-1], noise_multiplier=0.0, adaptive=True, quantile_noise=1.0)
        total = PrivateSum(settings, broadcast, layout, num_classes=2, expected_clients=len(norms))
        for norm in norms:
            upload = privatize_upload(_upload(norm), broadcast, [], settings)
            assert float(upload[BELOW_CLIP_KEY][0]) == (0.5 if norm <= clips[-1] else -0.5)
            total.add(upload)
        release = total.release(None)  # no noise: the fraction itself
        clips.append(next_clip(clips[-1], release.below_clip, quantile, lr))
    assert clips == pytest.approx(expected, rel=1e-12)
    # it settles between the 3rd and 4th smallest norms (the 0.6 quantile of five), starting far below them
    assert 1.2 * 0.8 < clips[-1] < 2.5 * 1.25


def test_the_server_bounds_what_one_indicator_can_move_under_central_noise():
    settings = ClientPrivacy(clip=1.0, noise_multiplier=0.0, adaptive=True, quantile_noise=1.0)
    broadcast = {"w": torch.zeros(4)}
    total = PrivateSum(settings, broadcast, {"weights": {"w": ((4,), torch.float32)}}, 2, expected_clients=2)
    honest = privatize_upload(_upload(0.5), broadcast, [], settings)
    lying = dict(honest, **{BELOW_CLIP_KEY: torch.tensor([1000.0])})  # claims to be a thousand clients below
    total.add(honest)
    total.add(lying)
    assert total.release(None).below_clip == pytest.approx((0.5 + 0.5) / 2 + 0.5)
    missing = {key: value for key, value in honest.items() if key != BELOW_CLIP_KEY}
    assert BELOW_CLIP_KEY in total.problem(missing)
    assert BELOW_CLIP_KEY in total.problem(dict(honest, **{BELOW_CLIP_KEY: torch.tensor([float("nan")])}))


def test_the_indicators_noise_has_the_stated_std_on_the_sum():
    settings = ClientPrivacy(clip=1.0, noise_multiplier=0.5, adaptive=True, quantile_noise=2.0)
    broadcast = {"w": torch.zeros(3)}
    layout = {"weights": {"w": ((3,), torch.float32)}}
    values = []
    for seed in range(2000):
        total = PrivateSum(settings, broadcast, layout, 2, expected_clients=10)
        values.append(total.release(torch.Generator().manual_seed(seed)).below_clip)
    std = float(torch.tensor(values, dtype=torch.float64).std()) * 10  # the sum's noise, before / expected
    assert abs(std / 2.0 - 1) < 5 / math.sqrt(2 * 2000)


def _ledger(quantile_noise: float, q: float = 0.1, clients: int = 1000, noise: str = "central",
            target: float = 0.0, class_tensors: bool = False) -> ClientLedger:
    options = PrivacyOptions(mode="client", noise=noise, noise_multiplier=1.1, clip_quantile=0.5,
                             quantile_noise=quantile_noise, delta=1e-5, target_epsilon=target)
    return ClientLedger(options, clients, 40, q, class_tensors, orders=WHOLE_ORDERS)


@pytest.mark.parametrize("class_tensors", [False, True])
def test_the_accountant_counts_the_indicator_release(class_tensors):
    book = _ledger(quantile_noise=3.0, class_tensors=class_tensors)
    events = [GaussianDpEvent(1.1)] * (2 if class_tensors else 1) + [GaussianDpEvent(6.0)]  # 2 x sigma_b
    accountant = RdpAccountant(orders=WHOLE_ORDERS)
    accountant.compose(PoissonSampledDpEvent(0.1, ComposedDpEvent(events)), 40)
    assert book.epsilon({}, 40) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    effective = sum(e.noise_multiplier ** -2 for e in events) ** -0.5  # Gaussians released together
    opacus, _ = get_privacy_spent(orders=WHOLE_ORDERS, delta=1e-5,
                                  rdp=compute_rdp(q=0.1, noise_multiplier=effective, steps=40, orders=WHOLE_ORDERS))
    assert book.epsilon({}, 40) == pytest.approx(float(opacus), rel=1e-9)
    fixed = ClientLedger(PrivacyOptions(mode="client", noise_multiplier=1.1, delta=1e-5), 1000, 40, 0.1,
                         class_tensors, orders=WHOLE_ORDERS)
    assert book.epsilon({}, 40) > fixed.epsilon({}, 40)  # the release is not free
    assert "below the clip" in " ".join(book.describe()["mechanisms"])


def test_the_default_indicator_noise_is_the_cohort_over_20_and_local_noise_counts_sensitivity_1():
    assert _ledger(0.0, q=0.1, clients=1000).quantile_noise == pytest.approx(5.0)  # 100 a round / 20
    local = _ledger(2.0, noise="local")
    accountant = RdpAccountant(orders=WHOLE_ORDERS)
    accountant.compose(ComposedDpEvent([GaussianDpEvent(1.1 / 2), GaussianDpEvent(2.0)]), 7)
    assert local.epsilon({0: 7, 1: 3}, 40) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


def test_a_target_the_indicator_alone_exceeds_is_one_line_naming_quantile_noise():
    with pytest.raises(ConfigError, match="privacy.quantile_noise") as error:
        _ledger(quantile_noise=0.05, q=1.0, clients=20, target=1.0)
    assert "\n" not in str(error.value)


def _tiny(data_dir, out, **extra) -> list[str]:
    settings = {"method": "fedavg", "rounds": 4, "clients": 4, "data.fraction": 0.02,
                "data.syn_size": DIGITS_SYN_SIZE, "data.test_fraction": DIGITS_TEST_FRACTION, "feature_dim": 16,
                "local_epochs": 1, "progress": "false", "threads": 1, "data_dir": str(data_dir), "seed": 3,
                "privacy": "client", "privacy.noise_multiplier": 0.01, "privacy.clip": 10.0,
                "privacy.clip_quantile": 0.5, "privacy.delta": 1e-3, "checkpoint_every": 1, "out": str(out), **extra}
    return ["run", *[f"{key}={value}" for key, value in settings.items()]]


@pytest.mark.slow
def test_a_run_moves_its_clip_by_the_rule_and_resumes_to_the_same_bytes(digits_data_dir, tmp_path):
    from fedhpro import cli
    from fedhpro.engines import checkpoint

    reference = tmp_path / "reference"
    assert cli.main(_tiny(digits_data_dir, reference)) == 0
    rows = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    clips = [row["privacy"]["clip"] for row in rows]
    assert clips[0] == 10.0
    for row, following in zip(rows, clips[1:]):
        assert following == pytest.approx(next_clip(row["privacy"]["clip"], row["privacy"]["below_clip"], 0.5, 0.2),
                                          rel=1e-12)
    assert clips[-1] < clips[0] * 0.85  # a clip far above the updates' norms shrinks (all of them fit under it)
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["privacy"]["clip_quantile"] == 0.5 and summary["privacy"]["quantile_noise"] == pytest.approx(0.2)

    # the run as if killed after round 3's checkpoint (the newest two are kept): the last one and the end's files
    # gone; the resumed round must start from the clip the rounds before moved it to
    killed = tmp_path / "killed"
    shutil.copytree(reference, killed)
    for name in ("summary.json", "model.pt", "model.json", "server_state.pt"):
        (killed / name).unlink(missing_ok=True)
    for path in (killed / "checkpoints").iterdir():
        if path.name > "round-000003.pt":
            path.unlink()
    assert checkpoint.latest(killed).name == "round-000003.pt" and clips[3] != clips[0]
    assert cli.main(["run", f"resume={killed}", "progress=false"]) == 0
    assert (killed / "metrics.jsonl").read_bytes() == (reference / "metrics.jsonl").read_bytes()


@pytest.mark.parametrize("below", [-50.0, -1e6, 1e6, 50.0, float("-inf")])
def test_one_round_moves_the_clip_by_at_most_exp_lr_whatever_the_release(below):
    # the released fraction is clamped to [0, 1] before the step: by hand, clip x exp(-lr (0 - q)) for a release
    # below 0 and clip x exp(-lr (1 - q)) above 1 (before: -50 took the clip 1 -> 6.7 in one round at lr 0.2,
    # -1e6 raised OverflowError and +1e6 gave a clip of 0, refused as "clip must be > 0")
    quantile, lr = 0.5, 0.2
    clip = next_clip(1.0, below, quantile, lr)
    fraction = 0.0 if below < 0 else 1.0
    assert clip == pytest.approx(math.exp(-lr * (fraction - quantile)), rel=1e-15)
    assert math.exp(-lr) <= clip <= math.exp(lr)
    ClientPrivacy(clip=clip, noise_multiplier=0.0, adaptive=True)  # a valid clip for the next round


def test_a_released_fraction_inside_0_1_moves_the_clip_as_before():
    assert next_clip(2.0, 0.3, 0.5, 0.2) == 2.0 * math.exp(-0.2 * (0.3 - 0.5))


def test_a_local_noise_indicator_beyond_half_plus_six_sigma_is_refused_and_an_honest_one_never():
    sigma = 0.25
    settings = ClientPrivacy(clip=1.0, noise_multiplier=0.0, noise="local", adaptive=True, quantile_noise=sigma)
    broadcast = {"w": torch.zeros(4)}
    layout = {"weights": {"w": ((4,), torch.float32)}}
    total = PrivateSum(settings, broadcast, layout, 2, expected_clients=3)
    honest = [privatize_upload(_upload(norm), broadcast, [], settings,
                               generator=torch.Generator().manual_seed(seed))
              for seed, norm in enumerate([0.5, 2.0] * 200)]
    assert all(total.problem(upload) is None for upload in honest)
    limit = 0.5 + 6 * sigma
    assert total.problem(dict(honest[0], **{BELOW_CLIP_KEY: torch.tensor([limit * 0.999])})) is None
    for lie in (-50.0, limit * 1.001, -1e6, 1e6):
        reason = total.problem(dict(honest[0], **{BELOW_CLIP_KEY: torch.tensor([lie])}))
        assert reason is not None and BELOW_CLIP_KEY in reason and "quantile_noise" in reason
    # under central noise the server clamps each indicator itself: nothing is refused for its size
    central = PrivateSum(ClientPrivacy(clip=1.0, noise_multiplier=0.0, adaptive=True, quantile_noise=sigma),
                         broadcast, layout, 2, expected_clients=3)
    assert central.problem(dict(honest[0], **{BELOW_CLIP_KEY: torch.tensor([-50.0])})) is None
