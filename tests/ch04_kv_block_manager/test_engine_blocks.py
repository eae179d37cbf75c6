"""The engine keeps block bookkeeping for every request, frees it all, and rejects what cannot fit."""

import pytest

from tests.ch03_batch_decode.test_batch_generate import MIXED_PROMPTS


def test_all_blocks_are_free_after_generate(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=4)
    total = llm.block_manager.num_total_blocks
    llm.generate(MIXED_PROMPTS, checkpoint.SamplingParams(temperature=0, max_tokens=9), use_tqdm=False)
    assert llm.block_manager.num_free_blocks == total
    assert all(count == 0 for count in llm.block_manager.allocator.ref_counts)


def test_a_small_pool_is_reused_across_requests(checkpoint, tiny_model_dirs):
    """12 blocks of 4 slots: only a few requests fit at once, the rest wait for blocks."""
    small = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=4, num_kv_blocks=12)
    large = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    params = checkpoint.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = large.generate(MIXED_PROMPTS, params, use_tqdm=False)
    seen_in_use = []
    allocator = small.block_manager.allocator
    allocate = allocator.allocate

    def recording_allocate():
        block = allocate()
        seen_in_use.append(allocator.num_total_blocks - allocator.num_free_blocks)
        return block

    allocator.allocate = recording_allocate
    got = small.generate(MIXED_PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert max(seen_in_use) == 12 and small.block_manager.num_free_blocks == 12  # the pool ran full


def test_a_request_that_can_never_fit_the_pool_is_rejected(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=4, num_kv_blocks=3)
    with pytest.raises(ValueError, match="num_kv_blocks=3"):
        llm.generate([list(range(10, 20))], checkpoint.SamplingParams(max_tokens=8), use_tqdm=False)
    ok = llm.generate([[10, 11]], checkpoint.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(ok[0].token_ids) >= 1 and llm.block_manager.num_free_blocks == 3
