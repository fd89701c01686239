"""The model zoo: shapes, the features/classifier contract, stems, TextCNN padding, HtFE lists, counts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn
from torchvision.models import GoogLeNet, MobileNetV2, ResNet
from torchvision.models.resnet import BasicBlock, Bottleneck

from fedhpro.models import (
    HTFE,
    MODELS,
    FedAvgCNN,
    architecture_for_client,
    build_model,
)
from fedhpro.models.summary import (
    USUAL_INPUT_SHAPES,
    count_parameters,
    describe_models,
    example_input,
    format_model_table,
    forward_flops,
)

C = 10
BATCH = 2


def _n(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _check_contract(model: nn.Module, x: torch.Tensor, d: int, num_classes: int = C) -> None:
    assert model.feature_dim == d and model.num_classes == num_classes
    assert isinstance(model.classifier, nn.Linear)
    assert (model.classifier.in_features, model.classifier.out_features) == (d, num_classes)
    model.train()
    z = model.features(x)  # train mode: BatchNorm on a batch of 2 must work
    assert z.shape == (x.shape[0], d)
    model.eval()
    with torch.no_grad():
        z = model.features(x)
        logits = model(x)
        assert z.shape == (x.shape[0], d) and logits.shape == (x.shape[0], num_classes)
        assert torch.isfinite(logits).all()
        torch.testing.assert_close(logits, model.classifier(z))


def test_registry_holds_the_zoo():
    assert set(MODELS) == {"cnn", "cnn4", "resnet10", "resnet18", "resnet34", "resnet50", "resnet101",
                           "resnet10-authors", "mobilenetv2", "googlenet", "textcnn", "mlp"}
    assert set(USUAL_INPUT_SHAPES) == set(MODELS)


@pytest.mark.slow
def test_importing_the_zoo_does_not_import_torchvision():
    code = "import sys, fedhpro.models as m; assert 'torchvision' not in sys.modules; m.ResNetFE; " \
           "assert 'torchvision' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("d", [64, 512])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_features_and_logits(name, d):
    torch.manual_seed(0)
    shape = USUAL_INPUT_SHAPES[name]
    model = build_model(name, C, shape, d)
    _check_contract(model, example_input(model, shape, BATCH), d)


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "mobilenetv2", "textcnn"])
def test_wide_features(name):
    shape = USUAL_INPUT_SHAPES[name]
    model = build_model(name, 7, shape, 1024)
    _check_contract(model, example_input(model, shape, BATCH), 1024, num_classes=7)


@pytest.mark.parametrize("name", ["cnn", "cnn4", "resnet10", "googlenet", "mobilenetv2"])
def test_one_channel_28x28(name):
    model = build_model(name, C, (1, 28, 28), 64)
    _check_contract(model, torch.randn(BATCH, 1, 28, 28), 64)


def test_backward_reaches_every_parameter():
    for name in ["resnet10", "googlenet", "mobilenetv2", "textcnn"]:
        shape = USUAL_INPUT_SHAPES[name]
        model = build_model(name, C, shape, 32)
        model(example_input(model, shape, BATCH)).logsumexp(1).sum().backward()
        missing = [key for key, p in model.named_parameters() if p.grad is None]
        assert not missing, (name, missing)


# ----------------------------------------------------------------------------------------------- stems


def _first_conv(model: nn.Module) -> nn.Conv2d:
    return next(m for m in model.features.modules() if isinstance(m, nn.Conv2d))


def _has_maxpool(model: nn.Module) -> bool:
    return any(isinstance(m, nn.MaxPool2d) for m in model.features.modules())


@pytest.mark.parametrize("name", ["resnet10", "resnet50"])
def test_resnet_stem_rule(name):
    small = build_model(name, C, (3, 32, 32), 64)
    conv = _first_conv(small)
    assert (conv.kernel_size, conv.stride, conv.in_channels) == ((3, 3), (1, 1), 3)
    assert not _has_maxpool(small) and small.small_input_stem
    large = build_model(name, C, (1, 64, 64), 64)
    conv = _first_conv(large)
    assert (conv.kernel_size, conv.stride, conv.in_channels) == ((7, 7), (2, 2), 1)
    assert _has_maxpool(large) and not large.small_input_stem
    _check_contract(large, torch.randn(BATCH, 1, 64, 64), 64)
    # 28x28 digits count as small
    assert not _has_maxpool(build_model(name, C, (3, 28, 28), 64))


def test_resnet_stage_layout_and_projection():
    blocks = {"resnet10": [1, 1, 1, 1], "resnet18": [2, 2, 2, 2], "resnet34": [3, 4, 6, 3],
              "resnet50": [3, 4, 6, 3], "resnet101": [3, 4, 23, 3]}
    for name, layout in blocks.items():
        model = build_model(name, C, (3, 32, 32), 512)
        assert [len(getattr(model.features, f"layer{i}")) for i in range(1, 5)] == layout
        bottleneck = name in ("resnet50", "resnet101")
        block = Bottleneck if bottleneck else BasicBlock
        assert isinstance(model.features.layer1[0], block)
        projection = model.features.projection
        if bottleneck:
            assert isinstance(projection, nn.Linear) and projection.in_features == 2048
        else:
            assert isinstance(projection, nn.Identity)
    assert isinstance(build_model("resnet18", C, (3, 32, 32), 64).features.projection, nn.Linear)


def test_parameter_free_pool_projection():
    linear = build_model("resnet50", C, (3, 32, 32), 512)
    pooled = build_model("resnet50", C, (3, 32, 32), 512, projection="pool")
    assert _n(linear) - _n(pooled) == 2048 * 512 + 512
    _check_contract(pooled, torch.randn(BATCH, 3, 32, 32), 512)
    with pytest.raises(ValueError, match="projection"):
        build_model("resnet50", C, (3, 32, 32), 512, projection="conv")


def test_googlenet_and_mobilenet_small_stems():
    g_small, g_large = build_model("googlenet", C, (3, 32, 32), 64), build_model("googlenet", C, (3, 64, 64), 64)
    assert (_first_conv(g_small).kernel_size, _first_conv(g_small).stride) == ((3, 3), (1, 1))
    assert (_first_conv(g_large).kernel_size, _first_conv(g_large).stride) == ((7, 7), (2, 2))
    assert not hasattr(g_small.features, "maxpool1") and hasattr(g_large.features, "maxpool1")
    # inception 5 runs at 4x4 for a 32x32 input
    trunk = nn.Sequential(*list(g_small.features.children())[:-3])
    assert trunk(torch.randn(1, 3, 32, 32)).shape == (1, 1024, 4, 4)
    _check_contract(g_large, torch.randn(BATCH, 3, 64, 64), 64)

    m_small, m_large = build_model("mobilenetv2", C, (3, 32, 32), 64), build_model("mobilenetv2", C, (3, 64, 64), 64)
    assert _first_conv(m_small).stride == (1, 1) and _first_conv(m_large).stride == (2, 2)
    assert m_small.features[0](torch.randn(1, 3, 32, 32)).shape[-2:] == (4, 4)
    assert m_large.features[0](torch.randn(1, 3, 64, 64)).shape[-2:] == (2, 2)
    _check_contract(m_small, torch.randn(BATCH, 3, 32, 32), 64)


# ------------------------------------------------------------------------------------------------ text


def test_textcnn_layout():
    model = build_model("textcnn", 4, (256,), 512)
    f = model.features
    assert (f.embedding.num_embeddings, f.embedding.embedding_dim, f.embedding.padding_idx) == (30000, 128, 0)
    assert [(c.in_channels, c.out_channels, c.kernel_size[0]) for c in f.convs] == [(128, 32, k) for k in (3, 4, 5)]
    assert (f.fc.in_features, f.fc.out_features) == (96, 512)
    assert torch.count_nonzero(f.embedding.weight[0]) == 0
    small = build_model("textcnn", 4, (20,), 16, vocab_size=100, embed_dim=8)
    assert small.features.embedding.num_embeddings == 100 and small.vocab_size == 100


def test_textcnn_padding_and_variable_length():
    torch.manual_seed(0)
    model = build_model("textcnn", 4, (64,), 32, vocab_size=50).eval()
    tokens = torch.randint(1, 50, (BATCH, 12))
    with torch.no_grad():
        base = model.features(tokens)
        for extra in (1, 4, 30):  # any amount of trailing padding: same features
            padded = torch.cat([tokens, torch.zeros(BATCH, extra, dtype=torch.long)], dim=1)
            torch.testing.assert_close(model.features(padded), base)
        # rows of different real lengths padded to one L behave as each alone
        ragged = torch.zeros(BATCH, 40, dtype=torch.long)
        ragged[0, :12], ragged[1, :7] = tokens[0], tokens[1, :7]
        out = model.features(ragged)
        torch.testing.assert_close(out[0], base[0])
        torch.testing.assert_close(out[1], model.features(tokens[1:, :7])[0])
        # very short and empty (all-padding) sequences stay finite; all padding gives fc's bias
        assert model(torch.randint(1, 50, (BATCH, 2))).shape == (BATCH, 4)
        torch.testing.assert_close(model.features(torch.zeros(1, 9, dtype=torch.long))[0], model.features.fc.bias)
        assert model(torch.randint(1, 50, (BATCH, 300))).shape == (BATCH, 4)
    with pytest.raises(TypeError, match="integer"):
        model(torch.randn(BATCH, 12))
    # the padding embedding gets no gradient
    model.train()
    model(torch.cat([tokens, torch.zeros(BATCH, 3, dtype=torch.long)], 1)).sum().backward()
    assert torch.count_nonzero(model.features.embedding.weight.grad[0]) == 0


# --------------------------------------------------------------------------------------------- errors


def test_build_model_errors():
    with pytest.raises(KeyError, match="resnet18"):
        build_model("resnet7", C, (3, 32, 32))
    with pytest.raises(ValueError, match="token"):
        build_model("textcnn", C, (3, 32, 32))
    for name in ("resnet18", "cnn", "googlenet", "mobilenetv2", "cnn4"):
        with pytest.raises(ValueError, match="images"):
            build_model(name, C, (256,))
    with pytest.raises(ValueError, match="'cnn'"):
        build_model("cnn", C, (3, 8, 8))
    with pytest.raises(ValueError, match="feature_dim"):
        build_model("resnet10", C, (3, 32, 32), 0)


def test_cnn_is_unchanged_and_cnn4_is_the_fedavg_cnn():
    for name in ("cnn", "cnn4"):
        model = build_model(name, C, (3, 32, 32), 512)
        assert isinstance(model, FedAvgCNN)
        assert _n(model) == (3 * 25 * 32 + 32) + (32 * 25 * 64 + 64) + (1600 * 512 + 512) + (512 * C + C)
    assert build_model("cnn", C, (1, 28, 28), 512).features[7].in_features == 1024


# ------------------------------------------------------------------------------------------------ HtFE


def test_htfe_lists():
    assert {k: len(v) for k, v in HTFE.items()} == {"htfe2": 2, "htfe3": 3, "htfe5": 5, "htfe8": 8}
    assert all(name in MODELS for names in HTFE.values() for name in names)
    eight = ["cnn4", "googlenet", "mobilenetv2", "resnet10", "resnet18", "resnet34", "resnet50", "resnet101"]
    assert [architecture_for_client("htfe8", k) for k in range(20)] == [eight[k % 8] for k in range(20)]
    assert [architecture_for_client("htfe2", k) for k in range(4)] == ["cnn4", "resnet18"] * 2
    assert architecture_for_client("htfe5", 7) == "resnet18"  # 7 mod 5 = 2
    with pytest.raises(KeyError, match="htfe8"):
        architecture_for_client("htfe4", 0)
    with pytest.raises(ValueError):
        architecture_for_client("htfe3", -1)


# ----------------------------------------------------------------------------------------------- counts


def test_flops_of_a_linear_model_and_fedavg_cnn_match_hand_counts():
    assert forward_flops(nn.Linear(100, 7), torch.randn(1, 100)) == 2 * 100 * 7
    assert forward_flops(nn.Linear(100, 7), torch.randn(3, 100)) == 3 * 2 * 100 * 7
    model = FedAvgCNN(C, (3, 32, 32), 512)
    hand = 2 * 75 * 32 * 28 * 28 + 2 * 800 * 64 * 10 * 10 + 2 * 1600 * 512 + 2 * 512 * C
    assert forward_flops(model, torch.randn(1, 3, 32, 32)) == hand
    assert model.training  # forward_flops restores the mode
    # textcnn: only the three convolutions and two linears count (not the embedding look-up)
    text = build_model("textcnn", C, (256,), 512)
    hand = sum(2 * 128 * k * 32 * (256 - k + 1) for k in (3, 4, 5)) + 2 * 96 * 512 + 2 * 512 * C
    assert forward_flops(text, example_input(text, (256,))) == hand


def test_params_agree_with_torchvision_adjusted_by_hand():
    # resnet18, CIFAR stem, d = 512: torchvision resnet18(num_classes=C) with a 3x3 instead of a 7x7 stem conv
    reference = _n(ResNet(BasicBlock, [2, 2, 2, 2], num_classes=C))
    assert count_parameters(build_model("resnet18", C, (3, 32, 32), 512)) == reference - 64 * 3 * 49 + 64 * 3 * 9
    # resnet50, d = 512: plus the 2048 -> 512 projection and a 512-wide classifier
    reference = _n(ResNet(Bottleneck, [3, 4, 6, 3], num_classes=C))
    assert count_parameters(build_model("resnet50", C, (3, 32, 32), 512)) == (
        reference - 64 * 3 * 49 + 64 * 3 * 9 - (2048 * C + C) + (2048 * 512 + 512) + (512 * C + C))
    # mobilenetv2 at 64x64 (unchanged trunk): its 1280 -> C classifier becomes 1280 -> d -> C
    reference = _n(MobileNetV2(num_classes=C))
    assert count_parameters(build_model("mobilenetv2", C, (3, 64, 64), 512)) == (
        reference - (1280 * C + C) + (1280 * 512 + 512) + (512 * C + C))
    # googlenet, small stem (conv1 3x3 instead of 7x7, no bias in either): fc 1024 -> C becomes 1024 -> d -> C
    reference = _n(GoogLeNet(num_classes=C, aux_logits=False, init_weights=False))
    assert count_parameters(build_model("googlenet", C, (3, 32, 32), 512)) == (
        reference - 64 * 3 * 49 + 64 * 3 * 9 - (1024 * C + C) + (1024 * 512 + 512) + (512 * C + C))


def test_describe_models_and_table():
    state = torch.random.get_rng_state()
    rows = describe_models(["cnn", "resnet10", "mobilenetv2", "textcnn"])
    assert torch.equal(torch.random.get_rng_state(), state)
    assert [row["name"] for row in rows] == ["cnn", "resnet10", "mobilenetv2", "textcnn"]
    for row in rows:
        assert row["params"] > 0 and row["flops"] > 0 and row["feature_dim"] == 512 and row["num_classes"] == 10
        assert row["classifier_params"] == 512 * 10 + 10
        assert row["input_shape"] == USUAL_INPUT_SHAPES[row["name"]]
    assert rows[0]["flops"] == 2 * 75 * 32 * 28 * 28 + 2 * 800 * 64 * 10 * 10 + 2 * 1600 * 512 + 2 * 512 * 10
    assert rows[2]["input_shape"] == (3, 64, 64) and rows[3]["input_shape"] == (256,)
    table = format_model_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows) and "params (M)" in lines[0] and "GFLOPs" in lines[0]
    assert "3x32x32" in table and "L=256" in table and "mobilenetv2" in table
    assert len({len(line) for line in lines[1:]}) == 1  # right-aligned numeric columns: equal widths
    with pytest.raises(KeyError):
        describe_models(["nope"])


# --- the no-grad max pool: exactly nn.MaxPool2d, faster -------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 4, 8, 8), (2, 5, 7, 9), (1, 1, 2, 3), (4, 32, 28, 28)])
def test_fast_max_pool_equals_torch_max_pool_bit_for_bit(shape):
    from fedhpro.models._common import MaxPool2d

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    x[0, 0, 0, :2] = 1.5  # a tie inside one window
    x[-1, -1, -1, -1] = float("nan")  # NaN propagates in both (odd sizes: a dropped row may hold it)
    with torch.no_grad():
        expected = nn.MaxPool2d(2)(x)
        got = MaxPool2d(2)(x)
    assert got.shape == expected.shape
    assert torch.equal(torch.nan_to_num(got, nan=7.0), torch.nan_to_num(expected, nan=7.0))
    assert torch.equal(got.isnan(), expected.isnan())


def test_fast_max_pool_takes_the_standard_kernel_when_training():
    from fedhpro.models._common import MaxPool2d

    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    ours, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    MaxPool2d(2)(ours).pow(2).sum().backward()
    nn.MaxPool2d(2)(theirs).pow(2).sum().backward()
    assert torch.equal(ours.grad, theirs.grad)
    # a window it does not cover (3 x 3, stride 2, padding 1) runs torch's kernel under no_grad too
    with torch.no_grad():
        assert torch.equal(MaxPool2d(3, 2, 1)(x), nn.MaxPool2d(3, 2, 1)(x))


def test_cnn_eval_forward_equals_the_torch_max_pool_network():
    model = build_model("cnn", C, (3, 32, 32), 64).eval()
    reference = build_model("cnn", C, (3, 32, 32), 64).eval()
    reference.load_state_dict(model.state_dict())
    for index, layer in enumerate(reference.features):
        if isinstance(layer, nn.MaxPool2d):
            reference.features[index] = nn.MaxPool2d(layer.kernel_size)  # torch's own layer
    assert sum(type(layer) is nn.MaxPool2d for layer in reference.features) == 2
    x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
