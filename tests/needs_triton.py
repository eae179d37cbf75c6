"""Triton has wheels for Linux only. Where it cannot be imported, the tests (and the notebook) that need it are
skipped with this reason: the one skip besides the `gpu` marker."""

import importlib.util
import platform


def triton_missing() -> str | None:
    """Why Triton cannot be imported here, or None when it can."""
    try:
        if importlib.util.find_spec("triton") is not None:
            return None
    except (ImportError, ValueError):  # an import system that refuses it, or a module without a spec
        pass
    return f"triton is not installed: it has wheels for Linux only, and this is {platform.system()}"


TRITON_MISSING = triton_missing()
