"""KV block bookkeeping: which fixed-size blocks of KV slots each sequence owns.

Plain Python over ids and counts: it never sees a tensor of keys or values, so it can be read and
tested on its own. A sequence's block table lives on the sequence (`seq.block_table`); the manager
grows and frees it. Token i lives in block `block_table[i // block_size]`, slot `i % block_size`.
"""

from collections import deque
from dataclasses import dataclass

from .block_math import blocks_for
from .sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    """The pool has no free block left."""


@dataclass(frozen=True)
class AllocatorState:
    """The allocator's whole state, saved so that a failed step can put it back exactly."""

    free_ids: tuple[int, ...]
    ref_counts: tuple[int, ...]


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

    def free(self, block_id: int) -> None:
        """One owner fewer; the block returns to the free list when none is left."""
        if self.ref_counts[block_id] < 1:
            raise ValueError(f"block {block_id} is already free")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_ids.append(block_id)

    def save(self) -> AllocatorState:
        return AllocatorState(tuple(self.free_ids), tuple(self.ref_counts))

    def restore(self, state: AllocatorState) -> None:
        self.free_ids = deque(state.free_ids)
        self.ref_counts = list(state.ref_counts)


class BlockManager:
    """Grows and frees the block tables of sequences over one `BlockAllocator`."""

    def __init__(self, num_blocks: int, block_size: int):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs for its table to hold `num_tokens` slots."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= self.num_free_blocks

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq.block_table` to hold `num_tokens` slots with new blocks (all or nothing)."""
        missing = self.num_missing_blocks(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise NoFreeBlocksError(f"{seq.request_id!r} needs {missing} blocks, {self.num_free_blocks} are free")
        seq.block_table.extend(self.allocator.allocate() for _ in range(missing))

    def free(self, seq: Sequence) -> None:
        """Give back all of the sequence's blocks; its table is empty afterwards."""
        for block_id in seq.block_table:
            self.allocator.free(block_id)
        seq.block_table = []

    def save(self) -> AllocatorState:
        """The pool's whole state, for `restore` (a failed step puts it back)."""
        return self.allocator.save()

    def restore(self, state: AllocatorState) -> None:
        self.allocator.restore(state)
