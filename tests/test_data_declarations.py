"""The data sets' and models' declarations are torch-free: what a config reads of a data set (its ``data.*``
options class, description, run settings), of a model (its input kind) and the values of ``data.standardize`` and
``client_test=`` is known before torch loads; the code is imported on first use and uses the declared options
class itself. ``data.cache`` and ``data.bit_depth`` are declared once for the data sets of image files, with one
meaning of each value."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fedhpro.data
import fedhpro.models
from fedhpro.config import load_config
from fedhpro.data import DatasetDeclaration, DatasetSpec, declared_dataset, get_dataset
from fedhpro.data.clients_options import ClientsOptions
from fedhpro.data.imagefolder_options import ImageFolderOptions
from fedhpro.errors import ConfigError, DataError
from fedhpro.models import ModelDeclaration, declared_model
from fedhpro.registry import Declared

SOURCE = Path(__file__).resolve().parents[1] / "src"

#: every built-in data set, in registration order (written out: a data set added or lost is noticed)
BUILTIN_DATASETS = ["digits-offline", "digits", "office-caltech", "cifar10", "cifar100", "ham10000", "tinyimagenet",
                    "cifar10-lt", "cifar100-lt", "tinyimagenet-lt", "ag-news", "sun397", "clients", "imagefolder",
                    "huggingface"]


def fresh_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(SOURCE), "PATH": "/usr/bin:/bin"})


def test_the_declarations_import_no_torch():
    code = (
        "import dataclasses, sys\n"
        "import fedhpro.data, fedhpro.models\n"
        "from fedhpro.data.standardize_options import FEDERATED, FORMER_FEDERATED, resolved_standardize\n"
        "from fedhpro.data.client_tests import CLIENT_TESTS\n"
        "names = fedhpro.data.dataset_names()\n"
        "for name in names:\n"
        "    options = fedhpro.data.declared_dataset(name).options\n"
        "    dataclasses.asdict(options())\n"
        "    getattr(options, 'STANDARDIZE_AUTO', FEDERATED)\n"
        "kinds = {name: fedhpro.models.declared_model(name).input_kind for name in fedhpro.models.model_names()}\n"
        "assert resolved_standardize('auto', True) [0] == 'client' and CLIENT_TESTS == ('shared', 'matched')\n"
        "assert 'torch' not in sys.modules, 'torch loaded'\n"
        "print(','.join(names)); print(kinds['textcnn'], kinds['mlp'], kinds['cnn'])\n")
    result = fresh_python(code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split(",") == BUILTIN_DATASETS and lines[1] == "tokens any image"


def test_fedhpro_models_split_stays_the_function_after_its_module_is_imported():
    result = fresh_python("import sys, fedhpro.models, fedhpro.models.split\n"
                          "from fedhpro.models.split import SplitModel\n"
                          "assert callable(fedhpro.models.split) and fedhpro.models.split.__name__ == 'split'\n"
                          "assert fedhpro.models.SplitModel is SplitModel\n")
    assert result.returncode == 0, result.stderr


def test_old_import_paths_give_the_torch_free_names():
    from fedhpro.data import client_tests, feature_statistics, matched_tests, standardize_options
    from fedhpro.data.federation import Federation

    assert feature_statistics.resolved_standardize is standardize_options.resolved_standardize
    assert (feature_statistics.FEDERATED, feature_statistics.FORMER_FEDERATED) == ("federated", "train")
    assert matched_tests.CLIENT_TESTS is client_tests.CLIENT_TESTS
    assert fedhpro.data.Federation is Federation  # given lazily: its module imports torch
    for name in fedhpro.data.__all__:
        assert getattr(fedhpro.data, name) is not None, name
    for name in fedhpro.models.__all__:
        assert getattr(fedhpro.models, name) is not None, name
    assert ImageFolderOptions.STANDARDIZE_AUTO == "none" and not hasattr(ClientsOptions, "STANDARDIZE_AUTO")


@pytest.mark.parametrize("name", BUILTIN_DATASETS)
def test_each_built_in_data_set_is_declared_with_the_options_its_code_uses(name):
    declaration = declared_dataset(name)
    assert isinstance(declaration, DatasetDeclaration) and declaration.name == name
    spec = get_dataset(name)  # imports the code
    assert spec.options is declaration.options and spec.declaration == declaration
    assert spec.description == declaration.description and spec.run_defaults == declaration.run_defaults


def test_the_run_settings_a_benchmark_changes_are_declared():
    changed = {name: declared_dataset(name).run_defaults for name in BUILTIN_DATASETS
               if declared_dataset(name).run_defaults}
    assert changed == {"ag-news": {"model": "textcnn"}, "sun397": {"participation": 0.2}}


def test_an_unknown_data_set_or_model_is_the_registrys_one_line_error():
    with pytest.raises(ConfigError, match=r"^dataset='cifar' is not valid \(did you mean 'cifar10'") as error:
        declared_dataset("cifar")
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"^model='resnet' is not valid"):
        declared_model("resnet")


def test_a_data_set_registered_whole_answers_its_declaration():
    @dataclasses.dataclass
    class Knobs:
        size: int = 3

    def build(*args, **kwargs):
        raise AssertionError("never built here")

    with fedhpro.data.REGISTRY.kept():
        fedhpro.data.register("whole", DatasetSpec("other", Knobs, build, "a whole spec", {"rounds": 2}))
        assert declared_dataset("whole") == DatasetDeclaration("whole", Knobs, "a whole spec", {"rounds": 2})
        assert declared_dataset("whole").options is Knobs and get_dataset("whole").build is build
    with pytest.raises(ConfigError, match="is not valid"):
        declared_dataset("whole")


def test_a_data_set_registered_as_declared_imports_its_code_on_first_lookup(tmp_path, monkeypatch):
    (tmp_path / "declared_data_options.py").write_text(
        "import dataclasses\n"
        "from fedhpro.data import DatasetDeclaration\n"
        "@dataclasses.dataclass\n"
        "class Options:\n"
        "    size: int = 2\n"
        "DECLARATION = DatasetDeclaration('mine', Options, 'a declared data set')\n")
    (tmp_path / "declared_data_code.py").write_text(
        "import dataclasses\n"
        "from declared_data_options import DECLARATION\n"
        "from fedhpro.data import DatasetSpec\n"
        "@dataclasses.dataclass\n"
        "class Redefined:\n"
        "    size: int = 2\n"
        "DATASET = DatasetSpec.of(DECLARATION, lambda *args, **kwargs: None)\n"
        "OTHER = DatasetSpec('other', Redefined, lambda *args, **kwargs: None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import declared_data_options

    with fedhpro.data.REGISTRY.kept():
        fedhpro.data.register("mine", Declared(declared_data_options.DECLARATION, "declared_data_code:DATASET"))
        fedhpro.data.register("wrong", Declared(declared_data_options.DECLARATION, "declared_data_code:OTHER"))
        assert declared_dataset("mine") is declared_data_options.DECLARATION
        assert "declared_data_code" not in sys.modules  # declared: its code is not imported yet
        assert get_dataset("mine").options is declared_data_options.Options and "declared_data_code" in sys.modules
        with pytest.raises(ConfigError, match="has options <class 'declared_data_code.Redefined'>, not the declared"):
            get_dataset("wrong")
    monkeypatch.delitem(sys.modules, "declared_data_code")
    monkeypatch.delitem(sys.modules, "declared_data_options")


def test_each_built_in_model_is_declared_with_its_constructors_input_kind():
    for name in fedhpro.models.model_names():
        declaration = declared_model(name)
        assert isinstance(declaration, ModelDeclaration) and declaration.description, name
        assert getattr(fedhpro.models.MODELS[name], "input_kind", "image") == declaration.input_kind, name
    assert declared_model("textcnn").input_kind == "tokens" and declared_model("mlp").input_kind == "any"


def test_a_model_registered_whole_answers_its_input_kind_and_a_wrong_kind_is_refused():
    def tokens_model(num_classes, input_shape, feature_dim=512):
        """A model of token ids."""
        return torch.nn.Linear(input_shape[0], num_classes)

    tokens_model.input_kind = "tokens"  # type: ignore[attr-defined]

    def odd_model(num_classes, input_shape, feature_dim=512):
        return torch.nn.Linear(1, num_classes)

    odd_model.input_kind = "audio"  # type: ignore[attr-defined]
    with fedhpro.models.REGISTRY.kept():
        fedhpro.models.register("tokens-model", tokens_model)
        assert declared_model("tokens-model") == ModelDeclaration("tokens", "A model of token ids.")
        with pytest.raises(ValueError, match="takes token-id sequences"):
            fedhpro.models.build_model("tokens-model", 4, (3, 8, 8))
        with pytest.raises(ConfigError, match="input_kind is 'audio'; set it to one of image, tokens, any"):
            fedhpro.models.register("odd", odd_model)


# -- data.cache and data.bit_depth: declared once, one meaning of each value -------------------------------------


def test_the_image_file_keys_are_declared_once_in_each_data_sets_own_place():
    def fields(options: type) -> dict[str, dataclasses.Field]:
        return {field.name: field for field in dataclasses.fields(options)}

    clients, folder = fields(ClientsOptions), fields(ImageFolderOptions)
    for key in ("cache", "bit_depth"):
        assert clients[key].default == folder[key].default and clients[key].metadata == folder[key].metadata
    assert clients["bit_depth"].default == 0 and list(clients["bit_depth"].metadata["choices"]) == [0, 8, 10, 12, 14,
                                                                                                   16]
    assert "0 detects the depth" in clients["bit_depth"].metadata["help"]
    # the order of the keys (config.yaml's order) is as it was
    assert list(clients) == ["image_size", "classes", "num_classes", "max_classes", "cache", "bit_depth",
                             "standardize", "statistics_limit", "feature_mean", "feature_std", "feature_low",
                             "feature_high", "label_column", "site_column", "split_column", "untrained_classes"]
    assert list(folder) == ["image_size", "test_fraction", "split_seed", "clients_per_domain", "cache", "bit_depth",
                            "standardize"]


def _grey_images(folder: Path, values: dict[str, int]) -> None:
    """One constant 4x4 grey 16-bit image per class and split: ``values`` class -> its pixel value."""
    for split in ("train", "test"):
        for name, value in values.items():
            (folder / split / name).mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.full((4, 4), value, dtype=np.uint16)).save(folder / split / name / "0.png")


def _imagefolder(root: Path, *settings: str, cache: bool = False):
    config = load_config(None, ["dataset=imagefolder", f"data_dir={root}", "clients=1", "partition=iid",
                                "data.image_size=4", f"data.cache={str(cache).lower()}", *settings])
    return get_dataset("imagefolder").build(config.data, config.run.clients, config.run.seed,
                                            data_dir=config.run.data_dir, partition=config.partition)


def _clients(root: Path, *settings: str, cache: bool = False):
    config = load_config(None, ["dataset=clients", f"data_dir={root}", "data.image_size=4",
                                f"data.cache={str(cache).lower()}", *settings])
    return get_dataset("clients").build(config.data, None, 0, data_dir=config.run.data_dir)


def _site_pixel(federation, name: str) -> float:
    x, y = federation.client_tests[0]
    return float(x[y == federation.partition["classes"].index(name)][0, 0, 0, 0])


def test_bit_depth_zero_detects_and_a_positive_depth_scales_in_both_image_data_sets(tmp_path):
    # 12-bit values in 16-bit files: 0 and 4095; scaled by 1/(2**bits - 1) to [-1, 1]
    folder = tmp_path / "folder"
    _grey_images(folder, {"dark": 0, "bright": 4095})
    site = tmp_path / "sites" / "site-0"
    _grey_images(site, {"dark": 0, "bright": 4095})

    detected = _imagefolder(folder)  # 0: the smallest depth holding 4095 is 12 bits -> 4095 is 1.0
    assert _site_pixel_of_folder(detected, "bright") == pytest.approx(1.0)
    assert _site_pixel_of_folder(detected, "dark") == pytest.approx(-1.0)
    told = _imagefolder(folder, "data.bit_depth=16")  # 4095 / 65535 * 2 - 1
    assert _site_pixel_of_folder(told, "bright") == pytest.approx(4095 / 32767.5 - 1, abs=1e-6)

    # a site decodes alone: the depth it detects (12) is refused, not guessed; said, it scales alike
    with pytest.raises(DataError, match=r"set data.bit_depth=12 for every site") as error:
        _clients(tmp_path / "sites")
    assert "\n" not in str(error.value)
    assert _site_pixel(_clients(tmp_path / "sites", "data.bit_depth=12"), "bright") == pytest.approx(1.0)
    assert _site_pixel(_clients(tmp_path / "sites", "data.bit_depth=16"), "bright") == pytest.approx(
        4095 / 32767.5 - 1, abs=1e-6)
    # 0 detects 16 bits where the values need them, in both
    wide = tmp_path / "wide" / "site-0"
    _grey_images(wide, {"dark": 1000, "bright": 60000})
    assert _site_pixel(_clients(tmp_path / "wide"), "bright") == pytest.approx(60000 / 32767.5 - 1, abs=1e-6)
    assert _site_pixel_of_folder(_imagefolder(wide), "bright") == pytest.approx(60000 / 32767.5 - 1, abs=1e-6)


def _site_pixel_of_folder(federation, name: str) -> float:
    x, y = federation.test_sets["all"]
    return float(x[y == federation.partition["classes"].index(name)][0, 0, 0, 0])


def test_data_cache_false_writes_no_cache_and_true_keeps_the_decoded_pixels(tmp_path):
    for dataset, root, build in (("imagefolder", tmp_path / "folder", _imagefolder),
                                 ("clients", tmp_path / "sites", _clients)):
        _grey_images(root / "site-0" if dataset == "clients" else root, {"dark": 0, "bright": 65535})
        build(root)
        assert not (root / ".fedhpro-cache").exists(), dataset
        build(root, cache=True)
        assert any((root / ".fedhpro-cache").iterdir()), dataset
