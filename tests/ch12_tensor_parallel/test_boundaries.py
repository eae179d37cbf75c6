"""One type per boundary: the runner side never imports the bookkeeping (it is handed `StepInputs`), and an
attention backend holds nothing between calls (its plan travels with the metadata)."""

import ast
from pathlib import Path

import pytest
import torch

from tests.ch05_paged_attention.paged_data import dense_attention, make_problem

# The modules that run the model (and, through their imports, everything they import from the package)
RUNNER_SIDE = ["model_runner", "parallel_runner", "attention_backend", "model", "paged_attention", "kernels"]
BOOKKEEPING = {"scheduler", "sequence", "block_manager"}


def package_imports(package: Path, module: str) -> set[str]:
    """The modules of `package` that `module` (dotted, inside the package) imports, read with `ast`."""
    path = package / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = package / module.replace(".", "/") / "__init__.py"
    parts = module.split(".")
    here = parts if path.name == "__init__.py" else parts[:-1]  # the package a relative import starts from
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - (node.level - 1)]
            if node.module:
                found.add(".".join(base + node.module.split(".")))
            else:
                found.update(".".join([*base, alias.name]) for alias in node.names)
    return {
        name for name in found if (package / (name.replace(".", "/") + ".py")).exists() or (package / name).is_dir()
    }


def imported_closure(package: Path, modules: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += package_imports(package, module)
    return seen


def test_the_import_reader_sees_relative_imports(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("from .store import x\nfrom ..scheduler import Plan\n")
    (tmp_path / "kernels" / "store.py").write_text("from .. import sequence\n")
    for name in ("scheduler", "sequence", "runner"):
        (tmp_path / f"{name}.py").write_text("")
    (tmp_path / "runner.py").write_text("from . import kernels\nimport torch\n")
    assert imported_closure(tmp_path, ["runner"]) == {"runner", "kernels", "kernels.store", "scheduler", "sequence"}


def test_the_runner_side_never_imports_the_bookkeeping(checkpoint_info):
    path = checkpoint_info.module_path  # a flat name's place in the checkpoint (chapter 17's subpackages)
    reached = imported_closure(checkpoint_info.path, [path(name) for name in RUNNER_SIDE])
    assert path("step_inputs") in reached  # what the runner is handed instead
    assert not reached & {path(name) for name in BOOKKEEPING}


def state(value, seen=None):
    """What an object holds, recursively through the objects it holds (tensors by identity and content)."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value.clone())
    fields = getattr(value, "__dict__", None)
    if fields is None or id(value) in seen or callable(value) and not fields:
        return value
    seen.add(id(value))
    return (type(value), {name: state(field, seen) for name, field in fields.items()})


def same(a, b) -> bool:
    if isinstance(a, tuple) and a and a[0] == "tensor":
        return isinstance(b, tuple) and b[0] == "tensor" and a[1] == b[1] and torch.equal(a[2], b[2])
    if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], dict):
        return (
            isinstance(b, tuple)
            and a[0] == b[0]
            and a[1].keys() == b[1].keys()
            and all(same(a[1][k], b[1][k]) for k in a[1])
        )
    return a == b


@pytest.mark.requires("compiled")
@pytest.mark.parametrize("name", ["reference", "torch", "cpu"])
def test_a_backend_is_unchanged_by_a_forward_and_forwards_interleave(checkpoint, name):
    """Two steps planned, then their layers interleaved: each gives dense attention's answer, and the backend
    object holds exactly what it held before."""
    backend = checkpoint.attention_backend.get_attention_backend(name, "cpu")
    steps = [([40, 1, 17, 23, 9], [1, 1, 17, 5, 1]), ([12, 30, 64], [12, 30, 1])]
    problems = [make_problem(checkpoint, s, q, 4, 4, 2, head_dim=8, seed=i) for i, (s, q) in enumerate(steps)]
    before = state(backend)
    for problem in problems:
        problem[3].plan = backend.plan(problem[3], 4)
    for _ in range(2):  # two layers of each step, one after the other
        for (seq_lens, query_lens), (query, key_cache, value_cache, metadata, dense_k, dense_v) in zip(steps, problems):
            out = backend.paged_attention(query, key_cache, value_cache, metadata)
            expected = dense_attention(query, dense_k, dense_v, seq_lens, query_lens)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert same(state(backend), before)
