"""SmolLM2 with a shared system prompt: prefix hits change nothing in the greedy tokens (transformers is the
oracle), and the later requests find the system prompt's full blocks in the cache."""

import pytest

from tests.oracle import hf_greedy

pytestmark = pytest.mark.requires("prefix_caching")

SYSTEM = (
    "You are a patient teacher. Answer in one short sentence, with plain words, and never mention that you "
    "are a language model. If a question has several answers, give the most common one."
)


@pytest.mark.model
def test_smollm2_shared_system_prompt_hits_the_cache_and_matches_transformers(checkpoint, smollm2_path, smollm2_hf):
    llm = checkpoint.LLM(block_size=16)
    tokenizer = llm.tokenizer
    chats = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        for question in ["What is the capital of France?", "Name a fruit.", "What is 3 + 4?"]
    ]
    prompts = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in chats]
    token_ids = [tokenizer.encode(prompt) for prompt in prompts]  # as the engine tokenizes a str prompt
    params = checkpoint.SamplingParams(temperature=0, max_tokens=12)
    for i, (prompt, ids) in enumerate(zip(prompts, token_ids)):
        [output] = llm.generate([prompt], params, use_tqdm=False)  # one at a time: each finds the ones before
        shared = max((common_prefix(ids, earlier) for earlier in token_ids[:i]), default=0)
        assert output.num_cached_tokens == min(shared, len(ids) - 1) // 16 * 16
        assert output.prompt_token_ids == ids and output.token_ids == hf_greedy(smollm2_hf, ids, 12)
    assert common_prefix(*token_ids[:2]) >= 32  # the system prompt fills two blocks at least


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
