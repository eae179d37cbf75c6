"""nbval runs every notebook of this folder, except chapter 06's where Triton cannot be imported (it has wheels
for Linux only): that notebook is not collected, and the run's header says why."""

from tests.needs_triton import TRITON_MISSING

TRITON_NOTEBOOK = "ch06_triton_kernels.ipynb"


def pytest_ignore_collect(collection_path, config):
    if TRITON_MISSING and collection_path.name == TRITON_NOTEBOOK:
        return True
    return None


def pytest_report_header(config):
    if TRITON_MISSING:
        return f"notebooks/{TRITON_NOTEBOOK} is not run: {TRITON_MISSING}"
    return None
