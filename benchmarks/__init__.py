"""The benchmark harness: `python -m benchmarks <workload> [options]`.

A workload is a module of this folder that declares, each at the start of a line, `NAME = "its-command"`,
`CHAPTER = N` (the chapter it belongs to: a chapter's tag carries only the workloads of the chapters up to it)
and `HELP = "one line"`, and defines `FULL` (its settings and their defaults: an option each), `QUICK` (what
`--quick` changes) and `run(args, settings)`; `add_arguments(parser)` only for options that are not settings.
Writing the module registers it: the names are read from the files, and a command imports only its module.
"""

import re
from pathlib import Path

DECLARATION = re.compile(r'^(NAME|CHAPTER) = "?([\w-]+)"?', re.MULTILINE)


# Command name -> (module, chapter) for every workload module in this folder (read, not imported).
WORKLOADS = {
    declared["NAME"]: (f"benchmarks.{path.stem}", int(declared["CHAPTER"]))
    for path in sorted(Path(__file__).resolve().parent.glob("*.py"))
    if "NAME" in (declared := dict(DECLARATION.findall(path.read_text())))
}
