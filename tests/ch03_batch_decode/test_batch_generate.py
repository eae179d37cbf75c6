"""Batched generation: each request gets exactly what it gets alone, and what transformers gives."""

import pytest

from tests.oracle import hf_greedy
from tests.tiny_models import TINY_CONFIGS

# Prompts of all different lengths, from 1 token to more than 32.
MIXED_PROMPTS = [[7], [20, 21, 22], list(range(30, 37)), list(range(40, 60)), list(range(100, 133)), [5, 6]]


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_mixed_length_batch_matches_transformers(checkpoint, tiny_model_dirs, tiny_hf_models, name):
    llm = checkpoint.LLM(str(tiny_model_dirs[name]))
    outputs = llm.generate(MIXED_PROMPTS, checkpoint.SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    for prompt, output in zip(MIXED_PROMPTS, outputs):
        assert output.token_ids == hf_greedy(tiny_hf_models[name], prompt, 20)


def batch_size_option(checkpoint_info, size: int) -> dict:
    """Chapter 03 calls the limit `max_batch_size`; the step engine of chapter 07 adopts vLLM's `max_num_seqs`."""
    name = "max_num_seqs" if "step_engine" in checkpoint_info.capabilities else "max_batch_size"
    return {name: size}


def solo(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("max_batch_size", [1, 2, 4, 32])
def test_output_does_not_depend_on_the_batch(checkpoint, checkpoint_info, tiny_model_dirs, max_batch_size):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), **batch_size_option(checkpoint_info, max_batch_size))
    params = [checkpoint.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 17, 1, 9, 12, 5)]
    batched = llm.generate(MIXED_PROMPTS, params, use_tqdm=False)
    for prompt, p, output in zip(MIXED_PROMPTS, params, batched):
        assert output.token_ids == solo(llm, prompt, p)
        assert len(output.token_ids) == p.max_tokens and output.finish_reason == "length"


def test_seeded_sampling_in_a_batch_equals_sampling_alone(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    params = [
        checkpoint.SamplingParams(temperature=0.9, top_p=0.9, top_k=50, max_tokens=12, ignore_eos=True, seed=seed)
        for seed in range(len(MIXED_PROMPTS))
    ]
    batched = llm.generate(MIXED_PROMPTS, params, use_tqdm=False)
    for prompt, p, output in zip(MIXED_PROMPTS, params, batched):
        assert output.token_ids == solo(llm, prompt, p)


def test_per_request_sampling_params_in_one_batch(checkpoint, tiny_model_dirs, tiny_hf_models):
    llm = checkpoint.LLM(str(tiny_model_dirs["mqa_tied"]))
    greedy = checkpoint.SamplingParams(temperature=0, max_tokens=10)
    hot = checkpoint.SamplingParams(temperature=1.5, max_tokens=4, ignore_eos=True, seed=3)
    outputs = llm.generate(MIXED_PROMPTS, [greedy, hot] * 3, use_tqdm=False)
    for prompt, output in zip(MIXED_PROMPTS[::2], outputs[::2]):
        assert output.token_ids == hf_greedy(tiny_hf_models["mqa_tied"], prompt, 10)
    assert all(len(output.token_ids) == 4 for output in outputs[1::2])


@pytest.mark.model
def test_smollm2_batch_matches_transformers(checkpoint, smollm2_llm, smollm2_hf):
    questions = [
        "What is the capital of France?",
        "Name a color.",
        "Why is the sky blue? Answer briefly.",
        "Count from one to five.",
        "What is 2 + 2?",
    ]
    tokenizer = smollm2_llm.tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    outputs = smollm2_llm.generate(prompts, checkpoint.SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert len({len(o.prompt_token_ids) for o in outputs}) > 1  # really a mixed-length batch
    for output in outputs:
        assert output.token_ids == hf_greedy(smollm2_hf, output.prompt_token_ids, 32)
