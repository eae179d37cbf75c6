"""The "torch" backend of mixed steps: rows grouped by kind and length, equal to the reference attention."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ch05_paged_attention.paged_data import dense_attention, make_problem
from tests.engine_options import default_cpu_backend

# A step of continuous batching: short and long decodes beside new prompts, one with a cached prefix.
MIXED_STEP = ([3, 200, 210, 17, 150, 5, 64], [1, 1, 1, 1, 150, 5, 40])


def grouped_attention(checkpoint, problem, block_size, backend=None):
    """Plan the forward once, then run the attention twice, as two layers would (the second reuses the plan
    and its gather buffers). Returns both outputs."""
    query, key_cache, value_cache, metadata = problem[:4]
    backend = backend or checkpoint.grouped_attention.GroupedAttentionBackend()
    metadata.plan = backend.plan(metadata, block_size)
    return [backend.paged_attention(query, key_cache, value_cache, metadata) for _ in range(2)]


def test_decode_rows_are_grouped_apart_from_prompts_and_by_length(checkpoint):
    query_lens = [1, 1, 1, 1, 150, 5, 40]
    seq_lens = [3, 200, 210, 17, 150, 5, 64]
    groups = checkpoint.grouped_attention.padding_groups(query_lens, seq_lens)
    # decodes first, longest first; 17 < 0.7 * 210 starts a new group, so does 3 < 0.7 * 17
    assert groups == [[2, 1], [3], [0], [4], [6], [5]]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 600), st.integers(1, 600)), min_size=1, max_size=40))
def test_every_row_is_in_exactly_one_group_of_one_kind(checkpoint, rows):
    seq_lens = [max(n, q) for n, q in rows]
    query_lens = [q if q > 1 else 1 for _, q in rows]
    groups = checkpoint.grouped_attention.padding_groups(query_lens, seq_lens, min_fill=0.7)
    assert sorted(b for group in groups for b in group) == list(range(len(rows)))
    for group in groups:
        assert len({query_lens[b] == 1 for b in group}) == 1  # decode rows never pad to a prompt
        longest = max(seq_lens[b] for b in group)
        assert all(seq_lens[b] >= 0.7 * longest for b in group)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (9, 3)])
def test_mixed_step_equals_the_reference_and_dense_attention(checkpoint, block_size, num_heads, num_kv_heads):
    seq_lens, query_lens = MIXED_STEP
    problem = make_problem(checkpoint, seq_lens, query_lens, block_size, num_heads, num_kv_heads, head_dim=16, seed=7)
    expected = dense_attention(problem[0], *problem[4:], seq_lens, query_lens)
    reference = checkpoint.paged_attention.paged_attention(*problem[:4])
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)
    for out in grouped_attention(checkpoint, problem, block_size):
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 70)), min_size=1, max_size=8),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_random_batches_equal_the_reference(checkpoint, rows, block_size, seed):
    seq_lens = [n + q for n, q in rows]  # n cached or new tokens, then q more (a decode when q <= 1)
    query_lens = [max(1, q) if q > 1 else 1 for _, q in rows]
    seq_lens = [max(s, q) for s, q in zip(seq_lens, query_lens)]
    problem = make_problem(checkpoint, seq_lens, query_lens, block_size, 6, 2, head_dim=8, seed=seed)
    reference = checkpoint.paged_attention.paged_attention(*problem[:4])
    for out in grouped_attention(checkpoint, problem, block_size):
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_attention_refuses_a_forward_it_has_not_planned(checkpoint):
    seq_lens, query_lens = MIXED_STEP
    problem = make_problem(checkpoint, seq_lens, query_lens, 16, 4, 2, head_dim=8)
    backend = checkpoint.grouped_attention.GroupedAttentionBackend()
    with pytest.raises(RuntimeError, match="plan"):
        backend.paged_attention(*problem[:4])
    problem[3].plan = backend.plan(problem[3], 16)
    other = make_problem(checkpoint, seq_lens, query_lens, 16, 4, 2, head_dim=8)  # another forward's metadata
    with pytest.raises(RuntimeError, match="plan"):
        backend.paged_attention(*other[:4])


def test_buffers_work_inside_and_outside_inference_mode(checkpoint):
    seq_lens, query_lens = MIXED_STEP
    backend = checkpoint.grouped_attention.GroupedAttentionBackend()
    problem = make_problem(checkpoint, seq_lens, query_lens, 16, 4, 2, head_dim=8)
    expected = dense_attention(problem[0], *problem[4:], seq_lens, query_lens)
    with torch.inference_mode():
        inside = grouped_attention(checkpoint, problem, 16, backend)[0]
    outside = grouped_attention(checkpoint, problem, 16, backend)[0]
    torch.testing.assert_close(inside, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outside, expected, atol=1e-5, rtol=1e-5)


def test_each_engine_has_its_own_backend(checkpoint, tiny_model_dirs):
    first, second = (checkpoint.LLMEngine(str(tiny_model_dirs["gqa"])) for _ in range(2))
    assert first.model_runner.attention_backend.name == default_cpu_backend(checkpoint)
    assert first.model_runner.attention_backend is not second.model_runner.attention_backend
