"""What each chapter changed: the files of its checkpoint that differ from the previous checkpoint's.

    python scripts/chapter_changes.py            # print the list
    python scripts/chapter_changes.py --update   # write it to tests/repo/chapter_changes.txt

`tests/repo/test_chapter_changes.py` compares the list with that committed file, so a chapter that starts
touching another file shows in review: update the file on purpose when the change belongs to the chapter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPECTED = ROOT / "tests" / "repo" / "chapter_changes.txt"
HEADER = "# chapter  status  file (inside rosellm/), against the previous checkpoint: scripts/chapter_changes.py\n"


def package_files(package: Path) -> dict[str, bytes]:
    """Relative path -> content of every file of a checkpoint, caches left out."""
    return {
        path.relative_to(package).as_posix(): path.read_bytes()
        for path in sorted(package.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def chapter_changes(checkpoints: list) -> str:
    """One line per file a chapter added, changed or removed, in chapter order, under the header."""
    lines = [HEADER]
    for before, after in zip(checkpoints, checkpoints[1:]):
        old, new = package_files(before.path), package_files(after.path)
        moved = {name: after.file_path(name) for name in old} if not before.renames else {name: name for name in old}
        found = {}
        for name in old:
            place = moved[name]
            if place != name and place in new:  # a flat file at its path in the subpackages (chapter 17)
                found[name] = f"{'moved' if old[name] == new[place] else 'moved, changed'}  {name} -> {place}"
            elif old[name] != new.get(name):
                found[name] = f"{'removed' if name not in new else 'changed'}  {name}"
        for name in new.keys() - {name for name in old if moved[name] == name} - set(moved.values()):
            found[name] = f"added  {name}"
        lines += [f"{after.name}  {found[name]}\n" for name in sorted(found)]
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help=f"write the list to {EXPECTED.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # the repository's `chapters` helper finds the checkpoints
    import chapters

    listing = chapter_changes(chapters.checkpoints())
    if args.update:
        EXPECTED.write_text(listing)
        print(f"wrote {EXPECTED.relative_to(ROOT)}")
    else:
        print(listing, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
