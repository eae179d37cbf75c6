"""Redraw the figures of the committed benchmark results, without measuring anything again: each result file
of benchmarks/results/ names its workload and its figures, and the workload draws them with its own `plot`.
Only figures under docs/figures/ are redrawn (a result whose figures went elsewhere keeps none there).

    .venv/bin/python scripts/figures/redraw_results.py                  # every figure of every result
    .venv/bin/python scripts/figures/redraw_results.py chapters.json    # the figures of the results named
"""

import argparse
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import WORKLOADS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FIGURES = Path("docs") / "figures"


def redraw(path: Path) -> list[str]:
    """Draw the figures `path` names under docs/figures/ with its workload's `plot`; the figures drawn."""
    result = json.loads(path.read_text())
    figures = [name for name in result.get("figures", []) if Path(name).parent == FIGURES]
    if result.get("workload") not in WORKLOADS or not figures:
        return []
    module = importlib.import_module(WORKLOADS[result["workload"]][0])
    module.plot(result, *[ROOT / name for name in figures])
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", help="result files of benchmarks/results/ (default: all)")
    args = parser.parse_args(argv)
    for path in [RESULTS / name for name in args.results] or sorted(RESULTS.glob("*.json")):
        for figure in redraw(path):
            print(f"wrote {figure} from benchmarks/results/{path.name}")


if __name__ == "__main__":
    main()
