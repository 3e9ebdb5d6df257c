"""`wandistiller.core.registry`: an extension point's options found from the modules that declare `OPTION`, on a
real package written to a temporary folder, and on the project's five registries."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap

import pytest
import yaml
from hydra.core.config_store import ConfigStore

from wandistiller.compose import registries
from wandistiller.config import CONF_DIR
from wandistiller.core.errors import UserError
from wandistiller.core.registry import Option, Registry, path_of


@pytest.fixture
def shapes(tmp_path, monkeypatch):
    """A package `shapes` with two options, a helper module without OPTION, and one declared under the wrong name."""
    root = tmp_path / "shapes"
    root.mkdir()
    (root / "__init__.py").write_text("")
    option = """
        from dataclasses import dataclass
        from wandistiller.core.registry import Option

        @dataclass
        class {cls}Config:
            _target_: str = "shapes.{name}.{cls}"
            size: int = {size}

        class {cls}:
            sides = {sides}

        OPTION = Option("{name}", {cls}Config, {cls})
    """
    for name, cls, size, sides in (("square", "Square", 2, 4), ("triangle", "Triangle", 3, 3)):
        text = option.format(name=name, cls=cls, size=size, sides=sides)
        (root / f"{name}.py").write_text(textwrap.dedent(text))
    (root / "helpers.py").write_text("AREA = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield Registry("shape", "shapes", "a shape")
    for name in [m for m in sys.modules if m == "shapes" or m.startswith("shapes.")]:
        del sys.modules[name]


def test_options_are_the_modules_declaring_option_in_name_order(shapes):
    assert shapes.names() == ["square", "triangle"]
    assert shapes.get("square").cls.sides == 4
    assert shapes.where(lambda cls: cls.sides == 3) == ["triangle"]
    assert shapes.of_target("shapes.triangle.Triangle").name == "triangle"
    assert shapes.of_target("shapes.nothing.Here") is None


def test_an_unknown_name_is_one_line_listing_the_options(shapes):
    with pytest.raises(UserError, match=r"^shape='circle' is not a shape; pick one of square, triangle$"):
        shapes.get("circle")


def test_each_schema_is_stored_under_its_group_for_the_yaml_to_name(shapes):
    store = ConfigStore.instance()
    shapes.register_schemas(store)
    assert {"square.yaml", "triangle.yaml"} <= set(store.list("schema/shape"))


def test_an_option_declared_under_another_name_is_refused(shapes, tmp_path):
    (tmp_path / "shapes" / "circle.py").write_text(
        "from dataclasses import dataclass\nfrom wandistiller.core.registry import Option\n"
        "@dataclass\nclass C:\n    r: int = 1\nOPTION = Option('round', C, object)\n"
    )
    with pytest.raises(TypeError, match=r"shapes\.circle\.OPTION must be Option\('circle'"):
        shapes.names()


def test_a_schema_must_be_a_dataclass():
    with pytest.raises(TypeError, match="not a dataclass"):
        Option("odd", dict, object)


@pytest.mark.parametrize("registry", registries(), ids=lambda r: r.group)
def test_every_shipped_option_has_its_own_schema_naming_its_class(registry):
    schemas = [option.schema for option in registry.options.values()]
    assert len(set(schemas)) == len(schemas), "two options share one schema"
    for option in registry.options.values():
        assert dataclasses.is_dataclass(option.schema)
        target = getattr(option.schema, "_target_", None)
        if target is not None:  # every group but data (a data node is read, not built)
            assert target == path_of(option.cls), option.name


def init_defaults(cls: type) -> dict[str, tuple[object, ast.expr]]:
    """The defaults of the `__init__` a class runs (its own or the nearest base's): name -> (value, its source)."""
    owner = next(c for c in cls.__mro__ if "__init__" in vars(c))
    if owner is object:
        return {}
    function = ast.parse(textwrap.dedent(inspect.getsource(owner.__init__))).body[0]
    assert isinstance(function, ast.FunctionDef)
    args = function.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    parameters = inspect.signature(owner.__init__).parameters
    return {a.arg: (parameters[a.arg].default, d) for a, d in pairs}


def yaml_keys(registry, name: str) -> dict[str, dict]:
    """The keys each shipped YAML of an option writes (its defaults list and Hydra's `_target_`/`_partial_` left out):
    file name -> keys. A data source may have several YAMLs (each names its source in `latents`)."""
    folder = CONF_DIR / registry.group
    found = {}
    for file in sorted(folder.glob("*.yaml")):
        node = yaml.safe_load(file.read_text()) or {}
        if registry.group == "data" and node.get("latents") != name or registry.group != "data" and file.stem != name:
            continue
        if registry.group in ("hooks", "logger"):  # the option's keys sit under its name
            node = node.get(name) or {}
        found[file.name] = {k: v for k, v in node.items() if k not in ("defaults", "_target_", "_partial_")}
    return found


@pytest.mark.parametrize("registry", registries(), ids=lambda r: r.group)
def test_each_default_is_written_once_in_the_options_schema(registry):
    """An option's defaults live in its schema dataclass: its YAML writes only what differs (an interpolation, a
    value of its own), and its class's `__init__` either requires the key or names the schema's field
    (`every: int = SamplesConfig.every`); a literal there would be a second copy that can drift."""
    twice = []
    for name, option in registry.options.items():
        schema = option.defaults()
        factories = {f.name for f in dataclasses.fields(option.schema) if f.default_factory is not dataclasses.MISSING}
        names = {c.__name__ for c in option.schema.__mro__}
        for key, (value, source) in init_defaults(option.cls).items():
            if key not in schema:
                continue
            if key in factories:  # a mutable default cannot be named: None stands for the schema's empty value
                ok = isinstance(source, ast.Constant) and source.value is None
            else:
                named = isinstance(source, ast.Attribute) and isinstance(source.value, ast.Name)
                ok = named and source.attr == key and source.value.id in names and value == schema[key]
            if not ok:
                twice.append(f"{path_of(option.cls)}.__init__: {key}={ast.unparse(source)} (schema: {schema[key]!r})")
        for file, keys in yaml_keys(registry, name).items():
            for key, value in keys.items():
                if key in schema and value == schema[key] and type(value) is type(schema[key]):
                    twice.append(f"conf/{registry.group}/{file}: {key}: {value!r}, the schema's default again")
    assert not twice, "defaults written twice: " + "; ".join(twice)


def test_an_options_defaults_are_its_schemas_and_build_takes_them():
    from wandistiller.recipe.methods import REGISTRY

    dmd = REGISTRY.get("dmd")
    assert dmd.defaults()["fake_updates"] == 5 and "_target_" not in dmd.defaults()
    built = dmd.build(steps=2)
    assert (built.k, built.fake_updates, built.teacher_steps) == (2, 5, 20)
