"""With a KV cache, the model sees the prompt once, then one token per step, and the output is unchanged."""

import pytest
import torch

from tests.oracle import hf_greedy
from tests.tiny_models import TINY_CONFIGS


def count_tokens_per_forward(llm) -> list[int]:
    """Record how many tokens each call of the model processes."""
    counts = []
    llm.model.register_forward_pre_hook(lambda module, args: counts.append(args[0].numel()))
    return counts


def test_prefill_once_then_one_token_per_step(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    counts = count_tokens_per_forward(llm)
    params = checkpoint.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm.generate([list(range(20, 33))], params, use_tqdm=False)
    assert counts == [13] + [1] * 9  # the 10th token needs no forward of its own afterwards


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
@pytest.mark.parametrize("prompt_len", [1, 2, 50])
def test_long_cached_generation_matches_transformers(checkpoint, tiny_model_dirs, tiny_hf_models, name, prompt_len):
    llm = checkpoint.LLM(str(tiny_model_dirs[name]))
    prompt = torch.randint(
        3, llm.model.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len)
    ).tolist()
    [output] = llm.generate([prompt], checkpoint.SamplingParams(temperature=0, max_tokens=120), use_tqdm=False)
    assert output.token_ids == hf_greedy(tiny_hf_models[name], prompt, 120)


@pytest.mark.model
def test_smollm2_long_greedy_matches_transformers(checkpoint, smollm2_llm, smollm2_hf):
    """Over 100 tokens decoded from the cache, every one transformers' greedy token."""
    tokenizer = smollm2_llm.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a long story about a robot."}], tokenize=False, add_generation_prompt=True
    )
    params = checkpoint.SamplingParams(temperature=0, max_tokens=120)
    [output] = smollm2_llm.generate([prompt], params, use_tqdm=False)
    assert len(output.token_ids) > 100
    assert output.token_ids == hf_greedy(smollm2_hf, output.prompt_token_ids, 120)
