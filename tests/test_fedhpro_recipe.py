"""``fedhpro.recipe=authors`` and the options of the authors' code it sets, against independent references.

References: the resolved config with and without the recipe (the set of keys
that differ), per-class autograd loops through an ``nn.Linear`` in float64
(the clients' classifier gradients, the synthetic gradients with
``create_graph`` as the authors' code takes them), the layer-wise distance
written out with Python floats, a hand-written ``nn.Linear`` + ``torch.optim.SGD``
training loop, and hand-built replies for the server step on C = 2, d = 3.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DIGITS_SYN_SIZE, DIGITS_TEST_FRACTION, NUM_CLASSES, TinyNet, make_client
from test_methods import fit_fedhpro, loop_prototypes, model_with
from torch import nn

from fedhpro import functional
from fedhpro.config import load_config
from fedhpro.methods import MethodContext, TrainSettings
from fedhpro.methods.fedhpro import AUTHORS_RECIPE, FedHProOptions, authors_code, equations
from fedhpro.methods.fedhpro.server import FedHProServer

TRAIN = TrainSettings(epochs=1, batch_size=8, lr=0.1, momentum=0.0, weight_decay=0.0)

#: what the README's Faithfulness list documents: the keys whose resolved value the recipe changes
DOCUMENTED = {
    "feature_dim": 256,
    "lr": 0.1,
    "momentum": 0.0,
    "weight_decay": 0.0,
    "fedhpro.gradient_timing": "before",
    "fedhpro.gradient_samples_per_class": 100,
    "fedhpro.margin": "off",
    "fedhpro.hpcl_batch_divide": True,
    "fedhpro.classifier_step": "synthetic",
    "model": "resnet10-authors",
    "local_epochs": 10,
    "fedhpro.matching_distance": "elementwise",
    "fedhpro.class_gradient_divide": True,
    "fedhpro.gradient_sample_choice": "random",
    "fedhpro.gradient_augment": "dsa",
    "fedhpro.local_augment": "crop-flip",
    "fedhpro.recipe": "authors",
}


def flat(config) -> dict:
    """Every resolved key of a config as ``section.knob`` (run keys bare)."""
    out = {}
    for key, value in config.to_dict().items():
        if isinstance(value, dict) and key not in ("clients_per_domain",):
            out.update({f"{key}.{inner}": v for inner, v in value.items()})
        else:
            out[key] = value
    return out


def differing(a, b) -> dict:
    fa, fb = flat(a), flat(b)
    assert set(fa) == set(fb)
    return {key: fb[key] for key in fa if fa[key] != fb[key]}


# ---------------------------------------------------------------------------- the preset


#: their CIFAR normalisation (main_run.py, FedHPro()): set where the data set takes channel statistics
DATA_KEYS = {"data.mean": [0.4914, 0.4822, 0.4465], "data.std": [0.2023, 0.1994, 0.2010]}


@pytest.mark.parametrize("method", ["fedhpro", "fedavg"])
@pytest.mark.parametrize("dataset, data_keys", [("digits-offline", {}), ("cifar10", DATA_KEYS)])
def test_authors_recipe_changes_exactly_the_documented_keys(method, dataset, data_keys):
    paper = load_config(None, [f"method={method}", f"dataset={dataset}"])
    authors = load_config(None, [f"method={method}", f"dataset={dataset}", "fedhpro.recipe=authors"])
    assert differing(paper, authors) == {**DOCUMENTED, **data_keys}
    # normalised HPAL is the authors' form and already the default: set by the recipe, changed by nothing
    assert AUTHORS_RECIPE["fedhpro.hpal_form"] == "normalized" == authors.methods["fedhpro"].hpal_form
    assert set(AUTHORS_RECIPE) | {"fedhpro.recipe"} == set(DOCUMENTED) | set(DATA_KEYS) | {"fedhpro.hpal_form"}


def test_recipe_paper_is_the_default_config():
    assert load_config(None, ["fedhpro.recipe=paper"]) == load_config()
    assert differing(load_config(), load_config({"fedhpro": {"recipe": "paper"}})) == {}


@pytest.mark.parametrize("overrides", [
    ["fedhpro.recipe=authors", "lr=0.05", "fedhpro.margin=dot"],
    ["lr=0.05", "fedhpro.margin=dot", "fedhpro.recipe=authors"],  # the order of the user's keys does not matter
])
def test_a_user_key_overrides_the_recipe(overrides):
    config = load_config(None, overrides)
    assert config.run.lr == 0.05 and config.methods["fedhpro"].margin == "dot"
    assert config.run.feature_dim == 256 and config.methods["fedhpro"].classifier_step == "synthetic"


def test_recipe_from_a_yaml_file_and_back_to_paper_on_the_command_line(tmp_path):
    path = tmp_path / "authors.yaml"
    path.write_text("fedhpro:\n  recipe: authors\nmomentum: 0.5\n")
    config = load_config(path)
    assert config.run.momentum == 0.5 and config.run.lr == 0.1
    assert load_config(path, ["fedhpro.recipe=paper"]) == load_config(None, ["momentum=0.5"])
    # a saved config.yaml (every key written out) loads to the same config
    assert load_config(config.to_dict()) == config


# ---------------------------------------------------------------------------- slow references


def loop_classifier_gradients(features, labels, weight, bias, num_classes):
    """Per class: autograd of the class's mean CE through an nn.Linear, float64, one class at a time."""
    head = nn.Linear(weight.shape[1], weight.shape[0]).double()
    head.load_state_dict({"weight": weight.double(), "bias": bias.double()})
    gw = torch.zeros(num_classes, *weight.shape, dtype=torch.float64)
    gb = torch.zeros(num_classes, weight.shape[0], dtype=torch.float64)
    for c in range(num_classes):
        rows = labels == c
        if rows.any():
            loss = F.cross_entropy(head(features[rows].double()), labels[rows])
            gw[c], gb[c] = torch.autograd.grad(loss, (head.weight, head.bias))
    return gw, gb


def python_distance(real, synthetic, eps=1e-6) -> float:
    """The authors' distance_wb written out: rows of a 2-D gradient (one row for 1-D), sum of 1 - cos_eps."""
    real_rows = real.tolist() if real.dim() == 2 else [real.tolist()]
    synthetic_rows = synthetic.tolist() if synthetic.dim() == 2 else [synthetic.tolist()]
    total = 0.0
    for r, s in zip(real_rows, synthetic_rows):
        dot = sum(a * b for a, b in zip(r, s))
        total += 1.0 - dot / (math.sqrt(sum(a * a for a in r)) * math.sqrt(sum(b * b for b in s)) + eps)
    return total


def explicit_synthetic_gradients(features, weight, bias):
    """Per class c: 1/m sum_i (softmax(W s_i + b) - e_c) s_i^T and 1/m sum_i (softmax(W s_i + b) - e_c), loops."""
    num_classes, per_class, _ = features.shape
    gw = torch.zeros(num_classes, *weight.shape, dtype=torch.float64)
    gb = torch.zeros(num_classes, weight.shape[0], dtype=torch.float64)
    for c in range(num_classes):
        for i in range(per_class):
            s = features[c, i].double()
            r = torch.softmax(weight.double() @ s + bias.double(), 0)
            r[c] -= 1.0
            gw[c] += torch.outer(r, s) / per_class
            gb[c] += r / per_class
    return gw, gb


def autograd_matching_loss(features, weight, bias, weight_real, bias_real, present):
    """The authors' set_meta_params loss: per class, grads of CE(Linear(s^c), c) w.r.t. (W, b) with create_graph,
    distance_wb of the weight (row loop) and of the bias; differentiable w.r.t. ``features``."""
    head = nn.Linear(weight.shape[1], weight.shape[0]).double()
    head.load_state_dict({"weight": weight.double(), "bias": bias.double()})
    total = torch.zeros((), dtype=torch.float64)
    for c in range(features.shape[0]):
        if not present[c]:
            continue
        labels = torch.full((features.shape[1],), c, dtype=torch.long)
        loss = F.cross_entropy(head(features[c]), labels)
        gw, gb = torch.autograd.grad(loss, (head.weight, head.bias), create_graph=True)
        for real, syn in list(zip(weight_real[c].double(), gw)) + [(bias_real[c].double(), gb)]:
            total = total + 1 - (real * syn).sum() / (real.norm() * syn.norm() + 1e-6)
    return total


def hand_trained_head(features, labels, num_classes, generator, epochs, batch_size, lr):
    """nn.Linear with U(-1/sqrt(d), 1/sqrt(d)) weight then bias, torch.optim.SGD, shuffled mini-batches."""
    dim = features.shape[1]
    head = nn.Linear(dim, num_classes).double()
    bound = 1 / math.sqrt(dim)
    with torch.no_grad():
        head.weight.copy_(torch.rand(num_classes, dim, generator=generator) * 2 * bound - bound)
        head.bias.copy_(torch.rand(num_classes, generator=generator) * 2 * bound - bound)
    optimizer = torch.optim.SGD(head.parameters(), lr=lr)
    for _ in range(epochs):
        order = torch.randperm(features.shape[0], generator=generator)
        for batch in order.split(batch_size):
            optimizer.zero_grad()
            F.cross_entropy(head(features[batch].double()), labels[batch]).backward()
            optimizer.step()
    return head.weight.detach(), head.bias.detach()


# ---------------------------------------------------------------------------- the pure functions


def test_classifier_class_gradients_match_per_class_autograd():
    g = torch.Generator().manual_seed(0)
    features, weight = torch.randn(30, 5, generator=g), torch.randn(4, 5, generator=g)
    bias = torch.randn(4, generator=g)
    labels = torch.tensor([0, 1, 3] * 10)  # class 2 absent
    gw, gb = authors_code.classifier_class_gradients(features, labels, weight, bias, 4)
    ew, eb = loop_classifier_gradients(features, labels, weight, bias, 4)
    torch.testing.assert_close(gw.double(), ew, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gb.double(), eb, rtol=1e-5, atol=1e-7)
    assert not gw[2].any() and not gb[2].any()


def test_synthetic_gradients_and_their_matching_loss_match_the_authors_autograd():
    g = torch.Generator().manual_seed(1)
    features = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)
    gw, gb = authors_code.synthetic_classifier_gradients(features, weight, bias)
    ew, eb = explicit_synthetic_gradients(features, weight, bias)
    torch.testing.assert_close(gw, ew)
    torch.testing.assert_close(gb, eb)
    real_w, real_b = torch.randn(3, 3, 5, generator=g, dtype=torch.float64), torch.randn(3, 3, generator=g,
                                                                                         dtype=torch.float64)
    present = torch.tensor([True, False, True])
    ours = authors_code.classifier_matching_loss(real_w, real_b, gw, gb, present)
    by_hand = sum(python_distance(real_w[c], ew[c]) + python_distance(real_b[c], eb[c]) for c in (0, 2))
    assert float(ours) == pytest.approx(by_hand, rel=1e-12)
    assert float(authors_code.layerwise_distance(real_w[1], ew[1])) == pytest.approx(python_distance(real_w[1], ew[1]))
    assert float(authors_code.layerwise_distance(real_b[1], eb[1])) == pytest.approx(python_distance(real_b[1], eb[1]))


def test_layerwise_distance_ignores_the_scale_of_the_gradients():
    g = torch.Generator().manual_seed(2)
    real, synthetic = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g,
                                                                                      dtype=torch.float64)
    # a client's mean over n samples is 1/n times the sum: the same distance up to the eps of 1e-6
    assert float(authors_code.layerwise_distance(real / 100, synthetic)) == pytest.approx(
        float(authors_code.layerwise_distance(real, synthetic)), abs=1e-3)
    assert float(authors_code.layerwise_distance(real, real)) == pytest.approx(0.0, abs=1e-5)


def test_one_matching_step_against_a_slow_formula_on_two_classes_in_three_dimensions():
    g = torch.Generator().manual_seed(3)
    features = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(2, 3, generator=g, dtype=torch.float64), torch.randn(2, generator=g, dtype=torch.float64)
    real_w, real_b = torch.randn(2, 2, 3, generator=g, dtype=torch.float64), torch.randn(2, 2, generator=g,
                                                                                         dtype=torch.float64)
    present = torch.tensor([True, True])
    new, before, after = authors_code.match_classifier_features(features, weight, bias, real_w, real_b, present,
                                                                steps=1, lr=0.1)
    ew, eb = explicit_synthetic_gradients(features, weight, bias)
    slow_before = sum(python_distance(real_w[c], ew[c]) + python_distance(real_b[c], eb[c]) for c in range(2))
    assert before == pytest.approx(slow_before, rel=1e-12)
    variable = features.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(autograd_matching_loss(variable, weight, bias, real_w, real_b, present), variable)
    torch.testing.assert_close(new, features - 0.1 * grad)
    assert after == pytest.approx(float(autograd_matching_loss(new, weight, bias, real_w, real_b, present).detach()))
    # a class without real gradients is in no term: its features stay as they were
    kept, _, _ = authors_code.match_classifier_features(features, weight, bias, real_w, real_b,
                                                        torch.tensor([True, False]), steps=3, lr=0.1)
    assert torch.equal(kept[1], features[1]) and not torch.equal(kept[0], features[0])


def test_train_linear_classifier_equals_a_hand_written_loop():
    g = torch.Generator().manual_seed(4)
    features = torch.randn(11, 3, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 1] * 5 + [1])
    weight, bias = authors_code.train_linear_classifier(features, labels, 2, torch.Generator().manual_seed(9), epochs=3,
                                              batch_size=4, lr=0.5)  # 11 samples: batches of 4, 4, 3
    ew, eb = hand_trained_head(features, labels, 2, torch.Generator().manual_seed(9), epochs=3, batch_size=4, lr=0.5)
    torch.testing.assert_close(weight, ew)
    torch.testing.assert_close(bias, eb)


def test_dot_product_margin_and_its_log_term_in_hpcl():
    g = torch.Generator().manual_seed(5)
    prototypes = torch.rand(4, 3, generator=g, dtype=torch.float64)
    present = torch.tensor([True, False, True, True])
    held = [0, 2, 3]
    expected = sum(float(prototypes[a] @ prototypes[b]) for a in held for b in held if a != b) / 9
    assert float(authors_code.dot_product_margin(prototypes, present)) == pytest.approx(expected, rel=1e-12)
    assert float(authors_code.dot_product_margin(prototypes, torch.tensor([False, True, False, False]))) == 0.0

    z, y = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 0])
    hyper = torch.randn(4, 2, 3, generator=g, dtype=torch.float64)
    tau, k = 0.2, 0.7
    total = 0.0
    for i in range(5):
        s = [sum(float(F.cosine_similarity(z[i], hyper[c, j], dim=0)) for j in range(2)) / 2 for c in range(4)]
        total += math.log(sum(math.exp(v / tau) for v in s) + k) - s[int(y[i])] / tau
    assert float(authors_code.hpcl_loss_log_margin(z, y, hyper, k, tau)) == pytest.approx(total / 5, rel=1e-10)
    # without a margin it is Eq. 12 with d_k = 0
    assert float(authors_code.hpcl_loss_log_margin(z, y, hyper, 0.0, tau)) == pytest.approx(
        float(equations.hpcl_loss(z, y, hyper, 0.0, tau)), rel=1e-10)


# ---------------------------------------------------------------------------- the client


def test_client_uploads_classifier_gradients_of_the_received_model_on_the_sampled_samples():
    data = make_client(30, [0, 1, 3], seed=6)
    options = FedHProOptions(num_hyper=2, classifier_step="synthetic", gradient_samples_per_class=4)
    received, _, reply, _ = fit_fedhpro(options, data, train=TRAIN)
    model = model_with(received)
    keep = torch.cat([(data.y == c).nonzero().squeeze(1)[:4] for c in range(NUM_CLASSES)]).sort().values
    with torch.no_grad():
        features = model.features(data.x[keep])
    ew, eb = loop_classifier_gradients(features, data.y[keep], model.classifier.weight, model.classifier.bias,
                                       NUM_CLASSES)
    torch.testing.assert_close(reply["classifier_weight_gradients"].double(), ew, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(reply["classifier_bias_gradients"].double(), eb, rtol=1e-4, atol=1e-6)


def test_client_dot_margin_is_the_authors_formula_on_the_received_model():
    data = make_client(24, [0, 1, 3], seed=7)
    received, _, _, metrics = fit_fedhpro(FedHProOptions(num_hyper=2, margin="dot"), data, train=TRAIN)
    p = loop_prototypes(model_with(received), data.x, data.y, NUM_CLASSES)
    expected = sum(float(p[a] @ p[b]) for a in (0, 1, 3) for b in (0, 1, 3) if a != b) / (NUM_CLASSES - 1) ** 2
    assert metrics["margin"] == pytest.approx(expected, rel=1e-5)


def test_hpcl_batch_divide_divides_the_batch_mean_by_the_batch_size():
    data = make_client(8, [0, 1, 2, 3], seed=8)  # one batch: the logged HPCL is the value before the step
    _, _, _, plain = fit_fedhpro(FedHProOptions(num_hyper=2), data, train=TRAIN)
    _, _, _, divided = fit_fedhpro(FedHProOptions(num_hyper=2, hpcl_batch_divide=True), data, train=TRAIN)
    assert divided["hpcl"] == pytest.approx(plain["hpcl"] / 8, rel=1e-6)
    assert divided["ce"] == plain["ce"]


# ---------------------------------------------------------------------------- the server step, C = 2, d = 3


def tiny_server(seed=7, match_steps=2):
    options = FedHProOptions(classifier_step="synthetic", match_steps=match_steps, num_hyper=2)
    model = TinyNet(num_classes=2, feature_dim=3)
    return FedHProServer(MethodContext(model=model, num_classes=2, options=options, train=TRAIN, seed=seed))


def tiny_replies(server):
    g = torch.Generator().manual_seed(11)
    replies = []
    for counts in ([3, 5], [0, 4]):  # client 0 holds both classes, client 1 only class 1
        weights = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in server.weights.items()}
        w_grads, b_grads = torch.randn(2, 2, 3, generator=g), torch.randn(2, 2, generator=g)
        if counts[0] == 0:
            w_grads[0], b_grads[0] = float("nan"), float("nan")  # rows of an absent class are never read
        replies.append({"weights": weights, "num_examples": sum(counts), "class_counts": torch.tensor(counts),
                        "class_gradients": torch.randn(2, 3, generator=g), "prototypes": torch.randn(2, 3, generator=g),
                        "classifier_weight_gradients": w_grads, "classifier_bias_gradients": b_grads})
    return replies


def test_server_step_against_a_hand_computation(monkeypatch):
    server = tiny_server()
    replies = tiny_replies(server)
    features0 = server.synthetic.features.clone().double()
    hyper0 = server.hyper.clone()
    sent_w, sent_b = server.weights["classifier.weight"].double(), server.weights["classifier.bias"].double()
    generators = []
    real = authors_code.train_linear_classifier

    def recording(features, labels, num_classes, generator, **kwargs):
        generators.append((generator.get_state(), kwargs))
        return real(features, labels, num_classes, generator, **kwargs)

    monkeypatch.setattr(authors_code, "train_linear_classifier", recording)
    metrics = server.aggregate(0, copy.deepcopy(replies))

    # the averaged classifier gradients: unweighted means over the clients holding each class
    w0, w1 = replies[0]["classifier_weight_gradients"], replies[1]["classifier_weight_gradients"]
    b0, b1 = replies[0]["classifier_bias_gradients"], replies[1]["classifier_bias_gradients"]
    real_w, real_b = torch.stack([w0[0], (w0[1] + w1[1]) / 2]), torch.stack([b0[0], (b0[1] + b1[1]) / 2])
    # 100 SGD steps (lr = hyper_lr 0.1) of the authors' loss, against the head the clients received
    variable = features0.clone()
    present = torch.tensor([True, True])
    for step in range(100):
        variable.requires_grad_(True)
        loss = autograd_matching_loss(variable, sent_w, sent_b, real_w.double(), real_b.double(), present)
        if step == 0:
            assert metrics["classifier_match_before"] == pytest.approx(float(loss.detach()), rel=1e-4)
        (grad,) = torch.autograd.grad(loss, variable)
        variable = (variable - 0.1 * grad).detach()
    torch.testing.assert_close(server.synthetic.features.double(), variable, rtol=1e-3, atol=1e-4)
    assert metrics["classifier_match_after"] < metrics["classifier_match_before"]

    # a fresh head, 100 epochs of batches of 50 with SGD 0.01, from the generator the server seeded
    ((state, kwargs),) = generators
    assert kwargs == {"epochs": 100, "batch_size": 50, "lr": 0.01}
    labels = torch.tensor([0] * 50 + [1] * 50)
    ew, eb = hand_trained_head(server.synthetic.features.reshape(100, 3), labels, 2,
                               torch.Generator().set_state(state), epochs=100, batch_size=50, lr=0.01)
    torch.testing.assert_close(server.weights["classifier.weight"].double(), ew, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(server.weights["classifier.bias"].double(), eb, rtol=1e-4, atol=1e-5)

    # everything else is FedAvg, and the hyper-prototypes were matched against the new classifier
    average = functional.weighted_average([r["weights"] for r in replies], [8, 4])
    for key in average:
        if not key.startswith("classifier."):
            assert torch.equal(server.weights[key], average[key])
    head = nn.Linear(3, 2)
    head.load_state_dict({"weight": server.weights["classifier.weight"], "bias": server.weights["classifier.bias"]})
    g_real, held = equations.aggregate_class_gradients(torch.stack([r["class_gradients"] for r in replies]),
                                                torch.tensor([[True, True], [False, True]]))
    expected_hyper, _, _ = equations.match_hyper_prototypes(hyper0, head, g_real, held, steps=2, lr=0.1)
    torch.testing.assert_close(server.hyper, expected_hyper)


def test_server_synthetic_features_are_seeded_and_persist_in_the_state():
    first, same, other = tiny_server(seed=7), tiny_server(seed=7), tiny_server(seed=8)
    assert torch.equal(first.synthetic.features, same.synthetic.features)
    assert not torch.equal(first.synthetic.features, other.synthetic.features)
    assert first.synthetic.features.shape == (2, 50, 3)
    first.aggregate(0, tiny_replies(first))
    state = copy.deepcopy(first.state_dict())
    resumed = tiny_server(seed=7)  # a run resumed from a checkpoint
    resumed.load_state_dict(state)
    assert torch.equal(resumed.synthetic.features, first.synthetic.features)
    assert not torch.equal(resumed.synthetic.features, same.synthetic.features)  # matching moved them
    # the next round continues from the carried features in both, and gives the same head
    first.aggregate(1, tiny_replies(first))
    resumed.aggregate(1, tiny_replies(resumed))
    assert torch.equal(resumed.synthetic.features, first.synthetic.features)
    assert torch.equal(resumed.weights["classifier.weight"], first.weights["classifier.weight"])


def test_server_refuses_a_reply_without_classifier_gradients():
    from fedhpro.errors import UpdateError

    server = tiny_server()
    reply = tiny_replies(server)[0]
    del reply["classifier_bias_gradients"]
    with pytest.raises(UpdateError, match="classifier_bias_gradients"):
        server.validate_reply(reply)


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_fedhpro_run_with_the_authors_recipe(digits_data_dir, tmp_path, capsys):
    from fedhpro.cli import main

    out = tmp_path / "authors"
    code = main(["run", "fedhpro.recipe=authors", f"data.syn_size={DIGITS_SYN_SIZE}",
                 f"data.test_fraction={DIGITS_TEST_FRACTION}", f"data_dir={digits_data_dir}", "rounds=2", "clients=4",
                 "data.fraction=0.02", "local_epochs=1", "feature_dim=32", "device=cpu", "progress=false",
                 "checkpoint_every=0", f"out={out}"])
    assert code == 0, capsys.readouterr().err
    config = load_config(out / "config.yaml")
    assert config.run.feature_dim == 32 and config.run.lr == 0.1  # the user's d, the recipe's lr
    assert config.methods["fedhpro"].classifier_step == "synthetic"
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 2
    for row in rows:
        assert {"classifier_match_before", "classifier_match_after", "gm_loss_before"} <= set(row["server"])
        assert row["train"]["margin"] == 0.0  # the published command runs without a margin


def test_reply_layout_declares_the_classifier_gradients():
    """What the Flower server checks replies against before decoding them."""
    layout = tiny_server().reply_layout()
    assert layout["classifier_weight_gradients"] == ((2, 2, 3), torch.float32)
    assert layout["classifier_bias_gradients"] == ((2, 2), torch.float32)
    assert "classifier_weight_gradients" not in FedHProServer(
        MethodContext(model=TinyNet(), num_classes=NUM_CLASSES, options=FedHProOptions(), train=TRAIN)).reply_layout()


def test_a_loss_weight_of_one_returns_the_term_itself_and_other_weights_multiply():
    """``weighted``: lambda = 1 (the default) is the term itself (x * 1.0 is x, value and gradient); others
    multiply."""
    from fedhpro.methods.fedhpro.client import weighted

    term = torch.tensor(0.731, requires_grad=True)
    assert weighted(1.0, term) is term
    assert torch.equal(weighted(0.25, term), 0.25 * term)
    (one,) = torch.autograd.grad(1.0 * term, term)
    (same,) = torch.autograd.grad(weighted(1.0, term), term)
    assert torch.equal(one, same)
