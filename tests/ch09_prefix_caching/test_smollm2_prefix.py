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
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True) for chat in chats]
    shared = next(i for i, tokens in enumerate(zip(*prompts)) if len(set(tokens)) > 1)  # tokens all prompts share
    params = checkpoint.SamplingParams(temperature=0, max_tokens=12)
    first = llm.generate([prompts[0]], params, use_tqdm=False)  # computes and caches the system prompt
    later = llm.generate(prompts[1:], params, use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in later] == [shared // 16 * 16] * 2 and shared >= 32
    for prompt, output in zip(prompts, first + later):
        assert output.token_ids == hf_greedy(smollm2_hf, prompt, 12)
