"""The one client sequence every method shares (``Client.fit``) and its hooks, and the per-class keys of
reply layouts (``ClassRows``) that the engines read instead of guessing from shapes."""

from __future__ import annotations

import copy
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import NUM_CLASSES, TinyBNNet, TinyNet, make_client

import fedhpro.methods
from fedhpro.engines.class_rows import class_tensor_keys, declared_class_keys
from fedhpro.engines.faults import hostile
from fedhpro.methods import MethodContext, TrainSettings
from fedhpro.methods.base import Client, Server, clone_weights
from fedhpro.methods.fedavg import FedAvgOptions
from fedhpro.methods.layout import ClassRows, class_keys
from fedhpro.methods.parts import features_of
from fedhpro.methods.training import Batch, LocalRound, train_epochs

TRAIN = TrainSettings(epochs=2, batch_size=8, lr=0.1, momentum=0.9, weight_decay=1e-4)
METHODS_DIR = Path(fedhpro.methods.__file__).parent


def method_modules():
    names = [info.name for info in pkgutil.iter_modules([str(METHODS_DIR)])]
    return [importlib.import_module(f"fedhpro.methods.{name}") for name in names]


def all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from all_subclasses(sub)


def seeded(model_cls=TinyNet, seed=0):
    torch.manual_seed(seed)
    return model_cls()


def context(options=None, model=TinyNet, train=TRAIN):
    return MethodContext(model=model(), num_classes=NUM_CLASSES, options=options or FedAvgOptions(), train=train)


def test_no_method_client_overrides_fit_or_registers_hooks():
    method_modules()
    clients = [cls for cls in all_subclasses(Client) if cls.__module__.startswith("fedhpro.methods")]
    assert {cls.__name__ for cls in clients} >= {"FedHProClient", "FedProxClient", "MoonClient", "FedRCLClient",
                                                  "PrototypeClient", "FedGMKDClient", "FedSAClient"}
    assert [cls.__name__ for cls in clients if "fit" in vars(cls)] == []
    for path in METHODS_DIR.glob("*.py"):
        if path.name not in ("base.py", "training.py"):  # the shared loop records the declared activations
            assert "register_forward" not in path.read_text(), path.name
            assert "train_epochs(" not in path.read_text(), path.name


class Recorder(Client):
    """A plug-in client using every hook: records the order of the calls and what the batches carry."""

    def prepare(self, round: LocalRound) -> None:
        round.scratch["calls"] = ["prepare"]
        round.scratch["frozen"] = copy.deepcopy(round.model)
        round.notes["before"] = 1.0

    def activation_modules(self, round):
        return [round.model.features[0], round.model.features[2]]  # conv and ReLU of TinyBNNet

    def loss_terms(self, round: LocalRound):
        round.scratch["calls"].append("loss_terms")
        seen = round.scratch["batches"] = []

        def terms(batch: Batch):
            seen.append(batch)
            return {"extra": 0.5 * batch.z.pow(2).mean()}

        return terms

    def train_settings(self, round):
        return TrainSettings(epochs=1, batch_size=8, lr=0.05, momentum=0.0, weight_decay=0.0)

    def upload(self, round: LocalRound):
        round.scratch["calls"].append("upload")
        round.state["scratch"] = round.scratch
        round.notes["after"] = 2.0
        return {"class_counts": torch.bincount(round.data.y, minlength=NUM_CLASSES)}


def test_hooks_run_in_order_and_batches_carry_inputs_and_declared_activations():
    data = make_client(20, [0, 1, 2, 3], seed=3)
    model = seeded(TinyBNNet, 1)
    state: dict = {}
    reply, metrics = Recorder(context(model=TinyBNNet)).fit(model, {"weights": clone_weights(model)}, data, state,
                                                           torch.Generator().manual_seed(0))
    scratch = state["scratch"]
    assert scratch["calls"] == ["prepare", "loss_terms", "upload"]
    assert list(reply) == ["weights", "num_examples", "class_counts"]
    assert list(metrics) == ["ce", "extra", "loss", "before", "after"]
    batches = scratch["batches"]
    assert len(batches) == 3  # 20 samples in batches of 8 (the train_settings hook's), one epoch
    # replay the first batch on the received model: x, z and the two activations are those of its forward
    frozen = scratch["frozen"].train()
    first = batches[0]
    assert torch.equal(first.x, data.x[torch.randperm(20, generator=torch.Generator().manual_seed(0))[:8]])
    with torch.no_grad():
        conv = frozen.features[0](first.x)
        relu = frozen.features[2](frozen.features[1](conv))
        z = frozen.features[3:](relu)
    assert len(first.activations) == 2
    torch.testing.assert_close(first.activations[0].detach(), conv)
    torch.testing.assert_close(first.activations[1].detach(), relu)
    torch.testing.assert_close(first.z.detach(), z)
    torch.testing.assert_close(first.logits.detach(), frozen.classifier(z))
    assert all(not m._forward_hooks for m in model.modules())  # the loop's recording ends with the training


def test_the_old_regularizer_form_equals_loss_terms_bit_for_bit():
    data = make_client(24, [0, 1, 2], seed=5)
    results = []
    for kind in ("regularizer", "loss_terms"):
        model = seeded(TinyNet, 2)
        if kind == "regularizer":
            losses = train_epochs(model, data, TRAIN, torch.Generator().manual_seed(1),
                                  lambda z, y, logits: {"pull": z.pow(2).mean()})
        else:
            losses = train_epochs(model, data, TRAIN, torch.Generator().manual_seed(1),
                                  loss_terms=lambda batch: {"pull": batch.z.pow(2).mean()})
        results.append((clone_weights(model), losses))
    (w1, l1), (w2, l2) = results
    assert l1 == l2
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    with pytest.raises(ValueError, match="not both"):
        train_epochs(seeded(), data, TRAIN, torch.Generator(), lambda z, y, logits: {}, loss_terms=lambda b: {})


def test_moon_terms_read_the_batch_inputs():
    """MOON's frozen models run on ``Batch.x``: with previous = global = received, the term is log 2."""
    from fedhpro.methods.moon import MoonClient, MoonOptions

    data = make_client(16, [0, 1, 2, 3], seed=4)
    model = seeded(TinyNet, 3)
    client = MoonClient(context(MoonOptions(mu=1.0)))
    round = LocalRound(model, {"weights": clone_weights(model)}, data, {"previous_weights": clone_weights(model)},
                       torch.Generator())
    client.prepare(round)
    terms = client.loss_terms(round)
    assert terms is not None
    x = data.x[:8]
    z = features_of(model)(x)
    value = terms(Batch(x, data.y[:8], z, model.classifier(z)))["moon"]
    assert float(value.detach()) == pytest.approx(float(torch.log(torch.tensor(2.0))), rel=1e-6)
    assert MoonClient(context(MoonOptions())).loss_terms(
        LocalRound(model, {"weights": {}}, data, {}, torch.Generator())) is None  # first participation


def test_fit_is_declared_final():
    assert getattr(Client.fit, "__final__", False)  # typing.final: mypy refuses an override in src/


# ---------------------------------------------------------------------------- per-class keys


def test_class_rows_is_a_plain_layout_tuple():
    rows = ClassRows((NUM_CLASSES, 16), torch.float32)
    assert rows == ((NUM_CLASSES, 16), torch.float32)
    shape, dtype = rows
    assert shape == (NUM_CLASSES, 16) and dtype == torch.float32
    layout = {"weights": {}, "num_examples": int, "prototypes": rows, "other": ((NUM_CLASSES, 16), torch.float32),
              "class_counts": ClassRows((NUM_CLASSES,), torch.int64)}
    assert class_keys(layout) == ["prototypes", "class_counts"]


@pytest.mark.parametrize("name, options", [
    ("fedhpro", {}), ("fedhpro", {"classifier_step": "synthetic"}), ("fedproto", {}),
    ("fedproto", {"prototypes": "hyper"}), ("fedtgp", {}), ("fedgmkd", {}), ("fedsa", {}),
])
def test_builtin_layouts_declare_their_class_tensors(name, options):
    spec = fedhpro.methods.get_method(name)
    server = spec.server(MethodContext(model=TinyNet(), num_classes=NUM_CLASSES, options=spec.options(**options),
                                       train=TRAIN))
    layout = server.reply_layout()
    declared = class_keys(layout)
    # every tensor whose rows are classes is declared, and nothing else
    by_shape = [key for key, entry in layout.items() if key != "weights" and isinstance(entry, tuple)
                and len(entry[0]) >= 1 and entry[0][0] == NUM_CLASSES]
    assert declared == by_shape
    assert "class_counts" in declared
    assert declared_class_keys(server) == [key for key in declared if key != "class_counts"]


def test_hostility_scales_only_the_declared_class_tensors():
    weights = {"w": torch.zeros(2)}
    reply = {"weights": {"w": torch.ones(2)}, "num_examples": 3, "prototypes": torch.ones(NUM_CLASSES, 2),
             "extra": torch.ones(NUM_CLASSES, 2), "class_counts": torch.ones(NUM_CLASSES, dtype=torch.long)}
    out = hostile(reply, weights, -2.0, NUM_CLASSES, ["prototypes"])
    assert torch.equal(out["prototypes"], -2.0 * torch.ones(NUM_CLASSES, 2))
    assert torch.equal(out["extra"], reply["extra"])  # C rows but not declared: left alone
    assert torch.equal(out["class_counts"], reply["class_counts"])
    assert class_tensor_keys(reply, NUM_CLASSES, ["prototypes", "class_counts", "missing"]) == ["prototypes"]
    assert declared_class_keys(Server(context())) == []


def test_fedavg_update_through_the_hooks_is_plain_sgd():
    """FedAvg's client (no hooks) equals a hand-written SGD loop on CE with the same batches."""
    data = make_client(16, [0, 1], seed=7)
    train = TrainSettings(epochs=1, batch_size=8, lr=0.1, momentum=0.0, weight_decay=0.0)
    model, ref = seeded(TinyNet, 4), seeded(TinyNet, 4)
    reply, _ = Client(context(train=train)).fit(model, {"weights": clone_weights(model)}, data, {},
                                                torch.Generator().manual_seed(2))
    order = torch.randperm(16, generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    for start in (0, 8):
        index = order[start:start + 8]
        loss = F.cross_entropy(ref(data.x[index]), data.y[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(reply["weights"][name], value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_all_finite_agrees_with_isfinite_elementwise(dtype):
    """check_weights' finiteness test (one min/max reduction) against the element-wise reference, on NaN and
    both infinities at the first, a middle and the last position, the dtype's largest finite value and an
    empty tensor."""
    from fedhpro.errors import UpdateError
    from fedhpro.methods.base import all_finite, check_weights

    generator = torch.Generator().manual_seed(0)
    cases = [torch.randn(7, 5, generator=generator).to(dtype), torch.empty(0, dtype=dtype),
             torch.full((4,), torch.finfo(dtype).max, dtype=dtype),
             torch.full((4,), torch.finfo(dtype).min, dtype=dtype)]
    for bad in (float("nan"), float("inf"), float("-inf")):
        for position in (0, 17, 34):
            tensor = torch.randn(35, generator=generator).to(dtype)
            tensor[position] = bad
            cases.append(tensor.reshape(5, 7))
    for tensor in cases:
        assert all_finite(tensor) == bool(torch.isfinite(tensor).all())
    with pytest.raises(UpdateError, match="non-finite values in 'w'"):
        check_weights({"w": cases[-1]}, {"w": cases[-1]})
