"""privacy=sample's model check (:func:`fedhpro.methods.sample_dp.model_problem`) against Opacus's own.

Reference: Opacus's ``ModuleValidator.validate(model, strict=False)`` on each model in training mode. Ours must
refuse everything it refuses (at least as strict), and beyond it every BatchNorm (affine or not: batch statistics
couple the samples), InstanceNorm with running statistics and any module holding a buffer (state outside the
noised gradients), each in one line naming the module and the fix.
"""

from __future__ import annotations

import pytest
import torch
from conftest import NUM_CLASSES, TinyNet
from torch import nn

from fedhpro.errors import ConfigError
from fedhpro.methods import METHODS, MethodContext, TrainSettings
from fedhpro.methods.sample_dp import model_problem

pytest.importorskip("opacus")
from opacus.validators import ModuleValidator  # noqa: E402


class WithBuffer(nn.Module):
    """A custom layer with a running mean of its inputs (a buffer training updates), as a user might write."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("running", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.running.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.linear(x - self.running)


def built_in(name: str) -> nn.Module:
    from fedhpro.models import build_model

    shape = (64,) if name == "textcnn" else (3, 32, 32)
    return build_model(name, 10, shape, feature_dim=16)


#: (module, whether ours refuses it, the word the line names)
CASES = [
    (nn.BatchNorm1d(3), True, "BatchNorm1d"),
    (nn.BatchNorm1d(3, affine=False), True, "BatchNorm1d"),  # Opacus lets it through: no trainable parameter
    (nn.BatchNorm2d(3, affine=False, track_running_stats=False), True, "BatchNorm2d"),
    (nn.BatchNorm2d(3), True, "BatchNorm2d"),
    (nn.BatchNorm3d(3, affine=False), True, "BatchNorm3d"),
    (nn.BatchNorm3d(3), True, "BatchNorm3d"),
    (nn.SyncBatchNorm(3), True, "SyncBatchNorm"),
    (nn.InstanceNorm1d(3), False, ""),
    (nn.InstanceNorm1d(3, track_running_stats=True), True, "track_running_stats=False"),
    (nn.InstanceNorm2d(3, affine=True), False, ""),
    (nn.InstanceNorm2d(3, track_running_stats=True), True, "InstanceNorm2d"),  # Opacus: only when affine
    (nn.InstanceNorm2d(3, affine=True, track_running_stats=True), True, "InstanceNorm2d"),
    (nn.GroupNorm(1, 3), False, ""),
    (nn.LayerNorm(3), False, ""),
    (WithBuffer(), True, "'running'"),
    (nn.LSTM(3, 3), True, "LSTM"),
    (nn.GRU(3, 3), True, "GRU"),
    (nn.MultiheadAttention(4, 2), True, "MultiheadAttention"),
    (nn.Linear(3, 3), False, ""),
]


def opacus_refuses(model: nn.Module) -> bool:
    model.train()
    return bool(ModuleValidator.validate(model, strict=False))


@pytest.mark.parametrize(("module", "refused", "named"), CASES, ids=[repr(case[0])[:40] for case in CASES])
def test_our_verdict_is_at_least_as_strict_as_opacus_module_validator(module, refused, named):
    model = nn.Sequential(nn.Linear(3, 3), module)
    problem = model_problem(model)
    if opacus_refuses(model):
        assert problem is not None
    assert (problem is not None) == refused, problem
    if refused:
        assert "\n" not in problem and named in problem and "'1'" in problem  # the module's name in the model


@pytest.mark.parametrize("name", ["cnn", "cnn4", "mlp", "textcnn", "resnet10", "mobilenetv2", "googlenet"])
def test_the_built_in_models_ours_refuses_exactly_the_ones_with_batchnorm(name):
    model = built_in(name)
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    problem = model_problem(model)
    if opacus_refuses(model):
        assert problem is not None
    assert (problem is not None) == has_batchnorm
    assert not has_batchnorm or "BatchNorm" in problem


class NoAffineNet(TinyNet):
    """TinyNet with a BatchNorm1d(affine=False) on its features: no trainable parameter in the norm, but running
    statistics of the raw data and batch coupling."""

    def __init__(self) -> None:
        super().__init__()
        self.features.append(nn.BatchNorm1d(self.classifier.in_features, affine=False))


def test_a_user_model_with_batchnorm_without_affine_is_refused_in_one_line():
    train = TrainSettings(epochs=1, batch_size=8, dp_clip=1.0, dp_noise_multiplier=1.0)
    spec = METHODS["fedavg"]
    with pytest.raises(ConfigError, match=r"module 'features\.3' \(BatchNorm1d\)") as error:
        spec.client(MethodContext(model=NoAffineNet(), num_classes=NUM_CLASSES, options=spec.options(), train=train,
                                  seed=0))
    assert "\n" not in str(error.value) and "GroupNorm" in str(error.value)
