"""The book speaks to readers about the engine: no word about how the work behind it was organised.

The forbidden patterns are in `book_forbidden_words.txt`, next to this file. Checked: every Markdown page
under docs/, every notebook's cells and text outputs, README.md, the chapter pages once the
measured-results hook has filled them in, and what the benchmarks say to their readers: every docstring of
every module in benchmarks/ and the `--help` text of `python -m benchmarks` and of each of its workloads.
"""

import ast
import functools
import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.repo

ROOT = Path(__file__).resolve().parents[2]
PATTERNS = [
    re.compile(line, re.IGNORECASE)
    for line in (Path(__file__).parent / "book_forbidden_words.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]


def notebook_text(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    parts = []
    for cell in cells:
        parts.append("".join(cell["source"]))
        for output in cell.get("outputs", []):
            parts.append("".join(output.get("text", "")))
            parts.append("".join(output.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def generated_chapter_pages() -> dict[str, str]:
    """Each chapter page with its `<!-- measured: ... -->` blocks filled in, as the site shows it."""
    spec = importlib.util.spec_from_file_location("docs_results", ROOT / "scripts" / "docs_results.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    config = SimpleNamespace(config_file_path=str(ROOT / "mkdocs.yml"))
    pages = {}
    for path in sorted((ROOT / "docs" / "chapters").glob("*.md")):
        page = SimpleNamespace(file=SimpleNamespace(src_path=str(path)))
        pages[f"{path.relative_to(ROOT)} (generated)"] = hook.on_page_markdown(path.read_text(), page, config, None)
    return pages


def docstrings(path: Path) -> str:
    """Every docstring of a Python file: the module's, its classes' and its functions'."""
    tree = ast.parse(path.read_text(), filename=str(path))
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return "\n".join(ast.get_docstring(node) or "" for node in ast.walk(tree) if isinstance(node, kinds))


def benchmark_texts() -> dict[str, str]:
    """The docstrings of every module of benchmarks/, and the `--help` of the command and of every workload."""
    from benchmarks import WORKLOADS
    from benchmarks.__main__ import top_parser, workload_parser

    folder = ROOT / "benchmarks"
    texts = {f"{p.relative_to(ROOT)} (docstrings)": docstrings(p) for p in sorted(folder.glob("*.py"))}
    texts["python -m benchmarks --help"] = top_parser().format_help()
    return texts | {f"python -m benchmarks {name} --help": workload_parser(name)[0].format_help() for name in WORKLOADS}


@functools.cache
def book_texts() -> dict[str, str]:
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))}
    texts |= {str(p.relative_to(ROOT)): notebook_text(p) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}
    texts["README.md"] = (ROOT / "README.md").read_text()
    return texts | generated_chapter_pages() | benchmark_texts()


def offending_lines(text: str) -> list[str]:
    return [
        f"{number}: {line.strip()}"
        for number, line in enumerate(text.splitlines(), 1)
        if any(pattern.search(line) for pattern in PATTERNS)
    ]


def test_the_check_knows_what_to_look_for():
    assert len(PATTERNS) >= 10
    assert offending_lines("not measured: no GPU was lent to this task") and not offending_lines("a KV cache")
    assert offending_lines("see DESIGN §6") and offending_lines("the targets: not met")
    texts = book_texts()
    assert any(name.startswith("notebooks/") for name in texts) and any("(generated)" in name for name in texts)
    assert "python -m benchmarks offline-cpu --help" in texts and "benchmarks/serve.py (docstrings)" in texts
    assert "--quick" in texts["python -m benchmarks serve --help"]
    assert "share of all CPUs' time" in texts["benchmarks/harness.py (docstrings)"]  # a class's, not only the module's


@pytest.mark.parametrize("name", sorted(book_texts()))
def test_page_has_no_internal_wording(name):
    assert offending_lines(book_texts()[name]) == []
