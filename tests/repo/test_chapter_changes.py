"""Each chapter touches the files it is about: its list of changed files is committed and reviewed."""

import difflib
import importlib.util
from pathlib import Path

import chapters

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("chapter_changes", ROOT / "scripts" / "chapter_changes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_files_each_chapter_changed_are_the_committed_list():
    script = load_script()
    points = chapters.checkpoints()
    present = {point.name for point in points}  # at a chapter's tag, the later chapters are not there yet
    expected = "".join(
        line for line in script.EXPECTED.read_text().splitlines(True) if line.split()[0] in present | {"#"}
    )
    found = script.chapter_changes(points)
    diff = "".join(difflib.unified_diff(expected.splitlines(True), found.splitlines(True), "committed", "found"))
    assert found == expected, (
        "a chapter changed other files than tests/repo/chapter_changes.txt lists; if that belongs to the "
        f"chapter, run `python scripts/chapter_changes.py --update` and commit the list:\n{diff}"
    )


def test_a_new_file_in_a_chapter_shows(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for package in (one, two):
        package.mkdir()
        (package / "llm.py").write_text("A = 1\n")
    (two / "llm.py").write_text("A = 2\n")
    (two / "pool.py").write_text("")
    points = [
        chapters.Checkpoint(1, "one", "ch01_one", "x", one, frozenset()),
        chapters.Checkpoint(2, "two", "ch02_two", "y", two, frozenset()),
    ]
    listing = load_script().chapter_changes(points)
    assert listing.splitlines()[1:] == ["ch02_two  changed  llm.py", "ch02_two  added  pool.py"]
