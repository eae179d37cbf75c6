"""The compiled decode kernel reads the pool in place and gives what dense attention gives; the "cpu"
backend does the same on mixed steps (decode rows in place, prompt rows by grouped SDPA)."""

import pytest
import torch

from tests.ch05_paged_attention.paged_data import dense_attention, make_problem

pytestmark = [pytest.mark.requires("compiled"), pytest.mark.cpu_features]

# (seq_lens, heads, kv_heads): one sequence, a ragged batch, GQA / MQA / MHA groupings
DECODE_BATCHES = [
    ([1], 4, 2),
    ([37], 4, 1),
    ([5, 1, 33, 16, 17], 4, 2),
    ([64, 3, 48, 2, 9, 30, 31], 4, 4),
]


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seq_lens, heads, kv_heads", DECODE_BATCHES)
def test_decode_attention_equals_dense(checkpoint, seq_lens, heads, kv_heads, block_size):
    query_lens = [1] * len(seq_lens)
    query, key_cache, value_cache, metadata, dense_k, dense_v = make_problem(
        checkpoint, seq_lens, query_lens, block_size, heads, kv_heads, head_dim=8
    )
    tables = metadata.block_tables.clamp(min=0).long()
    expected = dense_attention(query, dense_k, dense_v, seq_lens, query_lens)
    for attend in (checkpoint.cpu_attention.decode_attention, checkpoint.cpu_attention.compiled_decode_attention):
        out = attend(query, key_cache, value_cache, tables, metadata.seq_lens)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_cpu_backend_on_a_mixed_step(checkpoint, block_size):
    """Decode rows of several lengths beside prompts: two fresh (attending to their own new keys), one after a
    cached beginning (grouped SDPA over the pool)."""
    seq_lens, query_lens = [40, 1, 17, 23, 9, 30, 64], [1, 1, 17, 5, 1, 30, 1]
    query, key_cache, value_cache, metadata, dense_k, dense_v = make_problem(
        checkpoint, seq_lens, query_lens, block_size, 4, 2, head_dim=8
    )
    backend = checkpoint.attention_backend.get_attention_backend("cpu", "cpu")
    assert backend.name == "cpu"
    metadata.plan = backend.plan(metadata, block_size)
    assert len(metadata.plan.fresh_prompts) == 2  # the 17- and 30-token prompts: every token new, nothing cached
    # the step's new keys and values (already in the pool: storing them again changes nothing)
    new_keys = torch.cat([k[n - q :] for k, n, q in zip(dense_k, seq_lens, query_lens)])
    new_values = torch.cat([v[n - q :] for v, n, q in zip(dense_v, seq_lens, query_lens)])
    backend.store_kv(new_keys, new_values, key_cache, value_cache, metadata.slot_mapping)
    out = backend.paged_attention(query, key_cache, value_cache, metadata)
    torch.testing.assert_close(
        out, dense_attention(query, dense_k, dense_v, seq_lens, query_lens), atol=1e-5, rtol=1e-5
    )
