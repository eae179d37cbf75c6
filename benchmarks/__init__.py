"""The benchmark harness: `python -m benchmarks <workload> [options]`.

A workload is a module of this folder that declares, each at the start of a line, `NAME = "its-command"`,
`CHAPTER = N` (the chapter it belongs to: a chapter's tag carries only the workloads of the chapters up to it)
and `HELP = "one line"`, and defines `FULL` (its settings and their defaults: an option each), `QUICK` (what
`--quick` changes) and `run(args, settings)`; `add_arguments(parser)` only for options that are not settings.
Writing the module registers it: the names are read from the files, and a command imports only its module.
"""

import re
from pathlib import Path

import chapters

DECLARATION = re.compile(r'^(NAME|CHAPTER) = "?([\w-]+)"?', re.MULTILINE)


def find_workloads() -> dict[str, tuple[str, int]]:
    """Command name -> (module, chapter) for every workload module in this folder (read, not imported)."""
    found = {}
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        declared = dict(DECLARATION.findall(path.read_text()))
        if "NAME" in declared:
            found[declared["NAME"]] = (f"benchmarks.{path.stem}", int(declared["CHAPTER"]))
    return found


WORKLOADS = find_workloads()


def named_checkpoint(text: str) -> chapters.Checkpoint:
    """A checkpoint named on a command line: by chapter ("3", "ch03", ...) or by module ("rosellm",
    "chapters.ch03_batch_decode.rosellm")."""
    return next((point for point in chapters.checkpoints() if text == point.module), None) or chapters.checkpoint(text)
