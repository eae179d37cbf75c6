"""Prefix caching: full KV blocks remembered by their contents, so that prompts sharing a prefix share blocks.

A full block's keys and values depend only on its tokens and on every token before it (positions included:
a block's place in the chain fixes them). So a block is named by a hash chain,

    hash(block i) = sha256(hash(block i - 1) + token ids of block i),    hash(block -1) = b""

and two sequences whose first k blocks have the same hashes hold the same keys and values there. A
cryptographic hash, not Python's `hash`: a server shares the cache between clients, and a client able to
forge a collision could read keys and values computed for someone else's prompt.
"""

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import sha256

from .block_allocator import AllocatorState, BlockAllocator


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block, chained to the hash of the block before it (b"" for the first)."""
    return sha256(parent_hash + array("I", token_ids).tobytes()).digest()


def extend_hash_chain(hashes: list[bytes], token_ids: Sequence[int], block_size: int, num_blocks: int) -> None:
    """In place: `hashes`, the chain of the first full blocks of `token_ids`, extended to `num_blocks`."""
    for start in range(len(hashes) * block_size, num_blocks * block_size, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else b"", token_ids[start : start + block_size]))


@dataclass(frozen=True)
class PrefixCacheState(AllocatorState):
    """The caching allocator's whole state: the plain one's, the remembered blocks and the evictor's order."""

    block_hashes: dict[int, tuple[bytes, int]]  # block id -> (hash, depth)
    evictor: tuple[int, ...]  # in eviction order

    def holds_data(self, block_id: int) -> bool:
        """Owned, or remembered (unused ones wait in the evictor): a later prefix hit may read it."""
        return self.ref_counts[block_id] > 0 or block_id in self.block_hashes


class PrefixCachingBlockAllocator(BlockAllocator):
    """`BlockAllocator` that remembers full blocks by hash.

    - `remember(block, hash, depth)`: a full block's contents are computed; findable from now on.
    - `find(hash)`: the block remembered for that hash, or None; `share` it to take it (count + 1).
    - A remembered block whose count drops to zero goes to the evictor, not the free list: still findable,
      and still counted as free. `allocate` takes from the free list first; when it is empty, it evicts the
      least recently used block (the one released longest ago; within one release, the deepest block of a
      chain first, so that the start of a prefix outlives its end) and forgets its hash.
    """

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.cached: dict[bytes, int] = {}  # hash -> block id
        self.block_hashes: dict[int, tuple[bytes, int]] = {}  # block id -> (hash, depth: blocks in its chain)
        self.evictor: OrderedDict[int, None] = OrderedDict()  # unused remembered blocks, next to evict first

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictor)

    def allocate(self) -> int:
        if self.free_ids or not self.evictor:
            return super().allocate()  # the free list first (the plain allocator raises when all are in use)
        block_id, _ = self.evictor.popitem(last=False)
        block_hash, _ = self.block_hashes.pop(block_id)
        del self.cached[block_hash]
        self.ref_counts[block_id] = 1
        return block_id

    def find(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def share(self, block_id: int) -> None:
        """One owner more; an unused remembered block is taken back from the evictor (a prefix hit)."""
        if block_id in self.evictor:
            del self.evictor[block_id]
            self.ref_counts[block_id] = 1
        else:
            super().share(block_id)

    def remember(self, block_id: int, block_hash: bytes, depth: int) -> None:
        """Make a computed full block findable by its hash. The first block remembered for a hash keeps
        it: a second block with the same contents (computed while the first was not yet cached) stays
        anonymous and is freed as usual."""
        if block_hash not in self.cached and block_id not in self.block_hashes:
            self.cached[block_hash] = block_id
            self.block_hashes[block_id] = (block_hash, depth)

    def _recycle(self, unused: list[int]) -> None:
        """Anonymous blocks back to the free list; remembered ones to the evictor's end, deepest first."""
        self.free_ids.extend(b for b in unused if b not in self.block_hashes)
        remembered = [b for b in unused if b in self.block_hashes]
        for block_id in sorted(remembered, key=lambda b: -self.block_hashes[b][1]):
            self.evictor[block_id] = None

    def save(self) -> PrefixCacheState:
        return PrefixCacheState(
            tuple(self.free_ids), tuple(self.ref_counts), dict(self.block_hashes), tuple(self.evictor)
        )

    def restore(self, state: PrefixCacheState) -> None:
        super().restore(state)
        self.block_hashes = dict(state.block_hashes)
        self.cached = {h: block_id for block_id, (h, _) in self.block_hashes.items()}
        self.evictor = OrderedDict.fromkeys(state.evictor)
