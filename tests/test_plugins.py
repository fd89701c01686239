"""Data, models and methods from Python without editing the package.

``fedhpro.run(federation=..., model=<callable>)``, ``Federation.from_datasets``,
``fedhpro.models.split`` and the method registry (``register`` and the
``fedhpro.methods`` entry points). Every test that changes the registry
restores it (the ``registry`` fixture), so later tests see the built-ins only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import fedhpro
import fedhpro.methods as methods
from conftest import FEATURE_DIM, NUM_CLASSES, TinyNet, make_federation
from fedhpro.config import load_config
from fedhpro.data.federation import Federation
from fedhpro.errors import ConfigError, DataError
from fedhpro.methods import MethodSpec, Server
from fedhpro.methods.base import Client
from fedhpro.options import option


@pytest.fixture
def registry(monkeypatch):
    """The method registry, restored after the test (entries, entry-point state, load errors)."""
    with restored(methods.REGISTRY, monkeypatch):
        yield methods


@contextlib.contextmanager
def restored(registry, monkeypatch):
    """``registry`` (a fedhpro.registry.Registry) as it was, after the block: entries, entry-point state."""
    with registry.kept():
        yield registry


def fake_entry_points(monkeypatch, *entries: tuple[str, str], registry=None) -> None:
    """Entry points ``(name, "module:attr")`` in the group of ``registry`` (the methods'), loaded afresh on next
    use."""
    registry = registry or methods.REGISTRY
    points = [importlib.metadata.EntryPoint(name, value, registry.group) for name, value in entries]
    monkeypatch.setattr(registry, "_entry_points", lambda: points)
    monkeypatch.setattr(registry, "_loaded", False)


@dataclasses.dataclass
class CountingOptions:
    step: float = option(1.0, help="added to the server's counter every round")


class CountingServer(Server):
    """FedAvg that also reports a counter it advances by ``step`` every round: proof that it ran."""

    def __init__(self, context):
        super().__init__(context)
        self.count = 0.0

    def aggregate(self, round, replies):
        super().aggregate(round, replies)
        self.count += float(self.options.step)
        return {"counter": self.count}


COUNTING = MethodSpec(name="counting", options=CountingOptions, server=CountingServer, client=Client)


def tiny_settings(out: Path, **extra) -> dict:
    return {"rounds": 2, "local_epochs": 1, "batch_size": 8, "progress": False, "device": "cpu", "out": str(out),
            "feature_dim": FEATURE_DIM, **extra}


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------
# the method registry
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_registered_method_runs_and_its_knobs_are_config_keys(registry, tmp_path):
    registry.register("counting", COUNTING)
    federation = make_federation([12, 12, 12])
    result = fedhpro.run(method="counting", federation=federation, model=TinyNet,
                         **tiny_settings(tmp_path / "run", **{"counting.step": 2.5}))
    assert [row["server"]["counter"] for row in result.metrics] == [2.5, 5.0]  # its server, with its knob
    assert result.summary["method"] == "counting"
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["counting"] == {"step": 2.5}
    config = load_config(None, {"method": "counting", "counting.step": 3})
    assert config.method_options == CountingOptions(step=3.0)
    with pytest.raises(ConfigError, match="did you mean 'counting.step'"):
        load_config(None, {"counting.stpe": 1})


def test_registered_methods_are_listed_by_config_keys(registry, capsys):
    from fedhpro.cli import main

    registry.register("counting", COUNTING)
    assert main(["config", "--keys"]) == 0
    printed = capsys.readouterr().out
    assert "counting.step: added to the server's counter every round" in printed
    assert "|counting]" in printed.splitlines()[0]


def test_a_name_clash_is_refused_unless_replace(registry):
    with pytest.raises(ConfigError) as error:
        registry.register("fedavg", COUNTING)
    assert "'fedavg' is a built-in method" in one_line(error) and "replace=True" in str(error.value)
    registry.register("counting", COUNTING)
    with pytest.raises(ConfigError, match="already registered"):
        registry.register("counting", COUNTING)
    replaced = registry.register("fedavg", COUNTING, replace=True)
    assert registry.get_method("fedavg") is replaced and replaced.name == "fedavg"


@pytest.mark.parametrize("name,spec,words", [
    ("two words", COUNTING, "not a plain word"),
    ("data", COUNTING, "config section"),
    ("counting", {"server": Server}, "not a fedhpro.methods.MethodSpec"),
    ("counting", dataclasses.replace(COUNTING, options=dict), "must be a dataclass"),
], ids=["name", "reserved", "not-a-spec", "options"])
def test_register_refuses_what_cannot_be_a_method(registry, name, spec, words):
    before = dict(registry.METHODS)
    with pytest.raises(ConfigError) as error:
        registry.register(name, spec)
    assert words in one_line(error)
    assert registry.METHODS == before


def plugin_module(monkeypatch, **attributes) -> None:
    """An importable module ``plugin_module_for_tests`` holding ``attributes`` (for the fake entry points)."""
    module = types.ModuleType("plugin_module_for_tests")
    for name, value in attributes.items():
        setattr(module, name, value)
    monkeypatch.setitem(sys.modules, "plugin_module_for_tests", module)


def test_entry_points_load_once_a_spec_or_a_factory(registry, monkeypatch):
    calls = []
    plugin_module(monkeypatch, SPEC=dataclasses.replace(COUNTING, name="whatever"), make=lambda: COUNTING,
                  counted=lambda: calls.append(1) or COUNTING)
    fake_entry_points(monkeypatch, ("from-spec", "plugin_module_for_tests:SPEC"),
                      ("from-factory", "plugin_module_for_tests:make"), ("counted", "plugin_module_for_tests:counted"))
    assert "from-spec" not in registry.REGISTRY.entries  # lazily: nothing loaded before a lookup
    assert registry.get_method("from-spec").name == "from-spec"  # named by its entry point
    assert registry.get_method("from-factory").server is CountingServer
    registry.get_method("counted")
    registry.method_names()
    assert calls == [1]  # loaded once
    assert load_config(None, {"method": "from-factory"}).run.method == "from-factory"


def test_a_broken_entry_point_is_one_line_naming_its_package_and_others_still_work(registry, monkeypatch):
    fake_entry_points(monkeypatch, ("broken", "no_such_module_for_fedhpro_tests:METHOD"))
    with pytest.raises(ConfigError) as error:
        registry.get_method("broken")
    message = one_line(error)
    assert "method 'broken' of package no_such_module_for_fedhpro_tests failed to load" in message
    assert "ModuleNotFoundError" in message and "pip uninstall" in message
    with pytest.raises(ConfigError, match="method 'broken' of package"):
        load_config(None, {"method": "broken"})
    assert load_config(None, {"method": "fedavg"}).run.method == "fedavg"
    assert "broken" not in registry.method_names()


def test_an_entry_point_does_not_replace_a_built_in(registry, monkeypatch, capsys):
    plugin_module(monkeypatch, METHOD=COUNTING)
    fake_entry_points(monkeypatch, ("fedavg", "plugin_module_for_tests:METHOD"))
    assert registry.method_names().count("fedavg") == 1
    assert registry.get_method("fedavg") is registry.BUILTIN_METHODS["fedavg"]
    assert "the method 'fedavg' of package plugin_module_for_tests is ignored" in capsys.readouterr().err


@pytest.mark.slow
def test_the_cli_reports_a_broken_installed_method_in_one_line(tmp_path):
    from test_examples import run_python, write_dist_info

    write_dist_info(tmp_path, "broken-plugin", "1.0", {"broken": "no_such_module_for_fedhpro_tests:METHOD"})
    result = run_python(["-m", "fedhpro", "run", "method=broken"], tmp_path, [tmp_path])
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedhpro: error: method 'broken' of package broken-plugin")


def test_compare_runs_a_registered_method_and_keeps_its_own_section_only(registry, digits_data_dir, tmp_path):
    from fedhpro.compare import compare, run_settings
    from test_compare import settings

    registry.register("counting", COUNTING)
    nested = load_config(None, {"method": "counting"}).to_dict()
    assert "counting" in run_settings(nested, "counting") and "fedhpro" not in run_settings(nested, "counting")
    assert "counting" not in run_settings(nested, "fedavg")
    compare(["counting"], [0], settings(digits_data_dir, **{"counting.step": 0.5}), tmp_path, echo=False)
    assert "| counting |" in (tmp_path / "table.md").read_text()
    row = json.loads((tmp_path / "counting-seed0" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["server"]["counter"] == 0.5


# ----------------------------------------------------------------------------
# federation= and model= from Python
# ----------------------------------------------------------------------------


@pytest.mark.slow
def test_a_federation_from_python_is_recorded_and_clients_must_match(tmp_path):
    federation = make_federation([10, 14, 12])
    result = fedhpro.run(method="fedavg", federation=federation, model=TinyNet, **tiny_settings(tmp_path / "run"))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["dataset"] == "tiny" and summary["data_source"] == "python" and summary["clients"] == 3
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["federation"] == "python:tiny" and config["model"] == "python:conftest.TinyNet"
    assert config["dataset"] == "digits-offline"  # unused, left as it was
    assert result.summary["accuracy"] == summary["accuracy"]
    assert federation.clients[0].x.device.type == "cpu"  # the caller's federation is not replaced
    with pytest.raises(ConfigError) as error:
        fedhpro.run(federation=federation, clients=4, **tiny_settings(tmp_path / "other"))
    assert "clients=4 but the federation given has 3 clients" in one_line(error)
    # the config.yaml of such a run cannot run without the Python objects
    with pytest.raises(ConfigError, match="was a Python callable; pass it again"):
        fedhpro.run(str(tmp_path / "run" / "config.yaml"), out=str(tmp_path / "again"))
    with pytest.raises(ConfigError, match="data came from Python"):
        fedhpro.run(str(tmp_path / "run" / "config.yaml"), out=str(tmp_path / "again"), model="cnn")


@pytest.mark.slow
def test_resume_needs_the_same_federation_and_model_again(tmp_path):
    federation = make_federation([10, 14, 12])
    out = tmp_path / "run"
    first = fedhpro.run(method="fedavg", federation=federation, model=TinyNet,
                        **tiny_settings(out, rounds=3, checkpoint_every=1))
    # interrupt it after round 2: drop the last round's rows and checkpoint
    (out / "summary.json").unlink()
    from fedhpro.engines import checkpoint

    newest = checkpoint.latest(out)
    newest.unlink()
    with pytest.raises(ConfigError) as error:
        fedhpro.run(resume=str(out))
    assert "data came from Python (python:tiny); pass the same federation again" in one_line(error)
    with pytest.raises(ConfigError, match="model came from Python"):
        fedhpro.run(resume=str(out), federation=federation)
    with pytest.raises(ConfigError, match="not python:other with 3"):
        fedhpro.run(resume=str(out), federation=dataclasses.replace(federation, name="other"), model=TinyNet)
    resumed = fedhpro.run(resume=str(out), federation=federation, model=TinyNet, progress=False)
    assert resumed.summary["accuracy"] == first.summary["accuracy"]  # continued to the same numbers


@pytest.mark.slow
def test_a_model_callable_gets_the_arguments_it_names_and_methods_still_wrap_it(tmp_path):
    seen = {}

    def build(num_classes, input_shape, feature_dim=7):
        seen.update(num_classes=num_classes, input_shape=input_shape, feature_dim=feature_dim)
        return TinyNet(num_classes, input_shape, feature_dim)

    federation = make_federation([12, 12])
    result = fedhpro.run(method="moon", federation=federation, model=build,
                         **tiny_settings(tmp_path / "run", rounds=1, feature_dim=5, **{"moon.projection_dim": 6}))
    assert seen == {"num_classes": NUM_CLASSES, "input_shape": (3, 8, 8), "feature_dim": 5}
    assert result.config.run.model.endswith("test_a_model_callable_gets_the_arguments_it_names_and_methods_still_"
                                            "wrap_it.<locals>.build")
    assert result.summary["params_up"] > 0


class NoClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Flatten()
        self.head = nn.Linear(3 * 8 * 8, NUM_CLASSES)

    def forward(self, x):
        return self.head(self.features(x))


class WrongFeatures(TinyNet):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 2, 3), nn.ReLU())  # B x 2 x 6 x 6: not flat


@pytest.mark.slow
@pytest.mark.parametrize("factory,words", [
    (NoClassifier, ["has no `classifier`", "fedhpro.models.split(model, head='fc')"]),
    (lambda: TinyNet(num_classes=3), ["classifier has 3 outputs", "4 classes"]),
    (WrongFeatures, ["features give (1, 2, 6, 6)", "must give 1 x d"]),
    (lambda: TinyNet(input_shape=(3, 4, 4)), ["(features) fails on one training input of shape (3, 8, 8)", "input_shape"]),
    (lambda depth: TinyNet(), ["needs the argument(s) depth"]),
    (TinyNet(), ["not a module instance"]),
], ids=["no-classifier", "classes", "not-flat", "input-shape", "unknown-argument", "instance"])
def test_a_model_callable_that_does_not_fit_is_refused_in_one_line(tmp_path, factory, words):
    with pytest.raises(ConfigError) as error:
        fedhpro.run(method="fedavg", federation=make_federation([8, 8]), model=factory,
                    **tiny_settings(tmp_path / "run", rounds=1))
    message = one_line(error)
    for word in words:
        assert word in message, message
    assert not (tmp_path / "run").exists()


def test_a_yaml_model_must_still_be_a_registered_name():
    with pytest.raises(ConfigError, match="model='resnet9000' is not valid"):
        load_config(None, {"model": "resnet9000"})


# ----------------------------------------------------------------------------
# Federation.from_datasets
# ----------------------------------------------------------------------------


class PairDataset(Dataset):
    """Items ``(x, int label)`` from tensors: a Dataset that is not a TensorDataset."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def test_from_datasets_equals_from_tensors_on_the_same_data():
    reference = make_federation([9, 13, 7], seed=2)
    pairs = [(c.x, c.y) for c in reference.clients]
    tests = [(c.x[:3] + 1, c.y[:3]) for c in reference.clients]
    expected = Federation.from_tensors(pairs, tests, domains=["a", None, "a"], names=["x", "y", "z"],
                                       num_classes=5, name="mine")
    built = Federation.from_datasets([PairDataset(*p) for p in pairs[:2]] + [TensorDataset(*pairs[2])],
                                     [TensorDataset(*t) for t in tests], domains=["a", None, "a"],
                                     names=["x", "y", "z"], num_classes=5, name="mine", batch_size=4)
    for a, b in zip(expected.clients, built.clients):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and b.y.dtype == torch.long
    for (ax, ay), (bx, by) in zip(expected.client_tests, built.client_tests):
        assert torch.equal(ax, bx) and torch.equal(ay, by)
    assert expected.test_sets.keys() == built.test_sets.keys()
    assert expected.partition == built.partition and built.client_names == ["x", "y", "z"]
    shared = Federation.from_datasets([TensorDataset(*pairs[0])], {"all": PairDataset(*tests[1])})
    assert torch.equal(shared.test_sets["all"][0], tests[1][0]) and shared.client_tests is None


def test_from_datasets_asks_for_a_transform_for_pil_images():
    from PIL import Image

    class Pictures(Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return Image.new("RGB", (4, 4)), i

    with pytest.raises(DataError) as error:
        Federation.from_datasets([Pictures()], [Pictures()], names=["site"])
    message = one_line(error)
    assert "site: training inputs are PIL images" in message and "ToTensor()" in message


def test_from_datasets_names_items_of_different_shapes_and_empty_datasets():
    ragged = PairDataset([torch.zeros(1, 4, 4), torch.zeros(1, 5, 5)], torch.tensor([0, 1]))
    with pytest.raises(DataError, match="inputs differ in shape"):
        Federation.from_datasets([ragged], {"all": ragged})
    with pytest.raises(DataError, match="client 0: the training dataset is empty"):
        Federation.from_datasets([TensorDataset(torch.zeros(0, 2), torch.zeros(0))], {"all": ragged})


# ----------------------------------------------------------------------------
# fedhpro.models.split
# ----------------------------------------------------------------------------


def test_split_resnet18_computes_exactly_the_original_output():
    import torchvision

    torch.manual_seed(0)
    original = torchvision.models.resnet18(weights=None, num_classes=7).eval()
    model = fedhpro.models.split(original, head="fc").eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(x), original(x))
        features = model.features(x)
        assert features.shape == (4, 512) and torch.equal(model.classifier(features), model(x))
    assert isinstance(original.fc, nn.Linear)  # the model passed in is left whole
    assert (model.feature_dim, model.num_classes) == (512, 7)
    assert torch.equal(model.classifier.weight, original.fc.weight)


def test_split_a_dotted_head_and_a_new_number_of_classes():
    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(1, 2, 3), nn.AdaptiveAvgPool2d(1))  # B x 2 x 1 x 1: flattened by split
    original = nn.Sequential()
    original.body = body
    original.head = nn.Sequential(nn.Flatten(), nn.Linear(2, 3))
    model = fedhpro.models.split(original, head="head.1", num_classes=5)
    x = torch.randn(2, 1, 6, 6)
    assert model.features(x).shape == (2, 2) and model(x).shape == (2, 5)
    assert model.classifier is not original.head[1] and model.classifier.in_features == 2
    kept = fedhpro.models.split(original, head="head.1", num_classes=3)
    assert torch.equal(kept(x), original(x))
    with pytest.raises(ConfigError, match="head='head.1'"):
        fedhpro.models.split(original, head="head")
    with pytest.raises(ConfigError, match="no module 'neck'"):
        fedhpro.models.split(original, head="neck.1")


@pytest.mark.slow
def test_a_split_torchvision_model_trains_in_a_run(tmp_path):
    import torchvision

    def factory(num_classes):
        net = torchvision.models.resnet18(weights=None, num_classes=num_classes)
        return fedhpro.models.split(net, head="fc")

    federation = make_federation([6, 6])
    result = fedhpro.run(method="fedhpro", federation=federation, model=factory,
                         **tiny_settings(tmp_path / "run", rounds=1, **{"fedhpro.match_steps": 2}))
    resnet_parameters = sum(p.numel() for p in factory(NUM_CLASSES).parameters())
    assert 0.0 <= result.accuracy <= 100.0 and result.metrics[0]["params_up"] >= 2 * resnet_parameters


# ----------------------------------------------------------------------------
# a data set and a partitioner from an installed package (examples/own_dataset)
# ----------------------------------------------------------------------------

OWN_DATASET = Path(__file__).resolve().parent.parent / "examples" / "own_dataset"


def write_plugin_dist_info(root: Path, package: str, groups: dict[str, dict[str, str]]) -> None:
    """What ``pip install`` leaves for importlib.metadata: METADATA and entry_points.txt of every group."""
    folder = root / f"{package.replace('-', '_')}-0.1.0.dist-info"
    folder.mkdir(parents=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1.0\n")
    text = "".join(f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in entries.items()) + "\n"
                   for group, entries in groups.items())
    (folder / "entry_points.txt").write_text(text)


@pytest.mark.slow
def test_an_installed_data_set_and_partitioner_are_config_keys_and_run_from_the_cli(tmp_path):
    from test_examples import run_python

    write_plugin_dist_info(tmp_path / "site", "fedhpro-blobs", {
        "fedhpro.datasets": {"blobs": "fedhpro_blobs:DATASET"},
        "fedhpro.partitioners": {"shards": "fedhpro_blobs:PARTITIONER"}})
    pythonpath = [tmp_path / "site", OWN_DATASET]
    keys = run_python(["-m", "fedhpro", "config", "--keys", "dataset=blobs"], tmp_path, pythonpath)
    assert keys.returncode == 0, keys.stderr
    lines = keys.stdout.splitlines()
    dataset_line = next(line for line in lines if line.startswith("dataset ["))
    assert "|blobs]" in dataset_line and "(default: blobs)" in dataset_line
    assert any(line.startswith("data.features: dimension of every sample") for line in lines)
    assert "|shards]" in next(line for line in lines if line.startswith("partition.scheme ["))
    assert any(line.startswith("partition.shards_per_client: shards:") for line in lines)
    assert "model [" in keys.stdout and any(line.startswith("model [") and "(default: mlp)" in line
                                            for line in lines)  # the data set's run_defaults

    out = tmp_path / "run"
    settings = ["dataset=blobs", "partition=shards", "partition.shards_per_client=1", "rounds=1", "local_epochs=1",
                "feature_dim=16", "batch_size=16", "progress=false", "device=cpu", f"out={out}"]
    result = run_python(["-m", "fedhpro", "run", *settings], tmp_path, pythonpath)
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dataset"] == "blobs" and summary["rounds"] == 1 and summary["clients"] == 4
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["model"] == "mlp" and config["partition"]["scheme"] == "shards"
    assert config["partition"]["shards_per_client"] == 1 and config["data"]["features"] == 16
    partition = json.loads((out / "partition.json").read_text())
    assert partition["scheme"] == "shards"
    # one shard each of a label-sorted training set: every client holds one class (4 classes, 4 clients)
    assert all(sum(1 for count in client["class_counts"] if count) == 1 for client in partition["clients"])

    # the plug-in partitioner splits a built-in label-skew data set too; a domain data set refuses it
    wrong = run_python(["-m", "fedhpro", "run", "dataset=blobs", "partition=shard", f"out={tmp_path / 'x'}"],
                       tmp_path, pythonpath)
    assert wrong.returncode == 2 and "did you mean 'shards'" in wrong.stderr


@pytest.fixture
def data_registries(monkeypatch):
    """The data set, partitioner and model registries, restored after the test."""
    from fedhpro import data, models
    from fedhpro.data import partition

    with restored(data.REGISTRY, monkeypatch), restored(partition.REGISTRY, monkeypatch), \
            restored(models.REGISTRY, monkeypatch):
        yield data.REGISTRY, partition.REGISTRY, models.REGISTRY


def test_a_data_set_and_partitioner_registered_from_python_are_valid_config_values(data_registries, monkeypatch,
                                                                                   capsys):
    from fedhpro.cli import main

    monkeypatch.syspath_prepend(str(OWN_DATASET))
    import fedhpro_blobs

    datasets, partitioners, _ = data_registries
    fedhpro.data.register("blobs", fedhpro_blobs.DATASET)
    fedhpro.data.partition.register("shards", fedhpro_blobs.PARTITIONER)
    config = load_config(None, {"dataset": "blobs", "partition": "shards", "partition.shards_per_client": 3,
                                "data.features": 8})
    assert config.run.model == "mlp" and config.data == fedhpro_blobs.BlobsOptions(features=8)
    assert config.partition.scheme == "shards" and config.partition.shards_per_client == 3
    assert load_config(config.to_dict()).to_dict() == config.to_dict()  # config.yaml reads back
    assert main(["config", "--keys", "dataset=blobs"]) == 0
    printed = capsys.readouterr().out
    assert "data.spread:" in printed and "partition.shards_per_client:" in printed
    with pytest.raises(ConfigError, match="partition=shards does not apply to digits"):
        from fedhpro.data import get_dataset
        get_dataset("digits").build(get_dataset("digits").options(), None, 0,
                                    partition=load_config(None, {"partition": "shards"}).partition)
    with pytest.raises(ConfigError, match="already registered"):
        fedhpro.data.register("blobs", fedhpro_blobs.DATASET)
    with pytest.raises(ConfigError, match="partition.alpha is already a partition key"):
        fedhpro.data.partition.register("alpha", dataclasses.replace(
            fedhpro_blobs.PARTITIONER, options=dataclasses.make_dataclass("A", [("alpha", float, 1.0)])))


def test_an_installed_data_set_that_fails_to_load_is_one_line_naming_its_entry_point(data_registries,
                                                                                     monkeypatch):
    datasets, _, _ = data_registries
    fake_entry_points(monkeypatch, ("broken-data", "no_such_module_for_fedhpro_tests:DATASET"), registry=datasets)
    with pytest.raises(ConfigError) as error:
        load_config(None, {"dataset": "broken-data"})
    message = one_line(error)
    assert message.startswith("data set 'broken-data' of package no_such_module_for_fedhpro_tests failed to load")
    assert "'fedhpro.datasets'" in message and "ModuleNotFoundError" in message
    assert load_config(None, {"dataset": "cifar10"}).run.dataset == "cifar10"


def test_an_installed_model_is_a_valid_model(data_registries, monkeypatch):
    _, _, models = data_registries
    plugin_module(monkeypatch, build=TinyNet)
    fake_entry_points(monkeypatch, ("tiny", "plugin_module_for_tests:build"), registry=models)
    assert load_config(None, {"model": "tiny"}).run.model == "tiny"
    assert "tiny" in fedhpro.models.MODELS
    with pytest.raises(ConfigError, match=r"model='tinny' is not valid \(did you mean 'tiny'\?\)"):
        load_config(None, {"model": "tinny"})


def test_the_authors_recipe_is_declared_with_the_method(registry):
    from fedhpro.methods.fedhpro import AUTHORS_RECIPE

    assert registry.recipes_of("fedhpro") == {"authors": AUTHORS_RECIPE}
    assert registry.recipes_of("fedavg") == {}
    recipe = load_config(None, {"method": "fedavg", "fedhpro.recipe": "authors", "lr": 0.05})
    for key, value in AUTHORS_RECIPE.items():
        if key != "lr" and "." not in key:
            assert getattr(recipe.run, key) == value
    assert recipe.run.lr == 0.05  # the user's key wins

    @dataclasses.dataclass
    class WithRecipe:
        recipe: str = option("plain", choices=("plain", "fast"), help="a recipe")

    registry.register("counting", dataclasses.replace(COUNTING, options=WithRecipe),
                      recipes={"fast": {"rounds": 3, "local_epochs": 2}})
    assert load_config(None, {"counting.recipe": "fast"}).run.rounds == 3
    assert load_config(None, {"counting.recipe": "fast", "rounds": 4}).run.rounds == 4
    assert load_config(None, {}).run.rounds == 10


def test_which_weights_travel_is_declared_by_the_method(registry):
    """The engines read which weights travel from the method's spec (MethodSpec.weights_travel), never from
    an option's name: proto-only keeps every model local, a method declaring "none" likewise, an option
    merely called ``protocol`` changes nothing, and differing architectures share only the classifier."""
    import dataclasses

    from fedhpro import methods
    from fedhpro.config import load_config
    from fedhpro.experiment import _shared
    from fedhpro.options import option

    @dataclasses.dataclass
    class Options:
        protocol: str = option("proto-only", help="a knob that only shares the prototype methods' name")

    fedavg = methods.get_method("fedavg")
    methods.register("keepsown", dataclasses.replace(fedavg, options=Options, weights_travel=lambda o: "none"))
    methods.register("sharesall", dataclasses.replace(fedavg, options=Options))
    shared = {case: _shared(load_config(dict(case))) for case in [
        (("method", "fedproto"), ("fedproto.protocol", "proto-only")),
        (("method", "fedproto"),),
        (("method", "fedgmkd"), ("fedgmkd.protocol", "proto-only"), ("heterogeneity", "htfe2")),
        (("method", "fedavg"), ("heterogeneity", "htfe2")),
        (("method", "keepsown"),),
        (("method", "sharesall"),)]}
    assert list(shared.values()) == ["none", "all", "none", "classifier", "none", "all"]
