"""Who took part stays private under client-level DP.

The accountant's amplification by subsampling (a Poisson draw at rate q, ``PoissonSampledDpEvent``) assumes
that whoever sees the released model does not know who took part. So under ``privacy=client``:

* with ``privacy.secure_noise`` (the deployment's default) the draw comes from the operating system's
  randomness, not from the config's seed: two runs of one config draw different participants, and one run
  answers one draw per round however often it is asked;
* the run folder does not publish the participants (``metrics.jsonl`` holds their number, and dropped
  clients without their ids) unless ``privacy.publish_participants`` asks for them;
* where the draws are not known (a round to come, or one before a resume), local noise's accountant counts
  every client as taken part (the worst case), never fewer.

References: the seeded Poisson draw written out with NumPy, set equality over 2^-100-unlikely coincidences,
and the accountant of dp_accounting for the epsilon of ``rounds`` participations.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION, TinyNet, make_federation

from fedhpro.api import run
from fedhpro.config import PrivacyOptions
from fedhpro.engines.simulator import Simulator
from fedhpro.methods import METHODS, TrainSettings
from fedhpro.seeds import derive_seed

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=0.0)
SAMPLE_STREAM = 2  # derive_seed(seed, 2, round): the protocol's documented sampling stream
CLIENTS = 100


def protocol(secure: bool, noise: str = "central", participation: float = 0.5):
    privacy = PrivacyOptions(mode="client", clip=1.0, noise_multiplier=1.0, noise=noise, secure_noise=secure)
    federation = make_federation([4] * CLIENTS, seed=3)
    return Simulator(METHODS["fedavg"], METHODS["fedavg"].options(), federation, TinyNet, TRAIN, rounds=6, seed=5,
                     privacy=privacy, participation=participation).protocol


def test_secure_draws_differ_between_runs_of_one_config_and_repeat_within_one():
    first, second = protocol(secure=True), protocol(secure=True)
    draws = [first.sample_clients(r) for r in range(3)]
    assert all(draws[r] != second.sample_clients(r) for r in range(3))  # equal with probability 2^-100 each
    assert draws == [first.sample_clients(r) for r in range(3)]  # one draw a round, however often asked
    assert all(20 < len(d) < 80 for d in draws)  # still a Poisson draw at rate 0.5 (mean 50, std 5)
    # seeded (the simulator's default): the draw written out from the seed, the same in every run
    seeded = [protocol(secure=False).sample_clients(r) for _ in range(2) for r in range(3)]
    expected = [[k for k, u in enumerate(np.random.default_rng(derive_seed(5, SAMPLE_STREAM, r)).random(CLIENTS))
                 if u < 0.5] for r in range(3)]
    assert seeded == expected * 2


def test_local_noise_counts_undrawn_rounds_as_taken_part_by_everyone():
    """Local noise spends epsilon per participation: a secret draw that this process did not make (a round to
    come, or one before a resume) counts as one participation of every client, never fewer; a drawn round
    counts only its participants."""
    secret = protocol(secure=True, noise="local", participation=0.1)
    assert secret.participations(4) == {k: 4 for k in range(CLIENTS)}  # nothing drawn yet: the worst case
    drawn = secret.sample_clients(0)
    counts = secret.participations(2)
    assert counts == {k: 1 + (k in drawn) for k in range(CLIENTS)}
    assert secret.epsilon_after(3) == pytest.approx(secret.ledger.epsilon({0: 4}, 4))
    seeded = protocol(secure=False, noise="local", participation=0.1)
    assert max(seeded.participations(4).values()) < 4  # the seeded draw is known: its own counts


@pytest.mark.slow
@pytest.mark.parametrize("publish", [False, True])
def test_a_dp_run_folder_names_no_participant_unless_asked(publish, digits_data_dir, tmp_path):
    out = tmp_path / "run"
    run(overrides=["method=fedavg", "rounds=2", "clients=4", "data.fraction=0.02", f"data.syn_size={DIGITS_SYN_SIZE}",
                   f"data.test_fraction={DIGITS_TEST_FRACTION}", "feature_dim=16", "local_epochs=1", "seed=1",
                   "progress=false", "threads=1", f"data_dir={digits_data_dir}", "privacy=client",
                   "participation=0.5", "privacy.noise_multiplier=1.0", "faults.dropout=0.5",
                   f"privacy.publish_participants={str(publish).lower()}", "checkpoint_every=1", f"out={out}"],
        echo=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    dropped = [item for row in rows for item in row.get("dropped", [])]
    assert dropped  # faults.dropout=0.5 over the rounds' participants: some were dropped (seed 1)
    if publish:
        assert all(isinstance(row["participants"], list) for row in rows)
        assert all("client" in item for item in dropped)
    else:
        assert all("participants" not in row and isinstance(row["num_participants"], int) for row in rows)
        assert all(set(item) == {"reason"} for item in dropped)
        text = (out / "metrics.jsonl").read_text() + (out / "summary.json").read_text()
        assert '"participants"' not in text and '"client":' not in text
        for saved in (out / "checkpoints").glob("*.pt"):  # a checkpoint keeps the rows as written
            blob = torch.load(saved, weights_only=True)
            assert all("participants" not in row for row in blob["metrics"])
