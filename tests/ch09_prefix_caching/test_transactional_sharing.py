"""A failed step changes nothing, with shared blocks too: after a forward or a sampler that raises, the
queues, every sample's sequence, the allocator (reference counts, free list, evictor, remembered hashes),
the keys and values of every computed token and of every remembered block, and the random streams are what
they were before the step; stepping on gives exactly the tokens of an undisturbed run.

The scenario has prefix hits, blocks evicted and rewritten, forks, copies on write and preemption.
"""

import pytest
import torch

from tests.ch07_continuous_batching.test_transactional_step import Injected, fail_in_forward, fail_in_sampler

pytestmark = pytest.mark.requires("prefix_caching", "parallel_sampling")

SHARED = list(range(10, 19))
# (arrival step, prompt, max_tokens, n): on a pool of 14 blocks of 2 slots, 4 sequences at most
REQUESTS = [
    (1, SHARED + [40, 41], 8, 2),
    (2, SHARED + [41, 42], 6, 1),
    (4, list(range(60, 67)), 7, 1),
    (6, SHARED + [40, 41], 5, 2),
    (9, [7, 8, 9], 6, 1),
]


def make_engine(checkpoint, tiny_model_dirs):
    return checkpoint.LLMEngine(
        str(tiny_model_dirs["gqa"]), max_num_seqs=4, block_size=2, num_kv_blocks=14, watermark=0.0
    )


def params(checkpoint, max_tokens: int, n: int):
    return checkpoint.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens, ignore_eos=True, seed=5, n=n)


def snapshot(engine) -> dict:
    """Everything a step may change, as plain values."""
    scheduler, pool, allocator = engine.scheduler, engine.model_runner.kv_pool, engine.block_manager.allocator
    size = pool.block_size

    def kv(blocks_and_slots):
        index = torch.tensor([b * size + s for b, s in blocks_and_slots], dtype=torch.long)
        return pool.keys.flatten(1, 2)[:, index].clone(), pool.values.flatten(1, 2)[:, index].clone()

    seqs = list(scheduler.waiting) + scheduler.running
    return {
        "waiting": [(s.request_id, s.index) for s in scheduler.waiting],
        "running": [(s.request_id, s.index) for s in scheduler.running],
        "seqs": {
            (s.request_id, s.index): (s.status, s.num_computed_tokens, list(s.block_table), list(s.output_token_ids))
            for s in seqs
        },
        "allocator": allocator.save(),
        "kv": {
            (s.request_id, s.index): kv([(s.block_table[p // size], p % size) for p in range(s.num_computed_tokens)])
            for s in scheduler.running
        },
        "remembered": {b: kv([(b, slot) for slot in range(size)]) for b in allocator.block_hashes},
        "generators": {
            request_id: [s.generator.get_state() for s in state.samples]
            for request_id, state in engine.requests.items()
        },
    }


def assert_same(before: dict, after: dict) -> None:
    for key in ("waiting", "running", "seqs", "allocator"):
        assert after[key] == before[key], key
    for key in ("kv", "remembered", "generators"):
        assert after[key].keys() == before[key].keys(), key
        for name, tensors in before[key].items():
            assert all(torch.equal(a, b) for a, b in zip(after[key][name], tensors)), (key, name)


def run(checkpoint, engine, fail_at: int | None = None, patch=None):
    """REQUESTS to the end; the fault (if any) fires at the `fail_at`-th call. Returns every request's
    answers, what the steps did, and whether the fault fired."""
    calls = {"n": 0, "fired": False}

    def should_fail() -> bool:
        calls["n"] += 1
        calls["fired"] |= calls["n"] == fail_at
        return calls["n"] == fail_at

    if patch is not None:
        patch(engine, should_fail)
    plans, schedule = [], engine.scheduler.schedule

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recording_schedule
    tokens, step = {}, 0
    while step < 9 or engine.has_unfinished_requests():
        step += 1
        for index, (arrival, prompt, max_tokens, n) in enumerate(REQUESTS):
            if arrival == step:
                engine.add_request(str(index), prompt, params(checkpoint, max_tokens, n))
        before = snapshot(engine)
        try:
            outputs = engine.step()
        except checkpoint.llm_engine.StepError as error:
            assert isinstance(error.__cause__, Injected)
            assert_same(before, snapshot(engine))
            outputs = engine.step()  # the same step again
        tokens.update({o.request_id: [c.token_ids for c in o.outputs] for o in outputs if o.finished})
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    return tokens, plans, calls["fired"]


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_failed_step_with_shared_blocks_changes_nothing(checkpoint, tiny_model_dirs, monkeypatch, where):
    expected, plans, _ = run(checkpoint, make_engine(checkpoint, tiny_model_dirs))
    assert any(plan.preempted for plan in plans) and any(plan.copies for plan in plans)
    assert any(seq.num_cached_tokens for plan in plans for seq in plan.scheduled)  # prefix hits happened
    patch = fail_in_forward if where == "forward" else fail_in_sampler(checkpoint, monkeypatch)
    for fail_at in range(1, len(plans) + 1):
        tokens, _, fired = run(checkpoint, make_engine(checkpoint, tiny_model_dirs), fail_at, patch)
        assert fired and tokens == expected, f"failure at call {fail_at}"
