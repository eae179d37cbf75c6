"""Which engine core (data-parallel replica) gets a new request.

The least loaded, counted in requests the front end has sent it that have not ended: it knows that number
exactly, at no cost. With prefix caching on, a core that already holds the start of the prompt saves its
prefill; the front end cannot see the cores' caches, but it can remember which full blocks of prompts it
sent where (the same chain of block hashes the block manager keys its cache with, core/prefix_caching.py). A core
whose remembered blocks match the prompt's first ones wins, unless it has `PREFIX_LOAD_SLACK` more requests
than the least loaded: a cache hit is not worth a long queue. The memory per core is a bounded LRU of as
many blocks as its KV pool holds, so it forgets roughly when the core's cache does.
"""

from collections import OrderedDict

from ..core.prefix_caching import extend_hash_chain

PREFIX_LOAD_SLACK = 4  # requests more than the least-loaded core that a prefix hit may still outweigh


class ReplicaRouter:
    def __init__(self, num_cores: int, block_size: int, num_blocks: int, prefix_caching: bool):
        self.loads = [0] * num_cores  # requests routed to each core and not ended
        self.block_size, self.num_blocks, self.prefix_caching = block_size, num_blocks, prefix_caching
        self.seen: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_cores)]  # block hashes, LRU

    def route(self, prompt_token_ids: list[int]) -> int:
        """The core for a new request (counted in its load until `release`)."""
        least = min(range(len(self.loads)), key=lambda core: (self.loads[core], core))
        core = least
        if self.prefix_caching and len(self.loads) > 1:
            hashes = self.block_hashes(prompt_token_ids)
            hits = [self.matched(core, hashes) for core in range(len(self.loads))]
            best = max(range(len(self.loads)), key=lambda core: (hits[core], -self.loads[core], -core))
            if hits[best] and self.loads[best] - self.loads[least] <= PREFIX_LOAD_SLACK:
                core = best
            self.remember(core, hashes)
        self.loads[core] += 1
        return core

    def release(self, core: int) -> None:
        """A request routed to `core` ended (finished, aborted or failed)."""
        self.loads[core] -= 1

    def block_hashes(self, token_ids: list[int]) -> list[bytes]:
        """The hash chain of the prompt's full blocks."""
        hashes = []
        extend_hash_chain(hashes, token_ids, self.block_size, len(token_ids) // self.block_size)
        return hashes

    def matched(self, core: int, hashes: list[bytes]) -> int:
        """How many of the prompt's first blocks `core` was sent before."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self.seen[core]:
                break
            count += 1
        return count

    def remember(self, core: int, hashes: list[bytes]) -> None:
        seen = self.seen[core]
        for block_hash in hashes:
            seen[block_hash] = None
            seen.move_to_end(block_hash)
        while len(seen) > self.num_blocks:
            seen.popitem(last=False)
