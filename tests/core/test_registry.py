"""`wandistiller.core.registry`: an extension point's options found from the modules that declare `OPTION`, on a
real package written to a temporary folder, and on the project's five registries."""

from __future__ import annotations

import dataclasses
import sys
import textwrap

import pytest
from hydra.core.config_store import ConfigStore

from wandistiller.compose import registries
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
