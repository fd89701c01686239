"""The speed paths against independent references.

* FedHPro with ``gradient_timing=before`` makes one eval pass over the local
  data (its prototypes give the margin too) and still computes Eq. 10 on the
  received model; with ``after`` it needs two.
* The opt-in fast path of ``train_epochs`` (``amp=bf16``, ``channels_last``,
  ``compile``) trains the same model as the default float32 path, within the
  stated tolerances; the default path is left bit for bit as it was (the
  hand-written-SGD and determinism tests in test_methods.py / test_simulator.py).
* On a GPU (skipped here without one), the batch loop never waits for the device.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_CLASSES, TinyBNNet, make_client
from test_methods import fit_fedhpro, loop_class_gradients, loop_margin, loop_prototypes, model_with
from torch import nn

from fedhpro.config import load_config
from fedhpro.errors import ConfigError
from fedhpro.methods import TrainSettings
from fedhpro.methods.fedhpro import FedHProOptions
from fedhpro.methods.fedhpro import client as fedhpro_module
from fedhpro.methods.fedhpro import hyper as hyper_module
from fedhpro.methods.training import train_epochs
from fedhpro.models import build_model

HELD = [0, 1, 3]


def count_feature_passes(monkeypatch) -> list[int]:
    """Patch ``extract_features`` where FedHPro's client calls it; the list grows by one per pass."""
    calls: list[int] = []
    real = fedhpro_module.extract_features

    def counting(model, x, *args, **kwargs):
        calls.append(x.shape[0])
        return real(model, x, *args, **kwargs)

    monkeypatch.setattr(fedhpro_module, "extract_features", counting)
    monkeypatch.setattr(hyper_module, "extract_features", counting)
    return calls


@pytest.mark.parametrize("timing, passes", [("before", 1), ("after", 2)])
def test_fedhpro_feature_passes_and_eq10_margin_on_the_received_model(monkeypatch, timing, passes):
    data = make_client(24, HELD, seed=10)
    calls = count_feature_passes(monkeypatch)
    received, _, reply, metrics = fit_fedhpro(FedHProOptions(num_hyper=2, gradient_timing=timing), data)
    assert calls == [24] * passes
    before = loop_prototypes(model_with(received), data.x, data.y, NUM_CLASSES)
    assert metrics["margin"] == pytest.approx(loop_margin(before, HELD, NUM_CLASSES), rel=1e-5)
    if timing == "before":  # the one pass also gave the uploaded statistics, of the received model
        expected, _ = loop_class_gradients(model_with(received), data.x, data.y, NUM_CLASSES)
        torch.testing.assert_close(reply["class_gradients"].double(), expected, rtol=1e-4, atol=1e-6)
        assert "prototypes" not in reply  # prototypes=hyper: the server reads none, so none are sent


def test_fedhpro_before_with_subsampled_gradients_keeps_a_full_margin_pass(monkeypatch):
    data = make_client(30, HELD, seed=11)
    calls = count_feature_passes(monkeypatch)
    received, _, _, metrics = fit_fedhpro(
        FedHProOptions(num_hyper=2, gradient_timing="before", gradient_samples_per_class=4), data)
    assert sorted(calls) == [12, 30]  # 4 per held class for the gradients, all 30 samples for the margin
    before = loop_prototypes(model_with(received), data.x, data.y, NUM_CLASSES)
    assert metrics["margin"] == pytest.approx(loop_margin(before, HELD, NUM_CLASSES), rel=1e-5)


# ---------------------------------------------------------------------------- the opt-in fast path


def conv_client(n: int = 40, seed: int = 3):
    """A client of 3 x 8 x 8 images, for the convolutional TinyBNNet (channels_last matters for 4-d weights)."""
    return make_client(n, list(range(NUM_CLASSES)), seed=seed)


def train_copy(model: torch.nn.Module, data, train: TrainSettings, seed: int = 7):
    """Train a deep copy of ``model``; return it and the mean losses."""
    trained = copy.deepcopy(model)
    losses = train_epochs(trained, data, train, torch.Generator().manual_seed(seed))
    return trained, losses


def updates(before: torch.nn.Module, after: torch.nn.Module) -> torch.Tensor:
    """All parameters' changes, flattened into one vector."""
    return torch.cat([(a.detach() - b.detach()).flatten().float()
                      for a, b in zip(after.parameters(), before.parameters())])


@pytest.fixture
def conv_model():
    torch.manual_seed(0)
    return TinyBNNet()


def test_channels_last_trains_the_same_model_within_float32_rounding(conv_model):
    data = conv_client()
    train = TrainSettings(epochs=2, batch_size=8)
    reference, reference_losses = train_copy(conv_model, data, train)
    fast, fast_losses = train_copy(conv_model, data, dataclasses.replace(train, channels_last=True))
    conv_weight = fast.features[0].weight
    assert conv_weight.is_contiguous(memory_format=torch.channels_last)
    assert list(fast.state_dict()) == list(reference.state_dict())  # same keys: loads and averages as before
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(fast.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert fast_losses["loss"] == pytest.approx(reference_losses["loss"], rel=1e-4)


def test_bf16_autocast_update_stays_close_to_the_float32_update(conv_model):
    """bf16 keeps 8 bits of mantissa (relative rounding ~4e-3): after 10 SGD steps the total update
    must point the same way (cosine > 0.99) with about the same size (within 5%), and the mean loss
    agree within 2%."""
    data = conv_client()
    train = TrainSettings(epochs=2, batch_size=8)
    reference, reference_losses = train_copy(conv_model, data, train)
    fast, fast_losses = train_copy(conv_model, data, dataclasses.replace(train, amp="bf16", channels_last=True))
    expected, got = updates(conv_model, reference), updates(conv_model, fast)
    assert float(F.cosine_similarity(expected, got, dim=0)) > 0.99
    assert float(got.norm() / expected.norm()) == pytest.approx(1.0, abs=0.05)
    assert fast_losses["loss"] == pytest.approx(reference_losses["loss"], rel=0.02)
    assert all(p.dtype == torch.float32 for p in fast.parameters())  # weights stay float32


def test_fast_path_regularizer_sees_float32_features(conv_model):
    seen = []

    def regularizer(z, y, logits):
        seen.append((z.dtype, logits.dtype))
        return {"zero": (z * 0).sum()}

    train_epochs(copy.deepcopy(conv_model), conv_client(16), TrainSettings(batch_size=8, amp="bf16"),
                 torch.Generator().manual_seed(0), regularizer)
    assert seen and all(dtypes == (torch.float32, torch.float32) for dtypes in seen)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="torch.compile's CPU backend needs a C++ compiler")
def test_compiled_features_train_like_eager(conv_model):
    data = conv_client(24)
    train = TrainSettings(epochs=1, batch_size=8)
    reference, reference_losses = train_copy(conv_model, data, train)
    compiled, compiled_losses = train_copy(conv_model, data, dataclasses.replace(train, compile=True))
    assert list(compiled.state_dict()) == list(reference.state_dict())
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert compiled_losses["loss"] == pytest.approx(reference_losses["loss"], rel=1e-5)


def test_amp_choices_are_validated():
    with pytest.raises(ValueError, match="amp must be one of"):
        TrainSettings(amp="fp16")
    with pytest.raises(ConfigError, match="bf16"):
        load_config(None, ["amp=fp16"])
    run = load_config(None, ["amp=bf16", "channels_last=true", "compile=true"]).run
    assert (run.amp, run.channels_last, run.compile) == ("bf16", "true", True)
    defaults = load_config(None).run
    assert (defaults.amp, defaults.channels_last, defaults.compile) == ("off", "auto", False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fast", [False, True], ids=["default", "bf16-channels_last"])
def test_gpu_batch_loop_does_not_synchronise(conv_model, fast):
    """Host-device synchronisations per client must not grow with the number of batches: the same
    count for 6 and for 12 batches per epoch (what remains is per epoch or per client: the epoch's
    order copied to the device, the finite-loss check, the logged means). FedHPro's losses included."""
    from fedhpro.methods.fedhpro import equations

    device = torch.device("cuda")
    hyper = torch.randn(NUM_CLASSES, 3, 16, device=device)
    margin = torch.tensor(0.3, device=device)

    def regularizer(z, y, logits):
        return {"hpcl": equations.hpcl_loss(z, y, hyper, margin, 0.05),
                "hpal": equations.hpal_loss(z, y, hyper, normalized=True)}

    model = copy.deepcopy(conv_model).to(device)
    train = TrainSettings(epochs=2, batch_size=8, amp="bf16" if fast else "off", channels_last=fast)

    def count_syncs(samples: int) -> int:
        data = conv_client(samples)
        data = dataclasses.replace(data, x=data.x.to(device), y=data.y.to(device))
        train_epochs(model, data, train, torch.Generator().manual_seed(0), regularizer)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                train_epochs(model, data, train, torch.Generator().manual_seed(1), regularizer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message).lower() for w in caught)

    assert count_syncs(48) == count_syncs(96)


# --- process settings (fedhpro.runtime) -----------------------------------------------------------------------


def _runtime_probe(env_value: str | None) -> str:
    import os
    import subprocess

    env = dict(os.environ)
    env.pop("FEDHPRO_KEEP_FREED_MEMORY", None)
    if env_value is not None:
        env["FEDHPRO_KEEP_FREED_MEMORY"] = env_value
    code = ("from fedhpro.runtime import configure_cpu_runtime, keep_freed_memory; "
            "configure_cpu_runtime(); print(keep_freed_memory())")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
def test_runtime_keeps_freed_memory_on_glibc_and_the_switch_turns_it_off():
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "gnu_get_libc_version"):
        pytest.skip("not glibc")
    assert _runtime_probe(None) == "True"
    assert _runtime_probe("0") == "False"



def _openmp_probe(code: str, **env_values: str) -> dict:
    """The OpenMP wait variables a fresh interpreter holds after running ``code`` (none set beforehand
    except ``env_values``)."""
    import json
    import os
    import subprocess

    env = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_values)
    probe = code + "; import json, os; print(json.dumps({k: os.environ.get(k) for k in " \
                   "('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}))"
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_import_fedhpro_lets_openmp_threads_sleep_unless_the_user_chose_or_torch_is_loaded():
    from fedhpro.runtime import OPENMP_DEFAULTS

    assert OPENMP_DEFAULTS == {"OMP_WAIT_POLICY": "PASSIVE"}
    # set before torch loads libgomp (which reads it once), and still there once torch is imported
    assert _openmp_probe("import fedhpro, torch") == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
    assert _openmp_probe("import fedhpro.cli") == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
    # the user's choice wins, whichever of the two variables it is
    assert _openmp_probe("import fedhpro", OMP_WAIT_POLICY="ACTIVE") == {"OMP_WAIT_POLICY": "ACTIVE",
                                                                          "GOMP_SPINCOUNT": None}
    assert _openmp_probe("import fedhpro", GOMP_SPINCOUNT="300000") == {"OMP_WAIT_POLICY": None,
                                                                         "GOMP_SPINCOUNT": "300000"}
    # torch first: its OpenMP runtime has read the environment already, so nothing is set (it would mislead)
    assert _openmp_probe("import torch, fedhpro") == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}

# --- no-grad passes in channels_last, with a fallback ---------------------------------------------------------


class _ViewingNet(nn.Module):
    """A user's model that flattens with ``.view`` (fails on channels_last activations)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.features = nn.Sequential(self.conv)
        self.classifier = nn.Linear(4 * 6 * 6, NUM_CLASSES)

    def forward(self, x):
        return self.classifier(self.conv(x).view(x.shape[0], -1))


def test_eval_passes_fall_back_to_nchw_for_a_model_that_views_its_activations():
    from fedhpro.engines.client_tests import evaluate
    from fedhpro.methods.no_grad import _NCHW_ONLY, eval_forward

    model = _ViewingNet().eval()
    x = torch.randn(10, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, NUM_CLASSES, (10,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
        assert torch.equal(eval_forward(model, x), expected)  # NCHW after the channels_last attempt failed
    assert model in _NCHW_ONLY
    by_hand = 100.0 * float((expected.argmax(1) == y).float().mean())
    assert evaluate(model, {"t": (x, y)})["t"] == pytest.approx(by_hand)


def test_eval_features_in_channels_last_match_nchw_to_rounding():
    from fedhpro.methods.no_grad import extract_features

    torch.manual_seed(0)
    model = build_model("cnn", NUM_CLASSES, (3, 32, 32), 64)
    x = torch.randn(70, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    features = extract_features(model, x)
    with torch.no_grad():
        reference = model.eval().features(x)  # NCHW, torch's layout
    assert features.shape == (70, 64)
    torch.testing.assert_close(features, reference, rtol=1e-5, atol=1e-5)
