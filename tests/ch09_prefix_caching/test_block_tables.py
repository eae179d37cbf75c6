"""The prefix-caching block manager, operation by operation, worked out by hand (as vLLM's
`test_prefix_caching.py` does): blocks of 4 slots, a pool of 10 (ids 0-9), every id handed out, every
hit, the eviction order and the reference counts after each operation.

Reading guide: `free` is the free list in the order `allocate` takes from it; `evictor` holds the unused
remembered blocks, next to evict first; `refs` maps each block in use to its reference count.
"""

import pytest

pytestmark = pytest.mark.requires("prefix_caching")

T = list(range(100, 140))  # a shared text: tokens 100, 101, ...
OTHER = list(range(200, 240))


def make(checkpoint, caching: bool = True):
    return checkpoint.block_manager.BlockManager(10, 4, enable_prefix_caching=caching)


def make_seq(checkpoint, request_id: str, prompt: list[int], n: int = 1):
    params = checkpoint.SamplingParams(max_tokens=8, n=n)
    return checkpoint.sequence.Sequence(request_id, prompt, params, set(), max_model_len=64)


def admit(manager, seq, num_new: int | None = None) -> list[int]:
    """What the scheduler does to admit `seq`: take its cached prefix, then blocks for `num_new` more tokens
    (all of the rest if None). Returns the hits."""
    hits = manager.cached_prefix(seq)
    manager.take_prefix(seq, hits)
    num_new = seq.num_tokens - seq.num_computed_tokens if num_new is None else num_new
    manager.grow(seq, seq.num_computed_tokens + num_new)
    return hits


def state(manager) -> dict:
    allocator = manager.allocator
    return {
        "free": list(allocator.free_ids),
        "evictor": list(allocator.evictor),
        "refs": {b: count for b, count in enumerate(allocator.ref_counts) if count},
        "num_free": manager.num_free_blocks,
    }


def test_hits_reference_counts_and_eviction_order(checkpoint):
    manager = make(checkpoint)

    # a: 10 tokens of T in blocks 0, 1, 2; once computed, its two full blocks are remembered.
    a = make_seq(checkpoint, "a", T[:10])
    assert admit(manager, a) == [] and a.block_table == [0, 1, 2]
    manager.commit_computed(a, 10)
    assert sorted(manager.allocator.block_hashes) == [0, 1]  # block 2 is not full: never remembered
    assert state(manager) == {"free": [3, 4, 5, 6, 7, 8, 9], "evictor": [], "refs": {0: 1, 1: 1, 2: 1}, "num_free": 7}

    # b starts with a's 8 tokens: both full blocks are hits; it computes only its last 3 tokens, in block 3.
    b = make_seq(checkpoint, "b", T[:8] + [7, 8, 9])
    assert manager.num_blocks_to_admit(b, manager.cached_prefix(b), b.num_tokens) == 1
    assert admit(manager, b) == [0, 1]
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    manager.commit_computed(b, 3)
    assert state(manager) == {
        "free": [4, 5, 6, 7, 8, 9],
        "evictor": [],
        "refs": {0: 2, 1: 2, 2: 1, 3: 1},
        "num_free": 6,
    }

    # a leaves: its shared blocks keep one owner, its partial block is forgotten (back to the free list).
    manager.free(a)
    assert state(manager) == {"free": [4, 5, 6, 7, 8, 9, 2], "evictor": [], "refs": {0: 1, 1: 1, 3: 1}, "num_free": 7}

    # b leaves: its remembered blocks go to the evictor, deepest first (1 before 0); they count as free.
    manager.free(b)
    assert state(manager) == {"free": [4, 5, 6, 7, 8, 9, 2, 3], "evictor": [1, 0], "refs": {}, "num_free": 10}

    # c shares only T's first block: block 0 is taken back from the evictor; two new blocks from the free list.
    c = make_seq(checkpoint, "c", T[:4] + OTHER[:8])
    assert manager.num_blocks_to_admit(c, manager.cached_prefix(c), c.num_tokens) == 3  # 2 new + 1 leaving the evictor
    assert admit(manager, c) == [0] and c.block_table == [0, 4, 5]
    manager.commit_computed(c, 8)  # 12 tokens computed: blocks 4 and 5 are full and remembered
    assert sorted(manager.allocator.block_hashes) == [0, 1, 4, 5]
    assert state(manager) == {"free": [6, 7, 8, 9, 2, 3], "evictor": [1], "refs": {0: 1, 4: 1, 5: 1}, "num_free": 7}

    # d takes the whole free list (and is computed: six more remembered blocks); e then needs one block
    # more: the evictor gives up block 1, and T's second block is no longer cached.
    d = make_seq(checkpoint, "d", OTHER[8:32])
    assert admit(manager, d) == [] and d.block_table == [6, 7, 8, 9, 2, 3]
    manager.commit_computed(d, 24)
    e = make_seq(checkpoint, "e", [1, 2, 3])
    assert admit(manager, e) == [] and e.block_table == [1]
    assert sorted(manager.allocator.block_hashes) == [0, 2, 3, 4, 5, 6, 7, 8, 9]
    assert manager.cached_prefix(make_seq(checkpoint, "probe", T[:9])) == [0]  # the chain stops after block 0
    assert state(manager)["num_free"] == 0 and state(manager)["refs"] == {b: 1 for b in range(10)}

    # c leaves (5, 4, 0: deepest first), then e (block 1 was never full: free list).
    manager.free(c)
    manager.free(e)
    assert state(manager) == {
        "free": [1],
        "evictor": [5, 4, 0],
        "refs": {b: 1 for b in [2, 3, 6, 7, 8, 9]},
        "num_free": 4,
    }

    # f repeats c's 12 tokens exactly. A full-prompt hit still computes the last token, so f takes only the
    # first two blocks (from the evictor) and computes its last block again into a fresh one (1), which
    # stays anonymous: block 5 is remembered for that content already.
    f = make_seq(checkpoint, "f", T[:4] + OTHER[:8])
    assert admit(manager, f) == [0, 4] and f.num_computed_tokens == 8 and f.block_table == [0, 4, 1]
    manager.commit_computed(f, 4)
    assert 1 not in manager.allocator.block_hashes
    assert state(manager)["evictor"] == [5] and state(manager)["free"] == []

    # d leaves: its six blocks join the evictor after block 5, deepest first.
    manager.free(d)
    assert state(manager)["evictor"] == [5, 3, 2, 9, 8, 7, 6]

    # g needs two blocks and the free list is empty: the two least recently used go, 5 then 3, and are forgotten.
    g = make_seq(checkpoint, "g", [5, 6, 7, 8, 9, 10, 11])
    assert admit(manager, g) == [] and g.block_table == [5, 3]
    assert sorted(manager.allocator.block_hashes) == [0, 2, 4, 6, 7, 8, 9]
    assert state(manager) == {
        "free": [],
        "evictor": [2, 9, 8, 7, 6],
        "refs": {0: 1, 1: 1, 3: 1, 4: 1, 5: 1},
        "num_free": 5,
    }

    # Everyone leaves: every block is free again, the remembered ones in the evictor.
    manager.free(f)
    manager.free(g)
    assert manager.num_free_blocks == 10 and sorted(state(manager)["free"] + state(manager)["evictor"]) == list(
        range(10)
    )


def test_without_prefix_caching_nothing_is_remembered(checkpoint):
    manager = make(checkpoint, caching=False)
    a = make_seq(checkpoint, "a", T[:10])
    admit(manager, a)
    manager.commit_computed(a, 10)
    b = make_seq(checkpoint, "b", T[:10])
    assert admit(manager, b) == [] and b.block_table == [3, 4, 5] and b.num_computed_tokens == 0
    manager.free(a)
    assert list(manager.allocator.free_ids) == [6, 7, 8, 9, 0, 1, 2]


@pytest.mark.requires("parallel_sampling")
def test_a_fork_shares_every_block_and_copies_the_partial_one_on_write(checkpoint):
    manager = make(checkpoint)
    parent = make_seq(checkpoint, "r", T[:6], n=3)
    admit(manager, parent)  # blocks 0 (full) and 1 (2 of 4 slots)
    manager.commit_computed(parent, 6)
    children = [parent.fork(1), parent.fork(2)]
    for child in children:
        manager.fork(parent, child)
    assert [c.block_table for c in children] == [[0, 1], [0, 1]]
    assert state(manager)["refs"] == {0: 3, 1: 3}

    # Each writes its first generated token at position 6, in block 1: the first two writers get copies,
    # the last one is the only owner left and writes in place. Block 0 is full: never written, never copied.
    for seq in (parent, *children):
        seq.output_token_ids.append(7)
    assert manager.needs_copy(children[0]) and manager.num_missing_blocks(children[0], 7) == 1
    assert manager.copy_on_write(children[0]) == (1, 2)
    manager.grow(children[0], 7)
    assert manager.copy_on_write(children[1]) == (1, 3)
    manager.grow(children[1], 7)
    assert not manager.needs_copy(parent) and manager.copy_on_write(parent) is None
    manager.grow(parent, 7)
    assert [parent.block_table, children[0].block_table, children[1].block_table] == [[0, 1], [0, 2], [0, 3]]
    assert state(manager)["refs"] == {0: 3, 1: 1, 2: 1, 3: 1}
    for seq in (parent, *children):
        manager.free(seq)
    assert manager.num_free_blocks == 10


def test_hash_chain_depends_on_every_earlier_token(checkpoint):
    hash_block = checkpoint.prefix_caching.hash_block
    first = hash_block(b"", T[:4])
    assert hash_block(first, T[4:8]) != hash_block(hash_block(b"", OTHER[:4]), T[4:8])  # same block, other parent
    assert hash_block(b"", T[:4]) == first and len(first) == 32
