"""The import graph of a checkpoint's package, read with `ast` (nothing is imported): its cycles, its imports
that go up the layers the package declares, and its depth.

    python scripts/import_layers.py                              # rosellm/
    python scripts/import_layers.py chapters/ch16_engine_core/rosellm

A package declares its layers in `__init__.py`, top first: `__layers__ = ("entrypoints", "engine", ...,
"config outputs utils")`. A module may import from its own layer or any layer below it; the package's
`__init__.py` and `__main__.py` sit above every layer. Names sharing a layer (space-separated) are leaves
that may import one another, as long as no cycle forms. Each import counts, those inside functions too: a
lazy import is still an arrow. Exit status 1 when the package has a cycle or an upward import.
Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("", "__main__")  # the package itself and `python -m`: above every layer


def module_names(package: Path) -> dict[str, Path]:
    """Every module of `package` by its dotted name inside it ("" for the package, "engine.core", ...)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported(name: str, path: Path, names: dict[str, Path]) -> set[str]:
    """The modules of the package that module `name` imports (relative imports and absolute ones alike)."""
    here = name.split(".") if name else []
    if path.name != "__init__.py":
        here = here[:-1]  # a module's relative imports start from its package
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{module}.{alias.name}".lstrip(".")
                found.add(child if child in names else module)
    return {module for module in found if module in names and module != name}


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules it imports, for every module of `package`."""
    names = module_names(package)
    return {name: imported(name, path, names) for name, path in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def levels(graph: dict[str, set[str]]) -> int:
    """The longest chain of imports, counted in modules (a cycle counts as one module)."""
    group_of = {node: node for node in graph}
    for group in cycles(graph):
        for node in group:
            group_of[node] = group[0]
    arrows = {}
    for node, targets in graph.items():
        arrows.setdefault(group_of[node], set()).update(group_of[t] for t in targets if group_of[t] != group_of[node])

    @cache
    def depth(node: str) -> int:
        return 1 + max((depth(other) for other in arrows.get(node, ())), default=0)

    return max(depth(node) for node in arrows)


def rank_of(layers: tuple[str, ...]) -> dict[str, int]:
    """Top-level name -> its layer's index (0 is the top)."""
    return {name: rank for rank, layer in enumerate(layers) for name in layer.split()}


def upward(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[tuple[str, str]]:
    """The imports that go up: from a module to one in a layer above its own."""
    rank = rank_of(layers)

    def layer(module: str) -> int:
        return -1 if module in TOP else rank[module.split(".")[0]]

    return sorted(
        (node, target) for node, targets in graph.items() for target in targets if layer(target) < layer(node)
    )


def unplaced(graph: dict[str, set[str]], layers: tuple[str, ...]) -> list[str]:
    """Top-level modules and subpackages that no layer names."""
    rank = rank_of(layers)
    return sorted({name.split(".")[0] for name in graph if name not in TOP} - rank.keys())


def declared_layers(package: Path) -> tuple[str, ...]:
    """`__layers__` of the package's `__init__.py`, parsed; () where it declares none (a flat chapter)."""
    for node in ast.parse((package / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__layers__"]:
            return tuple(ast.literal_eval(node.value))
    return ()


def describe(package: Path) -> str:
    """One line: files, lines and import levels of the package."""
    graph = import_graph(package)
    files = sorted(package.rglob("*.py"))
    lines = sum(len(path.read_text().splitlines()) for path in files)
    where = package.relative_to(ROOT) if package.is_relative_to(ROOT) else package
    return f"{where}: {len(files)} Python files, {lines} lines, {levels(graph)} import levels"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", nargs="?", default=ROOT / "rosellm", type=Path, help="a package folder")
    package = parser.parse_args(argv).package.resolve()
    graph, layers = import_graph(package), declared_layers(package)
    print(describe(package))
    problems = [f"cycle: {' <-> '.join(group)}" for group in cycles(graph)]
    if layers:
        problems += [f"upward: {source} imports {target}" for source, target in upward(graph, layers)]
        problems += [f"in no layer: {name}" for name in unplaced(graph, layers)]
    print("\n".join(problems) or "no cycle" + (", no upward import" if layers else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
