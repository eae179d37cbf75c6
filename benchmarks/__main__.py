"""Command line: `python -m benchmarks WORKLOAD [options]`, one per workload module (`benchmarks.WORKLOADS`), and
`python -m benchmarks results [options]`: every file the book quotes, measured group by group (book_results.py)."""

import argparse
import importlib
import sys

from . import WORKLOADS, harness


def top_parser() -> argparse.ArgumentParser:
    """The parser of `python -m benchmarks` itself: which workloads there are."""
    epilog = "`python -m benchmarks WORKLOAD --help` lists a workload's options"
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__, epilog=epilog)
    parser.add_argument("workload", choices=[*WORKLOADS, "results"])
    return parser


def workload_parser(name: str) -> tuple[argparse.ArgumentParser, object]:
    """A workload's parser (an option per setting, the common ones, its own) and its module. Only the chosen
    workload is imported: one workload's heavy or broken imports never block another."""
    module = importlib.import_module(WORKLOADS[name][0])
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {name}", description=module.HELP)
    harness.add_arguments(parser, module.FULL)
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser)
    return parser, module


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["results"]:
        from . import book_results

        book_results.main(argv[1:])
        return
    if not argv or argv[0] not in WORKLOADS:  # --help, or a missing or unknown workload: argparse says so
        top_parser().parse_args(argv)
        return
    parser, module = workload_parser(argv[0])
    args = parser.parse_args(argv[1:])
    module.run(args, harness.settings(args, module.FULL, module.QUICK))


if __name__ == "__main__":
    main()
