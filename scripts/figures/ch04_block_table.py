"""Chapter 04's figure: two sequences' tokens, grouped into logical blocks, and the block tables that map
them to physical blocks of a pool, with the free list and the reference counts.

The tables, counts and free list are not drawn by hand: they come from chapter 04's own `BlockManager`,
after a short history (a, b and c allocated, c freed, a grows) so that the blocks are out of order.

    .venv/bin/python scripts/figures/ch04_block_table.py   ->  docs/figures/ch04_block_table.png
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from chapters.ch04_kv_block_manager.rosellm.block_manager import BlockManager  # noqa: E402

OUT = ROOT / "docs" / "figures" / "ch04_block_table.png"
BLOCK_SIZE, NUM_BLOCKS = 4, 8
COLORS = {"a": "#3182bd", "b": "#e6550d"}
LIGHT = {"a": "#c6dbef", "b": "#fdd0a2"}
GAP = 0.4


def build() -> BlockManager:
    manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    manager.allocate("c", 6)  # blocks 0, 1
    manager.allocate("a", 5)  # blocks 2, 3
    manager.allocate("b", 3)  # block 4
    manager.free("c")  # 0 and 1 go to the back of the free list
    for _ in range(5):  # a decodes 5 tokens: 10 in all, a third block from the front of the free list
        manager.append_slot("a")
    return manager


def main() -> None:
    manager = build()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    pool_y = 5.2
    owner = {block: seq for seq, table in manager.block_tables.items() for block in table}
    for block in range(NUM_BLOCKS):
        x = block * (BLOCK_SIZE / 2 + GAP)
        seq = owner.get(block)
        ax.add_patch(
            Rectangle(
                (x, pool_y), BLOCK_SIZE / 2, 1, facecolor=LIGHT[seq] if seq else "white", edgecolor="black", lw=1.3
            )
        )
        ax.text(x + BLOCK_SIZE / 4, pool_y + 0.5, str(block), ha="center", va="center", fontsize=11)
        ax.text(
            x + BLOCK_SIZE / 4,
            pool_y - 0.3,
            f"ref {manager.allocator.ref_counts[block]}",
            ha="center",
            va="center",
            fontsize=8.5,
            color="gray",
        )
    ax.text(
        0,
        pool_y + 1.45,
        f"the pool: {NUM_BLOCKS} physical blocks of {BLOCK_SIZE} token slots",
        fontsize=10.5,
        fontweight="bold",
    )
    free = list(manager.allocator.free_ids)
    ax.text(NUM_BLOCKS * (BLOCK_SIZE / 2 + GAP) - GAP, pool_y + 1.45, f"free list: {free}", ha="right", fontsize=10)

    seq_x0 = 3.2
    for row, seq in enumerate(["a", "b"]):
        y = 2.4 - row * 1.9
        table, count = manager.block_tables[seq], manager.num_tokens[seq]
        for position in range(len(table) * BLOCK_SIZE):
            logical, offset = divmod(position, BLOCK_SIZE)
            x = seq_x0 + logical * (BLOCK_SIZE + GAP) * 0.55 + offset * 0.55
            live = position < count
            ax.add_patch(Rectangle((x, y), 0.55, 0.7, facecolor=LIGHT[seq] if live else "white", edgecolor="gray"))
            if live:
                ax.text(x + 0.275, y + 0.35, str(position), ha="center", va="center", fontsize=8)
        for logical, block in enumerate(table):
            x = seq_x0 + logical * (BLOCK_SIZE + GAP) * 0.55
            ax.add_patch(Rectangle((x, y), BLOCK_SIZE * 0.55, 0.7, fill=False, edgecolor="black", lw=1.3))
            ax.text(x + BLOCK_SIZE * 0.275, y - 0.3, f"logical {logical}", ha="center", fontsize=8, color="gray")
            target = block * (BLOCK_SIZE / 2 + GAP) + BLOCK_SIZE / 4
            ax.add_patch(
                FancyArrowPatch(
                    (x + BLOCK_SIZE * 0.275, y + 0.72),
                    (target, pool_y - 0.5),
                    arrowstyle="-|>",
                    mutation_scale=10,
                    color=COLORS[seq],
                    lw=1.2,
                    alpha=0.85,
                )
            )
        ax.text(
            seq_x0 - 0.3,
            y + 0.35,
            f"sequence {seq}: {count} tokens\nblock table {table}",
            ha="right",
            va="center",
            fontsize=10,
            color=COLORS[seq],
        )
    ax.set_xlim(-3.6, NUM_BLOCKS * (BLOCK_SIZE / 2 + GAP))
    ax.set_ylim(-0.3, pool_y + 1.9)
    ax.axis("off")
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=120, bbox_inches="tight", pad_inches=0.1)
    plt.close(fig)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
