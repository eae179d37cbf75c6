"""Random arrivals, lengths, aborts, budgets and pools with chunked prefill: the invariants hold during
and after every step, nothing leaks, and every request that was not aborted gets its solo output."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ch07_continuous_batching.test_random_schedules import solo
from tests.engine_options import no_prefix_caching


def check_plan(engine, plan) -> None:
    """Right after scheduling: each scheduled sequence runs tokens it has, within the budget, and holds
    exactly the blocks for its computed tokens plus this step's new ones."""
    manager, scheduler = engine.block_manager, engine.scheduler
    assert sum(plan.num_new_tokens) <= scheduler.max_num_batched_tokens
    assert len(plan.scheduled) <= scheduler.max_num_seqs
    for seq, num_new in zip(plan.scheduled, plan.num_new_tokens):
        assert 1 <= num_new and seq.num_computed_tokens + num_new <= seq.num_tokens
        assert len(seq.block_table) == manager.blocks_needed(seq.num_computed_tokens + num_new)


def check_between_steps(engine) -> None:
    """Between steps: computed tokens never exceed the sequence; blocks cover exactly the computed ones."""
    scheduler, manager = engine.scheduler, engine.block_manager
    running = [seq.request_id for seq in scheduler.running]
    assert not set(running) & {seq.request_id for seq in scheduler.waiting}
    for seq in scheduler.running:
        assert 0 < seq.num_computed_tokens < seq.num_tokens
        assert len(seq.block_table) == manager.blocks_needed(seq.num_computed_tokens)
    for seq in scheduler.waiting:
        assert seq.num_computed_tokens == 0 and seq.block_table == []
    owned = [block for seq in scheduler.running for block in seq.block_table]
    assert len(owned) == len(set(owned)) and len(owned) + manager.num_free_blocks == manager.num_total_blocks


request = st.tuples(
    st.integers(1, 6),  # arrival step
    st.lists(st.integers(3, 300), min_size=1, max_size=30),  # prompt
    st.integers(1, 10),  # max_tokens
    st.one_of(st.none(), st.integers(1, 30)),  # abort at this step, or never
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request, min_size=1, max_size=6),
    num_kv_blocks=st.integers(8, 24),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 24),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_random_chunked_schedules(
    checkpoint, tiny_model_dirs, requests, num_kv_blocks, max_num_seqs, budget, block_size
):
    model_dir = tiny_model_dirs["gqa"]
    max_num_seqs = min(max_num_seqs, budget)
    engine = checkpoint.LLMEngine(
        str(model_dir),
        max_num_seqs=max_num_seqs,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=budget,
        watermark=0.0,
        **no_prefix_caching(checkpoint),  # blocks shared between sequences are chapter 09's invariants
    )
    schedule = engine.scheduler.schedule

    def checked_schedule():
        plan = schedule()
        check_plan(engine, plan)
        return plan

    engine.scheduler.schedule = checked_schedule
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
                    assert -(-(len(prompt) + max_tokens - 1) // block_size) > num_kv_blocks
        for index, (_, _, _, abort_step) in enumerate(requests):
            if abort_step == step and str(index) in accepted and str(index) not in finished:
                assert engine.abort_request(str(index))
                aborted.add(str(index))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.token_ids
        check_between_steps(engine)
        assert step < 2000
    assert engine.block_manager.num_free_blocks == num_kv_blocks
    assert set(finished) == set(accepted) - aborted
    for request_id, tokens in finished.items():
        assert tokens == solo(checkpoint, model_dir, *accepted[request_id])
