"""Redraw the benchmark figures of the chapter pages from the committed result files, without measuring
anything again (each workload draws its own figure with its `plot` function).

    .venv/bin/python scripts/figures/redraw_results.py
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import decode_scaling, paged_vs_padded  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "docs" / "figures"
REDRAWN = [  # (result file, the workload's plot function, figure)
    ("decode_scaling_ch01.json", decode_scaling.plot, "decode_scaling_ch01.png"),
    ("paged_vs_padded.json", paged_vs_padded.plot, "paged_vs_padded.png"),
]


def main() -> None:
    for result_name, plot, figure_name in REDRAWN:
        plot(json.loads((RESULTS / result_name).read_text()), FIGURES / figure_name)
        print(f"wrote docs/figures/{figure_name} from benchmarks/results/{result_name}")


if __name__ == "__main__":
    main()
