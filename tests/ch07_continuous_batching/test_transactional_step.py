"""A step is a transaction: when the forward or the sampler raises, the engine is exactly as before the step.

Fault injection, for every forward of a scenario that has prefill-only, decode-only, mixed and preempting
steps: the k-th call raises once; right after it the queues, every sequence, the allocator and the keys and
values of every computed token are what they were before the step; stepping on gives exactly the tokens of
an undisturbed run, and every block is free at the end.
"""

import pytest
import torch

# (arrival step, prompt, max_tokens): on a pool of 12 blocks of 2 slots, 3 sequences at most
REQUESTS = [(1, list(range(10, 17)), 9), (1, [40, 41, 42], 12), (3, [60, 61, 62], 6), (6, [7, 8], 10)]


class Injected(Exception):
    pass


def make_engine(checkpoint, tiny_model_dirs):
    return checkpoint.LLMEngine(
        str(tiny_model_dirs["gqa"]), max_num_seqs=3, block_size=2, num_kv_blocks=12, watermark=0.0
    )


def params(checkpoint, max_tokens: int, seeded: bool):
    if seeded:
        return checkpoint.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens, ignore_eos=True, seed=5)
    return checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def snapshot(checkpoint, engine) -> dict:
    """Everything a step may change, as plain values."""
    scheduler, pool = engine.scheduler, engine.model_runner.kv_pool
    seqs = list(scheduler.waiting) + scheduler.running
    kv = {}
    for seq in scheduler.running:  # the keys and values of its computed tokens, read through its table
        slots = torch.tensor(
            [
                seq.block_table[p // pool.block_size] * pool.block_size + p % pool.block_size
                for p in range(seq.num_computed_tokens)
            ]
        )
        kv[seq.request_id] = (pool.keys.flatten(1, 2)[:, slots].clone(), pool.values.flatten(1, 2)[:, slots].clone())
    return {
        "waiting": [s.request_id for s in scheduler.waiting],
        "running": [s.request_id for s in scheduler.running],
        "seqs": {
            s.request_id: (s.status, s.num_computed_tokens, list(s.block_table), list(s.output_token_ids)) for s in seqs
        },
        "allocator": engine.block_manager.allocator.save(),
        "kv": kv,
        "cached_kv": cached_blocks(checkpoint, engine),
        "generators": {
            rid: [g.get_state() for g in generators(checkpoint, state) if g is not None]
            for rid, state in engine.requests.items()
        },
    }


def generators(checkpoint, state) -> list:
    """A request's random streams: one per sample from chapter 09 on."""
    if "parallel_sampling" in checkpoint.__capabilities__:
        return [sample.generator for sample in state.samples]
    return [state.generator]


def cached_blocks(checkpoint, engine) -> dict:
    """From chapter 09 on, the keys and values of every block the prefix cache remembers (a later hit reads
    them, so a failed step must leave them as they were); block id -> (keys, values)."""
    if "prefix_caching" not in checkpoint.__capabilities__:
        return {}
    pool = engine.model_runner.kv_pool
    return {
        b: (pool.keys[:, b].clone(), pool.values[:, b].clone()) for b in engine.block_manager.allocator.block_hashes
    }


def assert_same(before: dict, after: dict) -> None:
    for key in ("waiting", "running", "seqs", "allocator"):
        assert after[key] == before[key], key
    assert before["kv"].keys() == after["kv"].keys()
    for request_id, (keys, values) in before["kv"].items():
        assert torch.equal(after["kv"][request_id][0], keys) and torch.equal(after["kv"][request_id][1], values)
    assert before["cached_kv"].keys() == after["cached_kv"].keys()
    for block_id, (keys, values) in before["cached_kv"].items():
        assert torch.equal(after["cached_kv"][block_id][0], keys) and torch.equal(
            after["cached_kv"][block_id][1], values
        )
    assert before["generators"].keys() == after["generators"].keys()
    for request_id, states in before["generators"].items():
        assert len(after["generators"][request_id]) == len(states)
        assert all(torch.equal(a, b) for a, b in zip(after["generators"][request_id], states))


def run(checkpoint, engine, seeded: bool, fail_at: int | None = None, patch=None):
    """Run REQUESTS; `patch(engine, should_fail)` installs the fault. Returns the tokens of each request,
    the kinds of the steps, and whether the fault fired."""
    calls = {"n": 0, "fired": False}

    def should_fail() -> bool:
        calls["n"] += 1
        if calls["n"] == fail_at:
            calls["fired"] = True
            return True
        return False

    if patch is not None:
        patch(engine, should_fail)
    plans, schedule = [], engine.scheduler.schedule

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recording_schedule
    tokens, kinds, step = {}, [], 0
    while step < 6 or engine.has_unfinished_requests():
        step += 1
        for index, (arrival, prompt, max_tokens) in enumerate(REQUESTS):
            if arrival == step:
                engine.add_request(str(index), prompt, params(checkpoint, max_tokens, seeded))
        before = snapshot(checkpoint, engine)
        try:
            outputs = engine.step()
        except checkpoint.llm_engine.StepError as error:
            assert isinstance(error.__cause__, Injected)
            assert error.request_ids == [seq.request_id for seq in plans[-1].scheduled]
            assert_same(before, snapshot(checkpoint, engine))
            outputs = engine.step()  # the same step again
        plan = plans[-1]
        kinds.append(
            "preempt"
            if plan.preempted
            else "mixed"
            if 0 < plan.num_prefills < len(plan.scheduled)
            else "prefill"
            if plan.num_prefills
            else "decode"
        )
        for output in outputs:
            if output.finished:
                tokens[output.request_id] = output.token_ids
        assert step < 200
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert not engine.requests
    return tokens, kinds, calls


def fail_in_forward(engine, should_fail):
    """The model runs to the end (every layer writes its keys and values), then raises."""
    model = engine.model_runner.model
    forward = model.forward

    def failing_forward(*args, **kwargs):
        hidden = forward(*args, **kwargs)
        if should_fail():
            raise Injected("forward")
        return hidden

    model.forward = failing_forward


def fail_in_sampler(checkpoint, monkeypatch):
    def patch(engine, should_fail):
        sample_batch = checkpoint.llm_engine.sample_batch

        def failing_sample_batch(logits, params, generators):
            tokens = sample_batch(logits, params, generators)  # the random streams have moved on
            if should_fail():
                raise Injected("sampler")
            return tokens

        monkeypatch.setattr(checkpoint.llm_engine, "sample_batch", failing_sample_batch)

    return patch


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_failed_step_changes_nothing(checkpoint, tiny_model_dirs, monkeypatch, seeded, where):
    expected, kinds, calls = run(checkpoint, make_engine(checkpoint, tiny_model_dirs), seeded)
    assert {"prefill", "decode", "mixed", "preempt"} <= set(kinds), kinds  # the scenario covers every kind
    patch = fail_in_forward if where == "forward" else fail_in_sampler(checkpoint, monkeypatch)
    for fail_at in range(1, len(kinds) + 1):
        tokens, _, calls = run(checkpoint, make_engine(checkpoint, tiny_model_dirs), seeded, fail_at, patch)
        assert calls["fired"]
        assert tokens == expected, f"failure at call {fail_at} ({kinds[fail_at - 1]} step)"


def test_a_failed_preempting_step_gives_the_victim_back_its_keys_and_values(checkpoint, tiny_model_dirs):
    """The victim's blocks went to another sequence and the forward wrote into them; after the rollback the
    victim owns them again with its own keys and values, even if the next step no longer preempts it."""
    engine = make_engine(checkpoint, tiny_model_dirs)
    solo = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    greedy = checkpoint.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("old", list(range(10, 19)), greedy)  # 9 slots: 5 blocks
    engine.add_request("new", list(range(30, 42)), greedy)  # 12 slots: 6 blocks; the pool (12) is full at 10 slots
    while not engine.scheduler.waiting:  # step until "old" needs a block and preempts "new"
        engine.step()
    fail_in_forward(engine, lambda: True)
    before = snapshot(checkpoint, engine)
    with pytest.raises(checkpoint.llm_engine.StepError) as failure:
        engine.step()
    assert isinstance(failure.value.__cause__, Injected) and failure.value.request_ids == ["old", "new"]
    assert_same(before, snapshot(checkpoint, engine))
    del engine.model_runner.model.forward  # the model works again
    assert engine.abort_request("old")  # now nobody needs "new"'s blocks: it decodes from its restored cache
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert finished["new"] == solo.generate([list(range(30, 42))], greedy, use_tqdm=False)[0].token_ids
