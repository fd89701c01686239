"""``privacy.noise_cohort``: central noise and the accountant calibrated as if a larger cohort took part.

References: Opacus's RDP accountant at the noise cohort's sampling rate ``M / N`` (the ledger must report
what a run with ``M`` clients a round would spend), the release's noise recomputed from the same seeded
draws (the sum's noise std is ``sigma C m / M``, so the mean update's is ``sigma C / M``), a sample std over
2,000 draws, and the run's printout and summary read back.
"""

from __future__ import annotations

import dataclasses

import json
import math

import pytest
import torch
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from fedhpro.config import PrivacyOptions, load_config
from fedhpro.errors import ConfigError
from fedhpro.experiment import protocol_settings
from fedhpro.privacy import ClientLedger, ClientPrivacy, PrivateSum, client_privacy, upload_noise_generator

WHOLE_ORDERS = list(range(2, 64)) + [128, 256, 512, 1024]


def _ledger(cohort: int, participation: float, clients: int, sigma: float = 1.0, noise: str = "central",
            target: float = 0.0) -> ClientLedger:
    options = PrivacyOptions(mode="client", noise=noise, noise_multiplier=sigma, noise_cohort=cohort, delta=1e-5,
                             target_epsilon=target)
    return ClientLedger(options, clients, 50, participation, False, orders=WHOLE_ORDERS)


def test_the_epsilon_is_the_noise_cohorts_by_opacus():
    book = _ledger(cohort=1000, participation=0.01, clients=10_000, sigma=0.9)
    assert book.sampling_rate == pytest.approx(0.1) and book.noise_scale == pytest.approx(100 / 1000)
    epsilon, _ = get_privacy_spent(orders=WHOLE_ORDERS, delta=1e-5,
                                   rdp=compute_rdp(q=0.1, noise_multiplier=0.9, steps=30, orders=WHOLE_ORDERS))
    assert book.epsilon({}, 30) == pytest.approx(float(epsilon), rel=1e-9)
    # the run's own cohort (100 of 10,000) would spend far less at the same sigma: the cohort is not free
    own = _ledger(cohort=0, participation=0.01, clients=10_000, sigma=0.9)
    assert own.epsilon({}, 30) < book.epsilon({}, 30) / 2
    described = book.describe()
    assert described["noise_cohort"] == 1000 and described["trained_cohort"] == pytest.approx(100)
    assert described["sampling_rate"] == pytest.approx(0.1) and "simulation" in described["simulated"]


def test_target_epsilon_is_calibrated_for_the_noise_cohort():
    book = _ledger(cohort=500, participation=0.02, clients=5000, target=8.0)
    epsilon, _ = get_privacy_spent(orders=WHOLE_ORDERS, delta=1e-5,
                                   rdp=compute_rdp(q=0.1, noise_multiplier=book.noise_multiplier, steps=50,
                                                   orders=WHOLE_ORDERS))
    assert 8.0 * 0.98 <= float(epsilon) <= 8.0 * (1 + 1e-6)


def test_the_sums_noise_is_scaled_by_the_trained_over_the_noise_cohort():
    sigma, clip, classes = 0.8, 0.5, 4
    layout = {"weights": {"w": ((6,), torch.float32)}}
    broadcast = {"w": torch.zeros(6)}
    plain = ClientPrivacy(clip=clip, noise_multiplier=sigma)
    scaled = ClientPrivacy(clip=clip, noise_multiplier=sigma, noise_scale=10 / 250)
    for seed in range(3):  # the same draws, a 25th of the noise: exactly what 250 summed clients' noise would be
        a = PrivateSum(plain, broadcast, layout, classes, expected_clients=10).release(
            upload_noise_generator(plain, seed, 0))
        b = PrivateSum(scaled, broadcast, layout, classes, expected_clients=10).release(
            upload_noise_generator(scaled, seed, 0))
        assert torch.allclose(b.update["w"], a.update["w"] * (10 / 250), rtol=1e-12, atol=0)
    draws = [PrivateSum(scaled, broadcast, layout, classes, expected_clients=10).release(
        upload_noise_generator(scaled, i, 0)).update["w"] for i in range(2000)]
    std = torch.stack(draws).std(0)
    bound = 5.0 / math.sqrt(2 * 2000)
    assert torch.all((std / (sigma * clip / 250) - 1).abs() < bound), std  # the mean's noise: sigma C / M


def test_client_privacy_carries_the_ledgers_scale_and_refuses_it_under_local_noise():
    options = PrivacyOptions(mode="client", noise_multiplier=1.0, noise_cohort=400, clipping="joint")
    assert client_privacy(options, 1.0, 0.25).noise_scale == 0.25
    with pytest.raises(ValueError, match="central"):
        ClientPrivacy(clip=1.0, noise_multiplier=1.0, noise="local", noise_scale=0.5)


@pytest.mark.parametrize(("cohort", "participation", "clients", "noise", "word"), [
    (50, 0.1, 1000, "central", "below the 100 clients"),
    (2000, 0.1, 1000, "central", "more than the federation's 1000 clients"),
    (500, 0.1, 1000, "local", "privacy.noise=central"),
])
def test_a_cohort_that_cannot_be_simulated_is_one_line(cohort, participation, clients, noise, word):
    with pytest.raises(ConfigError, match=word) as error:
        _ledger(cohort, participation, clients, noise=noise)
    assert "\n" not in str(error.value)


def test_a_noise_cohort_without_client_level_dp_is_one_line():
    for mode in ("none", "sample"):
        with pytest.raises(ConfigError, match="privacy=client") as error:  # as the config is read
            load_config(None, [f"privacy={mode}", "privacy.noise_cohort=100"])
        assert "\n" not in str(error.value)
        config = load_config(None, [f"privacy={mode}"])
        changed = dataclasses.replace(config, privacy=dataclasses.replace(config.privacy, noise_cohort=100))
        with pytest.raises(ConfigError, match="privacy=client"):  # and by a run of a config changed after
            protocol_settings(changed)


@pytest.mark.slow
def test_a_run_says_its_epsilon_is_the_larger_cohorts(digits_data_dir, tmp_path, capsys):
    from fedhpro import cli

    out = tmp_path / "run"
    assert cli.main(["run", "method=fedavg", "rounds=2", "clients=8", "participation=0.5", "data.fraction=0.02",
                     f"data.syn_size={DIGITS_SYN_SIZE}", f"data.test_fraction={DIGITS_TEST_FRACTION}",
                     "feature_dim=16", "local_epochs=1", "progress=false", "threads=1", f"data_dir={digits_data_dir}",
                     "privacy=client", "privacy.noise_multiplier=1.0", "privacy.noise_cohort=8",
                     "privacy.delta=1e-3", f"out={out}"]) == 0
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "privacy.noise_cohort=8: the noise and the epsilon are those of 8 clients a round while 4 train" in text
    assert "as if 8 clients took part a round" in text
    summary = json.loads((out / "summary.json").read_text())
    privacy = summary["privacy"]
    assert privacy["noise_cohort"] == 8 and privacy["sampling_rate"] == 1.0 and privacy["trained_cohort"] == 4
    assert any("noise_cohort" in note for note in summary["notes"])
    # the ledger's epsilon is the full cohort's: sampling rate 8 / 8 = 1, two rounds
    epsilon, _ = get_privacy_spent(orders=[1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64))
                                   + [128, 256, 512, 1024], delta=1e-3,
                                   rdp=compute_rdp(q=1.0, noise_multiplier=1.0, steps=2,
                                                   orders=[1 + x / 10.0 for x in range(1, 100)]
                                                   + list(range(11, 64)) + [128, 256, 512, 1024]))
    assert privacy["epsilon"] == pytest.approx(float(epsilon), rel=0.03)
