"""Chapter 07's block manager: it grows and frees the block table that each sequence holds itself."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.requires("sequence_blocks")


def make_seq(checkpoint, request_id: str, num_tokens: int = 1):
    return checkpoint.sequence.Sequence(request_id, [3] * num_tokens, checkpoint.SamplingParams(), set(), 1000)


def test_grow_and_free_by_hand(checkpoint):
    manager = checkpoint.block_manager.BlockManager(num_blocks=6, block_size=4)
    a, b = make_seq(checkpoint, "a"), make_seq(checkpoint, "b")
    manager.grow(a, 5)
    assert a.block_table == [0, 1]  # 5 slots: 2 blocks
    manager.grow(b, 3)
    assert b.block_table == [2]
    manager.grow(a, 8)
    assert a.block_table == [0, 1]  # the second block still has room
    manager.grow(a, 9)
    assert a.block_table == [0, 1, 3]
    assert (a.block_table, b.block_table, manager.num_free_blocks) == ([0, 1, 3], [2], 2)
    manager.free(b)
    assert b.block_table == [] and list(manager.allocator.free_ids) == [4, 5, 2]  # freed blocks go last
    manager.grow(b, 12)
    assert b.block_table == [4, 5, 2]
    assert manager.num_free_blocks == 0


def test_growth_is_all_or_nothing(checkpoint):
    module = checkpoint.block_manager
    manager = module.BlockManager(num_blocks=3, block_size=2)
    a, b = make_seq(checkpoint, "a"), make_seq(checkpoint, "b")
    manager.grow(a, 3)  # 2 blocks
    assert not manager.can_grow(b, 3) and manager.num_missing_blocks(b, 3) == 2
    with pytest.raises(module.NoFreeBlocksError, match="'b' needs 2 blocks, 1 are free"):
        manager.grow(b, 3)
    assert b.block_table == [] and manager.num_free_blocks == 1
    assert manager.can_grow(a, 6) and not manager.can_grow(a, 7)


def test_the_allocator_state_is_saved_and_restored_exactly(checkpoint):
    manager = checkpoint.block_manager.BlockManager(num_blocks=5, block_size=1)
    a = make_seq(checkpoint, "a")
    manager.grow(a, 2)
    saved, table = manager.allocator.save(), list(a.block_table)
    manager.free(a)
    manager.grow(make_seq(checkpoint, "b"), 4)
    manager.allocator.restore(saved)
    a.block_table = table
    assert list(manager.allocator.free_ids) == [2, 3, 4]
    assert manager.allocator.ref_counts == [1, 1, 0, 0, 0]


def test_misuse_is_refused(checkpoint):
    module = checkpoint.block_manager
    allocator = module.BlockAllocator(2)
    block = allocator.allocate()
    allocator.free(block)
    with pytest.raises(ValueError, match="already free"):
        allocator.free(block)
    with pytest.raises(ValueError):
        module.BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError):
        module.BlockManager(num_blocks=4, block_size=0)


operations = st.lists(st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(1, 40)), max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
def test_random_operations_keep_the_invariants(checkpoint, ops, num_blocks, block_size):
    module = checkpoint.block_manager
    manager = module.BlockManager(num_blocks, block_size)
    seqs = [make_seq(checkpoint, f"s{i}") for i in range(6)]
    slots = [0] * 6  # what each sequence's table must hold
    for op, i, num_tokens in ops:
        if op == "grow":
            fits = manager.can_grow(seqs[i], num_tokens)
            before = list(seqs[i].block_table)
            try:
                manager.grow(seqs[i], num_tokens)
                assert fits
                slots[i] = max(slots[i], num_tokens)
            except module.NoFreeBlocksError:
                assert not fits and seqs[i].block_table == before
        else:
            manager.free(seqs[i])
            slots[i] = 0
        owned = [block for seq in seqs for block in seq.block_table]
        assert len(owned) == len(set(owned))  # no block in two tables
        assert len(owned) + manager.num_free_blocks == num_blocks
        assert all(len(seq.block_table) == manager.blocks_needed(n) for seq, n in zip(seqs, slots))
        assert all(manager.allocator.ref_counts[b] == 1 for b in owned)
    for seq in seqs:
        manager.free(seq)
    assert manager.num_free_blocks == num_blocks and not any(manager.allocator.ref_counts)
