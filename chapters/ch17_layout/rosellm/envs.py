"""Settings read from the environment: where rosellm caches what it builds (converted models, C kernels)."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """`ROSELLM_CACHE`, else ~/.cache/rosellm."""
    return Path(os.environ.get("ROSELLM_CACHE", Path.home() / ".cache" / "rosellm"))
