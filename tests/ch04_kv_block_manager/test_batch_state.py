"""The batch state, field by field after each operation (in the manner of a batch-bucket test)."""

import pytest
import torch

pytestmark = pytest.mark.requires("batch_state")


def make(checkpoint, max_batch_size=4, max_blocks=5, block_size=4):
    return checkpoint.batch_state.BatchState(max_batch_size, max_blocks, block_size)


def fields(state):
    return state.seq_ids, state.seq_lens.tolist(), state.block_tables.tolist()


def test_add_fills_rows_in_order(checkpoint):
    state = make(checkpoint)
    assert state.size == 0 and torch.all(state.block_tables == -1)
    assert state.add("a", 5, [7, 2]) == 0
    assert state.add("b", 4, [3]) == 1
    assert fields(state) == (
        ["a", "b"],
        [5, 4, 0, 0],
        [[7, 2, -1, -1, -1], [3, -1, -1, -1, -1], [-1] * 5, [-1] * 5],
    )


def test_append_token_takes_a_new_block_only_at_the_boundary(checkpoint):
    state = make(checkpoint)
    state.add("a", 3, [9])
    state.append_token("a")  # 4 tokens: block 9 is now full
    with pytest.raises(ValueError, match="new block"):
        state.append_token("a")  # a 5th token needs a block
    state.append_token("a", new_block_id=1)
    assert fields(state)[1:] == ([5, 0, 0, 0], [[9, 1, -1, -1, -1]] + [[-1] * 5] * 3)
    with pytest.raises(ValueError, match="new block"):
        state.append_token("a", new_block_id=4)  # block 1 still has room


def test_remove_compacts_the_rows_below(checkpoint):
    state = make(checkpoint)
    state.add("a", 1, [0])
    state.add("b", 6, [1, 2])
    state.add("c", 9, [3, 4, 5])
    state.remove("b")
    assert fields(state) == (
        ["a", "c"],
        [1, 9, 0, 0],
        [[0, -1, -1, -1, -1], [3, 4, 5, -1, -1], [-1] * 5, [-1] * 5],
    )
    state.remove("c")
    state.remove("a")
    assert fields(state) == ([], [0] * 4, [[-1] * 5] * 4)


def test_merge_appends_the_other_batch_and_empties_it(checkpoint):
    first, second = make(checkpoint), make(checkpoint)
    first.add("a", 2, [0])
    second.add("b", 5, [1, 2])
    second.add("c", 1, [3])
    first.merge(second)
    assert fields(first) == (
        ["a", "b", "c"],
        [2, 5, 1, 0],
        [[0, -1, -1, -1, -1], [1, 2, -1, -1, -1], [3, -1, -1, -1, -1], [-1] * 5],
    )
    assert fields(second) == ([], [0] * 4, [[-1] * 5] * 4)
    full = make(checkpoint)
    for name in "wxy":
        full.add(name, 1, [9])
    with pytest.raises(ValueError, match="exceed max_batch_size"):
        first.merge(full)


def test_clear_and_limits(checkpoint):
    state = make(checkpoint, max_batch_size=2)
    state.add("a", 1, [0])
    with pytest.raises(ValueError, match="already in the batch"):
        state.add("a", 1, [1])
    state.add("b", 1, [1])
    with pytest.raises(ValueError, match="batch is full"):
        state.add("c", 1, [2])
    with pytest.raises(ValueError, match="cannot hold"):
        make(checkpoint).add("d", 9, [0, 1])  # 2 blocks of 4 hold 8 tokens
    state.clear()
    assert fields(state) == ([], [0, 0], [[-1] * 5] * 2)
