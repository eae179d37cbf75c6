"""Where Triton cannot be imported (it has wheels for Linux only), rosellm still imports and runs on its other
backends: the "triton" backend refuses in one line that says why, the command line says it before loading,
Triton's tests are skipped with that reason and nbval leaves chapter 06's notebook out. Each run hides
Triton from the import system of a fresh process, as on macOS or Windows."""

import os
import subprocess
import sys

from tests.conftest import ROOT

HIDE_TRITON = """
import importlib.abc, sys

class RefuseTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, RefuseTriton())
"""


def run_without_triton(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", HIDE_TRITON + code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_triton_backend_refuses_in_one_line(checkpoint):
    code = f"""
import chapters
attention_backend = chapters.submodule("{checkpoint.__name__}", "attention_backend")
for device in ("cuda", "cpu"):
    try:
        attention_backend.get_attention_backend("triton", device)
    except ValueError as error:
        print(error)
print(attention_backend.get_attention_backend("torch", "cpu").name)
"""
    run = run_without_triton(code)
    assert run.returncode == 0, run.stderr[-2000:]
    refusal, again, torch_backend = run.stdout.splitlines()
    assert refusal == again and "Triton is not installed" in refusal and "Linux only" in refusal
    assert 'attention_backend="torch"' in refusal and torch_backend == "torch"


def test_the_command_line_says_it_before_loading(checkpoint):
    code = f"""
import chapters
cli = chapters.submodule("{checkpoint.__name__}", "__main__")
cli.load_llm = None  # never reached: the check comes first
cli.main(["generate", "hi", "--attention-backend", "triton"])
"""
    run = run_without_triton(code, env=os.environ | {"TRITON_INTERPRET": "1"})
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.count("\n") == 1 and "--attention-backend triton: Triton is not installed" in run.stderr


def test_triton_tests_and_notebook_are_skipped_saying_why():
    tests = "tests/ch06_triton_kernels/test_triton_engine.py::test_backend_names_and_defaults"
    code = f"""
import pytest
sys.exit(pytest.main(["{tests}", "-rs", "-p", "no:cacheprovider"]))
"""
    run = run_without_triton(code)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "2 skipped" in run.stdout and "passed" not in run.stdout, run.stdout[-3000:]
    assert "triton is not installed: it has wheels for Linux only, and this is" in run.stdout
    code = """
import pytest
sys.exit(pytest.main(["--nbval-lax", "--collect-only", "-p", "no:cacheprovider", "notebooks"]))
"""
    run = run_without_triton(code)
    assert run.returncode == 0, run.stdout[-3000:]
    assert "<IPyNbFile ch05_paged_attention.ipynb>" in run.stdout and "ch06_triton_kernels.ipynb>" not in run.stdout
    assert "notebooks/ch06_triton_kernels.ipynb is not run: triton is not installed" in run.stdout
