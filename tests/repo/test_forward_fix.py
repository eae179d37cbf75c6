"""scripts/forward_fix.py on a throwaway repository of three small checkpoints (the real chapters helper)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = [
    ("ch01_one", "chapters/ch01_one/rosellm"),
    ("ch02_two", "chapters/ch02_two/rosellm"),
    ("ch03_three", "rosellm"),
]


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path) -> Path:
    """chapters 1 and 2 frozen, chapter 3 as rosellm/; `shared.py` is the same in all three, `drift.py` was
    changed by chapter 3, and everything is committed."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "forward_fix.py", tmp_path / "scripts")
    (tmp_path / "chapters").mkdir()
    shutil.copy(ROOT / "chapters" / "__init__.py", tmp_path / "chapters")
    for name, folder in CHAPTERS:
        package = tmp_path / folder
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(f'__chapter__ = "{name[2:]}"\n__capabilities__ = frozenset()\n')
        (package / "shared.py").write_text("LIMIT = 1\n")
        (package / "drift.py").write_text("VALUE = 3\n" if name == "ch03_three" else "VALUE = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "-c", "user.name=Test", "-c", "user.email=test@example.com", "commit", "-q", "-m", "three")
    return tmp_path


def forward_fix(repo: Path, *args: str) -> subprocess.CompletedProcess:
    script = repo / "scripts" / "forward_fix.py"
    return subprocess.run([sys.executable, str(script), *args], cwd=repo, capture_output=True, text=True)


def contents(repo: Path, relative: str) -> list[str | None]:
    files = [repo / folder / relative for _, folder in CHAPTERS]
    return [path.read_text() if path.is_file() else None for path in files]


def test_a_fix_reaches_every_later_copy_that_was_identical(repo):
    (repo / "chapters/ch01_one/rosellm/shared.py").write_text("LIMIT = 2\n")
    done = forward_fix(repo, "ch01")
    assert done.returncode == 0, done.stdout + done.stderr
    assert contents(repo, "shared.py") == ["LIMIT = 2\n"] * 3


def test_a_copy_that_had_changed_is_left_alone_and_reported(repo):
    (repo / "chapters/ch01_one/rosellm/drift.py").write_text("VALUE = 2\n")
    done = forward_fix(repo, "chapters/ch01_one/rosellm/drift.py")
    assert done.returncode == 1
    assert contents(repo, "drift.py") == ["VALUE = 2\n", "VALUE = 2\n", "VALUE = 3\n"]
    assert "DIFFERS        rosellm/drift.py" in done.stdout


def test_new_and_deleted_files_travel_too(repo):
    (repo / "chapters/ch02_two/rosellm/added.py").write_text("NEW = True\n")
    (repo / "chapters/ch02_two/rosellm/shared.py").unlink()
    done = forward_fix(repo, "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert contents(repo, "added.py") == [None, "NEW = True\n", "NEW = True\n"]
    assert contents(repo, "shared.py") == ["LIMIT = 1\n", None, None]


def test_a_committed_fix_with_base_and_a_dry_run(repo):
    (repo / "chapters/ch01_one/rosellm/shared.py").write_text("LIMIT = 5\n")
    git(repo, "-c", "user.name=Test", "-c", "user.email=test@example.com", "commit", "-qam", "fix")
    dry = forward_fix(repo, "ch01_one", "--base", "HEAD~1", "--dry-run")
    assert dry.returncode == 0 and "would fix" in dry.stdout
    assert contents(repo, "shared.py") == ["LIMIT = 5\n", "LIMIT = 1\n", "LIMIT = 1\n"]
    assert forward_fix(repo, "ch01_one", "--base", "HEAD~1").returncode == 0
    assert contents(repo, "shared.py") == ["LIMIT = 5\n"] * 3


def test_an_unknown_chapter_is_refused(repo):
    done = forward_fix(repo, "ch09")
    assert done.returncode == 2 and "no checkpoint 'ch09'" in done.stderr


@pytest.fixture
def moved_repo(repo) -> Path:
    """The same three checkpoints, chapter 3 with subpackages: `shared.py` moved unchanged to `core/`,
    `drift.py` to `engine/`, as its `__modules__` says."""
    package = repo / "rosellm"
    for name, folder in (("shared", "core"), ("drift", "engine")):
        (package / folder).mkdir()
        (package / folder / "__init__.py").write_text(f'"""The {folder}."""\n')
        git(repo, "mv", f"rosellm/{name}.py", f"rosellm/{folder}/{name}.py")
    modules = '__modules__ = {"shared": "core.shared", "drift": "engine.drift"}\n'
    (package / "__init__.py").write_text('__chapter__ = "03_three"\n__capabilities__ = frozenset()\n' + modules)
    git(repo, "add", ".")
    git(repo, "-c", "user.name=Test", "-c", "user.email=test@example.com", "commit", "-q", "-m", "move")
    return repo


def test_a_fix_of_a_flat_chapter_reaches_the_moved_file(moved_repo):
    (moved_repo / "chapters/ch01_one/rosellm/shared.py").write_text("LIMIT = 2\n")
    done = forward_fix(moved_repo, "ch01")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rosellm/core/shared.py" in done.stdout
    assert (moved_repo / "rosellm/core/shared.py").read_text() == "LIMIT = 2\n"
    assert not (moved_repo / "rosellm/shared.py").exists()
    assert contents(moved_repo, "shared.py")[:2] == ["LIMIT = 2\n"] * 2


def test_a_moved_file_that_had_changed_is_reported_at_its_new_path(moved_repo):
    (moved_repo / "chapters/ch02_two/rosellm/drift.py").write_text("VALUE = 2\n")
    done = forward_fix(moved_repo, "ch02")
    assert done.returncode == 1
    assert "DIFFERS        rosellm/engine/drift.py" in done.stdout
    assert (moved_repo / "rosellm/engine/drift.py").read_text() == "VALUE = 3\n"
