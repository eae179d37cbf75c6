"""Prefix caching changes which tokens are computed, never which tokens come out.

Requests sharing a system prompt, some repeating a whole prompt, arriving over time, on pools small enough
to force preemption and budgets small enough to chunk every prompt: greedy tokens equal transformers' with
caching on and off, seeded ones equal each other, and caching computes fewer tokens.
"""

import pytest

from tests.ch09_prefix_caching.engine_runs import run
from tests.oracle import hf_greedy

pytestmark = pytest.mark.requires("prefix_caching")

SYSTEM = [(j * 29) % 300 + 3 for j in range(23)]  # a shared "system prompt" of 23 tokens


def suffix(index: int, length: int) -> list[int]:
    return [(index * 53 + j * 17) % 300 + 3 for j in range(length)]


# (arrival step, prompt, max_tokens)
REQUESTS = [
    (1, SYSTEM + suffix(0, 5), 12),
    (1, SYSTEM + suffix(1, 9), 10),
    (3, SYSTEM + suffix(0, 5), 6),  # the first request's prompt again, whole
    (4, SYSTEM[:16], 9),  # a prompt that is a prefix of the others
    (6, suffix(7, 30), 8),  # shares nothing
    (9, SYSTEM + suffix(2, 1), 7),
]


def pool_blocks(block_size: int) -> int:
    """Room for the largest request and a quarter more: requests growing together must preempt, with
    caching on and off, under every budget and block size here."""
    largest = max(-(-(len(prompt) + max_tokens - 1) // block_size) for _, prompt, max_tokens in REQUESTS)
    return largest + largest // 4


def engine(checkpoint, tiny_model_dirs, caching: bool, block_size: int, budget: int):
    return checkpoint.LLMEngine(
        str(tiny_model_dirs["gqa"]),
        enable_prefix_caching=caching,
        block_size=block_size,
        num_kv_blocks=pool_blocks(block_size),
        max_num_batched_tokens=budget,
        max_num_seqs=min(budget, 4),
        watermark=0.0,
    )


def greedy(checkpoint):
    return lambda index, max_tokens: checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def seeded(checkpoint):
    return lambda index, max_tokens: checkpoint.SamplingParams(
        temperature=0.9, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, seed=300 + index
    )


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("budget", [3, 16, 256])
def test_greedy_tokens_equal_transformers_with_caching_on_and_off(
    checkpoint, tiny_model_dirs, tiny_hf_models, block_size, budget
):
    on = run(engine(checkpoint, tiny_model_dirs, True, block_size, budget), REQUESTS, greedy(checkpoint))
    off = run(engine(checkpoint, tiny_model_dirs, False, block_size, budget), REQUESTS, greedy(checkpoint))
    for index, (_, prompt, max_tokens) in enumerate(REQUESTS):
        expected = hf_greedy(tiny_hf_models["gqa"], prompt, max_tokens)
        assert on.tokens[str(index)] == off.tokens[str(index)] == [expected], index
    assert on.num_preemptions > 0 and off.num_preemptions > 0
    assert on.num_computed_tokens < off.num_computed_tokens
    assert set(off.num_cached_tokens.values()) == {0}


@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("budget", [3, 256])
def test_seeded_tokens_equal_with_caching_on_and_off(checkpoint, tiny_model_dirs, block_size, budget):
    on = run(engine(checkpoint, tiny_model_dirs, True, block_size, budget), REQUESTS, seeded(checkpoint))
    off = run(engine(checkpoint, tiny_model_dirs, False, block_size, budget), REQUESTS, seeded(checkpoint))
    assert on.tokens == off.tokens and on.num_preemptions > 0


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_later_request_reports_the_shared_full_blocks_as_cached(
    checkpoint, tiny_model_dirs, tiny_hf_models, block_size
):
    """One request at a time on a roomy pool, so each finds everything the ones before it computed."""
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=block_size, num_kv_blocks=64)
    params = checkpoint.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = SYSTEM + suffix(0, 9)  # 32 tokens
    outputs = {}
    for name, prompt in [
        ("first", first),
        ("sibling", SYSTEM + suffix(1, 4)),  # shares the 23-token system prompt
        ("again", first),  # the whole prompt again: every full block but the one holding the last token
        ("next turn", None),  # the first prompt, its answer and a new message: a chat's second turn
    ]:
        prompt = prompt or first + outputs["first"].token_ids + suffix(2, 3)
        [outputs[name]] = llm.generate([prompt], params, use_tqdm=False)
        assert outputs[name].token_ids == hf_greedy(tiny_hf_models["gqa"], prompt, 6), name
    assert outputs["first"].num_cached_tokens == 0
    assert outputs["sibling"].num_cached_tokens == 23 // block_size * block_size
    assert outputs["again"].num_cached_tokens == 31 // block_size * block_size  # the last token is computed
    # "first" computed its 32 prompt tokens and 5 of its 6 answer tokens (the last is never fed back):
    # every full block of those was cached as it filled, answer included
    assert outputs["next turn"].num_cached_tokens == (32 + 5) // block_size * block_size


def test_a_preempted_request_is_prefilled_again_mostly_from_the_cache(checkpoint, tiny_model_dirs):
    """Two requests admitted together on a pool too small for both at their longest: the newer one is
    preempted; its full blocks wait in the evictor while the older finishes, and its second prefill computes
    only what was not in a full block."""
    requests = [(1, suffix(0, 28), 10), (1, suffix(1, 16), 40)]
    results = {}
    for caching in (True, False):
        eng = checkpoint.LLMEngine(
            str(tiny_model_dirs["gqa"]),
            enable_prefix_caching=caching,
            block_size=4,
            num_kv_blocks=16,  # 64 slots: both prompts fit (11 blocks), not both requests at their end (24)
            watermark=0.0,
        )
        results[caching] = run(eng, requests, greedy(checkpoint))
    on, off = results[True], results[False]
    assert on.tokens == off.tokens and on.num_preemptions > 0 and off.num_preemptions > 0
    # Without preemption each token is computed once; each re-prefill with caching computes again at most
    # the tokens of its last, partial block (its full blocks are hits), without caching all of them.
    once = sum(len(prompt) + max_tokens - 1 for _, prompt, max_tokens in requests)
    assert on.num_computed_tokens <= once + 3 * on.num_preemptions < off.num_computed_tokens
