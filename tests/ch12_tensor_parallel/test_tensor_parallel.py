"""Tensor parallelism against one process: the same greedy tokens and logits within tolerance with 2 and 4
ranks, KV heads split and replicated, tied and untied heads, with continuous batching, chunked prefill,
prefix caching and preemption all in play; the bytes each step all-reduces; SmolLM2 on 3 ranks."""

import pytest
import torch

from chapters import submodule
from tests.ch09_prefix_caching.engine_runs import run
from tests.engine_options import logits_tolerance

pytestmark = pytest.mark.requires("tensor_parallel")

SHARED = [(j * 31) % 300 + 3 for j in range(13)]


def prompt(index: int, length: int) -> list[int]:
    return [(index * 41 + j * 13) % 300 + 3 for j in range(length)]


# (arrival step, prompt, max_tokens): arrivals over time, shared beginnings, prompts longer than a budget
REQUESTS = [
    (1, SHARED + prompt(0, 4), 9),
    (1, prompt(1, 3), 12),
    (2, SHARED + prompt(2, 9), 8),
    (3, prompt(3, 30), 5),
    (4, SHARED + prompt(0, 4), 6),
    (6, prompt(4, 11), 10),
]
BLOCK_SIZE = 4
LARGEST = max(-(-(len(p) + n) // BLOCK_SIZE) for _, p, n in REQUESTS)
OPTIONS = dict(  # a budget that chunks prompts, a pool that preempts, prefix caching on (the default)
    block_size=BLOCK_SIZE, num_kv_blocks=LARGEST + LARGEST // 3, max_num_batched_tokens=8, max_num_seqs=4, watermark=0.0
)


def greedy(checkpoint):
    return lambda index, max_tokens: checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


_one_process = {}


def one_process(checkpoint, path):
    """The run and logits on one process (eager), once per model."""
    if path not in _one_process:
        engine = checkpoint.LLMEngine(str(path), enforce_eager=True, **OPTIONS)
        _one_process[path] = run(engine, REQUESTS, greedy(checkpoint)), engine.prompt_logits(REQUESTS[3][1])
    return _one_process[path]


# gqa: 4 query heads, 2 KV heads (split on 2 ranks, replicated on 4); mha_tied: 4 and 4 (2 per rank), tied
# embedding; mqa_tied: 1 KV head, replicated. Later chapters carry the ranks' code (tensor_parallel.py,
# parallel_runner.py) unchanged: `make test` runs these on the latest checkpoint alone.
@pytest.mark.latest_only
@pytest.mark.parametrize(
    "name, size, options",
    [
        ("gqa", 4, {"enforce_eager": True}),
        ("mha_tied", 2, {"enforce_eager": True}),
        ("mqa_tied", 2, {"enforce_eager": True}),
        ("gqa", 2, {}),  # the default path: packed GEMMs, compiled layers, the "cpu" attention backend
    ],
)
def test_ranks_give_the_tokens_of_one_process(checkpoint, tiny_model_dirs, name, size, options):
    expected, expected_logits = one_process(checkpoint, tiny_model_dirs[name])
    engine = checkpoint.LLMEngine(str(tiny_model_dirs[name]), tensor_parallel_size=size, **OPTIONS, **options)
    try:
        result = run(engine, REQUESTS, greedy(checkpoint))
        logits = engine.prompt_logits(REQUESTS[3][1])
    finally:
        engine.close()
    assert result.tokens == expected.tokens
    assert result.num_preemptions > 0 and sum(result.num_cached_tokens.values()) > 0  # both were in play
    assert any(
        0 < n < len(seq.token_ids)
        for plan in result.plans
        for seq, n in zip(plan.scheduled, plan.num_new_tokens)
        if n > 1
    )
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)


def test_bytes_all_reduced_per_step(checkpoint, tiny_model_dirs):
    """Two all-reduces per layer, each of the step's hidden states [num_tokens, hidden] in fp32."""
    tp = submodule(checkpoint, "tensor_parallel")
    with checkpoint.LLM(str(tiny_model_dirs["gqa"]), tensor_parallel_size=2, enforce_eager=True, **OPTIONS) as llm:
        engine = llm.llm_engine
        config = engine.model.config
        shapes = tp.RankShapes.of(config, 2, 4)
        engine.add_request("a", prompt(0, 7), checkpoint.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        engine.add_request("b", prompt(1, 5), checkpoint.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        for num_tokens in (8, 5, 2):  # a's 7 + b's first (budget 8); a's decode + b's last 4; two decodes
            before = tp.comm_stats.calls, tp.comm_stats.bytes
            engine.step()
            assert tp.comm_stats.calls - before[0] == 2 * config.num_hidden_layers
            assert tp.comm_stats.bytes - before[1] == num_tokens * shapes.all_reduce_bytes_per_token
            assert shapes.all_reduce_bytes_per_token == 2 * config.num_hidden_layers * config.hidden_size * 4


@pytest.mark.model
@pytest.mark.latest_only  # three processes load SmolLM2; the ranks' code is carried unchanged (see above)
def test_smollm2_on_3_ranks(checkpoint, smollm2_llm):
    """SmolLM2's 9 query and 3 KV heads split over 3 ranks (2 ranks cannot hold whole heads: a ValueError),
    against one process on the default path."""
    prompts = ["What is the capital of France?", "List three colors:"]
    params = checkpoint.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide num_attention_heads=9"):
        checkpoint.LLM(tensor_parallel_size=2)
    expected = [out.token_ids for out in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    token_ids = smollm2_llm.tokenizer.encode(prompts[0])
    with checkpoint.LLM(tensor_parallel_size=3, enforce_eager=True) as llm:
        assert [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)] == expected
        logits = llm.prompt_logits(token_ids)
    torch.testing.assert_close(logits, smollm2_llm.prompt_logits(token_ids), **logits_tolerance(checkpoint))
