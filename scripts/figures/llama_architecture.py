"""Draw docs/figures/llama_architecture.png: the decoder of chapter 01 with SmolLM2-135M's shapes.

.venv/bin/python scripts/figures/llama_architecture.py
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parents[2] / "docs" / "figures" / "llama_architecture.png"
COLORS = {"io": "#eeeeee", "embed": "#f6d5e5", "norm": "#fff2c4", "attn": "#d6e6fb", "mlp": "#d8f0d8", "add": "#ffffff"}


def box(ax, x, y, w, h, text, kind, fontsize=9.5):
    """A rounded box centred on (x, y)."""
    ax.add_patch(
        FancyBboxPatch(
            (x - w / 2, y - h / 2),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.12",
            facecolor=COLORS[kind],
            edgecolor="#555555",
            linewidth=1,
        )
    )
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, family="DejaVu Sans")


def arrow(ax, start, end, color="#444444", **style):
    ax.add_patch(
        FancyArrowPatch(
            start, end, arrowstyle="-|>", mutation_scale=12, color=color, linewidth=1, shrinkA=0, shrinkB=0, **style
        )
    )


def main_column(ax):
    """The path every token takes, top to bottom."""
    x, w = 3.0, 4.6
    steps = [  # (y, height, text, kind)
        (15.2, 0.7, "token ids   [T]", "io"),
        (13.9, 0.9, "embed_tokens: table of 49152 × 576\nx   [T, 576]", "embed"),
        (12.2, 0.7, "RMSNorm (input_layernorm)", "norm"),
        (10.9, 1.0, "self-attention (GQA + RoPE)\n9 query heads, 3 KV heads, head_dim 64", "attn"),
        (9.5, 0.5, "x = x + attention", "add"),
        (8.4, 0.7, "RMSNorm (post_attention_layernorm)", "norm"),
        (7.1, 1.0, "SwiGLU MLP\n576 → 1536 → 576", "mlp"),
        (5.7, 0.5, "x = x + mlp", "add"),
        (4.3, 0.7, "RMSNorm (model.norm)", "norm"),
        (3.0, 0.9, "lm_head = embed_tokens.weight (tied)\nlogits   [T, 49152]", "embed"),
        (1.6, 0.7, "sampler: last row → next token id", "io"),
    ]
    for y, h, text, kind in steps:
        box(ax, x, y, w, h, text, kind)
    for (y0, h0, *_), (y1, h1, *_) in zip(steps, steps[1:]):
        arrow(ax, (x, y0 - h0 / 2), (x, y1 + h1 / 2))
    # The repeated block, and the two residual connections that skip around norm + sublayer.
    ax.add_patch(
        FancyBboxPatch(
            (x - w / 2 - 0.45, 5.25),
            w + 0.9,
            7.55,
            boxstyle="round,pad=0.05",
            facecolor="none",
            edgecolor="#888888",
            linestyle="--",
        )
    )
    ax.text(x - w / 2 - 0.3, 12.95, "× 30 decoder layers", fontsize=9.5, style="italic", color="#555555")
    for top, bottom in ((12.75, 9.5), (8.95, 5.7)):
        ax.plot([x - w / 2 - 0.2] * 2, [top, bottom], color="#999999", linewidth=1)
        ax.plot([x - w / 2 - 0.2, x - w / 2 + 0.1], [top, top], color="#999999", linewidth=1)
        arrow(ax, (x - w / 2 - 0.2, bottom), (x - 1.1, bottom), color="#999999")


def attention_detail(ax):
    x0 = 7.0
    ax.text(x0, 13.2, "inside self-attention (one layer)", fontsize=10.5, weight="bold")
    rows = [
        (12.3, "q_proj 576→576: q [T, 9, 64]    k_proj 576→192: k [T, 3, 64]    v_proj 576→192: v [T, 3, 64]"),
        (11.5, "RoPE on q and k: rotate each pair of dims by position × θ^(−2i/64),  θ = 100000"),
        (10.7, "GQA: each KV head serves 9 / 3 = 3 query heads (repeat k, v → [T, 9, 64])"),
        (9.9, "softmax(q kᵀ / √64 + causal mask) v   →   [T, 9, 64]   →   [T, 576]"),
        (9.1, "o_proj 576→576"),
    ]
    for y, text in rows:
        box(ax, x0 + 4.1, y, 8.4, 0.6, text, "attn", fontsize=8.5)
    for (y0, _), (y1, _) in zip(rows, rows[1:]):
        arrow(ax, (x0 + 4.1, y0 - 0.3), (x0 + 4.1, y1 + 0.3))
    arrow(ax, (x0 - 0.1, 11.7), (5.35, 10.9), color="#7799cc", linestyle=":")


def mlp_detail(ax):
    x0 = 7.0
    ax.text(x0, 7.9, "inside the MLP (one layer)", fontsize=10.5, weight="bold")
    rows = [
        (7.1, "gate_proj 576→1536 and up_proj 576→1536:  two [T, 1536]"),
        (6.3, "silu(gate) × up   (the gated linear unit)   [T, 1536]"),
        (5.5, "down_proj 1536→576   [T, 576]"),
    ]
    for y, text in rows:
        box(ax, x0 + 4.1, y, 8.4, 0.6, text, "mlp", fontsize=8.5)
    for (y0, _), (y1, _) in zip(rows, rows[1:]):
        arrow(ax, (x0 + 4.1, y0 - 0.3), (x0 + 4.1, y1 + 0.3))
    arrow(ax, (x0 - 0.1, 6.5), (5.35, 7.1), color="#66aa66", linestyle=":")


def notes(ax):
    text = (
        "SmolLM2-135M-Instruct: 134.5 M parameters, 30 layers, hidden 576, vocab 49152.\n"
        "T = tokens in the sequence. In chapter 01 every step runs all T tokens through all 30 layers,\n"
        "then keeps only the last row of the logits."
    )
    ax.text(7.0, 3.6, text, fontsize=9, va="top", color="#333333", linespacing=1.6)


def main() -> None:
    fig, ax = plt.subplots(figsize=(12.5, 8.6))
    ax.set_xlim(0, 15.5)
    ax.set_ylim(0.9, 15.8)
    ax.axis("off")
    main_column(ax)
    attention_detail(ax)
    mlp_detail(ax)
    notes(ax)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
