"""fedhpro.registry.Registry: register by name (call and decorator), live names, entry points loaded lazily
once, one-line errors (unknown name with the closest ones, a name taken twice, a plug-in that fails to load)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
import types

import pytest

from fedhpro.errors import ConfigError
from fedhpro.options import option
from fedhpro.registry import Declared, LiveChoices, Registry


def make(entries=(), check=None) -> Registry:
    registry: Registry = Registry("widget", "fedhpro.tests.widgets", key="widget", check=check, reserved={"data"})
    for name, value in entries:
        registry.builtin(name, value)
    registry._entry_points = lambda: []  # no installed packages unless a test gives some
    return registry


def entry_points(registry: Registry, monkeypatch, **points: str) -> list[str]:
    calls: list[str] = []

    def listed():
        calls.append("listed")
        return [importlib.metadata.EntryPoint(name, value, registry.group) for name, value in points.items()]

    registry._entry_points = listed
    registry._loaded = False
    return calls


def test_register_by_call_and_by_decorator_and_names_are_live():
    registry = make([("a", 1)])
    choices = registry.choices
    assert list(choices) == ["a"]
    registry.register("b", 2)

    @registry.register("c")
    def c():
        return 3

    assert registry.names() == ["a", "b", "c"] and list(choices) == ["a", "b", "c"]  # the same object, live
    assert "c" in choices and registry.lookup("c") is c and registry["b"] == 2
    assert registry.is_builtin("a") and not registry.is_builtin("b")


def test_an_unknown_name_is_one_line_with_the_closest_names():
    registry = make([("alpha", 1), ("alpine", 2), ("beta", 3)])
    with pytest.raises(ConfigError) as error:
        registry.lookup("alpin")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("widget='alpin' is not valid (did you mean 'alpine' or 'alpha'?); choose one of: ")
    with pytest.raises(ConfigError, match=r"widget='zzz' is not valid; choose one of: alpha, alpine, beta$"):
        registry.lookup("zzz")
    with pytest.raises(ConfigError, match="is not valid"):
        registry.lookup(["not", "a", "name"])  # type: ignore[arg-type]


@pytest.mark.parametrize("name,words", [("a", "is a built-in widget"), ("b", "already registered"),
                                        ("two words", "not a plain word"), ("data", "config section")])
def test_a_name_taken_twice_or_not_a_name_is_refused(name, words):
    registry = make([("a", 1)])
    registry.register("b", 2)
    with pytest.raises(ConfigError, match=words):
        registry.register(name, 5)
    registry.register("b", 6, replace=True)
    assert registry["b"] == 6


def test_entry_points_load_lazily_once_and_never_replace_a_name(monkeypatch, capsys):
    module = types.ModuleType("widgets_for_tests")
    module.W = 10
    module.a = 11
    monkeypatch.setitem(sys.modules, "widgets_for_tests", module)
    registry = make([("a", 1)])
    calls = entry_points(registry, monkeypatch, w="widgets_for_tests:W", a="widgets_for_tests:a")
    assert registry.lookup("a") == 1 and calls == []  # a registered name: nothing loaded
    assert registry.lookup("w") == 10
    registry.names()
    assert "zzz" not in registry
    assert calls == ["listed"]  # once
    assert registry["a"] == 1 and "the widget 'a' of package widgets_for_tests is ignored" in capsys.readouterr().err


def test_a_plug_in_that_fails_to_import_is_one_line_naming_its_entry_point(monkeypatch):
    def check(name, value, where):
        if value < 0:
            raise ConfigError(f"{where} gives a negative widget")
        return value

    module = types.ModuleType("widgets_for_tests")
    module.NEGATIVE = -1
    monkeypatch.setitem(sys.modules, "widgets_for_tests", module)
    registry = make([("a", 1)], check=check)
    entry_points(registry, monkeypatch, gone="no_such_module_for_fedhpro_tests:W",
                 negative="widgets_for_tests:NEGATIVE")
    with pytest.raises(ConfigError) as error:
        registry.lookup("gone")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("widget 'gone' of package no_such_module_for_fedhpro_tests failed to load "
                              "(ModuleNotFoundError:")
    assert "entry point gone = 'no_such_module_for_fedhpro_tests:W' in group 'fedhpro.tests.widgets'" in message
    with pytest.raises(ConfigError, match="negative widget"):
        registry.lookup("negative")
    assert registry.names() == ["a"] and set(registry.broken()) == {"gone", "negative"}
    assert registry.lookup("a") == 1


def test_live_choices_validate_options_at_each_use():
    import dataclasses

    from fedhpro.options import build

    registry = make([("a", 1)])

    @dataclasses.dataclass
    class Options:
        widget: str = option("a", choices=LiveChoices(registry.names, first=("auto",)))

    with pytest.raises(ConfigError, match=r"widget='b' is not valid; choose one of: auto, a$"):
        build(Options, {"widget": "b"})
    registry.register("b", 2)
    assert build(Options, {"widget": "b"}).widget == "b"
    assert list(dataclasses.fields(Options)[0].metadata["choices"]) == ["auto", "a", "b"]


def test_the_packages_registries_share_the_generic_registry():
    import fedhpro.data
    import fedhpro.data.partition
    import fedhpro.methods
    import fedhpro.models

    groups = {registry.group for registry in (fedhpro.methods.REGISTRY, fedhpro.data.REGISTRY,
                                              fedhpro.data.partition.REGISTRY, fedhpro.models.REGISTRY)}
    assert groups == {"fedhpro.methods", "fedhpro.datasets", "fedhpro.partitioners", "fedhpro.models"}
    assert fedhpro.methods.METHODS is fedhpro.methods.REGISTRY  # the public names are aliases
    assert fedhpro.data.DATASETS is fedhpro.data.REGISTRY and fedhpro.models.MODELS is fedhpro.models.REGISTRY
    assert fedhpro.data.partition.PARTITIONERS["ag-nid"] is fedhpro.data.partition.ag_nid


def test_the_robust_rules_are_a_registry_and_aggregation_rules_reads_it_live():
    import fedhpro.aggregation
    import fedhpro.robust

    registry = fedhpro.robust.REGISTRY
    assert isinstance(registry, Registry) and registry.group == "fedhpro.aggregation_rules"
    assert list(fedhpro.aggregation.AGGREGATION_RULES) == registry.names()
    with pytest.raises(ConfigError, match="gives 3, not a fedhpro.robust.base.RobustRule subclass"):
        registry.register("three", 3)
    with pytest.raises(ConfigError, match=r"aggregation='medain' is not valid \(did you mean 'median' or 'mean'\?\)"):
        registry.lookup("medain")


def test_key_kinds_are_declared_with_the_keys():
    from fedhpro.config import OBSERVER_KEYS, PRESENTATION_KEYS, RESUMABLE_KEYS

    assert PRESENTATION_KEYS == {"out", "progress", "device", "threads", "parallel_clients", "resume", "tensorboard",
                                 "checkpoint_every", "checkpoint_minutes", "keep_checkpoints", "tracker",
                                 "tracker_uri", "tracker_project"}
    assert RESUMABLE_KEYS == PRESENTATION_KEYS - {"out"} | {"tsne"}
    # the simulator-only observers; tensorboard and tracker read round records, so Flower runs them too
    assert OBSERVER_KEYS == ("flops", "prototype_distance", "tsne")


def test_checked_spec_takes_a_spec_or_a_factory_renames_it_and_refuses_in_one_line():
    import dataclasses

    from fedhpro.registry import checked_spec

    @dataclasses.dataclass
    class Knobs:
        speed: float = 1.0

    @dataclasses.dataclass
    class NoDefault:
        speed: float

    @dataclasses.dataclass
    class Spec:
        name: str
        options: type | None
        run: object = print

    def checked(spec, **settings):
        return checked_spec("given", spec, "register('given', ...)", Spec, path="tests.Spec",
                            give="Spec(name, options)", keys="the widget.* keys",
                            callables={"run": "callable () -> None"}, **settings)

    spec = Spec("other", Knobs)
    assert checked(spec) == Spec("given", Knobs) and checked(lambda: spec) == Spec("given", Knobs)
    same = Spec("given", Knobs)
    assert checked(same) is same  # already named so: taken as it is
    assert checked(Spec("x", None), optional_options=True).options is None
    refusals = [
        (dict, "register('given', ...) gives a dict, not a tests.Spec; give Spec(name, options)"),
        (Spec("x", dict), "register('given', ...): Spec.options must be a dataclass class (the widget.* keys), "
                          "got <class 'dict'>"),
        (Spec("x", None), "Spec.options must be a dataclass class"),
        (Spec("x", NoDefault), "every field of NoDefault needs a default (a run may leave every knob unset)"),
        (Spec("x", Knobs, run=3), "register('given', ...): Spec.run must be callable () -> None"),
    ]
    for given, words in refusals:
        with pytest.raises(ConfigError) as error:
            checked(given)
        assert words in str(error.value) and "\n" not in str(error.value)
    seen = []
    checked(Spec("x", Knobs), check=lambda spec, where: seen.append((spec.name, where)))
    assert seen == [("x", "register('given', ...)")]  # the kind's own checks see the spec before it is renamed


@pytest.mark.parametrize("registry,words", [
    ("fedhpro.methods", "every field of NoDefault needs a default"),
    ("fedhpro.data", "every field of NoDefault needs a default"),
    ("fedhpro.data.partition", "every field of NoDefault needs a default"),
])
def test_the_three_spec_registries_refuse_options_without_defaults_alike(registry, words):
    import dataclasses
    import importlib

    import fedhpro.data.partition as partition
    from fedhpro.data import get_dataset
    from fedhpro.methods import METHODS

    @dataclasses.dataclass
    class NoDefault:
        speed: float

    base = {"fedhpro.methods": METHODS["fedavg"], "fedhpro.data": get_dataset("digits-offline"),
            "fedhpro.data.partition": partition.REGISTRY["iid"]}[registry]
    module = importlib.import_module(registry)
    with pytest.raises(ConfigError) as error:
        module.REGISTRY.register("nodefaults", dataclasses.replace(base, options=NoDefault))
    assert words in str(error.value)
    assert "nodefaults" not in module.REGISTRY.entries


# -- declared entries: the declaration now, the code on first lookup ---------------------------------------------


@pytest.fixture
def widget_module(tmp_path, monkeypatch):
    """A module ``widget_code_<n>`` on sys.path whose import is recorded in ``imports`` (a list it appends to)."""
    name = f"widget_code_{len(list(tmp_path.parent.iterdir()))}_{tmp_path.name}".replace("-", "_")
    (tmp_path / f"{name}.py").write_text(
        "import dataclasses\n"
        "IMPORTS.append('imported')\n"
        "@dataclasses.dataclass\n"
        "class Options:\n"
        "    size: int = 1\n"
        "class Widget:\n"
        "    options = None\n"
        "WIDGET = Widget()\n")
    imports: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("builtins.IMPORTS", imports, raising=False)
    yield name, imports
    sys.modules.pop(name, None)


def test_a_declared_entry_is_listed_and_declared_without_importing_its_code(widget_module):
    name, imports = widget_module
    declaration = types.SimpleNamespace(options=None, description="a widget")
    registry = make([("first", 1)])
    registry.declare("lazy", declaration, f"{name}:WIDGET")
    assert registry.names() == ["first", "lazy"] and "lazy" in registry and registry.is_builtin("lazy")
    assert registry.declared("lazy") is declaration and registry.declarations()["lazy"] is declaration
    assert registry.declared("first") == 1  # a whole entry is its own declaration
    assert imports == [] and not registry.is_loaded("lazy")
    widget = registry.lookup("lazy")
    assert imports == ["imported"] and type(widget).__name__ == "Widget" and registry["lazy"] is widget
    assert registry.get("lazy") is widget and registry.entries["lazy"] is widget and imports == ["imported"]


def test_a_declared_entry_whose_code_has_other_options_is_refused_in_one_line(widget_module):
    name, _ = widget_module

    class Declared_options:  # not the class the code uses
        pass

    registry = make(check=lambda _name, loaded, _where: loaded)
    registry = Registry("widget", None, declaration_of=lambda entry: types.SimpleNamespace(options=entry.options))
    registry.declare("lazy", types.SimpleNamespace(options=Declared_options), f"{name}:WIDGET")
    with pytest.raises(ConfigError, match="has options None, not the declared") as error:
        registry.lookup("lazy")
    assert "\n" not in str(error.value)


def test_a_declared_code_path_that_does_not_import_is_one_line(widget_module):
    registry = make()
    registry.declare("gone", None, "no_such_module_anywhere:THING")
    assert registry.names() == ["gone"]
    with pytest.raises(ConfigError, match="widget 'gone' .*cannot be imported \\(ModuleNotFoundError"):
        registry.lookup("gone")
    with pytest.raises(ConfigError, match="package.module:attribute"):
        Declared(None, "not a path")


def test_an_entry_point_may_name_a_declaration_and_its_code_loads_on_lookup(widget_module, monkeypatch):
    name, imports = widget_module
    holder = types.ModuleType("widget_declarations")
    holder.DECLARED = Declared(types.SimpleNamespace(options=None), f"{name}:WIDGET")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "widget_declarations", holder)
    registry = make()
    entry_points(registry, monkeypatch, plug="widget_declarations:DECLARED")
    assert registry.names() == ["plug"] and not registry.is_builtin("plug")
    assert registry.declared("plug") is holder.DECLARED.declaration and imports == []
    assert type(registry.lookup("plug")).__name__ == "Widget" and imports == ["imported"]


def test_kept_puts_back_what_a_block_registered_replaced_or_removed():
    registry = make([("a", 1), ("b", 2)])
    registry.declare("c", "declared", "json:dumps")
    with registry.kept():
        registry.register("d", 4)
        registry.register("a", 10, replace=True)
        del registry["c"]
        assert registry.names() == ["b", "d", "a"] and not registry.is_builtin("a")
    assert registry.names() == ["a", "b", "c"] and registry["a"] == 1 and registry.is_builtin("a")
    assert registry.declared("c") == "declared" and registry.lookup("c") is __import__("json").dumps


@dataclasses.dataclass(frozen=True)
class WidgetDeclaration:
    name: str
    size: int = 1


def test_a_declaration_of_the_wrong_type_is_refused_and_a_renamed_one_takes_its_name(widget_module, monkeypatch):
    name, imports = widget_module
    registry = Registry("widget", "fedhpro.tests.widgets", key="widget", declaration_type=WidgetDeclaration)
    registry._entry_points = lambda: []  # type: ignore[method-assign]
    with pytest.raises(ConfigError, match=r"the declaration of a widget is a .*WidgetDeclaration, not a dict$"):
        registry.register("bad", Declared({"size": 2}, f"{name}:WIDGET"))
    registry.register("renamed", Declared(WidgetDeclaration("original", 3), f"{name}:WIDGET"))
    assert registry.declared("renamed") == WidgetDeclaration("renamed", 3) and imports == []
    holder = types.ModuleType("widget_bad_declarations")
    holder.DECLARED = Declared("not a declaration", f"{name}:WIDGET")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "widget_bad_declarations", holder)
    entry_points(registry, monkeypatch, plug="widget_bad_declarations:DECLARED")
    assert "plug" not in registry.names()  # an installed package's bad declaration is reported, never fatal
    with pytest.raises(ConfigError, match="widget 'plug' of package .* failed to load .*not a str"):
        registry.lookup("plug")
