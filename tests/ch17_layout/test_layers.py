"""The package's map: imports flow down its declared layers, with no cycle (scripts/import_layers.py reads them
with `ast`), each subpackage says its job, and every module of the flat chapters has its place."""

import ast
import importlib.util
from pathlib import Path

import pytest

import chapters

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.requires("subpackages")


def load_script():
    spec = importlib.util.spec_from_file_location("import_layers", ROOT / "scripts" / "import_layers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layers = load_script()


def test_imports_flow_down_the_layers_with_no_cycle(checkpoint_info):
    graph = layers.import_graph(checkpoint_info.path)
    declared = layers.declared_layers(checkpoint_info.path)
    assert declared, "a checkpoint with subpackages declares its __layers__"
    assert layers.cycles(graph) == []
    assert layers.upward(graph, declared) == []
    assert layers.unplaced(graph, declared) == []


def test_each_subpackage_says_its_job_in_one_line(checkpoint_info):
    for init in sorted(checkpoint_info.path.glob("*/**/__init__.py")):
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree)
        where = init.relative_to(checkpoint_info.path)
        assert doc and "\n" not in doc, f"{where}: one line saying the subpackage's job"
        assert len(tree.body) == 1, f"{where}: its docstring only (modules are imported where they are used)"


def test_every_module_of_the_flat_chapters_has_a_place(checkpoint, checkpoint_info):
    """The last flat checkpoint's modules, each found through `__modules__`: what the tests and `make
    forward-fix` rely on."""
    flat = max((point for point in chapters.checkpoints() if not point.renames), key=lambda point: point.number)
    for path in sorted(flat.path.rglob("*.py")):
        relative = path.relative_to(flat.path).as_posix()
        assert (checkpoint_info.path / checkpoint_info.file_path(relative)).is_file(), relative
        name = relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        if name not in ("__init__", "__main__"):
            assert chapters.submodule(checkpoint.package, name).__name__.startswith(checkpoint.__name__)
    assert checkpoint.loader is chapters.submodule(checkpoint.__name__, "loader")


# --- the check itself, on packages planted in tmp_path ------------------------------------------------------


def plant(root: Path, files: dict[str, str]) -> Path:
    """A package `pkg` in `root` with layers top, low and the leaf `leaf`; `files` adds or replaces modules."""
    package = root / "pkg"
    base = {
        "__init__.py": '__layers__ = ("top", "low", "leaf")\n',
        "top/__init__.py": '"""Top."""\n',
        "top/a.py": "from ..low import b\n",
        "low/__init__.py": '"""Low."""\n',
        "low/b.py": "from ..leaf import VALUE\n",
        "leaf.py": "VALUE = 1\n",
    }
    for name, text in (base | files).items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def problems(package: Path) -> tuple[list, list]:
    graph = layers.import_graph(package)
    return layers.cycles(graph), layers.upward(graph, layers.declared_layers(package))


def test_a_clean_package_passes(tmp_path):
    assert problems(plant(tmp_path, {})) == ([], [])
    assert layers.levels(layers.import_graph(plant(tmp_path, {}))) == 3  # top.a -> low.b -> leaf


def test_a_planted_upward_import_fails(tmp_path):
    package = plant(tmp_path, {"leaf.py": "VALUE = 1\n\n\ndef late():\n    from .top import a\n"})
    cycles, upward = problems(package)
    assert upward == [("leaf", "top.a")]  # an import inside a function is an arrow too
    assert cycles == [["leaf", "low.b", "top.a"]]


def test_a_planted_cycle_inside_one_layer_fails(tmp_path):
    package = plant(tmp_path, {"low/c.py": "from .b import x\n", "low/b.py": "from . import c\n"})
    cycles, upward = problems(package)
    assert upward == [] and cycles == [["low.b", "low.c"]]


def test_a_folder_in_no_layer_fails(tmp_path):
    package = plant(tmp_path, {"stray/__init__.py": '"""Stray."""\n'})
    assert layers.unplaced(layers.import_graph(package), layers.declared_layers(package)) == ["stray"]


def test_the_script_exits_1_on_a_planted_upward_import(tmp_path, capsys):
    package = plant(tmp_path, {"low/b.py": "from ..top import a\n"})
    assert layers.main([str(package)]) == 1
    assert "upward: low.b imports top.a" in capsys.readouterr().out


@pytest.mark.latest_only
def test_the_page_counts_the_package_as_it_is():
    """Chapter 17's page states files, lines and import levels of its own package (not a later chapter's):
    they must be today's."""
    page = (ROOT / "docs" / "chapters" / "ch17_layout.md").read_text()
    counted = layers.describe(chapters.checkpoint(17).path).split(": ", 1)[1]  # "84 Python files, 8658 lines, 19 ..."
    files, lines, levels = (int(word) for word in counted.replace(",", "").split() if word.isdigit())
    assert f"| chapter 17 | {files} | {lines:,} | {levels} | 0 |" in page, counted
