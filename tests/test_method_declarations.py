"""The methods' declarations (:class:`fedhpro.methods.MethodDeclaration`): read without torch, the same options
class and facts as the code's MethodSpec, and a plug-in's too (registered whole, or declared with its code loaded
on first lookup)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fedhpro.methods as methods
from fedhpro.errors import ConfigError
from fedhpro.methods import MethodDeclaration, MethodSpec
from fedhpro.methods.base import Client, Server
from fedhpro.options import option
from fedhpro.registry import Declared
from fedhpro.reports.plots import display_name, is_baseline, paper_order

SRC = Path(__file__).resolve().parents[1] / "src"

#: what each built-in declared in its MethodSpec before the declarations moved out of the code (main, e8924bf):
#: (options class, its module before the move, paper_order, dp_clipping, says why it needs each upload)
BUILT_IN = {
    "fedavg": ("FedAvgOptions", "fedavg", 0, "joint", False),
    "fedhpro": ("FedHProOptions", "fedhpro", 8, "joint", False),
    "fedprox": ("FedProxOptions", "fedprox", 1, "joint", False),
    "moon": ("MoonOptions", "moon", 2, "joint", False),
    "fedrcl": ("FedRCLOptions", "fedrcl", 6, "joint", False),
    "fedproto": ("FedProtoOptions", "fedproto", 3, "per-group", False),
    "fedtgp": ("FedTGPOptions", "fedtgp", 4, "per-group", True),
    "fedgmkd": ("FedGMKDOptions", "fedgmkd", 5, "per-group", True),
    "fedsa": ("FedSAOptions", "fedsa", 7, "per-group", False),
}


def _fresh(code: str) -> dict:
    """What ``code`` (which sets ``printed``) printed in a fresh Python with this checkout's fedhpro, and which
    modules it had imported then."""
    probe = (f"import json, sys\n{code}\nprint(json.dumps({{'printed': printed, 'modules': "
             "sorted(name for name in sys.modules if name == 'torch' or name.startswith('fedhpro.methods.'))}))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_declarations_are_read_without_torch_or_any_methods_code():
    result = _fresh(
        "import fedhpro.methods\n"
        "from fedhpro.reports.plots import display_name, paper_order\n"
        "declarations = fedhpro.methods.method_declarations()\n"
        "printed = {'names': fedhpro.methods.method_names(),\n"
        "           'options': fedhpro.methods.declared_method('fedhpro').options.__name__,\n"
        "           'recipes': sorted(fedhpro.methods.recipes_of('fedhpro')),\n"
        "           'keys': len(__import__('dataclasses').fields(declarations['fedgmkd'].options)),\n"
        "           'shown': [display_name(name) for name in paper_order(declarations)],\n"
        "           'loaded': [name for name in declarations if fedhpro.methods.REGISTRY.is_loaded(name)]}")
    assert result["printed"] == {
        "names": list(BUILT_IN), "options": "FedHProOptions", "recipes": ["authors"], "keys": 15,
        "shown": ["FedAvg", "FedProx", "MOON", "FedProto", "FedTGP", "FedGMKD", "FedRCL", "FedSA", "FedHPro"],
        "loaded": []}
    assert "torch" not in result["modules"]
    # only declarations: no method's code module (nor the interface, base, which imports torch)
    code = [name for name in result["modules"] if not name.endswith(("_options", ".declaration", ".options"))
            and name not in ("fedhpro.methods.fedhpro",)]
    assert code == []


@pytest.mark.parametrize("name", list(BUILT_IN))
def test_a_built_in_declares_what_its_code_runs_with(name):
    options_name, old_module, place, clipping, needs_each = BUILT_IN[name]
    declared = methods.declared_method(name)
    spec = methods.get_method(name)
    assert isinstance(declared, MethodDeclaration) and declared.name == name
    assert declared.options is spec.options and declared == spec.declaration
    assert declared.options.__name__ == options_name
    # the old import path gives the same class
    assert getattr(importlib.import_module(f"fedhpro.methods.{old_module}"), options_name) is declared.options
    assert (declared.paper_order, declared.dp_clipping, bool(declared.needs_each_upload)) == (
        place, clipping, needs_each)
    assert declared.baseline == (name == "fedavg") and is_baseline(name) == (name == "fedavg")
    assert display_name(name).lower() == name and declared.description.startswith(display_name(name) + ":")


def test_the_prototype_methods_share_the_torch_free_prototype_options():
    from fedhpro.methods import prototype_options, prototypes

    assert prototypes.PrototypeOptions is prototype_options.PrototypeOptions
    assert prototypes.weights_travel is prototype_options.weights_travel
    for name in ("fedproto", "fedtgp", "fedgmkd", "fedsa"):
        declared = methods.declared_method(name)
        assert issubclass(declared.options, prototype_options.PrototypeOptions)
        assert declared.weights_travel is prototype_options.weights_travel
        assert declared.weights_travel(declared.options(protocol="proto-only")) == "none"
        assert declared.weights_travel(declared.options()) == "all"
    assert methods.declared_method("fedavg").weights_travel is None


@dataclasses.dataclass
class PlugOptions:
    step: float = option(1.0, help="a plug-in's knob")
    recipe: str = option("plain", choices=("plain", "fast"), help="a recipe")


def test_an_unknown_name_or_a_bad_declaration_is_one_line():
    with pytest.raises(ConfigError) as error:
        methods.declared_method("fedavgg")
    assert "\n" not in str(error.value) and str(error.value).startswith(
        "method='fedavgg' is not valid (did you mean 'fedavg', ")
    assert "; choose one of: fedavg, fedhpro, fedprox, " in str(error.value)
    with pytest.raises(ConfigError, match=r"^MethodDeclaration\(name='x', dp_clipping='some'\): say 'joint' or"):
        MethodDeclaration("x", PlugOptions, dp_clipping="some")
    with pytest.raises(ConfigError, match=r"^MethodDeclaration\(name='x'\): options must be a dataclass class"):
        MethodDeclaration("x", dict)

    @dataclasses.dataclass
    class NoDefault:
        step: float

    with pytest.raises(ConfigError, match=r"^MethodDeclaration\(name='x'\): every field of NoDefault needs a default"):
        MethodDeclaration("x", NoDefault)
    with pytest.raises(ConfigError, match=r"its declaration is a type; give Declared\(MethodDeclaration"):
        methods.register("x", Declared(PlugOptions, "json:dumps"))
    assert "x" not in methods.method_names()
    assert methods.recipes_of("fedavgg") == {}


def test_a_method_registered_whole_answers_declared():
    spec = MethodSpec("plug", PlugOptions, Server, Client, description="Plug: a plug-in", paper_order=None,
                      dp_clipping="per-group")
    with methods.REGISTRY.kept():
        methods.register("plugged", spec, recipes={"fast": {"rounds": 3}})
        declared = methods.declared_method("plugged")
        assert declared == MethodDeclaration("plugged", PlugOptions, description="Plug: a plug-in",
                                             dp_clipping="per-group")
        assert declared.options is PlugOptions and methods.method_declarations()["plugged"] == declared
        assert methods.recipes_of("plugged") == {"fast": {"rounds": 3}}
        assert display_name("plugged") == "plugged" and paper_order(["plugged", "fedsa"]) == ["fedsa", "plugged"]
    assert "plugged" not in methods.method_names()


@pytest.fixture
def plug_package(tmp_path, monkeypatch):
    """Two modules of a plug-in on sys.path: ``<name>_decl`` (its options, a MethodDeclaration and a Declared of its
    code) and ``<name>_code`` (its MethodSpec, built from the declaration; it records being imported)."""
    name = f"plug_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}_decl.py").write_text(
        "import dataclasses\n"
        "from fedhpro.methods.declaration import MethodDeclaration\n"
        "from fedhpro.registry import Declared\n"
        "@dataclasses.dataclass\n"
        "class Options:\n"
        "    step: float = 1.0\n"
        "DECLARATION = MethodDeclaration('lazy', Options, description='Lazy: declared', paper_order=20,\n"
        "                                recipes={'fast': {'rounds': 2}})\n"
        f"DECLARED = Declared(DECLARATION, '{name}_code:METHOD')\n")
    (tmp_path / f"{name}_code.py").write_text(
        "import builtins\n"
        "import dataclasses\n"
        "from fedhpro.methods.base import Client, MethodSpec, Server\n"
        f"from {name}_decl import DECLARATION\n"
        "builtins.PLUG_IMPORTS.append(__name__)\n"
        "METHOD = MethodSpec.from_declaration(DECLARATION, server=Server, client=Client)\n"
        "@dataclasses.dataclass\n"
        "class Other:\n"
        "    step: float = 1.0\n"
        "OTHER = MethodSpec('lazy', Other, Server, Client)\n")
    imports: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("builtins.PLUG_IMPORTS", imports, raising=False)
    yield name, imports
    for module in (f"{name}_decl", f"{name}_code"):
        sys.modules.pop(module, None)


def test_a_declared_plug_in_keeps_its_code_unimported_until_looked_up(plug_package):
    name, imports = plug_package
    decl = importlib.import_module(f"{name}_decl")
    with methods.REGISTRY.kept():
        methods.register("lazy", decl.DECLARED)
        assert "lazy" in methods.method_names() and methods.declared_method("lazy") is decl.DECLARATION
        assert methods.method_declarations()["lazy"] is decl.DECLARATION
        assert methods.recipes_of("lazy") == {"fast": {"rounds": 2}}
        assert display_name("lazy") == "Lazy" and paper_order(["lazy", "fedhpro"]) == ["fedhpro", "lazy"]
        assert imports == [] and f"{name}_code" not in sys.modules and not methods.REGISTRY.is_loaded("lazy")
        spec = methods.get_method("lazy")
        assert imports == [f"{name}_code"] and isinstance(spec, MethodSpec)
        assert spec.options is decl.Options and spec.declaration == decl.DECLARATION
        assert methods.get_method("lazy") is spec and imports == [f"{name}_code"]  # imported once


def test_a_declared_plug_in_whose_code_has_other_options_is_one_line(plug_package):
    name, _ = plug_package
    decl = importlib.import_module(f"{name}_decl")
    with methods.REGISTRY.kept():
        methods.register("lazy", Declared(decl.DECLARATION, f"{name}_code:OTHER"))
        with pytest.raises(ConfigError) as error:
            methods.get_method("lazy")
        assert "\n" not in str(error.value) and "has options <class" in str(error.value)
        assert "not the declared <class" in str(error.value) and "declare the options class the code uses" in str(
            error.value)


def test_an_entry_point_naming_a_declared_plug_in_loads_its_code_on_lookup(plug_package, monkeypatch):
    name, imports = plug_package
    registry = methods.REGISTRY
    with registry.kept():
        points = [importlib.metadata.EntryPoint("lazy", f"{name}_decl:DECLARED", registry.group)]
        monkeypatch.setattr(registry, "_entry_points", lambda: points)
        monkeypatch.setattr(registry, "_loaded", False)
        assert methods.declared_method("lazy").description == "Lazy: declared" and imports == []
        assert not registry.is_builtin("lazy")
        assert methods.get_method("lazy").name == "lazy" and imports == [f"{name}_code"]
