"""The fast path (packed GEMMs, compiled layers, the "cpu" attention backend) against the reference path
(eager layers, chapter 05's attention): greedy tokens equal and logits within tolerance, under budgets that
chunk every prompt, pools that force preemption, shared prefixes and block sizes 1 and 16; and against
transformers."""

import pytest
import torch

from tests.ch09_prefix_caching.engine_runs import run
from tests.engine_options import logits_tolerance
from tests.oracle import hf_greedy, hf_logits

pytestmark = [pytest.mark.requires("compiled"), pytest.mark.cpu_features]


SHARED = [(j * 31) % 300 + 3 for j in range(21)]


def prompt(index: int, length: int) -> list[int]:
    return [(index * 41 + j * 13) % 300 + 3 for j in range(length)]


# (arrival step, prompt, max_tokens): arrivals over time, shared beginnings, one prompt longer than a budget
REQUESTS = [
    (1, SHARED + prompt(0, 4), 11),
    (1, prompt(1, 3), 14),
    (2, SHARED + prompt(2, 9), 9),
    (3, prompt(3, 40), 6),
    (5, SHARED + prompt(0, 4), 7),
    (5, [7], 10),
    (8, prompt(4, 17), 12),
]

FAST = {}
REFERENCE = {"enforce_eager": True, "attention_backend": "reference"}


def engine(checkpoint, path, block_size: int, budget: int, path_options: dict):
    largest = max(-(-(len(p) + n) // block_size) for _, p, n in REQUESTS)
    return checkpoint.LLMEngine(
        str(path),
        block_size=block_size,
        num_kv_blocks=largest + largest // 3,  # room for the largest and a third: running requests preempt
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        watermark=0.0,
        **path_options,
    )


@pytest.mark.parametrize("block_size, budget", [(1, 8), (16, 8), (16, 64)])  # 64: no prompt chunked
def test_fast_path_equals_reference_and_transformers(checkpoint, tiny_model_dirs, tiny_hf_models, block_size, budget):
    def greedy(index, max_tokens):
        return checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    fast = run(engine(checkpoint, tiny_model_dirs["gqa"], block_size, budget, FAST), REQUESTS, greedy)
    reference = run(engine(checkpoint, tiny_model_dirs["gqa"], block_size, budget, REFERENCE), REQUESTS, greedy)
    assert fast.tokens == reference.tokens
    assert fast.num_preemptions > 0 and sum(fast.num_cached_tokens.values()) > 0  # both were in play
    assert budget == 64 or max(len(p) for _, p, _ in REQUESTS) > budget  # under budget 8, prompts were chunked
    for index, (_, ids, max_tokens) in enumerate(REQUESTS):
        expected = hf_greedy(tiny_hf_models["gqa"], ids, max_tokens)  # stops at EOS, which we ignore
        assert fast.tokens[str(index)][0][: len(expected)] == expected


@pytest.mark.parametrize("name", ["gqa", "mha_tied", "mqa_tied"])
def test_fast_logits_within_tolerance_of_transformers(checkpoint, tiny_model_dirs, tiny_hf_models, name):
    ids = SHARED + prompt(5, 30)
    fast = checkpoint.LLM(str(tiny_model_dirs[name]))
    reference = checkpoint.LLM(str(tiny_model_dirs[name]), **REFERENCE)
    expected = hf_logits(tiny_hf_models[name], ids)
    torch.testing.assert_close(fast.prompt_logits(ids), expected, **logits_tolerance(checkpoint))
    torch.testing.assert_close(reference.prompt_logits(ids), expected, **logits_tolerance(checkpoint))


@pytest.mark.model
def test_smollm2_fast_path_equals_transformers(checkpoint, smollm2_llm, smollm2_hf):
    """A batch of chat prompts on the fast path (checked to be the one running): every greedy token equal to
    transformers', and one prompt's logits within the tolerance. (Chapter 03's questions: transformers'
    answers are computed once for both tests.)"""
    runner = smollm2_llm.llm_engine.model_runner
    assert runner.attention_backend.name == "cpu" and not runner.enforce_eager
    assert isinstance(smollm2_llm.model.lm_head, checkpoint.packed_linear.PackedLinear)
    tokenizer = smollm2_llm.tokenizer
    questions = ["What is the capital of France?", "Name a color.", "Why is the sky blue? Answer briefly."]
    questions += ["Count from one to five.", "What is 2 + 2?"]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    outputs = smollm2_llm.generate(prompts, checkpoint.SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    for output in outputs:
        assert output.token_ids == hf_greedy(smollm2_hf, output.prompt_token_ids, 32)
    ids = outputs[2].prompt_token_ids
    torch.testing.assert_close(
        smollm2_llm.prompt_logits(ids), hf_logits(smollm2_hf, ids), **logits_tolerance(checkpoint)
    )
