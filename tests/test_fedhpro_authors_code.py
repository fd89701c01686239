"""The options that make ``fedhpro.recipe=authors`` compute what the authors' code computes, against
independent references.

References: their matching distance written out over Python floats and over 0-dim tensors one element at a
time (the loop of ``utils/gradient_matching.py``), their hyper-prototype gradients by autograd of the class's
mean CE with ``create_graph`` (as ``obtain_hyper_prototypes`` takes them), torchvision's functional pad/crop/flip
for the batch augmentation, per-image transforms for the class-batch augmentation, replays of the round's
generator for the random samples, autograd of each class's mean CE for the class gradients, and a functional
forward (``F.conv2d``, ``F.batch_norm``) of the authors' ResNet-10 layout.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.functional as TF
from conftest import NUM_CLASSES, make_client
from test_methods import TRAIN, context, fit_fedhpro, generator, model_with
from torch import nn

from fedhpro.data.federation import ClientData
from fedhpro.errors import ConfigError
from fedhpro.methods import MethodContext
from fedhpro.methods.fedhpro import FedHProOptions, authors_code, equations
from fedhpro.methods.fedhpro.client import FedHProClient
from fedhpro.methods.fedhpro.hyper import divide_by_counts, sampled_features
from fedhpro.methods.fedhpro.server import LAST_CLIENT_WARNING, FedHProServer
from fedhpro.models import build_model
from fedhpro.models.authors_resnet import AuthorsResNet10

EPS = 1e-6  # their distance_wb's


# ---------------------------------------------------------------------------- the element-wise distance


def their_distance_over_floats(g_real, g_hyper, present) -> float:
    """``match_loss`` (dis_metric='matching') per class: for each element, ``distance_wb`` of two scalars."""
    total = 0.0
    for c in range(g_real.shape[0]):
        if not present[c]:
            continue
        for a, b in zip(g_real[c].tolist(), g_hyper[c].tolist()):
            total += 1.0 - a * b / (abs(a) * abs(b) + EPS)
    return total


def test_elementwise_distance_against_a_loop_over_scalars_of_their_formula():
    g = torch.Generator().manual_seed(3)
    g_real = torch.randn(4, 7, generator=g, dtype=torch.float64) * 1e-3
    g_hyper = torch.randn(4, 7, generator=g, dtype=torch.float64) * 1e-2
    g_hyper[1, 2] = 0.0  # a zero element: 1 - 0/eps = 1
    present = torch.tensor([True, False, True, True])
    got = float(equations.elementwise_matching_loss(g_real, g_hyper, present))
    assert got == pytest.approx(their_distance_over_floats(g_real, g_hyper, present), rel=1e-12)
    # the hand value of one pair: a = 1e-3, b = -2e-3: 1 + 2e-6 / (2e-6 + 1e-6) = 5/3
    one = equations.elementwise_matching_loss(torch.tensor([[1e-3]], dtype=torch.float64),
                                       torch.tensor([[-2e-3]], dtype=torch.float64), torch.tensor([True]))
    assert float(one) == pytest.approx(5.0 / 3.0, rel=1e-12)
    assert float(equations.elementwise_matching_loss(g_real, g_hyper, torch.zeros(4, dtype=torch.bool))) == 0.0


def test_elementwise_distance_gradient_is_the_hand_derivative():
    """d/db [1 - ab/(|a||b| + eps)] = -a eps / (|a||b| + eps)^2 (b != 0): about -a/eps for tiny gradients."""
    g = torch.Generator().manual_seed(4)
    a = torch.randn(2, 5, generator=g, dtype=torch.float64) * 1e-3
    b = (torch.randn(2, 5, generator=g, dtype=torch.float64) * 1e-3).requires_grad_(True)
    (grad,) = torch.autograd.grad(equations.elementwise_matching_loss(a, b, torch.tensor([True, True])), b)
    expected = -a * EPS / (a.abs() * b.detach().abs() + EPS) ** 2
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=0)


def their_matching_steps(hyper, head, g_real, present, steps, lr):
    """``obtain_hyper_prototypes`` (main_run.py lines 106-120): per class, the gradient of the mean CE of its
    |I| vectors by autograd with create_graph, averaged over the vectors (match_loss's ``gw_syn.mean(0)``),
    then the element-wise distance one 0-dim pair at a time; SGD on the sum."""
    variable = hyper.clone().requires_grad_(True)
    for _ in range(steps):
        loss = torch.zeros((), dtype=hyper.dtype)
        for c in range(hyper.shape[0]):
            if not present[c]:
                continue
            vectors = variable[c]
            labels = torch.full((vectors.shape[0],), c, dtype=torch.long)
            (gw_syn,) = torch.autograd.grad(F.cross_entropy(head(vectors), labels), vectors, create_graph=True)
            averaged = gw_syn.mean(dim=0)
            for i in range(g_real.shape[1]):
                a, b = g_real[c, i], averaged[i]
                loss = loss + (1 - torch.sum(a * b, dim=-1) / (torch.norm(a, dim=-1) * torch.norm(b, dim=-1) + EPS))
        (grad,) = torch.autograd.grad(loss, variable)
        variable = (variable - lr * grad).detach().requires_grad_(True)
    return variable.detach()


def test_matching_with_the_elementwise_distance_against_their_autograd_loop():
    torch.manual_seed(0)
    head = nn.Linear(3, 3).double()
    g = torch.Generator().manual_seed(5)
    hyper = torch.randn(3, 2, 3, generator=g, dtype=torch.float64)
    g_real = torch.randn(3, 3, generator=g, dtype=torch.float64) * 1e-3
    present = torch.tensor([True, False, True])
    matched, before, after = equations.match_hyper_prototypes(hyper, head, g_real, present, steps=3, lr=0.1,
                                                       distance="elementwise")
    expected = their_matching_steps(hyper, head, g_real, present, steps=3, lr=0.1)
    torch.testing.assert_close(matched, expected, rtol=1e-9, atol=1e-12)
    assert torch.equal(matched[1], hyper[1])  # a class nobody holds keeps its vectors
    g_hp = equations.hyper_prototype_gradients(hyper, head) / 2
    assert before == pytest.approx(their_distance_over_floats(g_real, g_hp, present), rel=1e-9)
    assert after < before


def test_server_passes_the_distance_to_the_bank_and_refuses_an_unknown_one():
    model = nn.Sequential()
    model.features = nn.Linear(2, 3)
    model.classifier = nn.Linear(3, 2)
    options = FedHProOptions(matching_distance="elementwise")
    server = FedHProServer(MethodContext(model=model, num_classes=2, options=options, train=TRAIN, seed=1))
    assert server.bank.distance == "elementwise"
    with pytest.raises(ValueError, match="distance must be one of"):
        equations.match_hyper_prototypes(server.hyper, model.classifier, torch.zeros(2, 3),
                                         torch.ones(2, dtype=torch.bool), steps=1, lr=0.1, distance="euclid")


# ---------------------------------------------------------------------------- the batch augmentation


def test_crop_flip_is_one_draw_for_the_whole_batch_as_torchvision_computes_it():
    x = torch.randn(5, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for seed in range(12):
        out = authors_code.batch_crop_flip(x, generator(seed))
        replay = generator(seed)  # RandomCrop.get_params draws the row, then the column; then the flip's coin
        top = int(torch.randint(0, 9, (1,), generator=replay))
        left = int(torch.randint(0, 9, (1,), generator=replay))
        flip = bool(torch.rand(1, generator=replay) < 0.5)
        expected = TF.crop(TF.pad(x, [4], fill=0), top, left, 32, 32)
        if flip:
            expected = TF.hflip(expected)
        assert torch.equal(out, expected)


def test_crop_flip_draws_every_offset_and_both_sides():
    x = torch.zeros(2, 1, 8, 8)
    x[:, :, 0, 0] = 1.0  # one marked pixel: where it lands tells the (offset, flip) of the draw
    seen = set()
    g = generator(0)
    for _ in range(1500):
        out = authors_code.batch_crop_flip(x, g)
        assert torch.equal(out[0], out[1])  # the same draw for every image of the batch
        marks = out[0, 0].nonzero().tolist()
        seen.add(tuple(marks[0]) if marks else None)
    # the pixel lands at row top', column left' or 7 - left' (flipped), or off the window
    assert len(seen) > 40 and None in seen


# ---------------------------------------------------------------------------- the class-batch augmentation


def test_class_batch_augment_draws_one_strategy_and_one_transform_for_the_class():
    x = torch.randn(6, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    strategies = []
    for seed in range(60):
        out = authors_code.class_batch_augment(x, generator(seed))
        replay = generator(seed)
        strategy = authors_code.DSA_STRATEGIES[int(torch.randint(0, 6, (1,), generator=replay))]
        strategies.append(strategy)
        state = replay.get_state()
        for k in range(x.shape[0]):  # image k alone, under the same draw, gives row k: one transform for all
            alone = authors_code.DSA_FUNCTIONS[strategy](x[k:k + 1], torch.Generator().set_state(state))
            if strategy == "color":  # the image mean is per image: the same as in the batch
                torch.testing.assert_close(out[k:k + 1], alone)
            else:
                assert torch.allclose(out[k:k + 1], alone, atol=1e-6), strategy
    assert set(strategies) == set(authors_code.DSA_STRATEGIES)


def test_each_strategy_against_its_hand_formula():
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))

    def draws(seed, n, kind="rand", low=0, high=1):
        g = generator(seed)
        if kind == "rand":
            return [float(torch.rand(1, generator=g)) for _ in range(n)]
        return [int(torch.randint(low, high, (1,), generator=g)) for _ in range(n)]

    # color: brightness 1.0, saturation 2.0 (mean over channels), contrast 0.5 (mean of each image)
    u = draws(0, 3)
    y = x + (u[0] - 0.5)
    y = (y - y.mean(1, keepdim=True)) * (2 * u[1]) + y.mean(1, keepdim=True)
    y = (y - y.mean([1, 2, 3], keepdim=True)) * (u[2] + 0.5) + y.mean([1, 2, 3], keepdim=True)
    torch.testing.assert_close(authors_code.DSA_FUNCTIONS["color"](x, generator(0)), y)
    # crop: a shift by (t_h, t_w) in -4..4 with zeros coming in
    t_h, t_w = draws(1, 2, "int", -4, 5)
    out = authors_code.DSA_FUNCTIONS["crop"](x, generator(1))
    for i in range(32):
        for j in range(32):
            si, sj = i + t_h, j + t_w
            inside = 0 <= si < 32 and 0 <= sj < 32
            expected = x[:, :, si, sj] if inside else torch.zeros(2, 3)
            assert torch.equal(out[:, :, i, j], expected)
    # cutout: a 16 x 16 square at rows o_h - 8 .. o_h + 7 (cut at the edges) set to 0
    o_h, o_w = draws(2, 2, "int", 0, 33)
    out = authors_code.DSA_FUNCTIONS["cutout"](x, generator(2))
    rows = set(min(max(r, 0), 31) for r in range(o_h - 8, o_h + 8))
    columns = set(min(max(c, 0), 31) for c in range(o_w - 8, o_w + 8))
    for i in range(32):
        for j in range(32):
            expected = torch.zeros(2, 3) if (i in rows and j in columns) else x[:, :, i, j]
            assert torch.equal(out[:, :, i, j], expected)
    # flip with probability 1/2
    (f,) = draws(3, 1)
    assert torch.equal(authors_code.DSA_FUNCTIONS["flip"](x, generator(3)), x.flip(3) if f < 0.5 else x)
    # scale: diag(s_w, s_h), s uniform on [1/1.2, 1.2); rotate: +-15 degrees; bilinear, zero padding
    s_w, s_h = [v * (1.2 - 1 / 1.2) + 1 / 1.2 for v in draws(4, 2)]
    theta = torch.tensor([[[s_w, 0, 0], [0, s_h, 0]]]).repeat(2, 1, 1)
    expected = F.grid_sample(x, F.affine_grid(theta, list(x.shape), align_corners=False), align_corners=False)
    torch.testing.assert_close(authors_code.DSA_FUNCTIONS["scale"](x, generator(4)), expected)
    (r,) = draws(5, 1)
    angle = (r - 0.5) * 2 * 15 / 180 * math.pi
    theta = torch.tensor([[[math.cos(angle), -math.sin(angle), 0], [math.sin(angle), math.cos(angle), 0]]])
    expected = F.grid_sample(x, F.affine_grid(theta.repeat(2, 1, 1), list(x.shape), align_corners=False),
                             align_corners=False)
    torch.testing.assert_close(authors_code.DSA_FUNCTIONS["rotate"](x, generator(5)), expected)


# ---------------------------------------------------------------------------- the sample choice


def test_random_samples_per_class_replay_the_generator_class_by_class():
    data = make_client(40, [0, 1, 3], seed=8)
    model = nn.Sequential()
    model.features = nn.Flatten()
    model.classifier = nn.Linear(3 * 8 * 8, NUM_CLASSES)
    features, labels = sampled_features(model, data, 5, choice="random", generator=generator(9))
    replay = generator(9)
    chosen = []
    for c in (0, 1, 3):
        where = (data.y == c).nonzero().squeeze(1)
        chosen.append(where[torch.randperm(where.numel(), generator=replay)][:5])
    index = torch.cat(chosen)
    assert torch.equal(labels, data.y[index])
    torch.testing.assert_close(features, data.x[index].flatten(1))
    first, _ = sampled_features(model, data, 5)
    assert not torch.equal(first.sort(0).values, features.sort(0).values)  # not the first five
    again, _ = sampled_features(model, data, 5, choice="random", generator=generator(10))
    assert not torch.equal(again, features)  # a new draw each round
    with pytest.raises(ValueError, match="pass one"):
        sampled_features(model, data, 5, choice="random")


def test_divide_by_counts_by_hand():
    gradients = torch.tensor([[2.0, 4.0], [0.0, 0.0], [3.0, 6.0]])
    labels = torch.tensor([0, 2, 0, 2, 2])
    torch.testing.assert_close(divide_by_counts(gradients, labels, 3), torch.tensor([[1.0, 2.0], [0.0, 0.0],
                                                                                     [1.0, 2.0]]))


def test_client_class_gradients_are_their_mean_ce_gradients_on_random_samples():
    """timing=before, random 4 per class, divided: per class, autograd of the mean CE of the chosen samples'
    features (received model, eval) w.r.t. the features, averaged over the samples (main_run.py 326-343)."""
    data = make_client(30, [0, 1, 3], seed=6)
    options = FedHProOptions(num_hyper=2, gradient_timing="before", gradient_samples_per_class=4,
                             gradient_sample_choice="random", class_gradient_divide=True)
    received, _, reply, _ = fit_fedhpro(options, data, train=TRAIN, gen_seed=5)
    model = model_with(received)
    replay = generator(5)  # prepare draws first from the round's generator
    expected = torch.zeros(NUM_CLASSES, reply["class_gradients"].shape[1])
    for c in (0, 1, 3):
        where = (data.y == c).nonzero().squeeze(1)
        index = where[torch.randperm(where.numel(), generator=replay)][:4]
        with torch.no_grad():
            features = model.features(data.x[index])
        features.requires_grad_(True)
        loss = F.cross_entropy(model.classifier(features), torch.full((4,), c))
        (grad,) = torch.autograd.grad(loss, features)
        expected[c] = grad.mean(0)
    torch.testing.assert_close(reply["class_gradients"], expected, rtol=1e-5, atol=1e-8)
    assert reply["class_counts"].tolist() == torch.bincount(data.y, minlength=NUM_CLASSES).tolist()


def test_client_with_dsa_augments_each_class_batch_once(monkeypatch):
    calls = []
    real = authors_code.class_batch_augment

    def spy(x, g):
        calls.append(x.shape[0])
        return real(x, g)

    monkeypatch.setattr(authors_code, "class_batch_augment", spy)
    data = make_client(30, [0, 1, 3], seed=6)
    options = FedHProOptions(num_hyper=2, gradient_timing="before", gradient_samples_per_class=4,
                             gradient_sample_choice="random", gradient_augment="dsa")
    fit_fedhpro(options, data, train=TRAIN)
    assert calls == [4, 4, 4]


# ---------------------------------------------------------------------------- local augmentation in the round


def test_local_crop_flip_augments_every_training_batch_and_the_default_none(monkeypatch):
    calls = []
    real = authors_code.batch_crop_flip

    def spy(x, g):
        calls.append(tuple(x.shape))
        return real(x, g)

    monkeypatch.setattr(authors_code, "batch_crop_flip", spy)
    data = make_client(24, [0, 1, 3], seed=6)
    fit_fedhpro(FedHProOptions(num_hyper=2), data, train=TRAIN)
    assert calls == []
    fit_fedhpro(FedHProOptions(num_hyper=2, local_augment="crop-flip"), data, train=TRAIN)
    assert calls == [(8, 3, 8, 8)] * 3 * TRAIN.epochs  # 24 samples in batches of 8, every epoch
    assert data.augment is None  # the client's data itself is left as it was


def test_local_crop_flip_after_the_datas_own_augmentation(monkeypatch):
    order = []
    data = make_client(16, [0, 1], seed=6)
    data = ClientData(data.x, data.y, data.num_classes, lambda x, g: order.append("data") or x)
    monkeypatch.setattr(authors_code, "batch_crop_flip", lambda x, g: order.append("crop-flip") or x)
    fit_fedhpro(FedHProOptions(num_hyper=2, local_augment="crop-flip"), data, train=TRAIN)
    assert order[:4] == ["data", "crop-flip", "data", "crop-flip"]


def test_augmentations_refuse_inputs_that_are_not_images_in_one_line():
    tokens = ClientData(torch.randint(0, 50, (12, 6)), torch.tensor([0, 1, 3] * 4), NUM_CLASSES)
    for changed, option in (({"local_augment": "crop-flip"}, "local_augment"),
                            ({"gradient_augment": "dsa", "gradient_timing": "before"}, "gradient_augment")):
        with pytest.raises(ConfigError, match=f"fedhpro.{option}=.* augments images") as raised:
            fit_fedhpro(FedHProOptions(num_hyper=2, **changed), tokens, train=TRAIN)
        assert "\n" not in str(raised.value)


# ---------------------------------------------------------------------------- their aggregation bug, by name


def test_authors_last_client_keeps_the_last_reply_and_warns_at_start():
    model = nn.Sequential()
    model.features = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    model.classifier = nn.Linear(3, 2)
    options = FedHProOptions(authors_last_client=True, num_hyper=1)
    with pytest.warns(UserWarning, match="LAST client"):
        server = FedHProServer(MethodContext(model=model, num_classes=2, options=options, train=TRAIN, seed=1))
    assert "not FedHPro" in LAST_CLIENT_WARNING
    replies = []
    g = torch.Generator().manual_seed(2)
    for counts in ([3, 1], [2, 2], [0, 5]):
        weights = {k: (v + torch.randn(v.shape, generator=g)) if v.is_floating_point() else v + 1
                   for k, v in server.weights.items()}
        replies.append({"weights": weights, "num_examples": sum(counts), "class_counts": torch.tensor(counts),
                        "class_gradients": torch.randn(2, 3, generator=g),
                        "prototypes": torch.randn(2, 3, generator=g)})
    collected = server.new_replies()
    assert not collected.folds_weights
    for reply in replies:
        server.validate_reply(reply)
        collected.append(reply)
    server.aggregate(0, collected)
    for key, value in replies[-1]["weights"].items():
        assert torch.equal(server.weights[key], value) and server.weights[key] is not value
    # the default averages
    default = FedHProServer(MethodContext(model=model, num_classes=2, options=FedHProOptions(num_hyper=1),
                                          train=TRAIN, seed=1))
    assert default.folds_weights
    default.aggregate(0, replies)
    assert not torch.equal(default.weights["classifier.weight"], replies[-1]["weights"]["classifier.weight"])


def test_sample_privacy_refuses_the_options_that_change_the_released_gradients():
    for changed in ({"class_gradient_divide": True}, {"gradient_augment": "dsa"}):
        client = FedHProClient(context(FedHProOptions(**changed)))
        assert "privacy=sample" in (client.sample_privacy_problem() or "")
    assert FedHProClient(context(FedHProOptions(local_augment="crop-flip"))).sample_privacy_problem() is None


# ---------------------------------------------------------------------------- their ResNet-10


def functional_resnet10(model: AuthorsResNet10, x: torch.Tensor) -> torch.Tensor:
    """Their ``ResNet.features`` (backbone/ResNet10.py lines 52-56, 116-122) in eval mode, written with
    F.conv2d / F.batch_norm on the model's parameters."""
    p = dict(model.named_parameters())
    b = dict(model.named_buffers())

    def bn(h, name):
        return F.batch_norm(h, b[f"{name}.running_mean"], b[f"{name}.running_var"], p[f"{name}.weight"],
                            p[f"{name}.bias"], False, 0.0, 1e-5)

    h = F.relu(bn(F.conv2d(x, p["features.0.weight"], padding=1), "features.1"))
    for index, stride in zip((3, 4, 5, 6), (1, 2, 2, 2)):
        name = f"features.{index}"
        out = F.relu(bn(F.conv2d(h, p[f"{name}.conv1.weight"], stride=stride, padding=1), f"{name}.bn1"))
        out = bn(F.conv2d(out, p[f"{name}.conv2.weight"], padding=1), f"{name}.bn2")
        if f"{name}.shortcut.0.weight" in p:
            shortcut = bn(F.conv2d(h, p[f"{name}.shortcut.0.weight"], stride=stride), f"{name}.shortcut.1")
        else:
            shortcut = h
        h = F.relu(out + shortcut)
    return h.mean(dim=(2, 3))


def test_their_resnet10_layout_parameters_and_forward():
    torch.manual_seed(0)
    model = build_model("resnet10-authors", 10, (3, 32, 32), 256)
    # their resnet10(10) has 1,426,346 parameters, 197,376 of them in the encoder no forward pass uses
    assert sum(p.numel() for p in model.parameters()) == 1_426_346 - 197_376
    widths = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert widths == [32, 32, 32, 64, 64, 128, 128, 256, 256]
    # BatchNorm statistics that are not the identity, then compare in eval mode
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(16, 3, 32, 32))
    model.eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        z = model.features(x)
        torch.testing.assert_close(z, functional_resnet10(model, x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model(x), model.classifier(z))
    assert bool((z >= 0).all())  # features after the last ReLU
    assert model.feature_dim == 256 and model.classifier.in_features == 256


def test_their_resnet10_refuses_shapes_in_one_line():
    with pytest.raises(ValueError, match="multiple of 8"):
        build_model("resnet10-authors", 10, (3, 32, 32), 100)
    with pytest.raises(ValueError, match="square"):
        build_model("resnet10-authors", 10, (3, 32, 40), 256)
    with pytest.raises(ValueError, match="takes no options"):
        build_model("resnet10-authors", 10, (3, 32, 32), 256, width=3)
    assert build_model("resnet10-authors", 4, (1, 28, 28), 64).feature_dim == 64
