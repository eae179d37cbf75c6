"""Parallel sampling: n answers from one prompt, sharing the prompt's blocks until one of them writes.

A request for n samples prefills its prompt once, then forks into n sequences that share every block;
the first write into the shared partial block gives the writer a copy. Sample i of a seeded request draws
from a stream seeded `seed + i`: it equals a request for one sample with that seed.
"""

import pytest

from tests.ch09_prefix_caching.engine_runs import run
from tests.oracle import hf_greedy

pytestmark = pytest.mark.requires("parallel_sampling")

PROMPT = [(j * 31) % 300 + 3 for j in range(10)]  # 10 tokens: blocks of 4 leave the third block half full


def engine(checkpoint, tiny_model_dirs, **options):
    options = {"block_size": 4, "num_kv_blocks": 64, "watermark": 0.0, **options}
    return checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), **options)


def sampled(checkpoint, seed: int, n: int = 1, max_tokens: int = 12):
    return checkpoint.SamplingParams(temperature=0.8, top_k=50, max_tokens=max_tokens, ignore_eos=True, seed=seed, n=n)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("budget", [4, 2048])
def test_n_seeded_answers_equal_separate_requests_seeded_seed_plus_i(checkpoint, tiny_model_dirs, caching, budget):
    options = dict(enable_prefix_caching=caching, max_num_batched_tokens=budget, max_num_seqs=4)
    together = run(
        engine(checkpoint, tiny_model_dirs, **options), [(1, PROMPT, 12)], lambda i, m: sampled(checkpoint, 7, 4, m)
    )
    apart = run(
        engine(checkpoint, tiny_model_dirs, **options),
        [(1, PROMPT, 12)] * 4,
        lambda i, m: sampled(checkpoint, 7 + i, 1, m),
    )
    assert together.tokens["0"] == [apart.tokens[str(i)][0] for i in range(4)]
    assert len({tuple(t) for t in together.tokens["0"]}) > 1  # the samples differ


def test_n_greedy_answers_are_identical_and_equal_transformers(checkpoint, tiny_model_dirs, tiny_hf_models):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=4, num_kv_blocks=64)
    [output] = llm.generate([PROMPT], checkpoint.SamplingParams(temperature=0, max_tokens=9, n=3), use_tqdm=False)
    expected = hf_greedy(tiny_hf_models["gqa"], PROMPT, 9)
    assert [o.index for o in output.outputs] == [0, 1, 2]
    assert [o.token_ids for o in output.outputs] == [expected] * 3
    assert output.token_ids == expected and output.text == output.outputs[0].text and output.finished


@pytest.mark.parametrize("prompt_len, copies", [(10, 3), (12, 0)])
def test_the_prompt_blocks_are_shared_and_copied_only_when_a_shared_block_is_written(
    checkpoint, tiny_model_dirs, prompt_len, copies
):
    """n = 4 on a prompt of 10 tokens: 3 blocks shared by all four samples, the third half full; at their
    first decode three of them copy it (the fourth is then its only owner). With 12 tokens every prompt
    block is full: the decodes write into new blocks, and nothing is copied."""
    eng = engine(checkpoint, tiny_model_dirs)
    prompt = (PROMPT * 2)[:prompt_len]
    eng.add_request("r", prompt, sampled(checkpoint, 1, n=4))
    copied = []
    copy_blocks = eng.model_runner.copy_blocks
    eng.model_runner.copy_blocks = lambda pairs: (copied.extend(pairs), copy_blocks(pairs))

    [first] = eng.step()  # the prefill: one sequence computes the prompt, then forks into four
    assert [len(o.token_ids) for o in first.outputs] == [1, 1, 1, 1]
    seqs = eng.scheduler.running
    assert [seq.index for seq in seqs] == [0, 1, 2, 3]
    prompt_blocks = list(seqs[0].block_table)
    assert len(prompt_blocks) == 3 and all(seq.block_table == prompt_blocks for seq in seqs)
    assert [eng.block_manager.allocator.ref_counts[b] for b in prompt_blocks] == [4, 4, 4]
    assert eng.block_manager.num_total_blocks - eng.block_manager.num_free_blocks == 3

    eng.step()  # every sample writes its first generated token (position prompt_len)
    assert len(copied) == copies
    if copies:
        assert {source for source, _ in copied} == {prompt_blocks[2]}
        tables = [seq.block_table for seq in seqs]
        assert all(table[:2] == prompt_blocks[:2] for table in tables)
        assert len({table[2] for table in tables}) == 4  # each sample now owns its third block
    while eng.has_unfinished_requests():
        eng.step()
    assert len(copied) == copies  # nothing shared is ever written again
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks


def test_n_answers_survive_preemption_and_chunked_prefill(checkpoint, tiny_model_dirs):
    """Two requests of n = 3 and one of n = 1 on a pool that cannot hold them all: samples are preempted
    one by one and prefilled again; every answer still equals its separate seeded request."""
    requests = [(1, PROMPT, 14), (1, PROMPT[:7] + [5, 6, 7, 8], 14), (2, PROMPT[::-1], 10)]
    ns = [3, 3, 1]
    options = dict(num_kv_blocks=14, max_num_batched_tokens=6, max_num_seqs=6)
    together = run(
        engine(checkpoint, tiny_model_dirs, **options), requests, lambda i, m: sampled(checkpoint, 10 * i, ns[i], m)
    )
    assert together.num_preemptions > 0
    separate = [(1, prompt, m) for (_, prompt, m), n in zip(requests, ns) for _ in range(n)]
    seeds = [10 * i + k for i, n in enumerate(ns) for k in range(n)]
    apart = run(
        engine(checkpoint, tiny_model_dirs, num_kv_blocks=64),
        separate,
        lambda j, m: sampled(checkpoint, seeds[j], 1, m),
    )
    flat = [answer for i in range(3) for answer in together.tokens[str(i)]]
    assert flat == [apart.tokens[str(j)][0] for j in range(len(separate))]


def test_aborting_a_forked_request_frees_every_sample(checkpoint, tiny_model_dirs):
    eng = engine(checkpoint, tiny_model_dirs)
    eng.add_request("r", PROMPT, sampled(checkpoint, 3, n=3, max_tokens=50))
    eng.step()
    eng.step()
    assert len(eng.scheduler.running) == 3
    assert eng.abort_request("r") and not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks


def test_bad_n_is_refused_and_nothing_is_queued(checkpoint, tiny_model_dirs):
    with pytest.raises(ValueError, match="n must be >= 1"):
        checkpoint.SamplingParams(n=0)
    with pytest.raises(ValueError, match="n must be an integer"):
        checkpoint.SamplingParams(n=2.5)
    with pytest.raises(ValueError, match=r"2\*\*64 - n"):
        checkpoint.SamplingParams(seed=2**64 - 2, n=3)
    checkpoint.SamplingParams(seed=2**64 - 3, n=3)  # the last stream is seeded 2**64 - 1
    eng = engine(checkpoint, tiny_model_dirs, max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        eng.add_request("r", PROMPT, checkpoint.SamplingParams(n=5))
    assert not eng.has_unfinished_requests() and not eng.requests
