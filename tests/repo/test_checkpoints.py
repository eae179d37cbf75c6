"""The chapters helper (chapters/__init__.py) and the test matrix built on it (tests/conftest.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

import chapters
from tests.conftest import checkpoints_for

ROOT = Path(__file__).resolve().parents[2]


def test_checkpoints_are_the_chapters_in_order_with_rosellm_last():
    points = chapters.checkpoints()
    assert [point.number for point in points] == list(range(1, len(points) + 1))
    assert points[-1] == chapters.latest()
    assert (points[-1].module, points[-1].path) == ("rosellm", ROOT / "rosellm")
    for point in points[:-1]:
        assert point.module == f"chapters.{point.name}.rosellm"
        assert point.path == ROOT / "chapters" / point.name / "rosellm"
    for point in points:
        assert point.name == f"ch{point.number:02d}_{point.slug}"
        assert point.capabilities <= chapters.CAPABILITIES.keys()


def test_a_checkpoint_is_named_by_number_or_name():
    last = chapters.latest()
    n = last.number
    for name in (n, str(n), f"{n:02d}", f"ch{n:02d}", last.name):
        assert chapters.checkpoint(name) == last
    for wrong in (0, 99, f"ch{n:02d}_other", "three", True, f"chapters/{last.name}"):
        with pytest.raises(ValueError):
            chapters.checkpoint(wrong)


def test_load_imports_the_declared_package():
    first = chapters.checkpoint(1)
    package = first.load()
    assert package.__name__ == first.module and package.__capabilities__ == first.capabilities


def test_listing_checkpoints_imports_no_torch():
    code = "import sys, chapters; chapters.checkpoints(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_an_unknown_capability_is_refused(tmp_path):
    init = tmp_path / "__init__.py"
    init.write_text('__chapter__ = "01_x"\n__capabilities__ = frozenset({"teleport"})\n')
    with pytest.raises(ValueError, match="teleport"):
        chapters.read_declarations(init)


def numbers(points) -> list[int]:
    return [point.number for point in points]


def test_the_matrix_own_checkpoint_and_latest_every_checkpoint_on_demand():
    every = list(range(1, chapters.latest().number + 1))
    assert numbers(checkpoints_for("ch01_naive_decode", set(), every=False)) == sorted({1, every[-1]})
    assert numbers(checkpoints_for("ch01_naive_decode", set(), every=True)) == every
    assert numbers(checkpoints_for(f"ch{every[-1]:02d}_latest", set(), every=False)) == [every[-1]]


def test_the_matrix_keeps_only_checkpoints_with_the_required_capabilities():
    wanted = {"contiguous_cache"}
    expected = [point.number for point in chapters.checkpoints()[1:] if wanted <= point.capabilities]
    assert numbers(checkpoints_for("ch02_kv_cache", wanted, every=True)) == expected
    assert 5 not in expected  # chapter 05 replaced the contiguous caches by a paged pool
