"""Block allocators: which KV blocks are in use, and by how many owners.

A block allocator hands out block ids and counts their owners; a block whose count drops to zero is
unused. Two allocators share this interface:
- `BlockAllocator` (here): an unused block goes straight back to the free list, its contents forgotten;
- `PrefixCachingBlockAllocator` (prefix_caching.py): a full block is remembered by the hash of its
  contents, and an unused remembered block stays findable until the pool needs it back.
The block manager builds block tables on top of either. Plain Python over ids and counts.
"""

from collections import deque
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """The pool has no free block left."""


@dataclass(frozen=True)
class AllocatorState:
    """The allocator's whole state, saved so that a failed step can put it back exactly."""

    free_ids: tuple[int, ...]
    ref_counts: tuple[int, ...]

    def holds_data(self, block_id: int) -> bool:
        """Whether someone could still read the block's keys and values: it has an owner."""
        return self.ref_counts[block_id] > 0


class BlockAllocator:
    """A fixed pool of block ids with reference counts; an unused block is free again at once."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_total_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_ids = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `allocate` can hand out."""
        return len(self.free_ids)

    def allocate(self) -> int:
        """A block with one owner; its old contents are garbage."""
        if not self.free_ids:
            raise NoFreeBlocksError(f"all {self.num_total_blocks} KV blocks are in use")
        block_id = self.free_ids.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    def share(self, block_id: int) -> None:
        """One owner more for a block in use (a forked sequence reads the same keys and values)."""
        if self.ref_counts[block_id] < 1:
            raise ValueError(f"block {block_id} is free: nothing to share")
        self.ref_counts[block_id] += 1

    def is_used(self, block_id: int) -> bool:
        return self.ref_counts[block_id] > 0

    def is_shared(self, block_id: int) -> bool:
        return self.ref_counts[block_id] > 1

    def free(self, *block_ids: int) -> None:
        """One owner fewer for each block, as one release (a sequence giving back its table)."""
        unused = []
        for block_id in block_ids:
            if self.ref_counts[block_id] < 1:
                raise ValueError(f"block {block_id} is already free")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                unused.append(block_id)
        self._recycle(unused)

    def _recycle(self, unused: list[int]) -> None:
        """Blocks nobody owns any more: back to the free list."""
        self.free_ids.extend(unused)

    def save(self) -> AllocatorState:
        return AllocatorState(tuple(self.free_ids), tuple(self.ref_counts))

    def restore(self, state: AllocatorState) -> None:
        self.free_ids = deque(state.free_ids)
        self.ref_counts = list(state.ref_counts)
