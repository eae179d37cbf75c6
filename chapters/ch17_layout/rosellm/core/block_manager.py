"""Block tables on top of a block allocator: which fixed-size blocks of KV slots each sequence uses.

Plain Python over ids and counts: it never sees a tensor of keys or values, so it can be read and
tested on its own. A sequence's block table lives on the sequence (`seq.block_table`); the manager
grows, shares, copies and frees it. Token i lives in block `block_table[i // block_size]`, slot
`i % block_size`. With prefix caching, full computed blocks are remembered by the hash chain of their
tokens (prefix_caching.py), and a new sequence starts from the longest chain of them its tokens begin with.
"""

from ..utils import blocks_for
from .block_allocator import AllocatorState, BlockAllocator, NoFreeBlocksError
from .prefix_caching import PrefixCachingBlockAllocator, extend_hash_chain
from .sequence import Sequence

__all__ = ["BlockManager", "NoFreeBlocksError"]


class BlockManager:
    """Grows, forks, copies on write and frees the block tables of sequences over one allocator."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        allocator = PrefixCachingBlockAllocator if enable_prefix_caching else BlockAllocator
        self.allocator = allocator(num_blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    # --- growing a table --------------------------------------------------------------------------------

    def needs_copy(self, seq: Sequence) -> bool:
        """Whether the block `seq` writes its next token into is shared: it must copy it first."""
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self.allocator.is_shared(seq.block_table[index])

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq`'s table lacks to hold `num_tokens` slots."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks the pool gives `seq` for its table to hold `num_tokens` slots: new ones, plus a copy of
        the shared block it writes into."""
        return self.num_new_blocks(seq, num_tokens) + self.needs_copy(seq)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= self.num_free_blocks

    def copy_on_write(self, seq: Sequence) -> tuple[int, int] | None:
        """Before `seq` writes into a block others share, give it a copy of its own. Returns (source,
        copy): the model runner copies the keys and values; the block manager never touches them."""
        if not self.needs_copy(seq):
            return None
        index = seq.num_computed_tokens // self.block_size
        source, copy = seq.block_table[index], self.allocator.allocate()
        self.allocator.free(source)  # one owner fewer; the others keep it
        seq.block_table[index] = copy
        return source, copy

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq.block_table` to hold `num_tokens` slots with new blocks (all or nothing)."""
        missing = self.num_new_blocks(seq, num_tokens)
        if missing > self.num_free_blocks:
            raise NoFreeBlocksError(f"{seq.request_id!r} needs {missing} blocks, {self.num_free_blocks} are free")
        seq.block_table.extend(self.allocator.allocate() for _ in range(missing))

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks beyond those `seq`'s computed tokens fill (slots of rejected drafts)."""
        self.shrink(seq, seq.num_computed_tokens)

    def shrink(self, owner, num_slots: int) -> None:
        """Give back the blocks of `owner` (anything with a `block_table`: a sequence, a draft model's
        record) beyond those its first `num_slots` slots fill."""
        keep = self.blocks_needed(num_slots)
        self.allocator.free(*owner.block_table[keep:])
        del owner.block_table[keep:]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` reads the same blocks as `parent`: one owner more for each."""
        for block_id in parent.block_table:
            self.allocator.share(block_id)
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        """Give back all of the sequence's blocks; its table is empty afterwards."""
        self.allocator.free(*seq.block_table)
        seq.block_table = []

    def save(self) -> AllocatorState:
        """The pool's whole state, for `restore` (a failed step puts it back)."""
        return self.allocator.save()

    def restore(self, state: AllocatorState) -> None:
        self.allocator.restore(state)

    # --- prefix caching ---------------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The longest chain of remembered blocks that `seq`'s tokens start with, leaving at least its
        last token to compute (its logits are what the next token is sampled from). [] without caching."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for block_hash in self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self.allocator.find(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_blocks_to_admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> int:
        """What admitting `seq` with `hits` as its first blocks and `num_tokens` slots takes from the free
        count: its new blocks, and the hits nobody uses (they leave the evictor)."""
        unused_hits = sum(1 for block_id in hits if not self.allocator.is_used(block_id))
        return self.blocks_needed(num_tokens) - len(hits) + unused_hits

    def take_prefix(self, seq: Sequence, hits: list[int]) -> None:
        """Start `seq`'s table with cached blocks: their tokens count as computed."""
        for block_id in hits:
            self.allocator.share(block_id)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size

    def commit_computed(self, seq: Sequence, num_new: int) -> None:
        """The forward computed `num_new` more of `seq`'s tokens: count them, and remember every block
        they filled."""
        first_full = seq.num_computed_tokens // self.block_size
        seq.num_computed_tokens += num_new
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for index, block_hash in enumerate(self.block_hashes(seq, num_full)[first_full:], start=first_full):
            self.allocator.remember(seq.block_table[index], block_hash, depth=index + 1)

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hash chain of `seq`'s first `num_blocks` full blocks of tokens (extended on the sequence as
        needed: tokens never change once appended)."""
        if len(seq.block_hashes) < num_blocks:
            extend_hash_chain(seq.block_hashes, seq.token_ids, self.block_size, num_blocks)
        return seq.block_hashes[:num_blocks]
