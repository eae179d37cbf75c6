"""Create the local tags ch01 ... chNN: the repository as it stood after each chapter.

Run from inside the repository: `python3 scripts/make_tags.py` (or `make tags`), then `git checkout ch03`.

The tags point at a linear series of synthetic commits built from HEAD's committed tree alone (uncommitted
changes are ignored). Commit k holds HEAD's tree with:
  - `rosellm/` replaced by `chapters/chk_slug/rosellm/` (the latest chapter keeps `rosellm/` as it is);
  - `chapters/chj_*` removed for j >= k (so `chapters/` holds exactly the earlier checkpoints);
  - `tests/chj_*`, `notebooks/chj_*` and `docs/chapters/chj_*` removed for j > k, and so are the benchmark
    workloads of chapter j (the modules under `benchmarks/` that declare `CHAPTER = j`);
  - `mkdocs.yml` without the nav lines that point at the removed chapter pages and notebooks.
Commit k's parent is commit k-1; ch01 is a root commit (no parent), so the series stands on its own and
`git log ch03` shows exactly three chapters. Author, committer and dates are HEAD's committer's, so the same
HEAD always gives the same commits, and re-running only moves the tags when HEAD moved.

Only git plumbing runs, against a temporary index file: the working tree, the real index and HEAD are left
alone. The one write besides the tags is the objects (trees, commits, the rewritten mkdocs.yml blob).
Standard library only, Python 3.10+.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

CHAPTER_DIR = re.compile(r"ch(\d+)_([A-Za-z0-9_]+)$")
CHAPTER_DECLARATION = re.compile(r'^__chapter__\s*=\s*["\'](\d+)_([A-Za-z0-9_]+)["\']', re.MULTILINE)
# Paths of per-chapter material, removed from commit k when their chapter j is later than k.
LATER_MATERIAL = re.compile(r"^(?:tests|notebooks|docs/chapters)/ch(\d+)_")
FROZEN_CHECKPOINT = re.compile(r"^chapters/ch(\d+)_")
# A benchmark workload says which chapter it belongs to: `CHAPTER = 3` at the start of a line of its module.
WORKLOAD_CHAPTER = re.compile(r"^CHAPTER = (\d+)\b", re.MULTILINE)
# A chapter page or notebook named in mkdocs.yml: chapters/ch02_kv_cache.md, notebooks/ch02_kv_cache.ipynb.
NAV_CHAPTER_PAGE = re.compile(r"\bch(\d+)_[\w-]*\.(?:md|ipynb)\b")


class Refusal(Exception):
    """The repository is not in a state tags can be made from; the message says why."""


@dataclass(frozen=True)
class Chapter:
    number: int
    slug: str

    @property
    def tag(self) -> str:
        return f"ch{self.number:02d}"

    @property
    def dirname(self) -> str:
        return f"ch{self.number:02d}_{self.slug}"


# --- git ------------------------------------------------------------------------------------------


def git_output(*args: str, env: dict | None = None, stdin: bytes | None = None) -> bytes:
    """Run git in the current directory and return its stdout as it is; raise on failure."""
    result = subprocess.run(["git", *args], input=stdin, capture_output=True, env=env)
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip()
        raise subprocess.CalledProcessError(result.returncode, ["git", *args], stderr=message)
    return result.stdout


def git(*args: str, env: dict | None = None, stdin: bytes | None = None) -> str:
    """Run git in the current directory and return its stdout, decoded and stripped."""
    return git_output(*args, env=env, stdin=stdin).decode().strip()


def git_paths(*args: str, env: dict | None = None) -> list[str]:
    """The NUL-separated records a `-z` git command prints."""
    return [record for record in git_output(*args, env=env).decode().split("\0") if record]


def enter_repository_root() -> None:
    """Change to the top of the repository around the current directory, so paths are root-relative."""
    try:
        os.chdir(git("rev-parse", "--show-toplevel"))
    except (subprocess.CalledProcessError, FileNotFoundError):
        raise Refusal("not inside a git repository (run it from the rosellm checkout)") from None


def head_commit() -> str:
    """HEAD's commit id; refuses before the first commit."""
    try:
        return git("rev-parse", "--verify", "--quiet", "HEAD^{commit}")
    except subprocess.CalledProcessError:
        raise Refusal("HEAD has no commit yet: commit something first") from None


def tree_entries(treeish: str) -> dict[str, tuple[str, str, str]]:
    """name -> (mode, type, object id) for the direct entries of a tree, or {} where there is none."""
    try:
        records = git_paths("ls-tree", "-z", treeish)
    except subprocess.CalledProcessError:
        return {}
    entries = {}
    for record in records:
        meta, name = record.split("\t", 1)
        mode, kind, oid = meta.split()
        entries[name] = (mode, kind, oid)
    return entries


def committer_env(commit: str) -> dict:
    """An environment in which new commits carry `commit`'s committer as author and committer, and its date."""
    name, email, date = git("log", "-1", "--format=%cn%x00%ce%x00%cd", "--date=raw", commit).split("\0")
    env = dict(os.environ)
    for role in ("AUTHOR", "COMMITTER"):
        env[f"GIT_{role}_NAME"] = name
        env[f"GIT_{role}_EMAIL"] = email
        env[f"GIT_{role}_DATE"] = date
    return env


# --- the chapters ---------------------------------------------------------------------------------


def latest_chapter(head: str) -> Chapter:
    """The chapter `rosellm/__init__.py` declares in HEAD's tree."""
    if tree_entries(head).get("rosellm", ("", ""))[1] != "tree":
        raise Refusal("HEAD's tree has no rosellm/ directory: is this the rosellm repository?")
    try:
        source = git("show", f"{head}:rosellm/__init__.py")
    except subprocess.CalledProcessError:
        raise Refusal("HEAD's tree has no rosellm/__init__.py") from None
    match = CHAPTER_DECLARATION.search(source)
    if not match:
        raise Refusal('rosellm/__init__.py declares no __chapter__ = "NN_slug"')
    return Chapter(int(match.group(1)), match.group(2))


def frozen_chapters(head: str, latest: Chapter) -> list[Chapter]:
    """Chapters 1 .. latest-1 from HEAD's `chapters/chNN_slug/rosellm/`; refuses when one is missing."""
    found: dict[int, Chapter] = {}
    for name, (_, kind, _) in tree_entries(f"{head}:chapters").items():
        match = CHAPTER_DIR.match(name)
        if kind != "tree" or not match:
            continue
        chapter = Chapter(int(match.group(1)), match.group(2))
        if tree_entries(f"{head}:chapters/{name}").get("rosellm", ("", ""))[1] != "tree":
            raise Refusal(f"chapters/{name}/ has no rosellm/ checkpoint")
        if chapter.number in found or chapter.number >= latest.number:
            raise Refusal(
                f"chapters/{name}/ clashes with another checkpoint or with rosellm/ (chapter {latest.dirname})"
            )
        found[chapter.number] = chapter
    missing = [f"{n:02d}" for n in range(1, latest.number) if n not in found]
    if missing:
        raise Refusal(f"no frozen checkpoint chapters/chNN_slug/rosellm/ for chapter {', '.join(missing)}")
    return [found[n] for n in range(1, latest.number)]


def workload_chapters(head: str) -> dict[str, int]:
    """Path -> chapter of each module directly under HEAD's `benchmarks/` that declares `CHAPTER = N`."""
    found = {}
    for name, (_, kind, oid) in tree_entries(f"{head}:benchmarks").items():
        if kind == "blob" and name.endswith(".py"):
            match = WORKLOAD_CHAPTER.search(git_output("cat-file", "blob", oid).decode(errors="replace"))
            if match:
                found[f"benchmarks/{name}"] = int(match.group(1))
    return found


# --- one chapter's tree ---------------------------------------------------------------------------


def is_removed(path: str, chapter: int, latest: int, workloads: dict[str, int] | None = None) -> bool:
    """Whether `path` (from HEAD's tree) is absent from chapter `chapter`'s commit; `workloads` maps the
    benchmark workloads' paths to their chapters."""
    if chapter < latest and path.startswith("rosellm/"):
        return True
    frozen = FROZEN_CHECKPOINT.match(path)
    if frozen and int(frozen.group(1)) >= chapter:
        return True
    if (workloads or {}).get(path, 0) > chapter:
        return True
    later = LATER_MATERIAL.match(path)
    return bool(later and int(later.group(1)) > chapter)


def filter_mkdocs_nav(text: str, chapter: int) -> str:
    """`mkdocs.yml` without the lines naming a page or notebook `chNN_slug.md|.ipynb` with NN > chapter."""
    kept = [
        line
        for line in text.splitlines(keepends=True)
        if not any(int(page.group(1)) > chapter for page in NAV_CHAPTER_PAGE.finditer(line))
    ]
    return "".join(kept)


def chapter_tree(head: str, chapter: Chapter, latest: Chapter, workloads: dict[str, int], index_env: dict) -> str:
    """Write the tree of `chapter`'s commit (see the module docstring) through a temporary index."""
    git("read-tree", head, env=index_env)
    paths = git_paths("ls-files", "-z", env=index_env)
    removed = [path for path in paths if is_removed(path, chapter.number, latest.number, workloads)]
    if removed:
        git("update-index", "-z", "--force-remove", "--stdin", env=index_env, stdin="\0".join(removed).encode())
    if chapter.number < latest.number:
        checkpoint = f"{head}:chapters/{chapter.dirname}/rosellm"
        git("read-tree", "--prefix=rosellm/", checkpoint, env=index_env)
    mkdocs = tree_entries(head).get("mkdocs.yml")
    if mkdocs:
        mode, _, oid = mkdocs
        text = git_output("cat-file", "blob", oid).decode()
        filtered = filter_mkdocs_nav(text, chapter.number)
        if filtered != text:
            blob = git("hash-object", "-w", "--stdin", stdin=filtered.encode())
            git("update-index", "--cacheinfo", f"{mode},{blob},mkdocs.yml", env=index_env)
    return git("write-tree", env=index_env)


def chapter_commit(tree: str, parent: str | None, chapter: Chapter, head: str, env: dict) -> str:
    """Commit `tree` on top of `parent` (None: a root commit) with the chapter's generated message."""
    message = f"{chapter.tag}: {chapter.slug} (generated by scripts/make_tags.py from {head})\n"
    parents = ["-p", parent] if parent else []
    return git("commit-tree", "--no-gpg-sign", tree, *parents, env=env, stdin=message.encode())


# --- main -----------------------------------------------------------------------------------------


def make_tags() -> list[tuple[Chapter, str]]:
    """Create or move the tags ch01 .. chNN; return (chapter, commit) for each.

    Every commit is made before any tag moves, so a failure leaves the old tags as they were.
    """
    enter_repository_root()
    head = head_commit()
    latest = latest_chapter(head)
    chapters = [*frozen_chapters(head, latest), latest]
    workloads = workload_chapters(head)
    commit_env = committer_env(head)
    made = []
    parent = None
    with tempfile.TemporaryDirectory(prefix="make_tags-") as scratch:
        index_env = {**os.environ, "GIT_INDEX_FILE": os.path.join(scratch, "index")}
        for chapter in chapters:
            tree = chapter_tree(head, chapter, latest, workloads, index_env)
            parent = chapter_commit(tree, parent, chapter, head, commit_env)
            made.append((chapter, parent))
    for chapter, commit in made:
        git("tag", "-f", "--no-sign", chapter.tag, commit)
    return made


def main() -> int:
    try:
        made = make_tags()
    except Refusal as refusal:
        print(f"make_tags.py: {refusal}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as error:
        print(f"make_tags.py: {' '.join(error.cmd)} failed: {error.stderr}", file=sys.stderr)
        return 1
    for chapter, commit in made:
        print(f"{chapter.tag}  {commit[:12]}  {chapter.dirname}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
