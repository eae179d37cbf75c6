"""What the repository publishes names no folder of the machine it was made on: the committed benchmark
results, every text file of docs/, the notebooks and README.md hold no absolute path into a home, work or
temporary folder (`/work/`, `/root/`, `/home/`, `/tmp/`). Paths there are relative to the repository, or
start at `~` for a cache. URL paths (`/v1/completions`, `https://host/home/...`) are not machine paths.
"""

import functools
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.repo

ROOT = Path(__file__).resolve().parents[2]
# a path that starts one of these folders, not inside a URL, a relative path or a longer name
MACHINE_PATH = re.compile(r"(?<![\w.~:/-])/(?:work|root|home|tmp)/")


@functools.cache
def published_texts() -> dict[str, str]:
    """Each published text file by its path in the repository (docs/ holds figures too: they are not text)."""
    paths = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    paths += sorted(p for p in (ROOT / "docs").rglob("*") if p.is_file())
    paths += sorted((ROOT / "notebooks").glob("*.ipynb")) + [ROOT / "README.md"]
    texts = {}
    for path in paths:
        try:
            texts[str(path.relative_to(ROOT))] = path.read_text()
        except UnicodeDecodeError:
            continue  # an image
    return texts


def machine_paths(text: str) -> list[str]:
    return [
        f"{number}: {line.strip()}" for number, line in enumerate(text.splitlines(), 1) if MACHINE_PATH.search(line)
    ]


def test_the_check_knows_a_machine_path():
    found = ["/work/main/.peers/vllm/bin/python", '"model": "/root/.cache/x"', "--figure /tmp/ch01.png", "/home/me"]
    fine = ["POST /v1/completions", "https://example.org/home/page", "~/.cache/rosellm", ".peers/vllm/lib/x.so"]
    fine += ["docs/tmp/figure.png", "LD_PRELOAD=.peers/lib.so:/usr/lib/libtcmalloc.so"]
    assert all(machine_paths(text) for text in found) and not any(machine_paths(text) for text in fine)
    names = set(published_texts())
    assert "README.md" in names and any(name.startswith("benchmarks/results/") for name in names)
    assert any(name.startswith("notebooks/") for name in names) and "docs/benchmarks.md" in names


@pytest.mark.parametrize("name", sorted(published_texts()))
def test_no_machine_path_is_published(name):
    assert machine_paths(published_texts()[name]) == []
