"""mkdocs hook: generate the parts of the pages that the chapter checkpoints decide, at build time.

A line of its own in a page

    <!-- chapter-diff: ch01_naive_decode ch02_kv_cache -->   a unified diff of the two checkpoints
    <!-- chapter-files: ch01_naive_decode -->                the files of one checkpoint
    <!-- chapter-list -->                                    the table of chapters (scripts/chapter_list.py)
    <!-- code-location: ch07_continuous_batching -->         the sentence saying where a chapter's code is

is replaced by generated Markdown: the diff is a table of the files that differ, each linked to its own
fold (a closed `<details>` block), so that the lesson is not buried under hundreds of diff lines. From a flat
chapter to one with subpackages (chapter 17), a file is diffed against its new path, as `git diff -M` shows a
rename: a row "moved" when it moved unchanged, "moved, changed" with the lines that changed. The
code-location line may be indented (inside a note) and its sentence names `rosellm/` as the chapter's
code only while the chapter is the latest, so that a new chapter turns the old page's words by itself.
A figure on a line of its own, `![alt](path.png)`, becomes a link to the full-size image.

A checkpoint `chNN_slug` is `chapters/chNN_slug/rosellm/` when that
folder exists, else `rosellm/` when its `__init__.py` says `__chapter__ = "NN_slug"` (the latest chapter).
"""

import ast
import difflib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^<!--\s*chapter-(diff|files):\s*([\w\s]+?)\s*-->[ \t]*$", re.MULTILINE)
CHAPTER_LIST = re.compile(r"^<!--\s*chapter-list\s*-->[ \t]*$", re.MULTILINE)
CODE_LOCATION = re.compile(r"^([ \t]*)<!--\s*code-location:\s*(\w+)\s*-->[ \t]*$", re.MULTILINE)
FIGURE = re.compile(r"^!\[([^\]]*)\]\(([^)\s]+)\)[ \t]*$", re.MULTILINE)


def on_page_markdown(markdown: str, page, config, files) -> str:
    root = Path(config.config_file_path).parent

    def expand(match: re.Match) -> str:
        kind, names = match.group(1), match.group(2).split()
        where = f"{page.file.src_path}: {match.group(0)!r}"
        if kind == "diff" and len(names) == 2:
            return chapter_diff(root, *names)
        if kind == "files" and len(names) == 1:
            return chapter_files(root, names[0])
        raise PluginError(f"{where}: expected chapter-diff OLD NEW or chapter-files NAME")

    def locate(match: re.Match) -> str:
        return match.group(1) + code_location(chapters_helper(root).checkpoints(), match.group(2))

    def listed(match: re.Match) -> str:
        return load_script(root, "chapter_list").chapter_table(root, chapters_helper(root).checkpoints(), "chapters")

    try:
        markdown = CHAPTER_LIST.sub(listed, CODE_LOCATION.sub(locate, markdown))
    except ValueError as error:
        raise PluginError(f"{page.file.src_path}: {error}") from None
    return FIGURE.sub(linked_figure, MARKER.sub(expand, markdown))


def linked_figure(match: re.Match) -> str:
    """A figure that opens at full size when clicked."""
    alt, src = match.groups()
    return f'[![{alt}]({src})]({src} "open the full-size figure"){{ .figure-link }}'


# --- checkpoints ----------------------------------------------------------------------------------------


def load_module(name: str, path: Path) -> ModuleType:
    """The module at `path`, loaded afresh (so that `mkdocs serve` sees edits) without replacing the module
    of that name the running process may have imported."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    previous = sys.modules.get(name)
    sys.modules[name] = module  # where a dataclass of the module looks itself up while it is made
    try:
        spec.loader.exec_module(module)
    finally:
        if previous is None:
            del sys.modules[name]
        else:
            sys.modules[name] = previous
    return module


def chapters_helper(root: Path) -> ModuleType:
    """The repository's `chapters` helper (chapters/__init__.py)."""
    return load_module("chapters", root / "chapters" / "__init__.py")


def load_script(root: Path, name: str) -> ModuleType:
    return load_module(name, root / "scripts" / f"{name}.py")


def checkpoint_dir(root: Path, name: str) -> Path:
    """The package folder of checkpoint `name` (`chNN_slug`), as the repository's `chapters` helper finds it."""
    return checkpoint_of(root, name).path


def code_location(points, name: str) -> str:
    """Where chapter `name`'s code is, given every checkpoint in order (the latest last): `rosellm/` for the
    latest chapter, its frozen copy for the others."""
    by_name = {point.name: point for point in points}
    if name not in by_name:
        raise ValueError(f"code-location names no checkpoint {name!r}; there are: {', '.join(by_name)}")
    point, latest = by_name[name], points[-1]
    if point == latest and len(points) == 1:
        return "This chapter's code is `rosellm/`, the latest checkpoint."
    if point == latest:
        before = points[-2]
        return (
            f"This chapter's code is `rosellm/`, the latest checkpoint; chapter {before.number:02d} is frozen in "
            f"`chapters/{before.name}/rosellm/`."
        )
    tag = f"ch{point.number:02d}"
    return (
        f"This chapter's code is frozen in `chapters/{name}/rosellm/` (the latest checkpoint, chapter "
        f"{latest.number:02d}'s, is `rosellm/`); it is importable as `chapters.{name}.rosellm`, and at git tag "
        f"`{tag}` (`make tags && git checkout {tag}`) it is `rosellm/` itself."
    )


def checkpoint_files(folder: Path) -> dict[str, list[str]]:
    """Relative path -> lines, for every file of the checkpoint except caches."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            found[path.relative_to(folder).as_posix()] = path.read_text().splitlines(keepends=True)
    return found


def summary_line(lines: list[str]) -> str:
    """The first paragraph of a module docstring, on one line."""
    try:
        doc = ast.get_docstring(ast.parse("".join(lines))) or ""
    except SyntaxError:
        return ""
    return " ".join(doc.split("\n\n")[0].split())


def fenced(language: str, text: str) -> str:
    """A code block whose fence is longer than any run of backticks inside it."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{language}\n{text.rstrip()}\n{fence}\n"


# --- generated Markdown -----------------------------------------------------------------------------


def chapter_files(root: Path, name: str) -> str:
    files = checkpoint_files(checkpoint_dir(root, name))
    rows = [
        f"| `rosellm/{path}` | {len(lines)} | {summary_line(lines) if path.endswith('.py') else ''} |"
        for path, lines in files.items()
    ]
    total = sum(len(lines) for lines in files.values())
    header = ["| file | lines | what it is |", "| --- | ---: | --- |"]
    return "\n".join(header + rows + [f"| **total** | **{total}** | |"]) + "\n"


def fold_id(path: str) -> str:
    return "diff-" + re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def checkpoint_of(root: Path, name: str):
    """The `chapters.Checkpoint` named `name` (`chNN_slug`)."""
    try:
        return chapters_helper(root).checkpoint(name)
    except ValueError as error:
        raise PluginError(str(error)) from None


def paired_paths(old_point, new_point, old: dict, new: dict) -> list[tuple[str | None, str | None]]:
    """(old path, new path) of every file of either checkpoint; None where it has none. From a flat chapter
    to one with subpackages, a file is paired with its new path (the new checkpoint's `__modules__`), as
    `git diff -M` pairs a renamed file."""
    moving = bool(new_point.renames) and not old_point.renames
    pairs = []
    for path in old:
        place = new_point.file_path(path) if moving else path
        pairs.append((path, place if place in new else None))
    paired = {after for _, after in pairs}
    pairs += [(None, path) for path in new if path not in paired]
    return sorted(pairs, key=lambda pair: pair[1] or pair[0])


def chapter_diff(root: Path, old_name: str, new_name: str) -> str:
    old_point, new_point = checkpoint_of(root, old_name), checkpoint_of(root, new_name)
    old, new = checkpoint_files(old_point.path), checkpoint_files(new_point.path)
    rows, folds, statuses = [], [], []
    for before_path, after_path in paired_paths(old_point, new_point, old, new):
        before, after = old.get(before_path, []), new.get(after_path, [])
        moved = None not in (before_path, after_path) and before_path != after_path
        if before == after and not moved:
            continue
        path = after_path or before_path
        shown = f"`rosellm/{before_path}` → `rosellm/{after_path}`" if moved else f"`rosellm/{path}`"
        diff = list(
            difflib.unified_diff(
                before, after, f"{old_name}/rosellm/{before_path or path}", f"{new_name}/rosellm/{path}", n=3
            )
        )
        added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
        removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
        status = "added" if before_path is None else "removed" if after_path is None else "changed"
        if moved:
            status = "moved, changed" if diff else "moved"
        statuses.append(status)
        if not diff:  # a file moved as it was: its row says so, there is nothing to fold
            rows.append(f"| {shown} | {status} | +0 | −0 |")
            continue
        rows.append(f"| [{shown}](#{fold_id(path)}) | {status} | +{added} | −{removed} |")
        text = "".join(line if line.endswith("\n") else line + "\n" for line in diff)
        folds.append(
            f'<details class="note chapter-diff" id="{fold_id(path)}" markdown>\n'
            f"<summary><code>rosellm/{path}</code> ({status}, +{added} −{removed})</summary>\n\n"
            f"{fenced('diff', text)}\n</details>\n"
        )
    if not rows:
        return f"*No file differs between `{old_name}` and `{new_name}`.*\n"
    kinds = ("changed", "added", "removed", "moved", "moved, changed")
    summary = ", ".join(f"{statuses.count(s)} {s}" for s in kinds if s in statuses)
    table = ["| file | status | added lines | removed lines |", "| --- | --- | ---: | ---: |", *rows]
    return (
        f"From `{old_name}` to `{new_name}`: {summary}. Each file's diff is folded below; open it from "
        "the table or by its name.\n\n" + "\n".join(table) + "\n\n" + "\n".join(folds)
    )
