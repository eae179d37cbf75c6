"""Command line: `python -m benchmarks WORKLOAD [options]`, one per workload module (`benchmarks.WORKLOADS`)."""

import argparse
import importlib
import sys

from . import WORKLOADS, harness


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in WORKLOADS:  # --help, or a missing or unknown workload: argparse says so
        epilog = "`python -m benchmarks WORKLOAD --help` lists a workload's options"
        parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__, epilog=epilog)
        parser.add_argument("workload", choices=list(WORKLOADS))
        parser.parse_args(argv)
        return
    # Import only the chosen workload: one workload's heavy or broken imports never block another.
    module = importlib.import_module(WORKLOADS[argv[0]][0])
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks {argv[0]}", description=module.HELP)
    harness.add_arguments(parser, module.FULL)
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    module.run(args, harness.settings(args, module.FULL, module.QUICK))


if __name__ == "__main__":
    main()
