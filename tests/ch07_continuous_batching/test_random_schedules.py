"""Random arrivals, lengths, aborts and pool sizes: the invariants hold after every step, and every
request that was not aborted finishes with exactly its solo output."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine_options import no_prefix_caching

_solo_cache: dict = {}


def solo(checkpoint, model_dir, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    key = (checkpoint.__name__, prompt, max_tokens)
    if key not in _solo_cache:
        llm = _solo_cache.setdefault((checkpoint.__name__, "llm"), checkpoint.LLM(str(model_dir)))
        params = checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        _solo_cache[key] = llm.generate([list(prompt)], params, use_tqdm=False)[0].token_ids
    return _solo_cache[key]


def check_invariants(engine) -> None:
    """Between steps: each sequence's record alone says what it holds, and the pool agrees with it."""
    scheduler, manager = engine.scheduler, engine.block_manager
    running = [seq.request_id for seq in scheduler.running]
    waiting = [seq.request_id for seq in scheduler.waiting]
    assert not set(running) & set(waiting)
    assert len(running) <= scheduler.max_num_seqs
    for seq in scheduler.running:  # every token but the last sampled one is computed, in exactly its blocks
        assert seq.num_computed_tokens == seq.num_tokens - 1
        assert len(seq.block_table) == manager.blocks_needed(seq.num_computed_tokens)
    for seq in scheduler.waiting:
        assert seq.num_computed_tokens == 0 and seq.block_table == []
    owned = [block for seq in scheduler.running for block in seq.block_table]
    assert len(owned) == len(set(owned))  # no block owned twice
    assert len(owned) + manager.num_free_blocks == manager.num_total_blocks
    assert all(manager.allocator.ref_counts[block] == 1 for block in owned)


request = st.tuples(
    st.integers(1, 6),  # arrival step
    st.lists(st.integers(3, 300), min_size=1, max_size=18),  # prompt
    st.integers(1, 10),  # max_tokens
    st.one_of(st.none(), st.integers(1, 12)),  # abort at this step, or never
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request, min_size=1, max_size=6),
    num_kv_blocks=st.integers(8, 24),
    max_num_seqs=st.integers(1, 4),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_random_schedules(checkpoint, tiny_model_dirs, requests, num_kv_blocks, max_num_seqs, block_size):
    model_dir = tiny_model_dirs["gqa"]
    engine = checkpoint.LLMEngine(
        str(model_dir),
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        watermark=0.0,
        **no_prefix_caching(checkpoint),  # blocks shared between sequences are chapter 09's invariants
    )
    accepted, aborted, finished = {}, set(), {}
    step = 0
    while step < 6 or engine.has_unfinished_requests():
        step += 1
        for index, (arrival, prompt, max_tokens, _) in enumerate(requests):
            if arrival == step:
                params = checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                try:
                    engine.add_request(str(index), prompt, params)
                    accepted[str(index)] = (tuple(prompt), max_tokens)
                except ValueError:  # could never fit this pool: rejected up front
                    assert (len(prompt) + max_tokens - 1 + block_size - 1) // block_size > num_kv_blocks
        for index, (_, _, _, abort_step) in enumerate(requests):
            if abort_step == step and str(index) in accepted and str(index) not in finished:
                assert engine.abort_request(str(index))
                aborted.add(str(index))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.token_ids
        check_invariants(engine)
        assert step < 500
    assert engine.block_manager.num_free_blocks == num_kv_blocks
    assert set(finished) == set(accepted) - aborted
    for request_id, tokens in finished.items():
        assert tokens == solo(checkpoint, model_dir, *accepted[request_id])
