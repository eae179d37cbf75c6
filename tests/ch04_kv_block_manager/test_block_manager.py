"""The block manager, case by case (in the manner of vLLM's block-manager tests) and by property."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.requires("batch_state")


def test_allocate_until_the_pool_is_exhausted(checkpoint):
    manager = checkpoint.block_manager.BlockManager(num_blocks=8, block_size=4)
    for i in range(8):
        assert manager.can_allocate(4)
        manager.allocate(f"s{i}", 4)  # one block each
    assert manager.num_free_blocks == 0 and not manager.can_allocate(1)
    with pytest.raises(checkpoint.block_manager.NoFreeBlocksError, match="free"):
        manager.allocate("one-too-many", 1)
    assert "one-too-many" not in manager.block_tables  # a failed allocation leaves no trace


def test_free_prevents_running_out(checkpoint):
    manager = checkpoint.block_manager.BlockManager(num_blocks=4, block_size=4)
    for round_ in range(10):  # far more sequences than the pool holds at once
        manager.allocate(f"s{round_}", 16)
        assert manager.num_free_blocks == 0
        manager.free(f"s{round_}")
        assert manager.num_free_blocks == 4


def test_free_counts_track_every_operation(checkpoint):
    manager = checkpoint.block_manager.BlockManager(num_blocks=10, block_size=4)
    manager.allocate("a", 5)  # 2 blocks
    assert manager.num_free_blocks == 8
    manager.allocate("b", 12)  # 3 blocks, exactly full
    assert manager.num_free_blocks == 5
    manager.append_slot("a")  # 6 tokens: still 2 blocks
    assert manager.num_free_blocks == 5
    manager.append_slot("b")  # 13 tokens: a 4th block
    assert manager.num_free_blocks == 4
    manager.free("a")
    assert manager.num_free_blocks == 6
    manager.free("b")
    assert manager.num_free_blocks == manager.num_total_blocks == 10


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_append_allocates_exactly_at_block_boundaries(checkpoint, block_size):
    manager = checkpoint.block_manager.BlockManager(num_blocks=64, block_size=block_size)
    manager.allocate("s", 1)
    for num_tokens in range(2, 3 * block_size + 2):
        full_before = (num_tokens - 1) % block_size == 0
        new_block = manager.append_slot("s")
        assert (new_block is not None) == full_before, num_tokens
        assert len(manager.block_tables["s"]) == -(-num_tokens // block_size)
        assert manager.num_tokens["s"] == num_tokens


def test_can_append_needs_a_free_block_only_when_the_last_is_full(checkpoint):
    manager = checkpoint.block_manager.BlockManager(num_blocks=2, block_size=4)
    manager.allocate("a", 3)
    manager.allocate("b", 4)
    assert manager.num_free_blocks == 0
    assert manager.can_append("a")  # a has a free slot in its block
    assert not manager.can_append("b")  # b's only block is full
    with pytest.raises(checkpoint.block_manager.NoFreeBlocksError):
        manager.append_slot("b")


def test_reference_counts_keep_shared_blocks_alive(checkpoint):
    manager = checkpoint.block_manager.BlockManager(num_blocks=8, block_size=4)
    table = list(manager.allocate("parent", 8))
    manager.fork("parent", "child")
    assert manager.block_tables["child"] == table
    assert all(manager.allocator.ref_counts[b] == 2 for b in table)
    assert manager.num_free_blocks == 6  # sharing costs nothing
    manager.free("parent")
    assert manager.num_free_blocks == 6  # the child still holds them
    assert all(manager.allocator.ref_counts[b] == 1 for b in table)
    manager.free("child")
    assert manager.num_free_blocks == 8


def test_misuse_is_refused(checkpoint):
    module = checkpoint.block_manager
    manager = module.BlockManager(num_blocks=4, block_size=4)
    manager.allocate("a", 4)
    with pytest.raises(ValueError, match="already has blocks"):
        manager.allocate("a", 4)
    allocator = module.BlockAllocator(2)
    block = allocator.allocate()
    allocator.free(block)
    with pytest.raises(ValueError, match="already free"):
        allocator.free(block)
    with pytest.raises(ValueError):
        module.BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(ValueError):
        module.BlockManager(num_blocks=4, block_size=0)


operations = st.lists(
    st.tuples(st.sampled_from(["allocate", "append", "free", "fork"]), st.integers(0, 7), st.integers(1, 40)),
    max_size=60,
)


# `checkpoint` only selects a module, so sharing it across examples is safe.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations, num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
def test_random_operations_keep_the_invariants(checkpoint, ops, num_blocks, block_size):
    module = checkpoint.block_manager
    manager = module.BlockManager(num_blocks, block_size)
    for op, seq, num_tokens in ops:
        seq_id, live = f"s{seq}", f"s{seq}" in manager.block_tables
        try:
            if op == "allocate" and not live:
                fits = manager.can_allocate(num_tokens)
                free_before = manager.num_free_blocks
                try:
                    manager.allocate(seq_id, num_tokens)
                    assert fits
                except module.NoFreeBlocksError:
                    assert not fits and manager.num_free_blocks == free_before
            elif op == "append" and live:
                if manager.can_append(seq_id):
                    manager.append_slot(seq_id)
                else:
                    with pytest.raises(module.NoFreeBlocksError):
                        manager.append_slot(seq_id)
            elif op == "free" and live:
                manager.free(seq_id)
            elif op == "fork" and live and f"f{seq}" not in manager.block_tables:
                manager.fork(seq_id, f"f{seq}")
        finally:
            check_invariants(manager)
    for seq_id in list(manager.block_tables):
        manager.free(seq_id)
    assert manager.num_free_blocks == num_blocks  # nothing leaks
    assert all(count == 0 for count in manager.allocator.ref_counts)
    reused = [manager.allocator.allocate() for _ in range(num_blocks)]  # every freed block is reusable
    assert sorted(reused) == list(range(num_blocks))


def check_invariants(manager):
    owners: dict[int, int] = {}
    for seq_id, table in manager.block_tables.items():
        assert len(table) == manager.blocks_needed(manager.num_tokens[seq_id])
        assert len(set(table)) == len(table)  # no block twice in one table
        for block in table:
            owners[block] = owners.get(block, 0) + 1
    free = set(manager.allocator.free_ids)
    assert len(free) == manager.num_free_blocks
    assert not free & owners.keys()  # a free block is owned by nobody
    assert len(free) + len(owners) == manager.num_total_blocks  # free + used = total
    for block, count in owners.items():  # owned blocks: the reference count is the number of owners
        assert manager.allocator.ref_counts[block] == count
