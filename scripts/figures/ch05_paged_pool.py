"""Chapter 05's figure: three sequences, their block tables pointing into a shuffled pool, and the slots
where this step's new tokens are written.

The block tables and the slot mapping are not drawn by hand: they come from chapter 05's own `BlockManager`
and `AttentionMetadata.build`, on a pool whose free list has been shuffled (a pool that has served many
requests hands out its blocks in no particular order).

    .venv/bin/python scripts/figures/ch05_paged_pool.py   ->  docs/figures/ch05_paged_pool.png
"""

import random
import sys
from collections import deque
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from chapters.ch05_paged_attention.rosellm.attention_metadata import AttentionMetadata  # noqa: E402
from chapters.ch05_paged_attention.rosellm.block_manager import BlockManager  # noqa: E402

OUT = ROOT / "docs" / "figures" / "ch05_paged_pool.png"
BLOCK_SIZE, NUM_BLOCKS = 4, 12
COLORS = {"A": "#3182bd", "B": "#e6550d", "C": "#31a354"}
LIGHT = {"A": "#c6dbef", "B": "#fdd0a2", "C": "#c7e9c0"}
GAP = 0.35  # between blocks, in cells
PER_ROW = 6  # blocks per row of the drawn pool: two rows keep the figure readable at a page's width
POOL_Y, ROW_STEP = 8.6, 2.3  # the first pool row, and the distance between pool rows


def build():
    """Sequence A (9 cached + 1 new), B (a 6-token prompt), C (4 cached + 1 new, which opens a block)."""
    manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    free = list(manager.allocator.free_ids)
    random.Random(5).shuffle(free)
    manager.allocator.free_ids = deque(free)
    manager.allocate("A", 9)
    manager.allocate("C", 4)
    manager.append_slot("A")  # room for A's new token: its 3rd block still has space
    manager.append_slot("C")  # C's only block is full: a new block
    manager.allocate("B", 6)  # the prompt joins the same step
    order = ["A", "B", "C"]  # rows of the batch
    new_lens = {"A": 1, "B": 6, "C": 1}
    seq_lens = [manager.num_tokens[s] for s in order]
    width = max(len(manager.block_tables[s]) for s in order)
    tables = torch.full((len(order), width), -1, dtype=torch.int32)
    for row, s in enumerate(order):
        tables[row, : len(manager.block_tables[s])] = torch.tensor(manager.block_tables[s], dtype=torch.int32)
    metadata = AttentionMetadata.build([new_lens[s] for s in order], seq_lens, tables, BLOCK_SIZE, torch.device("cpu"))
    return order, new_lens, seq_lens, tables, metadata


def cell_x(block: int, offset: int) -> float:
    return (block % PER_ROW) * (BLOCK_SIZE + GAP) + offset


def pool_y(block: int) -> float:
    return POOL_Y - (block // PER_ROW) * ROW_STEP


def main() -> None:
    order, new_lens, seq_lens, tables, metadata = build()
    fig, ax = plt.subplots(figsize=(7.5, 7.2))
    seq_x0 = 4.2
    owner = {}  # physical block -> sequence
    for row, s in enumerate(order):
        for block in tables[row].tolist():
            if block >= 0:
                owner[block] = s

    # The pool: NUM_BLOCKS blocks of BLOCK_SIZE slots, slot = block * BLOCK_SIZE + offset.
    new_slots = {}
    for t, slot in enumerate(metadata.slot_mapping.tolist()):
        new_slots[slot] = t
    for block in range(NUM_BLOCKS):
        s = owner.get(block)
        row = order.index(s) if s else None
        for offset in range(BLOCK_SIZE):
            slot = block * BLOCK_SIZE + offset
            position = None
            if s is not None:
                logical = tables[row].tolist().index(block)
                position = logical * BLOCK_SIZE + offset
            live = position is not None and position < seq_lens[row]
            is_new = slot in new_slots
            face = "white" if not live else (COLORS[s] if is_new else LIGHT[s])
            ax.add_patch(
                Rectangle((cell_x(block, offset), pool_y(block)), 1, 1, facecolor=face, edgecolor="gray", lw=0.8)
            )
            ax.text(
                cell_x(block, offset) + 0.5,
                pool_y(block) - 0.3,
                str(slot),
                ha="center",
                va="center",
                fontsize=8,
                color="black" if is_new else "gray",
                fontweight="bold" if is_new else "normal",
            )
            if live:
                ax.text(
                    cell_x(block, offset) + 0.5,
                    pool_y(block) + 0.5,
                    f"{s}{position}",
                    ha="center",
                    va="center",
                    fontsize=8.5,
                    color="white" if is_new else "black",
                )
        ax.add_patch(Rectangle((cell_x(block, 0), pool_y(block)), BLOCK_SIZE, 1, fill=False, edgecolor="black", lw=1.4))
        ax.text(cell_x(block, 0) + BLOCK_SIZE / 2, pool_y(block) + 1.3, f"block {block}", ha="center", fontsize=9.5)
    ax.text(
        -0.4,
        POOL_Y + 2.1,
        "KV pool (one layer); small numbers are slot ids",
        ha="left",
        va="center",
        fontsize=10,
        fontweight="bold",
    )

    # The sequences, in logical order, with their block tables.
    for row, s in enumerate(order):
        y = 2.6 - row * 1.3
        cached = seq_lens[row] - new_lens[s]
        table = [b for b in tables[row].tolist() if b >= 0]
        for position in range(seq_lens[row]):
            logical, offset = divmod(position, BLOCK_SIZE)
            x = seq_x0 + cell_x(logical, offset)
            is_new = position >= cached
            ax.add_patch(Rectangle((x, y), 1, 0.8, facecolor=COLORS[s] if is_new else LIGHT[s], edgecolor="gray"))
            ax.text(
                x + 0.5,
                y + 0.4,
                str(position),
                ha="center",
                va="center",
                fontsize=8.5,
                color="white" if is_new else "black",
            )
        for logical, block in enumerate(table):
            x = seq_x0 + cell_x(logical, 0)
            ax.add_patch(Rectangle((x, y), BLOCK_SIZE, 0.8, fill=False, edgecolor="black", lw=1.2))
            ax.add_patch(
                FancyArrowPatch(
                    (x + BLOCK_SIZE / 2, y + 0.8),
                    (cell_x(block, 0) + BLOCK_SIZE / 2, pool_y(block) - 0.55),
                    arrowstyle="-|>",
                    mutation_scale=9,
                    color=COLORS[s],
                    lw=1,
                    alpha=0.75,
                    zorder=0.5,
                )
            )  # behind the rows it crosses
        what = "prefill: a 6-token prompt" if s == "B" else f"decode: {cached} cached + 1 new"
        ax.text(
            seq_x0 - 0.4, y + 0.4, f"{s}: table {table}\n{what}", ha="right", va="center", fontsize=9.5, color=COLORS[s]
        )

    # This step's metadata, as the model receives it.
    lines = [
        "this step's attention metadata",
        "(new tokens end to end: A's 1, B's 6, C's 1):",
        f"positions       = {metadata.positions.tolist()}",
        f"slot_mapping    = {metadata.slot_mapping.tolist()}",
        f"                  (block_table[p // {BLOCK_SIZE}] * {BLOCK_SIZE} + p % {BLOCK_SIZE})",
        f"query_start_loc = {metadata.query_start_loc.tolist()}",
        f"seq_lens        = {metadata.seq_lens.tolist()}",
    ]
    ax.text(-0.4, -0.6, "\n".join(lines), family="monospace", fontsize=9, va="top")
    legend = "dark: this step's new tokens\nlight: tokens cached earlier\nwhite: free slots"
    ax.text(cell_x(PER_ROW - 1, BLOCK_SIZE), 2.6 + 0.8, legend, ha="right", va="top", fontsize=9)
    ax.set_xlim(-0.5, cell_x(PER_ROW - 1, BLOCK_SIZE) + 0.1)
    ax.set_ylim(-5.2, POOL_Y + 2.5)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(
        f"Three sequences in a pool of {NUM_BLOCKS} blocks of {BLOCK_SIZE} slots:\nblock tables, and the "
        "slots of this step's new tokens",
        fontsize=11,
    )
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=120, bbox_inches="tight", pad_inches=0.1)
    plt.close(fig)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
