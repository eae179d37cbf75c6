"""Chapter 17's figure: one request through the folders. Each band is a layer of `rosellm/` (top first, as
`__layers__` lists them; a few share a band here); each box a module the request passes, numbered in the
order it gets there. An arrow is a call and an import, so it never points up: results come back as return
values.

    .venv/bin/python scripts/figures/ch17_layout.py   ->  docs/figures/ch17_layout.png
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "figures" / "ch17_layout.png"

# (folder, what it holds in one line), top layer first; the leaves share the last band.
BANDS = [
    ("entrypoints/", "LLM, the CLI, the OpenAI server"),
    ("engine/", "requests in, outputs out"),
    ("core/", "sequences, scheduler, blocks"),
    ("structured_output/ · sample/", "masks, then tokens"),
    ("worker/", "one step's tensors"),
    ("model_executor/", "the model and its weights"),
    ("attention/", "metadata, layer, backends, ops"),
    ("leaves", "outputs, sampling_params, config, envs"),
]
BAND_COLORS = ["#deebf7", "#fee6ce", "#e5f5e0", "#efedf5", "#fde0dd", "#fff7bc", "#e0f3f8", "#f0f0f0"]
# (band, column, module, what it does here), numbered in the order the request gets there
BOXES = [
    (0, 0, "entrypoints/llm.py", "LLM.generate(prompt)"),
    (1, 0, "engine/llm_engine.py", "add_request, step()"),
    (1, 1, "engine/input_processor.py", "tokenize, check, queue"),
    (2, 1, "core/scheduler.py", "rows under budgets, blocks"),
    (4, 1, "worker/model_runner.py", "StepInputs -> tensors"),
    (5, 1, "model_executor/models/llama.py", "the forward"),
    (6, 1, "attention/layer.py", "one custom operator"),
    (6, 2, "attention/backends/cpu_attn.py", "plan, attend"),
    (6, 3, "attention/ops/c_kernels.py", "the C decode kernel"),
    (3, 1, "structured_output/grammar.py", "mask the logits"),
    (3, 2, "sample/sampler.py", "logits -> token ids"),
    (1, 2, "engine/output_processor.py", "detokenize, stop strings"),
    (7, 2, "outputs.py", "what 12 fills and 1 returns"),
]
# who calls whom: the engine calls each stage in turn; the forward goes down its own chain
CALLS = [(0, 1), (1, 2), (1, 3), (1, 4), (4, 5), (5, 6), (6, 7), (7, 8), (1, 9), (1, 10), (1, 11)]
BAND_H, BOX_W, BOX_H, LEFT, COLUMN = 1.0, 3.05, 0.62, 3.1, 3.3


def corner(box: int) -> tuple[float, float, float, float]:
    """x0, y0, x1, y1 of a box."""
    band, column, _, _ = BOXES[box]
    x0, y0 = LEFT + column * COLUMN, (len(BANDS) - 1 - band) * BAND_H + (BAND_H - BOX_H) / 2
    return x0, y0, x0 + BOX_W, y0 + BOX_H


def anchors(caller: int, callee: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Where an arrow leaves its caller and reaches its callee: side to side within a band, else from the
    caller's right edge (or bottom, straight below) to the callee's left edge (or top)."""
    a, b = corner(caller), corner(callee)
    if BOXES[caller][1] == BOXES[callee][1]:  # the same column: straight down
        return ((a[0] + a[2]) / 2, a[1]), ((b[0] + b[2]) / 2, b[3])
    if BOXES[caller][0] == BOXES[callee][0]:  # the same band: side to side
        return (a[2], (a[1] + a[3]) / 2), (b[0], (b[1] + b[3]) / 2)
    return (a[2], (a[1] + a[3]) / 2), (b[0], (b[1] + b[3]) / 2)


def main() -> None:
    fig, ax = plt.subplots(figsize=(16, 7.4))
    width = LEFT + 3 * COLUMN + BOX_W + 0.15
    for band, ((folder, job), color) in enumerate(zip(BANDS, BAND_COLORS)):
        y = (len(BANDS) - 1 - band) * BAND_H
        ax.add_patch(plt.Rectangle((0, y), width, BAND_H, facecolor=color, edgecolor="white", lw=2))
        ax.text(0.12, y + BAND_H * 0.62, folder, fontsize=9.5, fontweight="bold", va="center")
        ax.text(0.12, y + BAND_H * 0.3, job, fontsize=8, va="center", color="#444444")
    for number, (_, _, module, doing) in enumerate(BOXES, start=1):
        x0, y0, x1, y1 = corner(number - 1)
        style = "round,pad=0.03"
        ax.add_patch(FancyBboxPatch((x0, y0), BOX_W, BOX_H, boxstyle=style, facecolor="white", edgecolor="black"))
        ax.text(x0 + 0.08, y1 - 0.1, f"{number}", fontsize=9, fontweight="bold", va="top", color="#a50f15")
        ax.text(x0 + 0.36, y1 - 0.1, module, fontsize=7.3, va="top", family="monospace")
        ax.text(x0 + 0.36, y0 + 0.1, doing, fontsize=7.6, va="bottom", color="#333333")
    for caller, callee in CALLS:
        start, end = anchors(caller, callee)
        arrow = FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11, lw=1.2, color="#3182bd", zorder=3)
        ax.add_patch(arrow)
    ax.text(
        width,
        -0.3,
        "An arrow is a call, and an import: it never points to a band above. The engine (2) calls each stage "
        "in turn and takes its result back.",
        fontsize=8.2,
        ha="right",
        va="top",
        color="#333333",
    )
    ax.set_xlim(-0.1, width + 0.1)
    ax.set_ylim(-0.65, len(BANDS) * BAND_H + 0.05)
    ax.set_axis_off()
    ax.set_title("One request through rosellm/'s folders (chapter 17)", fontsize=12, fontweight="bold")
    fig.savefig(OUT, dpi=110, bbox_inches="tight", pad_inches=0.1)
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
