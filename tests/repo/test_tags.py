"""`make tags` (scripts/make_tags.py), checked in a throwaway clone of this repository.

The clone holds only committed files: the tags are built from HEAD's tree, never from the working tree.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.repo

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "make_tags.py"
CHAPTER_ENTRY = re.compile(r"ch(\d+)_")
WORKLOAD_CHAPTER = re.compile(r"^CHAPTER = (\d+)\b", re.MULTILINE)


def load_make_tags():
    """scripts/make_tags.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location("make_tags", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def make_tags(cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT)], cwd=cwd, capture_output=True, text=True, env={**os.environ, **env}
    )


def clone_repository(dest: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True, capture_output=True)
    return dest


def declared_chapter(init_source: str) -> int:
    return int(re.search(r'__chapter__ = "(\d+)_', init_source).group(1))


def chapter_numbers(names: str) -> set[int]:
    """The chapter numbers of the `chNN_*` names in a newline-separated listing."""
    return {int(m.group(1)) for name in names.splitlines() if (m := CHAPTER_ENTRY.match(Path(name).name))}


def workload_chapters(clone: Path, treeish: str) -> dict[str, int]:
    """Benchmark module name -> the chapter it declares, for the modules of `treeish` that declare one."""
    found = {}
    for name in git(clone, "ls-tree", "--name-only", treeish, "benchmarks/").splitlines():
        if name.endswith(".py") and (match := WORKLOAD_CHAPTER.search(git(clone, "show", f"{treeish}:{name}"))):
            found[name] = int(match.group(1))
    return found


def tags_of(latest: int) -> list[str]:
    return [f"ch{k:02d}" for k in range(1, latest + 1)]


@pytest.fixture(scope="module")
def tagged(tmp_path_factory):
    """A clone with the tags made: .path, .latest (HEAD's chapter number), .head, .output."""
    clone = clone_repository(tmp_path_factory.mktemp("tags") / "clone")
    latest = declared_chapter((clone / "rosellm" / "__init__.py").read_text())
    result = make_tags(clone)
    assert result.returncode == 0, result.stderr
    return SimpleNamespace(path=clone, latest=latest, head=git(clone, "rev-parse", "HEAD"), output=result.stdout)


def test_every_chapter_has_a_tag(tagged):
    tags = tags_of(tagged.latest)
    for tag in tags:
        git(tagged.path, "rev-parse", "--verify", f"{tag}^{{commit}}")
    printed = [line.split()[0] for line in tagged.output.splitlines()]
    assert printed == tags


def test_tags_form_a_linear_chain(tagged):
    parent = None
    for tag in tags_of(tagged.latest):
        commit, *parents = git(tagged.path, "rev-list", "--parents", "-n", "1", tag).split()
        assert parents == ([parent] if parent else []), tag
        parent = commit
    assert git(tagged.path, "rev-list", "--count", parent) == str(tagged.latest)


def test_each_tag_holds_its_checkpoint_and_only_earlier_chapters(tagged):
    clone, head = tagged.path, tagged.head
    for k, tag in enumerate(tags_of(tagged.latest), start=1):
        assert declared_chapter(git(clone, "show", f"{tag}:rosellm/__init__.py")) == k, tag
        assert chapter_numbers(git(clone, "ls-tree", "--name-only", tag, "chapters/")) == set(range(1, k))
        for folder in ("tests/", "notebooks/", "docs/chapters/"):
            later = chapter_numbers(git(clone, "ls-tree", "--name-only", tag, folder)) - set(range(1, k + 1))
            assert not later, f"{tag} still has {folder} of chapters {sorted(later)}"
        if k < tagged.latest:
            entries = git(clone, "ls-tree", "--name-only", head, "chapters/").splitlines()
            (frozen,) = [entry for entry in entries if Path(entry).name.startswith(f"ch{k:02d}_")]
            expected = git(clone, "rev-parse", f"{head}:{frozen}/rosellm")
        else:
            expected = git(clone, "rev-parse", f"{head}:rosellm")
        assert git(clone, "rev-parse", f"{tag}:rosellm") == expected, tag
        expected_workloads = {name: n for name, n in workload_chapters(clone, head).items() if n <= k}
        assert workload_chapters(clone, tag) == expected_workloads, tag


def test_rerunning_gives_the_same_tags(tmp_path):
    clone = clone_repository(tmp_path / "clone")
    latest = declared_chapter((clone / "rosellm" / "__init__.py").read_text())
    tags = tags_of(latest)

    def targets():
        assert make_tags(clone).returncode == 0
        return [git(clone, "rev-parse", f"{tag}^{{tree}}", tag) for tag in tags]

    first = targets()
    assert targets() == first  # trees, and commits too: the script reuses HEAD's committer and date


@pytest.mark.parametrize("tag", ["ch02"])  # its fast tests include chapter 01's; every tag's tree is checked above
def test_at_a_tag_rosellm_is_its_checkpoint_and_the_fast_tests_pass(tagged, tag, tmp_path):
    """`make test` without the model tests and the notebooks, in a worktree of the tag: no test, workload or
    page of a later chapter is left behind to fail there."""
    worktree = tmp_path / tag
    git(tagged.path, "worktree", "add", "-q", "--detach", str(worktree), tag)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}

    def python(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], cwd=worktree, capture_output=True, text=True, env=env)

    imported = python("-c", "import rosellm, chapters; print(rosellm.__file__, chapters.latest().name)")
    assert imported.returncode == 0, imported.stderr
    module_file, latest = imported.stdout.split()
    assert Path(module_file).resolve().is_relative_to(worktree.resolve())
    assert latest.startswith(f"{tag}_")

    tests = python("-m", "pytest", "-q", "-x", "-m", "not model and not repo", "-p", "no:cacheprovider", "tests")
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert f"tests/{tag}_" in python("-m", "pytest", "--collect-only", "-q", "tests").stdout
    book = python("-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path / "site"))
    assert book.returncode == 0, book.stderr[-3000:]


def test_refuses_outside_a_repository(tmp_path):
    outside = tmp_path / "not-a-repo"
    outside.mkdir()
    result = make_tags(outside, GIT_CEILING_DIRECTORIES=str(tmp_path))
    assert result.returncode == 1
    assert "not inside a git repository" in result.stderr


def test_refuses_a_repository_without_rosellm(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "README.md").write_text("not rosellm\n")
    git(tmp_path, "add", "README.md")
    git(tmp_path, "-c", "user.name=Test", "-c", "user.email=test@example.com", "commit", "-q", "-m", "init")
    result = make_tags(tmp_path)
    assert result.returncode == 1
    assert "no rosellm/" in result.stderr
    assert git(tmp_path, "tag") == ""


def test_filter_mkdocs_nav_drops_only_later_chapter_pages_and_notebooks():
    mkdocs = (
        "site_name: rosellm\n"
        "nav:\n"
        "  - Home: index.md\n"
        "  - Chapters:\n"
        '      - "01 naive decode": chapters/ch01_naive_decode.md\n'
        "      - chapters/ch02_kv_cache.md\n"
        "      - '03': chapters/ch03_batch_decode.md\n"
        "  - Notebooks:\n"
        '      - "01 · Naive decode": notebooks/ch01_naive_decode.ipynb\n'
        "      - notebooks/ch02_kv_cache.ipynb\n"
        "  - Benchmarks: benchmarks.md\n"
        "watch:\n"
        "  - chapters\n"
    )
    filtered = load_make_tags().filter_mkdocs_nav(mkdocs, 1)
    assert filtered == (
        "site_name: rosellm\n"
        "nav:\n"
        "  - Home: index.md\n"
        "  - Chapters:\n"
        '      - "01 naive decode": chapters/ch01_naive_decode.md\n'
        "  - Notebooks:\n"
        '      - "01 · Naive decode": notebooks/ch01_naive_decode.ipynb\n'
        "  - Benchmarks: benchmarks.md\n"
        "watch:\n"
        "  - chapters\n"
    )
    assert load_make_tags().filter_mkdocs_nav(mkdocs, 3) == mkdocs


def test_is_removed_at_chapter_two_of_three():
    is_removed = load_make_tags().is_removed
    removed = [
        "rosellm/llm.py",
        "chapters/ch02_kv_cache/rosellm/llm.py",
        "tests/ch03_batch_decode/test_x.py",
        "notebooks/ch03_batch_decode.ipynb",
        "docs/chapters/ch03_batch_decode.md",
    ]
    kept = [
        "chapters/__init__.py",
        "chapters/ch01_naive_decode/rosellm/llm.py",
        "tests/ch02_kv_cache/test_x.py",
        "tests/conftest.py",
        "notebooks/ch02_kv_cache.ipynb",
        "docs/index.md",
        "mkdocs.yml",
    ]
    workloads = {"benchmarks/arrivals.py": 3, "benchmarks/decode_scaling.py": 2}
    assert all(is_removed(path, 2, 3, workloads) for path in [*removed, "benchmarks/arrivals.py"])
    assert not any(
        is_removed(path, 2, 3, workloads) for path in [*kept, "benchmarks/decode_scaling.py", "benchmarks/harness.py"]
    )
    assert not is_removed("rosellm/llm.py", 3, 3)
