"""The package's layout (docs/ARCHITECTURE.md): subpackages import downward only, with no cycle, the CLIs and the
composition (`compose.py`) sit on top and no subpackage calls up into them, no module-level import cycle anywhere,
and `_target_`s of runs saved before the move still resolve (wandistiller/core/renamed.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from hydra.utils import get_object
from omegaconf import OmegaConf

import wandistiller
from wandistiller.core.renamed import RENAMED, modernize

PACKAGE = Path(wandistiller.__file__).parent
CLIS = {"train", "eval", "generate", "plan", "legacy", "pipeline", "export"}
CLI_PACKAGES = {"quality"}  # `python -m wandistiller.quality`: a CLI that is a package
# None: the end-of-run evaluation's hook calls the evaluation library (wandistiller/evaluation/), not its CLI, and
# the pipeline folder is made in state/export.py.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def imports_of(path: Path) -> set[str]:
    """The `wandistiller.X` top-level names a file imports (module level, inside functions, and an `if
    TYPE_CHECKING:` block's: a type that names a layer above is an arrow up all the same)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("wandistiller"):
            parts = node.module.split(".")
            found |= {a.name for a in node.names} if len(parts) == 1 else {parts[1]}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("wandistiller.")}
    return found


def package_edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for f in PACKAGE.rglob("*.py"):
        rel = f.relative_to(PACKAGE).parts
        if len(rel) == 1 or rel[0] in {"bench"} | CLI_PACKAGES:
            continue
        edges.setdefault(rel[0], set()).update(d for d in imports_of(f) if d != rel[0])
    return edges


def test_imports_of_counts_type_checking_blocks_and_calls_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from wandistiller.teacher import spec\n")
    assert imports_of(f) == {"teacher"}
    f.write_text("def later():\n    from wandistiller.teacher import spec\n")
    assert imports_of(f) == {"teacher"}
    f.write_text("def later():\n    from wandistiller.compose import registries\n    import wandistiller.train\n")
    assert imports_of(f) & TOP == {"compose", "train"}  # a call up, even inside a function, is one


def test_top_level_holds_only_clis_the_config_schemas_and_their_composition():
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert top == CLIS | {"config", "compose"}, top - CLIS


# The top level above every subpackage: the CLIs and the composition, which registers the registries and hands them
# down (a subpackage composes with wandistiller/core/hydra.py and asks wandistiller.core.registry.registered()).
TOP = CLIS | CLI_PACKAGES | {"compose"}


def test_no_subpackage_imports_a_cli_or_the_composition_and_core_imports_no_other_subpackage():
    edges = package_edges()
    upward = {(src, dst) for src, dsts in edges.items() for dst in dsts if dst in TOP}
    assert upward == KNOWN_UPWARD, "a layer below calls up: hand what it needs down (an argument, a registration)"
    assert edges["core"] <= {"config"}  # the schemas' Choice type; the schemas import nothing of the package
    assert imports_of(PACKAGE / "config.py") == set(), "config.py holds the schemas alone"


def test_no_cli_imports_another_cli():
    """Each CLI is a shell over the packages: what two of them share lives below both (job/run.py's `run`, which
    train's Hydra shell and the quality comparisons call)."""
    clis = CLIS | CLI_PACKAGES
    for cli in sorted(clis):
        module = PACKAGE / f"{cli}.py"
        files = [module] if module.is_file() else sorted((PACKAGE / cli).rglob("*.py"))
        found = set().union(*(imports_of(f) for f in files)) & (clis - {cli})
        assert not found, f"{cli} imports the CLI(s) {sorted(found)}: move what they share into a package below"


# docs/ARCHITECTURE.md's layer order: each subpackage imports only those before it (and the schemas, `config`).
LAYERS = [
    "core",
    "teacher",
    "student",
    "placements",
    "data",
    "pocket",
    "state",
    "tracking",
    "evaluation",
    "recipe",
    "job",  # runs first, yet above what it checks: preflight builds the recipe's method and loss
]


def test_each_subpackage_imports_only_the_layers_below_it():
    edges = package_edges()
    assert set(edges) - {"bench"} <= set(LAYERS), "a new subpackage needs its place in LAYERS and docs/ARCHITECTURE.md"
    for i, package in enumerate(LAYERS):
        above = {d for d in edges.get(package, ()) if (PACKAGE / d).is_dir()} - set(LAYERS[:i])
        assert not above, f"{package} imports {sorted(above)}, which sit above it"


def test_subpackages_form_no_import_cycle():
    edges = {src: {d for d in dsts if (PACKAGE / d).is_dir()} for src, dsts in package_edges().items()}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, f"import cycle: {' -> '.join([*path, node])}"
        if node not in done:
            for nxt in edges.get(node, ()):
                visit(nxt, [*path, node])
            done.add(node)

    for src in edges:
        visit(src, [])


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_moved_targets_resolve_in_an_older_runs_saved_config(old):
    saved = OmegaConf.create({"node": {"_target_": old}, "hydra": {"callbacks": {"x": {"_target_": old}}}})
    modernize(saved)
    assert saved.node._target_ == saved.hydra.callbacks.x._target_ == RENAMED[old]
    unread = OmegaConf.create({"a": {"_target_": "${oc.env:NOT_SET_ANYWHERE}"}, "b": ["${oc.env:NOT_SET_EITHER}"]})
    modernize(unread)  # resolving either would raise: a received config's interpolations are checked later
    assert OmegaConf.to_container(unread) == {
        "a": {"_target_": "${oc.env:NOT_SET_ANYWHERE}"},
        "b": ["${oc.env:NOT_SET_EITHER}"],
    }
    assert callable(get_object(RENAMED[old]))


def test_every_target_of_the_shipped_conf_tree_resolves():
    for yaml in (PACKAGE / "conf").rglob("*.yaml"):
        for line in yaml.read_text().splitlines():
            if line.strip().startswith("_target_:"):
                target = line.split(":", 1)[1].strip()
                assert target not in RENAMED, f"{yaml} names the old {target}"
                assert get_object(target), target


def test_the_architecture_page_names_every_subpackage_and_cli():
    """docs/ARCHITECTURE.md has a paragraph per subpackage (**`name/`**) and names every top-level module: a new
    module inside a subpackage needs no doc edit, a new subpackage or CLI does."""
    page = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    paragraphs = set(re.findall(r"\*\*`(\w+)/`\*\*", page))
    subpackages = {d.name for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()} - {"bench"}
    assert subpackages <= paragraphs, f"docs/ARCHITECTURE.md has no paragraph for {sorted(subpackages - paragraphs)}"
    named = set(re.findall(r"`([\w/]+\.py)`", page))
    for f in PACKAGE.glob("*.py"):
        assert f.name == "__init__.py" or f.name in named, f"docs/ARCHITECTURE.md does not name {f.name}"
    assert set(LAYERS) <= set(re.findall(r"^  (\w+) ", page, re.M)), "the layer picture lists every layer"


def test_every_test_file_the_docs_and_the_package_name_exists():
    root = PACKAGE.parent
    texts = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted(PACKAGE.rglob("*.py")),
             *sorted((root / "tests").rglob("*.py")), *sorted((root / "scripts").glob("*"))]  # fmt: skip
    named = {
        (f.relative_to(root), m) for f in texts if f.is_file() for m in re.findall(r"tests/[\w/]+\.py", f.read_text())
    }
    missing = sorted(f"{where}: {test}" for where, test in named if not (root / test).is_file())
    assert not missing, f"names of test files that do not exist (moved? tests mirror the package): {missing}"


# The tests that are about the project rather than one module: the layering (this file), the docs' commands, and
# the GPU lane (`scripts/gpu_figures.sh` runs it alone on a device whose image lacks some test dependencies).
PROJECT_TESTS = {"test_layout.py", "test_readme.py", "test_gpu.py"}
TESTS = PACKAGE.parent / "tests"


def mirror_of(module: Path) -> Path:
    """The test module of a package module: wandistiller/<a>/<b>.py -> tests/<a>/test_<b>.py (`__init__` -> test_init,
    `__main__` -> test_main)."""
    rel = module.relative_to(PACKAGE)
    return TESTS.joinpath(*rel.parts[:-1], "test_" + rel.stem.strip("_") + ".py")


def has_logic(module: Path) -> bool:
    """A module that defines a function or method; one of only constants, dataclass fields or imports has none."""
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) for n in ast.walk(ast.parse(module.read_text())))


def test_every_module_with_logic_has_its_test_module_at_the_mirrored_path():
    missing = sorted(str(mirror_of(f).relative_to(TESTS)) for f in PACKAGE.rglob("*.py") if has_logic(f)
                     and not mirror_of(f).is_file())  # fmt: skip
    assert not missing, f"{len(missing)} modules with logic have no test module: {missing}"


def test_every_test_module_mirrors_a_module_of_the_package():
    mirrored = {mirror_of(f) for f in PACKAGE.rglob("*.py")}
    strays = sorted(str(t.relative_to(TESTS)) for t in TESTS.rglob("test_*.py")
                    if t not in mirrored and t.relative_to(TESTS).as_posix() not in PROJECT_TESTS)  # fmt: skip
    assert not strays, f"test modules that mirror no module (tests/<package path>/test_<module>.py): {strays}"


def module_level_imports(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports when it is imported: its top-level statements (an `if` included,
    an `if TYPE_CHECKING:` block not), never a function's body. `from a import b` is a.b where b is a module, else a."""
    rel = path.relative_to(root.parent).with_suffix("").parts
    this = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
    package = this if path.name == "__init__.py" else this.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in modules and m != this}


def module_cycle(root: Path) -> list[str] | None:
    """A circle of module-level imports among the modules under `root` (a package folder), or None."""
    files = {}
    for f in root.rglob("*.py"):
        rel = f.relative_to(root.parent).with_suffix("").parts
        files[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = f
    edges = {name: module_level_imports(f, root, set(files)) for name, f in files.items()}
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(edges[node]):
            if cycle := visit(nxt, [*path, node]):
                return cycle
        done.add(node)
        return None

    return next((c for name in sorted(edges) if (c := visit(name, []))), None)


def test_no_module_imports_another_that_imports_it_back_at_module_level():
    """A circle of module-level imports (config.py, compose.py and the CLIs included) works in one import order only."""
    cycle = module_cycle(PACKAGE)
    assert cycle is None, f"module-level import cycle: {' -> '.join(cycle)}"


def test_the_cycle_check_finds_a_circle_and_not_a_functions_import(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    for name in ("__init__.py", "sub/__init__.py"):
        (root / name).write_text("")
    (root / "a.py").write_text("from pkg.sub import b\n")
    (root / "sub" / "b.py").write_text("def later():\n    import pkg.a\n")
    assert module_cycle(root) is None
    (root / "sub" / "b.py").write_text("from .. import a\n")
    assert module_cycle(root) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    (root / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    assert module_cycle(root) is None


# Where an option may be named: its registry's package, the mapping of older runs' names, and the benches (tools that
# measure given placements by design).
NAMES_OPTIONS = ("wandistiller.core.renamed", "wandistiller.bench")
GROUP_WORDS = {
    "teacher_placement": "placement",
    "data": "latents",
    "loss": "loss",
    "method": "method",
    "hooks": "hook",
    "logger": "logger",
}


def options_named_outside_their_registry(files: dict[str, Path]) -> list[str]:
    """`isinstance(x, WandbTracker)`, `target.endswith(".AutoPlacement")`, `data.latents == "images"`: code that
    names an option (its class, its class's path, or its name compared with its group's key) outside its registry."""
    from wandistiller.compose import registries

    options = [(r, o) for r in registries() for o in r.options.values()]
    found = []
    for module, path in files.items():
        if module.startswith(NAMES_OPTIONS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            for registry, option in options:
                if module.startswith(registry.package):
                    continue
                cls = option.cls.__name__
                named = (isinstance(node, ast.Name) and node.id == cls) or (
                    isinstance(node, ast.Attribute) and node.attr == cls
                )
                named |= isinstance(node, ast.alias) and node.name == cls
                named |= isinstance(node, ast.Constant) and isinstance(node.value, str) and f".{cls}" in node.value
                if isinstance(node, ast.Compare):
                    strings = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)}
                    named |= option.name in strings and GROUP_WORDS[registry.group] in ast.unparse(node)
                if named:
                    found.append(f"{module}:{getattr(node, 'lineno', '?')} names {registry.group}={option.name}")
    return found


def test_no_code_outside_a_registry_names_one_of_its_options():
    files = {".".join(f.relative_to(PACKAGE.parent).with_suffix("").parts): f for f in PACKAGE.rglob("*.py")}
    assert options_named_outside_their_registry(files) == []


def test_the_option_check_finds_a_named_option(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('from x import WandbTracker\nok = cfg.data.latents == "images" or t.endswith(".AutoPlacement")\n')
    found = options_named_outside_their_registry({"wandistiller.job.bad": bad})
    assert {line.split(" names ")[1] for line in found} == {"logger=wandb", "data=images", "teacher_placement=auto"}


def test_every_option_yaml_names_its_own_schema():
    from wandistiller.compose import registries

    for registry in registries():
        folder = PACKAGE / "conf" / registry.group
        for yaml_file in folder.glob("*.yaml"):
            node = OmegaConf.load(yaml_file)
            if yaml_file.stem == "none":  # logger=none: the empty list
                continue
            defaults = [str(d) for d in node.get("defaults", [])]
            option = node.get("latents", yaml_file.stem)  # a data option names its source
            assert any(d.startswith(f"/schema/{registry.group}/{option}@") for d in defaults), yaml_file


def test_each_import_inside_a_function_says_why_and_they_stay_few():
    """ruff's PLC0415 keeps imports at the top of their module; pyproject.toml lists the heavy libraries that wait
    for the function using them (and export.py's exception). Any other lazy import says why on its line."""
    marked = [
        f"{f.relative_to(PACKAGE)}: {line.strip()}"
        for f in PACKAGE.rglob("*.py")
        for line in f.read_text().splitlines()
        if "noqa: PLC0415" in line
    ]
    assert all(" -- " in line.split("noqa: PLC0415", 1)[1] for line in marked), marked
    assert len(marked) <= 10, f"{len(marked)} lazy imports: move them to the top, or break the cycle they avoid"
