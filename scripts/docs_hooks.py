"""mkdocs hook: generate "what changed" sections from the chapter checkpoints at build time.

A line of its own in a page

    <!-- chapter-diff: ch01_naive_decode ch02_kv_cache -->   a unified diff of the two checkpoints
    <!-- chapter-files: ch01_naive_decode -->                the files of one checkpoint

is replaced by generated Markdown: the diff is a table of the files that differ, each linked to its own
fold (a closed `<details>` block), so that the lesson is not buried under hundreds of diff lines.
A figure on a line of its own, `![alt](path.png)`, becomes a link to the full-size image.

A checkpoint `chNN_slug` is `chapters/chNN_slug/rosellm/` when that
folder exists, else `rosellm/` when its `__init__.py` says `__chapter__ = "NN_slug"` (the latest chapter).
"""

import ast
import difflib
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^<!--\s*chapter-(diff|files):\s*([\w\s]+?)\s*-->[ \t]*$", re.MULTILINE)
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

    return FIGURE.sub(linked_figure, MARKER.sub(expand, markdown))


def linked_figure(match: re.Match) -> str:
    """A figure that opens at full size when clicked."""
    alt, src = match.groups()
    return f'[![{alt}]({src})]({src} "open the full-size figure"){{ .figure-link }}'


# --- checkpoints ----------------------------------------------------------------------------------------


def checkpoint_dir(root: Path, name: str) -> Path:
    """The package folder of checkpoint `name` (`chNN_slug`), as the repository's `chapters` helper finds it."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("chapters", root / "chapters" / "__init__.py")
    helper = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = helper  # where its dataclass looks itself up
    spec.loader.exec_module(helper)
    try:
        return helper.checkpoint(name).path
    except ValueError as error:
        raise PluginError(str(error)) from None


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


def chapter_diff(root: Path, old_name: str, new_name: str) -> str:
    old = checkpoint_files(checkpoint_dir(root, old_name))
    new = checkpoint_files(checkpoint_dir(root, new_name))
    rows, folds, statuses = [], [], []
    for path in sorted(old.keys() | new.keys()):
        before, after = old.get(path, []), new.get(path, [])
        if before == after:
            continue
        diff = list(
            difflib.unified_diff(before, after, f"{old_name}/rosellm/{path}", f"{new_name}/rosellm/{path}", n=3)
        )
        added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
        removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
        status = "added" if path not in old else "removed" if path not in new else "changed"
        statuses.append(status)
        rows.append(f"| [`rosellm/{path}`](#{fold_id(path)}) | {status} | +{added} | −{removed} |")
        text = "".join(line if line.endswith("\n") else line + "\n" for line in diff)
        folds.append(
            f'<details class="note chapter-diff" id="{fold_id(path)}" markdown>\n'
            f"<summary><code>rosellm/{path}</code> ({status}, +{added} −{removed})</summary>\n\n"
            f"{fenced('diff', text)}\n</details>\n"
        )
    if not rows:
        return f"*No file differs between `{old_name}` and `{new_name}`.*\n"
    summary = ", ".join(f"{statuses.count(s)} {s}" for s in ("changed", "added", "removed") if s in statuses)
    table = ["| file | status | added lines | removed lines |", "| --- | --- | ---: | ---: |", *rows]
    return (
        f"From `{old_name}` to `{new_name}`: {summary}. Each file's diff is folded below; open it from "
        "the table or by its name.\n\n" + "\n".join(table) + "\n\n" + "\n".join(folds)
    )
