"""KV block bookkeeping: which fixed-size blocks of KV slots each sequence owns.

Plain Python over ids and counts: it never sees a tensor of keys or values, so it can be read and
tested on its own. A sequence of n tokens owns ceil(n / block_size) blocks, listed in its block table
in order: token i lives in block table[i // block_size], slot i % block_size.
"""

from collections import deque

from .block_math import blocks_for


class NoFreeBlocksError(RuntimeError):
    """The pool has no free block left."""


class BlockAllocator:
    """A fixed pool of block ids with reference counts; a block is free again only at count zero."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_total_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate(self) -> int:
        if not self.free_ids:
            raise NoFreeBlocksError(f"all {self.num_total_blocks} KV blocks are in use")
        block_id = self.free_ids.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    def share(self, block_id: int) -> None:
        """One more owner for an allocated block."""
        if self.ref_counts[block_id] < 1:
            raise ValueError(f"block {block_id} is free and cannot be shared")
        self.ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """One owner fewer; the block returns to the free list when none is left."""
        if self.ref_counts[block_id] < 1:
            raise ValueError(f"block {block_id} is already free")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_ids.append(block_id)


class BlockManager:
    """Block tables of sequences over one `BlockAllocator`."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_tokens: dict[str, int] = {}  # KV slots in use per sequence

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_free_blocks

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Blocks for a new sequence's first `num_tokens` (its prompt); returns its block table."""
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        needed = self.blocks_needed(num_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"{seq_id!r} needs {needed} blocks, {self.num_free_blocks} are free")
        self.block_tables[seq_id] = [self.allocator.allocate() for _ in range(needed)]
        self.num_tokens[seq_id] = num_tokens
        return self.block_tables[seq_id]

    def can_append(self, seq_id: str) -> bool:
        """Is there room for one more token? Only a full last block needs a free one."""
        return not self._last_block_full(seq_id) or self.num_free_blocks > 0

    def append_slot(self, seq_id: str) -> int | None:
        """Room for one more token of `seq_id`; returns the id of a newly allocated block, if any."""
        new_block = None
        if self._last_block_full(seq_id):
            new_block = self.allocator.allocate()
            self.block_tables[seq_id].append(new_block)
        self.num_tokens[seq_id] += 1
        return new_block

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares all of the parent's blocks (reference counts go up, nothing is copied)."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} already has blocks")
        for block_id in self.block_tables[parent_id]:
            self.allocator.share(block_id)
        self.block_tables[child_id] = list(self.block_tables[parent_id])
        self.num_tokens[child_id] = self.num_tokens[parent_id]

    def free(self, seq_id: str) -> None:
        """Give back the sequence's blocks (shared ones stay with their other owners)."""
        for block_id in self.block_tables.pop(seq_id):
            self.allocator.free(block_id)
        del self.num_tokens[seq_id]

    def _last_block_full(self, seq_id: str) -> bool:
        return self.num_tokens[seq_id] == len(self.block_tables[seq_id]) * self.block_size
