"""Chapter 09's figure: the layers of the block bookkeeping, and a pool where two requests share the full
blocks of a system prompt while a finished request's blocks wait in the evictor.

The pool below is not drawn by hand: it is the state of chapter 09's own `BlockManager` (prefix caching on,
blocks of 4 slots, a pool of 10) after a short history:
  a (the 8-token system prompt + 3 tokens) is admitted and computed: blocks 0, 1, 2; 0 and 1 are full;
  b (the system prompt + 5 tokens) finds 0 and 1 in the cache and computes only its 5 own tokens (3, 4);
  c (6 other tokens) is computed in 5 and 6, and finishes: 5 (full) goes to the evictor, 6 to the free list.

    .venv/bin/python scripts/figures/ch09_prefix_cache.py   ->  docs/figures/ch09_prefix_cache.png
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import chapters  # noqa: E402
from chapters import submodule  # noqa: E402

OUT = ROOT / "docs" / "figures" / "ch09_prefix_cache.png"
BLOCK_SIZE, NUM_BLOCKS = 4, 10
SYSTEM = list(range(100, 108))  # an 8-token "system prompt": two full blocks
COLORS = {"shared": "#9e9ac8", "owned": "#c6dbef", "evictor": "#fdd0a2", "free": "white"}
SEQ_COLORS = {"a": "#3182bd", "b": "#756bb1"}


def build():
    """The manager and the sequences still running, after the history of the module docstring."""
    package = chapters.checkpoint("ch09_prefix_caching").module
    block_manager = submodule(package, "block_manager")
    sequence = submodule(package, "sequence")
    sampling = submodule(package, "sampling")
    manager = block_manager.BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=True)

    def admit_and_compute(request_id, prompt):
        seq = sequence.Sequence(request_id, prompt, sampling.SamplingParams(max_tokens=4), set(), max_model_len=64)
        manager.take_prefix(seq, manager.cached_prefix(seq))
        seq.num_cached_tokens = seq.num_computed_tokens  # as the scheduler records it at admission
        manager.grow(seq, seq.num_tokens)
        manager.commit_computed(seq, seq.num_tokens - seq.num_computed_tokens)
        return seq

    a = admit_and_compute("a", SYSTEM + [7, 8, 9])
    b = admit_and_compute("b", SYSTEM + [20, 21, 22, 23, 24])
    c = admit_and_compute("c", [50, 51, 52, 53, 54, 55])
    manager.free(c)
    return manager, {"a": a, "b": b}


def box(ax, x, y, w, h, title, lines, color):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.08", facecolor=color, edgecolor="black", lw=1.1))
    ax.text(x + 0.25, y + h - 0.32, title, fontsize=10, fontweight="bold", va="top")
    ax.text(x + 0.25, y + h - 0.95, lines, fontsize=8.6, va="top", linespacing=1.45)


def arrow(ax, start, end, **style):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=11, lw=1.2, **style))


def draw_layers(ax):
    box(
        ax,
        0.3,
        11.3,
        12.6,
        2.5,
        "BlockManager  (block_manager.py): block tables",
        "cached_prefix · take_prefix · grow · copy_on_write · fork · commit_computed · free\n"
        "a sequence's table: token i in block table[i // block_size], slot i % block_size\n"
        "copy_on_write names (source, copy); it never touches keys or values",
        "#f0f0f0",
    )
    box(
        ax,
        13.6,
        11.3,
        6.1,
        2.5,
        "ModelRunner",
        "copies each (source, copy) block's\nkeys and values before the forward;\n"
        "saves and restores blocks a failed\nstep overwrote",
        "#f0f0f0",
    )
    arrow(ax, (12.95, 12.55), (13.55, 12.55), color="black")
    ax.text(9.5, 10.25, "one interface:  allocate · share · free · is_shared · save / restore", ha="center", fontsize=9)
    arrow(ax, (6.6, 11.25), (6.6, 10.6), color="black")
    box(
        ax,
        0.3,
        7.1,
        8.4,
        2.3,
        "BlockAllocator  (block_allocator.py)",
        "a free list and a reference count per block;\n"
        "at count 0 a block is free at once and\nits contents are forgotten",
        "white",
    )
    box(
        ax,
        9.3,
        7.1,
        10.4,
        2.3,
        "PrefixCachingBlockAllocator  (prefix_caching.py)",
        "+ remember(block, hash): full computed blocks, found by hash\n"
        "+ an evictor: unused remembered blocks, still findable,\n"
        "   counted as free, taken least recently released first",
        "white",
    )
    for x in (4.5, 14.5):
        arrow(ax, (x, 10.0), (x, 9.55), color="gray", linestyle=(0, (3, 2)))
        ax.text(x + 0.15, 9.72, "implements", fontsize=7.5, color="gray", va="center")
    ax.text(0.3, 14.2, "enable_prefix_caching picks the allocator; the block manager works on either", fontsize=9.5)


def draw_pool(ax, manager, seqs):
    allocator = manager.allocator
    pool_y, width, gap = 1.0, 1.65, 0.35
    xs = [0.3 + block * (width + gap) for block in range(NUM_BLOCKS)]
    evictor, free = list(allocator.evictor), list(allocator.free_ids)
    for block, x in enumerate(xs):
        refs = allocator.ref_counts[block]
        kind = "shared" if refs > 1 else "owned" if refs == 1 else "evictor" if block in evictor else "free"
        ax.add_patch(Rectangle((x, pool_y), width, 1.1, facecolor=COLORS[kind], edgecolor="black", lw=1.2))
        ax.text(x + width / 2, pool_y + 0.55, str(block), ha="center", va="center", fontsize=12)
        under = f"ref {refs}" if refs else ("evictor" if kind == "evictor" else "free")
        ax.text(x + width / 2, pool_y - 0.35, under, ha="center", va="center", fontsize=8.5, color="dimgray")
        if block in allocator.block_hashes:
            _, depth = allocator.block_hashes[block]
            ax.text(x + width / 2, pool_y + 1.35, f"hashed, depth {depth}", ha="center", fontsize=7.5, color="black")
    ax.text(
        0.3,
        pool_y - 1.05,
        f"free list {free}   ·   evictor {evictor} (next to evict first)   ·   "
        f"free count {manager.num_free_blocks} = {len(free)} + {len(evictor)}",
        fontsize=9,
    )
    for column, (name, seq) in enumerate(seqs.items()):
        x, y = 0.3 + 10 * column, 5.0
        label = f"{name}: {seq.num_tokens} tokens, table {seq.block_table}"
        if seq.num_cached_tokens:
            label += f", {seq.num_cached_tokens} of them a hit"
        ax.text(x, y, label, fontsize=9.5, color=SEQ_COLORS[name], va="center")
        for block in seq.block_table:
            arrow(ax, (x + 3.2, y - 0.35), (xs[block] + width / 2, pool_y + 1.7), color=SEQ_COLORS[name], alpha=0.8)
    ax.legend(
        handles=[
            Patch(facecolor=COLORS[k], edgecolor="black", label=label)
            for k, label in [
                ("shared", "in use, shared"),
                ("owned", "in use, one owner"),
                ("evictor", "unused, remembered"),
                ("free", "free, forgotten"),
            ]
        ],
        loc="upper left",
        bbox_to_anchor=(0.1, pool_y - 1.45),
        bbox_transform=ax.transData,
        ncol=4,
        fontsize=8.5,
        frameon=False,
    )


def main() -> None:
    manager, seqs = build()
    fig, ax = plt.subplots(figsize=(9.5, 7.8))
    draw_layers(ax)
    ax.plot([0.3, 19.7], [6.6, 6.6], color="lightgray", lw=1)
    ax.text(
        0.3,
        6.25,
        f"A pool of {NUM_BLOCKS} blocks of {BLOCK_SIZE} slots: a and b share the system prompt's two full blocks",
        fontsize=9.5,
        fontweight="bold",
    )
    draw_pool(ax, manager, seqs)
    ax.set_xlim(0, 20)
    ax.set_ylim(-1.4, 14.6)
    ax.axis("off")
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=120, bbox_inches="tight", pad_inches=0.1)
    plt.close(fig)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
