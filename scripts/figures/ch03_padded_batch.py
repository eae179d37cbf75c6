"""Draw docs/figures/ch03_padded_batch.png: what chapter 03's engine feeds the model for a batch of three
prompts of 5, 2 and 3 tokens: the padded input with its position ids and attention masks at prefill, then
the merged (padded) KV cache and the masks of the next decode step.

Nothing is drawn from hand-written numbers: the script runs chapter 03's engine on the bundled SmolLM2,
records the model's inputs with a forward pre-hook, and draws those.

    .venv/bin/python scripts/figures/ch03_padded_batch.py
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "figures" / "ch03_padded_batch.png"
PROMPT_LENS = (5, 2, 3)
ROW_COLORS = ("#d6e6fb", "#d8f0d8", "#f6d5e5")  # one per request
NEW_EDGE = "#c0392b"  # the tokens this forward feeds in


def record_forwards() -> list[dict]:
    """Run a 2-token generation of three prompts; return the model inputs of its two forwards."""
    sys.path.insert(0, str(ROOT))
    import chapters.ch03_batch_decode.rosellm as ch03

    llm = ch03.LLM()
    seen = []

    def hook(module, args):
        input_ids, positions, mask, batch_cache = args
        seen.append(
            {
                "input_ids": input_ids.tolist(),
                "positions": positions.tolist(),
                "mask": mask.tolist(),
                "new_lens": list(batch_cache.new_lens),
                "cached": [cache.length for cache in batch_cache.caches],
            }
        )

    handle = llm.model.register_forward_pre_hook(hook)
    prompts = [[1000 + 10 * row + i for i in range(n)] for row, n in enumerate(PROMPT_LENS)]
    llm.generate(prompts, ch03.SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    handle.remove()
    assert len(seen) == 2, "expected one prefill and one decode forward"
    return seen


def cell(ax, x, y, text, color, edge="#555555", hatch=None, lw=1.0, fontsize=8):
    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color, edgecolor=edge, hatch=hatch, linewidth=lw))
    ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=fontsize)


def draw_rows(ax, forward, kv: bool, title: str) -> None:
    """One line per request: the input tokens (prefill) or the merged key cache (decode)."""
    rows = len(forward["new_lens"])
    width = len(forward["mask"][0][0]) if kv else len(forward["input_ids"][0])
    for b in range(rows):
        y = rows - 1 - b
        cached, new = forward["cached"][b], forward["new_lens"][b]
        ax.text(-0.3, y + 0.5, f"request {b}", ha="right", va="center", fontsize=9)
        for j in range(width):
            if kv:
                real = j < cached + new
                text = f"k{j}" if real else "0"
                is_new = cached <= j < cached + new
            else:
                real = j < new
                text = f"{forward['input_ids'][b][j]}\npos {forward['positions'][b][j]}"
                is_new = real
            if real:
                cell(
                    ax,
                    j,
                    y,
                    text,
                    ROW_COLORS[b],
                    edge=NEW_EDGE if is_new else "#555555",
                    lw=2 if is_new else 1,
                    fontsize=7,
                )
            else:
                cell(
                    ax,
                    j,
                    y,
                    text if kv else f"0 (pad)\npos {forward['positions'][b][j]}",
                    "#eeeeee",
                    hatch="///",
                    fontsize=7,
                )
    ax.set_xlim(-2.3, width + 0.2)
    ax.set_ylim(-0.4, rows + 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=10)


def draw_masks(ax, forward, title: str) -> None:
    """Each request's mask [queries, keys]: filled = may attend, blank = masked out."""
    rows = len(forward["new_lens"])
    keys = len(forward["mask"][0][0])
    queries = len(forward["mask"][0])
    gap = 1.2
    for b in range(rows):
        x0 = b * (keys + gap)
        for q in range(queries):
            pad_query = q >= forward["new_lens"][b]
            for k in range(keys):
                allowed = forward["mask"][b][q][k]
                color = ROW_COLORS[b] if allowed else "white"
                ax.add_patch(
                    Rectangle(
                        (x0 + k, queries - 1 - q),
                        1,
                        1,
                        facecolor=color,
                        edgecolor="#999999",
                        linewidth=0.6,
                        alpha=0.35 if pad_query else 1.0,
                    )
                )
                if allowed:
                    ax.text(
                        x0 + k + 0.5,
                        queries - 1 - q + 0.5,
                        "1",
                        ha="center",
                        va="center",
                        fontsize=7,
                        alpha=0.35 if pad_query else 1.0,
                    )
        ax.text(x0 + keys / 2, -0.6, f"request {b}", ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.2, rows * (keys + gap))
    ax.set_ylim(-1.1, queries + 0.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=10)


def main() -> None:
    prefill, decode = record_forwards()
    fig = plt.figure(figsize=(13, 5.2))
    grid = fig.add_gridspec(2, 2, width_ratios=[1, 1.35], height_ratios=[1.6, 1], hspace=0.25, wspace=0.08)
    draw_rows(
        fig.add_subplot(grid[0, 0]),
        prefill,
        kv=False,
        title=f"prefill: input_ids [3, {len(prefill['input_ids'][0])}] padded to the longest prompt",
    )
    draw_masks(
        fig.add_subplot(grid[0, 1]),
        prefill,
        title="prefill masks [queries, keys]: causal, and padded queries (faded) repeat the last position",
    )
    draw_rows(
        fig.add_subplot(grid[1, 0]),
        decode,
        kv=True,
        title=f"next step: merged keys [3, kv_heads, {len(decode['mask'][0][0])}, 64], zero-padded",
    )
    draw_masks(
        fig.add_subplot(grid[1, 1]), decode, title="decode masks [1, keys]: everything cached, never the padding"
    )
    fig.text(
        0.5,
        0.015,
        "Red edges: the tokens this forward feeds in (their keys and values are written into each "
        "request's own cache). Hatched: padding. Shapes are chapter 03's, recorded from its engine.",
        ha="center",
        fontsize=9,
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110, bbox_inches="tight")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
