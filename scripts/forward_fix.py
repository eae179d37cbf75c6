"""Carry a fix made in one chapter checkpoint forward into every later checkpoint and `rosellm/`.

Make the fix in the frozen copy where the bug was taught, e.g. `chapters/ch03_batch_decode/rosellm/llm.py`,
then run from the repository:

    python scripts/forward_fix.py ch03                                          # every changed file of ch03
    python scripts/forward_fix.py chapters/ch03_batch_decode/rosellm/llm.py     # one file
    python scripts/forward_fix.py ch03 --base HEAD~1                            # a fix already committed

A file's change is its version at `--base` (default HEAD: the change is uncommitted) against the working
tree. Each later checkpoint whose copy of the file is still the one from before the fix gets the fixed file
(a file added or deleted by the fix is added or deleted alike); a later copy that had already changed is
left alone and reported, to be fixed by hand. Exit status 1 when anything was left to do by hand.

From chapter 17 on the package has subpackages: a file of a flat chapter (01-16) is looked for at its new
path, through the rename map the later checkpoint declares (`__modules__`, read by `chapters`), e.g.
`loader.py` in `rosellm/model_executor/model_loader/loader.py`. A file the move changed (its relative
imports) is reported, to be fixed by hand.
Standard library only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Change:
    """One file of a checkpoint, before and after the fix (None: the file does not exist)."""

    relative: str  # path inside the package, e.g. "llm.py"
    before: bytes | None
    after: bytes | None


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True)


def read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def committed(base: str, path: Path) -> bytes | None:
    """The file at `base`, or None where it does not exist there."""
    shown = git("show", f"{base}:{path.relative_to(ROOT).as_posix()}")
    return shown.stdout if shown.returncode == 0 else None


def changed_files(package: Path, base: str) -> list[Path]:
    """Files of `package` that differ from `base`: modified, deleted and new (untracked, not ignored)."""
    where = package.relative_to(ROOT).as_posix()
    listed = git("diff", "--name-only", "-z", base, "--", where).stdout + b"\0"
    listed += git("ls-files", "--others", "--exclude-standard", "-z", "--", where).stdout
    return sorted({ROOT / name for name in listed.decode().split("\0") if name})


def find_changes(target: str, base: str, chapters) -> tuple[object, list[Change]]:
    """The checkpoint a command-line target names (a chapter or a file inside one), and its changes."""
    path = (Path.cwd() / target).resolve()
    owner = next((point for point in chapters.checkpoints() if path.is_relative_to(point.path)), None)
    if owner is None or path == owner.path:
        owner = owner or chapters.checkpoint(target)
        files = changed_files(owner.path, base)
    else:
        files = [path]
    changes = [Change(file.relative_to(owner.path).as_posix(), committed(base, file), read(file)) for file in files]
    return owner, [change for change in changes if change.before != change.after]


def carry(change: Change, owner, later: list, dry_run: bool) -> list[str]:
    """Apply one change to the later checkpoints where the file was as before; return the manual cases. A
    flat owner's file is found in a later checkpoint with subpackages through that checkpoint's renames."""
    by_hand = []
    for point in later:
        target = point.path / (change.relative if owner.renames else point.file_path(change.relative))
        current = read(target)
        shown = f"{target.relative_to(ROOT)}"
        if current == change.after:
            print(f"  already fixed  {shown}")
        elif current == change.before:
            print(f"  {'would fix' if dry_run else 'fixed'}      {shown}")
            if not dry_run:
                if change.after is None:
                    target.unlink()
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(change.after)
        else:
            print(f"  DIFFERS        {shown}: it had changed before the fix; apply the fix by hand")
            by_hand.append(shown)
    return by_hand


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="a chapter (3, ch03, ch03_batch_decode) or a file inside its checkpoint")
    parser.add_argument("--base", default="HEAD", help="the commit holding the files before the fix (default HEAD)")
    parser.add_argument("--dry-run", action="store_true", help="report what would change, change nothing")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # the repository's `chapters` helper finds the checkpoints
    import chapters

    try:
        owner, changes = find_changes(args.target, args.base, chapters)
    except ValueError as error:
        print(f"forward_fix.py: {error}", file=sys.stderr)
        return 2
    later = [point for point in chapters.checkpoints() if point.number > owner.number]
    if not changes:
        print(f"{owner.name}: nothing differs from {args.base}")
        return 0
    by_hand = []
    for change in changes:
        print(f"{owner.name}/{change.relative}:")
        by_hand += carry(change, owner, later, args.dry_run)
    if by_hand:
        print(f"{len(by_hand)} file(s) to fix by hand: " + ", ".join(by_hand))
    return 1 if by_hand else 0


if __name__ == "__main__":
    sys.exit(main())
