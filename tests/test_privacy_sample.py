"""privacy=sample: DP-SGD in the shared client loop, the privatized statistics release and the SampleLedger.

References: a slow per-sample loop (each sample's gradient by autograd alone, clipped by hand, summed, the noise
drawn from a known generator) against the Opacus path; the clip bound and the release's sensitivity checked on
random data and random replacements; the ledger against Opacus's own RDP accountant; tiny simulated runs.
"""

from __future__ import annotations

import copy
import logging
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_CLASSES, TinyBNNet, TinyNet, make_client, make_federation

from fedhpro.errors import ConfigError
from fedhpro.methods import METHODS, MethodContext, TrainSettings
from fedhpro.methods.base import clone_weights
from fedhpro.methods.sample_dp import class_sums, clip_rows, poisson_plan, release_class_statistics

pytest.importorskip("opacus")
pytest.importorskip("dp_accounting")

from fedhpro.privacy.sample import SampleLedger  # noqa: E402

logging.getLogger("absl").setLevel(logging.ERROR)


def private_train(**changes) -> TrainSettings:
    settings = dict(epochs=1, batch_size=64, lr=0.5, momentum=0.0, weight_decay=0.0, dp_clip=0.7,
                    dp_noise_multiplier=0.0)
    settings.update(changes)
    return TrainSettings(**settings)


def client_of(method: str, train: TrainSettings, model=TinyNet, **options):
    spec = METHODS[method]
    return spec.client(MethodContext(model=model(), num_classes=NUM_CLASSES, options=spec.options(**options),
                                     train=train, seed=0))


def slow_private_step(model, data, clip, sigma, generator_seed, lr, public_gradient=None):
    """One DP-SGD step over the whole data (q = 1) by hand: each sample's CE gradient alone, clipped to ``clip``
    (over all parameters), summed, plus N(0, (sigma clip)^2) per parameter drawn as the loop seeds it (one draw of
    the round's generator seeds the noise generator), over n; then plain SGD. Returns the new weights."""
    parameters = list(model.parameters())
    total = [torch.zeros_like(p) for p in parameters]
    for i in range(len(data)):
        loss = F.cross_entropy(model(data.x[i:i + 1]), data.y[i:i + 1])
        grads = torch.autograd.grad(loss, parameters)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, clip / float(norm))
        for t, g in zip(total, grads):
            t += factor * g
    round_generator = torch.Generator().manual_seed(generator_seed)
    seed = int(torch.randint(0, 2 ** 62, (1,), generator=round_generator))
    noise = torch.Generator().manual_seed(seed)
    new = {}
    with torch.no_grad():
        for (name, p), t in zip(model.named_parameters(), total):
            if sigma > 0:
                t = t + torch.normal(0.0, sigma * clip, size=p.shape, generator=noise)
            step = t / len(data)
            if public_gradient is not None:
                step = step + public_gradient[name]
            new[name] = p - lr * step
    return new


@pytest.mark.parametrize("sigma", [0.0, 0.8])
def test_opacus_step_equals_the_slow_per_sample_loop(sigma):
    data = make_client(12, [0, 1, 2, 3], seed=3)
    torch.manual_seed(0)
    model = TinyNet()
    reference = slow_private_step(copy.deepcopy(model), data, clip=0.7, sigma=sigma, generator_seed=11, lr=0.5)
    train = private_train(dp_noise_multiplier=sigma)  # n = 12 <= B: one step on every sample (q = 1)
    assert poisson_plan(12, 64) == (1.0, 1)
    client = client_of("fedavg", train)
    reply, metrics = client.fit(model, {"weights": clone_weights(model)}, data, {}, torch.Generator().manual_seed(11))
    assert metrics["dp_steps"] == 1.0
    for name, value in reference.items():
        torch.testing.assert_close(reply["weights"][name], value, rtol=1e-5, atol=1e-6)


def test_the_proximal_gradient_joins_after_the_noise_unclipped():
    """FedProx's proximal term depends on no sample: its gradient mu (w - w_received) is added to the noisy mean
    of the clipped per-sample gradients, not clipped with them."""
    data = make_client(10, [0, 1, 2, 3], seed=4)
    torch.manual_seed(1)
    model = TinyNet()
    anchor = {name: p.detach().clone() - 0.3 for name, p in model.named_parameters()}
    mu = 5.0
    public = {name: mu * (p.detach() - anchor[name]) for name, p in model.named_parameters()}
    reference = slow_private_step(copy.deepcopy(model), data, clip=0.7, sigma=0.0, generator_seed=2, lr=0.5,
                                  public_gradient=public)
    client = client_of("fedprox", private_train(), mu=mu)
    from fedhpro.methods.training import LocalRound

    round = LocalRound(model, {"weights": anchor}, data, {}, torch.Generator().manual_seed(2))
    client._train_private(round)
    for name, value in reference.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6)
    assert float(torch.sqrt(sum(g.pow(2).sum() for g in public.values()))) > 10 * 0.7  # far beyond the clip


def test_every_sample_gradient_is_clipped_so_a_step_moves_at_most_lr_times_clip():
    """Huge inputs give huge per-sample gradients; without noise a step is lr x (mean of clipped gradients)."""
    data = make_client(40, [0, 1, 2, 3], seed=5)
    data.x.mul_(1e3)
    torch.manual_seed(2)
    model = TinyNet()
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    client = client_of("fedavg", private_train(batch_size=40, lr=1.0, dp_clip=0.25))
    client.fit(model, {"weights": clone_weights(model)}, data, {}, torch.Generator().manual_seed(0))
    moved = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
    assert 0 < float(moved.norm()) <= 0.25 * (1 + 1e-5)
    rows = torch.randn(500, 7, 3) * torch.logspace(-3, 3, 500).reshape(-1, 1, 1)
    norms = clip_rows(rows, 0.5).flatten(1).norm(dim=1)
    assert float(norms.max()) <= 0.5 * (1 + 1e-6)
    small = rows.flatten(1).norm(dim=1) <= 0.5
    torch.testing.assert_close(clip_rows(rows, 0.5)[small], rows[small])


def test_the_release_moves_by_at_most_the_clip_when_one_sample_changes():
    """The noiseless class sums (counts and every part) move by <= clip (L2, all of them together) when one sample is
    added or removed and by <= 2 clip when one is replaced by anything."""
    generator = torch.Generator().manual_seed(0)
    clip, classes = 1.5, 5
    worst_replace, worst_remove = 0.0, 0.0
    for trial in range(200):
        n = int(torch.randint(2, 30, (1,), generator=generator))
        labels = torch.randint(0, classes, (n,), generator=generator)
        parts = {"prototypes": torch.randn(n, 6, generator=generator) * 10 ** (trial % 4),
                 "soft": torch.rand(n, classes, generator=generator)}

        def flat(labels, parts):
            return torch.cat([t.flatten() for t in class_sums(labels, classes, parts, clip).values()])

        base = flat(labels, parts)
        i = int(torch.randint(0, n, (1,), generator=generator))
        replaced_labels = labels.clone()
        replaced_labels[i] = int(torch.randint(0, classes, (1,), generator=generator))
        replaced = {name: t.clone() for name, t in parts.items()}
        for t in replaced.values():
            t[i] = torch.randn(t.shape[1:], generator=generator) * 1e4
        worst_replace = max(worst_replace, float((flat(replaced_labels, replaced) - base).norm()))
        keep = torch.arange(n) != i
        worst_remove = max(worst_remove, float((flat(labels[keep], {k: t[keep] for k, t in parts.items()}) - base)
                                               .norm()))
    assert worst_replace <= 2 * clip * (1 + 1e-5)
    assert worst_remove <= clip * (1 + 1e-5)
    assert worst_replace > 1.2 * clip  # the bound is nearly reached (the test can fail)


def test_released_statistics_without_noise_are_the_clipped_class_means_and_exact_counts():
    generator = torch.Generator().manual_seed(1)
    labels = torch.tensor([0, 0, 1, 3, 3, 3])
    features = torch.randn(6, 4, generator=generator) * 3
    released = release_class_statistics(labels, 4, {"prototypes": features}, 2.0, 0.0, generator, 6)
    assert released.counts.tolist() == [2, 1, 0, 3]
    clipped = clip_rows(features, 2.0 / math.sqrt(2))
    for c in (0, 1, 3):
        torch.testing.assert_close(released.means["prototypes"][c], clipped[labels == c].mean(0))
    assert float(released.means["prototypes"][2].abs().sum()) == 0.0


def test_the_release_noise_has_std_sigma_times_clip():
    """2,000 releases of one sample's count (a single class): the noisy count's spread, in count units, is
    sigma x clip / (clip / sqrt(1)) = sigma, seen through rounding with a threshold of zero at sigma -> counts
    kept. Measured on the noisy sums before post-processing through many draws of the mechanism."""
    sigma, clip = 2.0, 1.0
    generator = torch.Generator().manual_seed(3)
    labels = torch.zeros(1000, dtype=torch.long)
    draws = []
    for _ in range(2000):
        released = release_class_statistics(labels, 1, {}, clip, sigma, generator, 10 ** 6)
        draws.append(float(released.counts[0]))
    draws_t = torch.tensor(draws)
    assert abs(float(draws_t.mean()) - 1000) < 0.2
    # rounding adds variance 1/12: std^2 = sigma^2 + 1/12
    assert abs(float(draws_t.std()) - math.sqrt(sigma ** 2 + 1 / 12)) < 0.1


# ----------------------------------------------------------------------------------------------------------------
# the ledger
# ----------------------------------------------------------------------------------------------------------------


class Options:
    def __init__(self, **values):
        self.clip, self.noise_multiplier, self.target_epsilon, self.delta, self.max_epsilon = 1.0, 1.0, 0.0, 0.0, 0.0
        self.mode = "sample"
        self.__dict__.update(values)


def opacus_epsilon(history, delta):
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = list(history)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("sigma,q,steps", [(1.0, 0.125, 40), (0.8, 0.05, 200), (2.0, 1.0, 3)])
def test_dp_accounting_agrees_with_opacus_rdp_accountant(sigma, q, steps):
    import dp_accounting

    from fedhpro.privacy.sample import event_epsilon

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    ours = event_epsilon(event, 1, 1e-5)
    assert ours == pytest.approx(opacus_epsilon([(sigma, q, steps)], 1e-5), rel=0.01)


def test_ledger_epsilon_is_the_largest_client_composition_checked_against_opacus():
    train = TrainSettings(epochs=2, batch_size=16)
    ledger = SampleLedger(Options(noise_multiplier=1.1, delta=1e-4), [40, 100, 160], train, rounds=5,
                          participation=1.0)
    participations = {0: 2, 1: 3, 2: 3}
    expected = []
    for k, count in participations.items():
        steps = math.ceil([40, 100, 160][k] / 16)
        round_history = [(1.1, 1.0 / steps, 2 * steps), (1.1, 1.0, 1)]  # DP-SGD, then the release
        expected.append(opacus_epsilon(round_history * count, 1e-4))
    assert ledger.epsilon(participations, 3) == pytest.approx(max(expected), rel=0.01)
    assert ledger.epsilon({}, 0) == 0.0
    assert ledger.epsilon({0: 1}, 1) < ledger.epsilon({0: 2}, 2)


@pytest.mark.slow
def test_ledger_delta_default_and_target_epsilon_within_one_percent():
    train = TrainSettings(epochs=1, batch_size=32)
    ledger = SampleLedger(Options(target_epsilon=4.0), [90, 200, 300], train, rounds=3, participation=0.5)
    assert ledger.delta == pytest.approx(1 / 90 ** 1.1)
    reached = ledger.epsilon({0: 3, 1: 3, 2: 3}, 3)
    assert 4.0 * 0.99 <= reached <= 4.0
    described = ledger.describe()
    assert described["mode"] == "sample" and described["noise_multiplier"] == ledger.noise_multiplier
    assert described["sampling_rate"] == {"min": 1 / math.ceil(300 / 32), "max": 1 / math.ceil(90 / 32)}


def test_ledger_refusals_are_one_line():
    train = TrainSettings(epochs=1, batch_size=32)
    with pytest.raises(ConfigError, match="noise_multiplier=0") as error:
        SampleLedger(Options(noise_multiplier=0.0), [50], train, rounds=2, participation=1.0)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="privacy.delta"):
        SampleLedger(Options(), [1, 50], train, rounds=2, participation=1.0)


# ----------------------------------------------------------------------------------------------------------------
# runs, refusals, cleanliness
# ----------------------------------------------------------------------------------------------------------------


def run_rounds(method, rounds=2, seed=1, **options):
    from fedhpro.engines.simulator import Simulator

    spec = METHODS[method]
    train = TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4, dp_clip=1.0,
                          dp_noise_multiplier=0.5)
    federation = make_federation([40, 50, 60], classes=[[0, 1, 2], [1, 2, 3], [0, 1, 2, 3]])
    simulator = Simulator(spec, spec.options(**options), federation, TinyNet, train, rounds=rounds, seed=seed)
    return [simulator.run_round(r) for r in range(rounds)], simulator


@pytest.mark.parametrize("method,options", [("fedavg", {}), ("fedhpro", {}), ("fedprox", {}), ("moon", {}),
                                            ("fedproto", {}), ("fedtgp", {"server_epochs": 3}),
                                            ("fedgmkd", {"max_components": 1}), ("fedsa", {}),
                                            ("fedhpro", {"gradient_timing": "before"}),
                                            ("fedproto", {"prototypes": "hyper"})])
def test_a_tiny_private_run_trains_every_client_and_repeats(method, options):
    records, simulator = run_rounds(method, **options)
    for record in records:
        assert not record.dropped, record.dropped
        assert record.train["dp_steps"] > 0 and "ce" not in record.train  # losses of the data are not reported
    assert records[-1].accuracy["AVG"] > 50.0  # 4 classes: chance is 25 %
    again, _ = run_rounds(method, **options)
    assert [r.to_json() for r in again] == [r.to_json() for r in records]


def test_the_uploads_are_the_released_ones():
    data = make_client(60, [0, 1, 2], seed=7)
    torch.manual_seed(0)
    model = TinyNet()
    client = client_of("fedproto", private_train(batch_size=16, dp_noise_multiplier=0.0))
    reply, _ = client.fit(model, {"weights": clone_weights(model)}, data, {}, torch.Generator().manual_seed(0))
    assert reply["class_counts"].tolist() == [20, 20, 20, 0] and reply["num_examples"] == 60
    from fedhpro.methods.no_grad import extract_features

    clipped = clip_rows(extract_features(model, data.x), 0.7 / math.sqrt(2))
    for c in range(3):
        torch.testing.assert_close(reply["prototypes"][c], clipped[data.y == c].mean(0))


def test_refusals_are_one_line():
    train = private_train()
    cases = [("fedrcl", TinyNet, {}, "fedrcl"), ("fedavg", TinyBNNet, {}, "BatchNorm2d"),
             ("fedhpro", TinyNet, {"hpcl_batch_divide": True}, "hpcl_batch_divide"),
             ("fedhpro", TinyNet, {"prototypes": "global"}, "prototypes=global"),
             ("fedhpro", TinyNet, {"gradient_samples_per_class": 100}, "gradient_samples_per_class"),
             ("fedhpro", TinyNet, {"classifier_step": "synthetic"}, "classifier_step")]
    for method, model, options, named in cases:
        with pytest.raises(ConfigError, match=named) as error:
            client_of(method, train, model=model, **options)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="amp=off"):
        client_of("fedavg", private_train(amp="bf16"))


def test_missing_opacus_is_one_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "opacus", None)
    with pytest.raises(ConfigError, match=r'pip install "fedhpro\[privacy\]"'):
        client_of("fedavg", private_train())


def test_the_working_model_is_left_clean():
    """The working model is reused by the next client: no Opacus hooks or attributes, in-place ReLUs restored."""
    from fedhpro.models.cnn import FedAvgCNN

    data = make_client(20, [0, 1], seed=2, shape=(1, 16, 16))
    model = FedAvgCNN(NUM_CLASSES, (1, 16, 16), 8)
    hooks_before = [(len(m._forward_hooks), len(m._backward_hooks)) for m in model.modules()]
    client = client_of("fedavg", private_train(batch_size=8), model=lambda: FedAvgCNN(NUM_CLASSES, (1, 16, 16), 8))
    client.fit(model, {"weights": clone_weights(model)}, data, {}, torch.Generator().manual_seed(0))
    assert [(len(m._forward_hooks), len(m._backward_hooks)) for m in model.modules()] == hooks_before
    assert all(m.inplace for m in model.modules() if isinstance(m, torch.nn.ReLU))
    for p in model.parameters():
        assert p.grad is None and not hasattr(p, "grad_sample") and not hasattr(p, "summed_grad")
    # and it trains plainly again afterwards (privacy=none on the same model object)
    plain = client_of("fedavg", TrainSettings(epochs=1, batch_size=8),
                      model=lambda: FedAvgCNN(NUM_CLASSES, (1, 16, 16), 8))
    plain.fit(model, {"weights": clone_weights(model)}, data, {}, torch.Generator().manual_seed(0))


def test_a_client_whose_counts_drown_in_the_noise_is_dropped_with_one_line():
    """4 samples under sigma = 1 (the threshold is 3 count-noise stds): nothing is kept, the fit says why; the
    empty Poisson batches of q = 1/4 train without error."""
    from fedhpro.errors import UpdateError

    data = make_client(4, [0, 1], seed=1)
    model = TinyNet()
    client = client_of("fedproto", private_train(epochs=3, batch_size=1, dp_noise_multiplier=1.0))
    with pytest.raises(UpdateError, match="below the noise threshold"):
        client.fit(model, {"weights": clone_weights(model)}, data, {}, torch.Generator().manual_seed(0))


def test_a_term_declared_public_that_reads_the_batch_is_refused():
    """A public term's gradient joins unclipped: one that depends on the samples' features would leak."""
    from fedhpro.methods.base import Client

    class LeakyClient(Client):
        public_loss_terms = frozenset({"leak"})

        def loss_terms(self, round):
            return lambda batch: {"leak": batch.z.pow(2).mean()}

    data = make_client(10, [0, 1], seed=1)
    model = TinyNet()
    client = LeakyClient(MethodContext(model=TinyNet(), num_classes=NUM_CLASSES,
                                       options=METHODS["fedavg"].options(), train=private_train(), seed=0))
    with pytest.raises(ConfigError, match="declared public"):
        client.fit(model, {"weights": clone_weights(model)}, data, {}, torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_a_batchnorm_architecture_of_model_heterogeneity_is_refused_before_the_run(tmp_path):
    """Under heterogeneity=htfe5 some clients train googlenet (BatchNorm): refused at build, in one line, not a
    client dropped every round."""
    import fedhpro
    from fedhpro.errors import ConfigError

    with pytest.raises(ConfigError, match=r"privacy=sample: model googlenet \(heterogeneity=htfe5 gives clients it\)"):
        fedhpro.run(rounds=1, clients=3, **{"data.fraction": 0.02}, feature_dim=16, local_epochs=1, progress=False,
                    heterogeneity="htfe5", privacy="sample", out=str(tmp_path / "run"))


# ----------------------------------------------------------------------------------------------------------------
# privacy.secure_noise and privacy.accountant=pld
# ----------------------------------------------------------------------------------------------------------------


def fit_weights(train: TrainSettings, method: str = "fedproto", generator_seed: int = 5):
    data = make_client(24, [0, 1, 2], seed=9)
    torch.manual_seed(3)
    model = TinyNet()
    reply, _ = client_of(method, train).fit(model, {"weights": clone_weights(model)}, data, {},
                                            torch.Generator().manual_seed(generator_seed))
    flat = torch.cat([value.flatten() for value in reply["weights"].values()])
    return flat, reply


def test_secure_noise_draws_dp_sgd_and_release_noise_from_the_os_seeded_noise_repeats():
    """Same round generator: seeded noise (secure off) repeats bit for bit; with dp_secure_noise the DP-SGD noise
    and the statistics release's noise differ from run to run."""
    seeded = private_train(batch_size=8, dp_noise_multiplier=1.0)
    first, reply_first = fit_weights(seeded)
    again, reply_again = fit_weights(seeded)
    assert torch.equal(first, again) and torch.equal(reply_first["prototypes"], reply_again["prototypes"])
    secure = private_train(batch_size=8, dp_noise_multiplier=1.0, dp_secure_noise=True)
    one, reply_one = fit_weights(secure)
    two, reply_two = fit_weights(secure)
    assert not torch.equal(one, two) and not torch.equal(one, first)
    assert not torch.equal(reply_one["prototypes"], reply_two["prototypes"])


def test_dp_sgd_noise_generator_takes_one_draw_of_the_round_generator_secure_or_not():
    from fedhpro.methods.sample_dp import dp_sgd_noise_generator

    def after(secure: bool) -> tuple[int, float]:
        round_generator = torch.Generator().manual_seed(5)
        noise = dp_sgd_noise_generator(round_generator, torch.device("cpu"), secure)
        return noise.initial_seed(), float(torch.rand((), generator=round_generator))

    seeded, next_draw = after(False)
    assert seeded == int(torch.randint(0, 2 ** 62, (1,), generator=torch.Generator().manual_seed(5)))
    assert after(False) == (seeded, next_draw)  # reproducible
    secure, next_secure = after(True)
    assert next_secure == next_draw and secure != seeded  # the round's other draws do not move


def test_secure_dp_sgd_noise_has_std_sigma_times_clip():
    """q = 1 (B >= n: every sample in the one batch, whoever draws it), momentum 0: the secure step minus the
    noiseless one is lr x noise / n on every parameter, so its std (3156 coordinates) is lr sigma C / n."""
    sigma, clip, lr, n = 2.0, 0.7, 0.5, 24
    noiseless, _ = fit_weights(private_train(batch_size=64, dp_noise_multiplier=0.0, dp_clip=clip, lr=lr), "fedavg")
    secure, _ = fit_weights(private_train(batch_size=64, dp_noise_multiplier=sigma, dp_clip=clip, lr=lr,
                                          dp_secure_noise=True), "fedavg")
    noise = (noiseless - secure) * n / lr
    assert noise.numel() > 3000
    assert abs(float(noise.std()) / (sigma * clip) - 1.0) < 0.06
    assert abs(float(noise.mean())) < 0.1 * sigma * clip


def test_private_train_settings_reads_secure_noise_unset_as_seeded():
    from fedhpro.config import load_config
    from fedhpro.privacy import private_train_settings

    class Book:
        noise_multiplier = 1.3

    for value, expected in (("", False), ("privacy.secure_noise=false", False), ("privacy.secure_noise=true", True)):
        config = load_config(None, ["privacy=sample", "privacy.clip=0.5", *([value] if value else [])])
        train = private_train_settings(config, TrainSettings(), Book())
        assert (train.dp_clip, train.dp_noise_multiplier, train.dp_secure_noise) == (0.5, 1.3, expected)


def prv_bounds(history, delta):
    import warnings

    from opacus.accountants import PRVAccountant

    accountant = PRVAccountant()
    accountant.history = list(history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # log(1 - q) at q = 1, masked out by Opacus
        lower, _, upper = accountant._get_dprv(eps_error=0.01, delta_error=delta / 1000).compute_epsilon(
            delta, delta / 1000, 0.01)
    return float(lower), float(upper)


@pytest.mark.slow
def test_pld_ledger_lies_within_opacus_prv_bounds_and_below_rdp():
    """Each client's DP-SGD steps and release, composed over its rounds by PLD, against Opacus's PRV accountant
    on the same history; and 5-20 % below the RDP ledger (measured 0.91-0.93 here)."""
    train = TrainSettings(epochs=2, batch_size=16)
    sizes, participations = [40, 100, 160], {0: 3, 1: 3, 2: 2}
    pld = SampleLedger(Options(noise_multiplier=1.1, delta=1e-4, accountant="pld"), sizes, train, rounds=3,
                       participation=1.0)
    rdp = SampleLedger(Options(noise_multiplier=1.1, delta=1e-4), sizes, train, rounds=3, participation=1.0)
    assert "PLDAccountant" in pld.describe()["accountant"] and "Rdp" in rdp.describe()["accountant"]
    for k, count in participations.items():
        steps = math.ceil(sizes[k] / 16)
        lower, upper = prv_bounds([(1.1, 1.0 / steps, 2 * steps), (1.1, 1.0, 1)] * count, 1e-4)
        assert lower <= pld.client_epsilon(k, count) <= upper
        assert 0.80 <= pld.client_epsilon(k, count) / rdp.client_epsilon(k, count) <= 0.95
    assert pld.epsilon(participations, 3) == max(pld.client_epsilon(k, c) for k, c in participations.items())


def test_pld_calibration_of_sample_level_dp_reaches_the_target_with_less_noise():
    train = TrainSettings(epochs=1, batch_size=32)
    pld = SampleLedger(Options(target_epsilon=4.0, delta=1e-5, accountant="pld"), [300], train, rounds=3,
                       participation=1.0)
    rdp = SampleLedger(Options(target_epsilon=4.0, delta=1e-5), [300], train, rounds=3, participation=1.0)
    assert 4.0 * 0.99 <= pld.epsilon({0: 3}, 3) <= 4.0
    assert pld.noise_multiplier < rdp.noise_multiplier
    steps = math.ceil(300 / 32)
    lower, upper = prv_bounds([(pld.noise_multiplier, 1.0 / steps, steps), (pld.noise_multiplier, 1.0, 1)] * 3, 1e-5)
    assert upper <= 4.0 * 1.01  # Opacus's PRV at the calibrated sigma
