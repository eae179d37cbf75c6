"""The PyTorch attention in mixed steps: rows grouped by kind and length, still equal to dense attention."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ch05_paged_attention.paged_data import dense_attention, make_problem

# A step of continuous batching: short and long decodes beside new prompts, one with a cached prefix.
MIXED_STEP = ([3, 200, 210, 17, 150, 5, 64], [1, 1, 1, 1, 150, 5, 40])


def test_decode_rows_are_grouped_apart_from_prompts_and_by_length(checkpoint):
    query_lens = [1, 1, 1, 1, 150, 5, 40]
    seq_lens = [3, 200, 210, 17, 150, 5, 64]
    groups = checkpoint.paged_attention.padding_groups(query_lens, seq_lens)
    # decodes first, longest first; 17 < 0.7 * 210 starts a new group, so does 3 < 0.7 * 17
    assert groups == [[2, 1], [3], [0], [4], [6], [5]]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 600), st.integers(1, 600)), min_size=1, max_size=40))
def test_every_row_is_in_exactly_one_group_of_one_kind(checkpoint, rows):
    seq_lens = [max(n, q) for n, q in rows]
    query_lens = [q if q > 1 else 1 for _, q in rows]
    groups = checkpoint.paged_attention.padding_groups(query_lens, seq_lens, min_fill=0.7)
    assert sorted(b for group in groups for b in group) == list(range(len(rows)))
    for group in groups:
        assert len({query_lens[b] == 1 for b in group}) == 1  # decode rows never pad to a prompt
        longest = max(seq_lens[b] for b in group)
        assert all(seq_lens[b] >= 0.7 * longest for b in group)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3)])
def test_mixed_step_equals_dense_attention(checkpoint, block_size, num_heads, num_kv_heads):
    seq_lens, query_lens = MIXED_STEP
    query, key_cache, value_cache, metadata, dense_k, dense_v = make_problem(
        checkpoint, seq_lens, query_lens, block_size, num_heads, num_kv_heads, head_dim=16, seed=7)
    expected = dense_attention(query, dense_k, dense_v, seq_lens, query_lens)
    for _ in range(2):  # the second call (the next layer) reuses the plan and the gather buffers
        out = checkpoint.paged_attention.paged_attention(query, key_cache, value_cache, metadata)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_buffers_work_inside_and_outside_inference_mode(checkpoint):
    seq_lens, query_lens = MIXED_STEP
    problem = make_problem(checkpoint, seq_lens, query_lens, 16, 4, 2, head_dim=8)
    expected = dense_attention(problem[0], *problem[4:], seq_lens, query_lens)
    with torch.inference_mode():
        inside = checkpoint.paged_attention.paged_attention(*problem[:4])
    problem = make_problem(checkpoint, seq_lens, query_lens, 16, 4, 2, head_dim=8)  # fresh metadata
    outside = checkpoint.paged_attention.paged_attention(*problem[:4])
    torch.testing.assert_close(inside, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outside, expected, atol=1e-5, rtol=1e-5)
