"""Paged attention (PyTorch reference) equals dense masked attention; store_kv writes through slots."""

import pytest
import torch

from tests.ch05_paged_attention.paged_data import dense_attention, make_problem

CASES = {
    # name: (seq_lens, query_lens) — decode has query_len 1, prefill query_len == seq_len
    "decode_ragged": ([1, 16, 17, 33, 5], [1, 1, 1, 1, 1]),
    "prefill_ragged": ([1, 16, 17, 9], [1, 16, 17, 9]),
    "mixed_and_cached_prefix": ([20, 40, 7], [1, 24, 7]),  # the 2nd prompt's first 16 tokens are cached
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_paged_equals_dense(checkpoint, case, block_size, num_heads, num_kv_heads):
    seq_lens, query_lens = CASES[case]
    query, key_cache, value_cache, metadata, dense_k, dense_v = make_problem(
        checkpoint, seq_lens, query_lens, block_size, num_heads, num_kv_heads, head_dim=32
    )
    out = checkpoint.paged_attention.paged_attention(query, key_cache, value_cache, metadata)
    torch.testing.assert_close(
        out, dense_attention(query, dense_k, dense_v, seq_lens, query_lens), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_lengths_at_and_one_past_a_block_boundary(checkpoint, block_size):
    seq_lens = [block_size, block_size + 1, 2 * block_size, 2 * block_size + 1]
    query, key_cache, value_cache, metadata, dense_k, dense_v = make_problem(
        checkpoint, seq_lens, [1] * 4, block_size, 4, 2, head_dim=16, seed=block_size
    )
    out = checkpoint.paged_attention.paged_attention(query, key_cache, value_cache, metadata)
    torch.testing.assert_close(out, dense_attention(query, dense_k, dense_v, seq_lens, [1] * 4), atol=1e-5, rtol=1e-5)


def test_store_kv_writes_each_token_to_its_slot_and_skips_minus_one(checkpoint):
    key_cache = torch.zeros(4, 2, 1, 3)  # 4 blocks of 2 slots
    value_cache = torch.zeros_like(key_cache)
    key = torch.arange(3 * 3, dtype=torch.float32).reshape(3, 1, 3) + 1
    slots = torch.tensor([5, -1, 0])  # block 2 slot 1; skipped; block 0 slot 0
    checkpoint.paged_attention.store_kv(key, -key, key_cache, value_cache, slots)
    assert torch.equal(key_cache[2, 1], key[0]) and torch.equal(key_cache[0, 0], key[2])
    assert torch.equal(value_cache[2, 1], -key[0])
    assert int((key_cache != 0).sum()) == 6  # nothing else was touched


def test_metadata_positions_and_slots(checkpoint):
    """Block size 2. Sequence 0: 3 new tokens of 5, in blocks 7, 2, 6; sequence 1: 1 new of 4, in 5, 1."""
    tables = torch.tensor([[7, 2, 6], [5, 1, -1]], dtype=torch.int32)
    metadata = checkpoint.attention_metadata.AttentionMetadata.build([3, 1], [5, 4], tables, 2, torch.device("cpu"))
    assert metadata.positions.tolist() == [2, 3, 4, 3]
    # slot = block * block_size + position % block_size
    assert metadata.slot_mapping.tolist() == [2 * 2 + 0, 2 * 2 + 1, 6 * 2 + 0, 1 * 2 + 1]
    assert metadata.query_start_loc.tolist() == [0, 3, 4]
    assert (metadata.max_query_len, metadata.max_seq_len) == (3, 5)
