"""The benchmark harness: `python -m benchmarks <workload> [options]`.

A workload is a module of this folder that declares `NAME` (its command), `CHAPTER` (the chapter it belongs
to) and `HELP` (one line), and defines `add_arguments(parser)` and `run(args)`. Writing the module is all it
takes to add one: the workloads are found by reading the files, and `__main__` imports only the one a command
names. A chapter's tag carries only the workloads of the chapters up to it.
"""

import re
from pathlib import Path

import chapters

HERE = Path(__file__).resolve().parent
DECLARATION = re.compile(r'^(NAME|CHAPTER) = "?([\w-]+)"?', re.MULTILINE)


def declarations(path: Path) -> dict[str, str]:
    """The `NAME` and `CHAPTER` a module of this folder declares (read, not imported)."""
    return dict(DECLARATION.findall(path.read_text()))


def find_workloads() -> dict[str, tuple[str, int]]:
    """Command name -> (module, chapter) for every workload module in this folder, in name order."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        declared = declarations(path)
        if "NAME" in declared:
            found[declared["NAME"]] = (f"benchmarks.{path.stem}", int(declared["CHAPTER"]))
    return found


WORKLOADS = find_workloads()


def named_checkpoint(text: str) -> chapters.Checkpoint:
    """A checkpoint named on a command line: by chapter ("3", "ch03", ...) or by module ("rosellm",
    "chapters.ch03_batch_decode.rosellm")."""
    for point in chapters.checkpoints():
        if text == point.module:
            return point
    return chapters.checkpoint(text)
