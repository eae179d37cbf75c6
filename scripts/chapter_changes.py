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
        for name in sorted(old.keys() | new.keys()):
            if old.get(name) != new.get(name):
                status = "added" if name not in old else "removed" if name not in new else "changed"
                lines.append(f"{after.name}  {status}  {name}\n")
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
