"""Chapter 06's figure: the split-K decode grid, and the merge of one query head's partial results.

Top: the programs `(b, h, s)` of a batch of two sequences (600 and 300 keys), 2 KV heads, and the split
count chapter 06's `choose_num_splits` picks for 600 keys; each program reads one chunk of its sequence's
keys, and a chunk past the end of the shorter sequence is empty. Bottom: the partial results of one query
head on random scores and values, their weights in the merge, and a check that the merge equals a softmax
over all keys at once.

    .venv/bin/python scripts/figures/ch06_split_k.py   ->  docs/figures/ch06_split_k.png
"""

import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from chapters.ch06_triton_kernels.rosellm.kernels import choose_num_splits  # noqa: E402

OUT = ROOT / "docs" / "figures" / "ch06_split_k.png"
SEQ_LENS, NUM_KV_HEADS, BLOCK_N = [600, 300], 2, 32
SPLIT_COLORS = ["#3182bd", "#31a354", "#e6550d", "#756bb1"]


def chunks(num_splits: int) -> list[tuple[int, int]]:
    """(start, end) of each split's keys, each a whole number of BLOCK_N steps, as the kernel cuts them."""
    per_split = math.ceil(max(SEQ_LENS) / num_splits / BLOCK_N) * BLOCK_N
    return [(s * per_split, (s + 1) * per_split) for s in range(num_splits)]


def partials(seq_len: int, bounds: list[tuple[int, int]], head_dim: int = 4):
    """Per chunk: (lse_s, o_s) of one query head on random scores and values; and the full-softmax output."""
    gen = torch.Generator().manual_seed(0)
    scores, values = torch.randn(seq_len, generator=gen) * 2, torch.randn(seq_len, head_dim, generator=gen)
    parts = []
    for start, end in bounds:
        s, v = scores[start : min(end, seq_len)], values[start : min(end, seq_len)]
        parts.append((torch.logsumexp(s, 0).item(), (s.softmax(0) @ v)) if len(s) else (-math.inf, None))
    return parts, scores.softmax(0) @ values


def draw_grid(ax, bounds: list[tuple[int, int]]) -> None:
    scale = 9.0 / bounds[-1][1]
    row = 0
    for b, seq_len in enumerate(SEQ_LENS):
        for h in range(NUM_KV_HEADS):
            y = -row * 0.9
            for s, (start, end) in enumerate(bounds):
                empty = start >= seq_len
                width = (min(end, seq_len) - start) * scale if not empty else (end - start) * scale
                ax.add_patch(
                    Rectangle(
                        (start * scale, y),
                        width,
                        0.7,
                        facecolor="white" if empty else SPLIT_COLORS[s],
                        alpha=1 if empty else 0.75,
                        edgecolor="gray",
                        hatch="//" if empty else None,
                    )
                )
                label = f"({b}, {h}, {s})" + ("  empty" if empty else "")
                ax.text(
                    start * scale + 0.1, y + 0.35, label, va="center", fontsize=8.5, color="gray" if empty else "white"
                )
            ax.text(-0.2, y + 0.35, f"seq {b} ({seq_len} keys), KV head {h}", ha="right", va="center", fontsize=9)
            row += 1
    for start, _ in bounds + [(bounds[-1][1], None)]:
        ax.text(start * scale, 0.85, str(start), ha="center", fontsize=8.5, color="gray")
    ax.text(-0.2, 0.85, "key position", ha="right", fontsize=8.5, color="gray")
    ax.set_title(
        f"grid (batch, num_kv_heads, num_splits) = ({len(SEQ_LENS)}, {NUM_KV_HEADS}, {len(bounds)}): "
        f"one program per box, chunks of {bounds[0][1]} keys",
        fontsize=10,
    )
    ax.set_xlim(-3.2, 9.3)
    ax.set_ylim(-row * 0.9 + 0.6, 1.2)
    ax.axis("off")


def draw_merge(ax, bounds: list[tuple[int, int]]) -> None:
    parts, full = partials(SEQ_LENS[0], bounds)
    lse = torch.logsumexp(torch.tensor([p[0] for p in parts]), 0).item()
    merged = sum(math.exp(l_s - lse) * o_s for l_s, o_s in parts)
    for s, (l_s, _) in enumerate(parts):
        x = s * 3.1
        ax.add_patch(Rectangle((x, 1.6), 2.7, 1.1, facecolor=SPLIT_COLORS[s], alpha=0.75, edgecolor="gray"))
        ax.text(
            x + 1.35,
            2.15,
            f"program (0, 0, {s})\nlse_{s} = {l_s:.2f}",
            ha="center",
            va="center",
            fontsize=9,
            color="white",
        )
        ax.text(x + 1.35, 1.25, f"weight exp(lse_{s} − lse) = {math.exp(l_s - lse):.3f}", ha="center", fontsize=8.5)
        ax.add_patch(
            FancyArrowPatch(
                (x + 1.35, 1.15), (4.45, 0.55), arrowstyle="-|>", mutation_scale=10, color=SPLIT_COLORS[s], lw=1.2
            )
        )
    ax.add_patch(Rectangle((1.6, -0.35), 5.7, 0.85, facecolor="#f0f0f0", edgecolor="black"))
    ax.text(
        4.45, 0.08, f"merge: lse = {lse:.2f},  o = Σ_s exp(lse_s − lse) · o_s", ha="center", va="center", fontsize=9.5
    )
    difference = (merged - full).abs().max().item()
    ax.text(
        4.45,
        -0.75,
        f"largest difference from one softmax over all {SEQ_LENS[0]} keys: {difference:.1e}",
        ha="center",
        fontsize=9,
        color="gray",
    )
    ax.set_title("the merge of one query head (sequence 0): exact, not an approximation", fontsize=10)
    ax.set_xlim(-0.2, 9.2)
    ax.set_ylim(-1.0, 2.9)
    ax.axis("off")


def main() -> None:
    bounds = chunks(choose_num_splits(max(SEQ_LENS)))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 6.4), height_ratios=[1, 1])
    draw_grid(top, bounds)
    draw_merge(bottom, bounds)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=120, bbox_inches="tight", pad_inches=0.1)
    plt.close(fig)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
