"""The engine on the paged pool: exact greedy output with blocks reused across requests, sized pools."""

import pytest
import torch

from tests.ch03_batch_decode.test_batch_generate import MIXED_PROMPTS, batch_size_option
from tests.engine_options import no_prefix_caching
from tests.oracle import hf_greedy


def record_allocations(llm) -> list[int]:
    """Every block id the engine's allocator hands out, in order, over the run."""
    allocator = llm.block_manager.allocator
    allocated, allocate = [], allocator.allocate

    def recording_allocate():
        allocated.append(allocate())
        return allocated[-1]

    allocator.allocate = recording_allocate
    return allocated


def test_small_pool_reuses_blocks_and_stays_exact(checkpoint, tiny_model_dirs, tiny_hf_models):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=4, num_kv_blocks=14)
    allocated = record_allocations(llm)
    outputs = llm.generate(MIXED_PROMPTS, checkpoint.SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for prompt, output in zip(MIXED_PROMPTS, outputs):
        assert output.token_ids == hf_greedy(tiny_hf_models["gqa"], prompt, 16)
    assert len(set(allocated)) < len(allocated), "no block was handed out twice (freed and reused)"
    assert llm.block_manager.num_free_blocks == 14


def test_admission_waits_for_free_blocks(checkpoint, tiny_model_dirs):
    """A pool with room for one request at a time runs them one at a time, all to completion (with prefix
    caching off from chapter 09 on: the identical prompts would share blocks)."""
    options = no_prefix_caching(checkpoint)
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=4, num_kv_blocks=5, **options)  # 20 slots
    prompts = [list(range(10, 20))] * 3  # 10 prompt + 8 new - 1 = 17 slots: 5 blocks each
    manager = llm.block_manager
    peak_used = []  # blocks in use after each allocation
    allocate = manager.allocator.allocate

    def recording_allocate():
        block = allocate()
        peak_used.append(manager.num_total_blocks - manager.num_free_blocks)
        return block

    manager.allocator.allocate = recording_allocate
    outputs = llm.generate(
        prompts, checkpoint.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert all(len(o.token_ids) == 8 for o in outputs)
    # 15 allocations (5 blocks each); the pool was emptied between requests, so the count restarted from 1 twice
    assert len(peak_used) == 15 and peak_used.count(1) == 3
    assert outputs[0].token_ids == outputs[1].token_ids == outputs[2].token_ids


def test_pool_size_from_a_memory_budget(checkpoint, tiny_model_dirs):
    config = checkpoint.config.ModelConfig.from_json(tiny_model_dirs["gqa"] / "config.json")
    per_token = checkpoint.kv_pool.KVPool.bytes_per_token(config, torch.float32)
    # tiny model: 2 (K, V) x 2 layers x 2 KV heads x 16 dims x 4 bytes
    assert per_token == 2 * 2 * 2 * 16 * 4
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=8, kv_cache_memory=100 * 8 * per_token)
    assert llm.block_manager.num_total_blocks == 100


def test_default_pool_is_capped_by_what_the_batch_can_use(checkpoint, checkpoint_info, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=16, **batch_size_option(checkpoint_info, 4))
    assert llm.block_manager.num_total_blocks == 4 * (256 // 16)  # max_model_len 256


@pytest.mark.model
def test_smollm2_on_a_small_pool_matches_transformers(checkpoint, smollm2_hf, smollm2_path):
    llm = checkpoint.LLM(block_size=16, num_kv_blocks=7)  # one request (5 blocks) at a time
    questions = ["What is the capital of France?", "Name two planets.", "What is a noun?"]
    prompts = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    allocated = record_allocations(llm)
    outputs = llm.generate(prompts, checkpoint.SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for output in outputs:
        assert output.token_ids == hf_greedy(smollm2_hf, output.prompt_token_ids, 32)
    assert len(set(allocated)) < len(allocated)  # blocks were freed and handed out again
    assert llm.block_manager.num_free_blocks == 7
