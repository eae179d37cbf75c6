"""Random requests sharing prefixes, random n, aborts, preemption, tiny pools and budgets: after every step
the reference counts, the free list, the evictor and the cache's claims all agree with the sequences, and
every answer that was not aborted equals its request's solo greedy output.

"The cache's claims" are checked against what was really written: every slot the forward writes (and every
block copied) is recorded with the tokens it was computed for, and a block remembered for a hash must hold,
slot by slot, the keys and values of the tokens that hash was made from.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.ch07_continuous_batching.test_random_schedules import solo

pytestmark = pytest.mark.requires("prefix_caching", "parallel_sampling")

PREFIXES = [[], [3, 4, 5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 20, 21], [40] * 7]


class Shadow:
    """Which tokens each written KV slot was computed for: (block, slot) -> the token ids up to that slot."""

    def __init__(self, checkpoint, engine):
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.prefixes: dict[bytes, tuple[int, ...]] = {}  # hash -> the tokens it chains
        self.block_size = engine.block_manager.block_size
        runner, forward, copy_blocks = engine.model_runner, engine.model_runner.forward, engine.model_runner.copy_blocks
        schedule, plans = engine.scheduler.schedule, []

        def remembering_schedule():
            plans[:] = [schedule()]
            return plans[-1]

        def recording_forward(inputs):  # the inputs of the last plan scheduled
            size, plan = self.block_size, plans[-1]
            for seq, num_new in zip(plan.scheduled, plan.num_new_tokens):
                tokens, end = tuple(seq.token_ids), seq.num_computed_tokens + num_new
                for p in range(seq.num_computed_tokens, end):
                    self.slots[seq.block_table[p // size], p % size] = tokens[: p + 1]
                block_hash = b""  # the hash chain of its full blocks, computed here independently
                for i in range(end // size):
                    block_hash = checkpoint.prefix_caching.hash_block(block_hash, tokens[i * size : (i + 1) * size])
                    self.prefixes[block_hash] = tokens[: (i + 1) * size]
            return forward(inputs)

        def recording_copy(pairs):
            for source, copy in pairs:
                for slot in range(self.block_size):
                    if (source, slot) in self.slots:
                        self.slots[copy, slot] = self.slots[source, slot]
            return copy_blocks(pairs)

        engine.scheduler.schedule = remembering_schedule
        runner.forward, runner.copy_blocks = recording_forward, recording_copy

    def check(self, engine) -> None:
        for block_id, (block_hash, depth) in engine.block_manager.allocator.block_hashes.items():
            tokens = self.prefixes[block_hash]
            assert len(tokens) == depth * self.block_size
            for slot in range(self.block_size):
                assert self.slots[block_id, slot] == tokens[: (depth - 1) * self.block_size + slot + 1]


def check_blocks(engine) -> None:
    """Reference counts, free list, evictor and tables agree; each sequence holds its computed tokens' blocks."""
    scheduler, manager = engine.scheduler, engine.block_manager
    allocator = manager.allocator
    owners = Counter(block for seq in scheduler.running for block in seq.block_table)
    assert all(allocator.ref_counts[b] == owners[b] for b in range(manager.num_total_blocks))
    free, evictor = set(allocator.free_ids), set(allocator.evictor)
    assert len(free) == len(allocator.free_ids) and len(evictor) == len(allocator.evictor)
    assert not free & evictor and not (free | evictor) & owners.keys()
    assert len(free) + len(evictor) + len(owners) == manager.num_total_blocks == manager.num_free_blocks + len(owners)
    assert not free & allocator.block_hashes.keys() and evictor <= allocator.block_hashes.keys()
    assert allocator.cached == {h: b for b, (h, _) in allocator.block_hashes.items()}
    for seq in scheduler.running:
        assert 0 < seq.num_computed_tokens < seq.num_tokens
        assert len(seq.block_table) == manager.blocks_needed(seq.num_computed_tokens)
    for seq in scheduler.waiting:
        assert seq.num_computed_tokens == 0 and seq.block_table == []
    assert sum(seq.num_seats for seq in scheduler.running) <= scheduler.max_num_seqs


request = st.tuples(
    st.integers(1, 6),  # arrival step
    st.sampled_from(range(len(PREFIXES))),
    st.lists(st.integers(3, 300), min_size=1, max_size=12),  # the rest of the prompt
    st.integers(1, 8),  # max_tokens
    st.integers(1, 3),  # n
    st.one_of(st.none(), st.integers(1, 30)),  # abort at this step, or never
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    requests=st.lists(request, min_size=1, max_size=6),
    num_kv_blocks=st.integers(8, 20),
    budget=st.integers(3, 24),
    block_size=st.sampled_from([1, 2, 4]),
)
def test_random_shared_prefix_schedules(checkpoint, tiny_model_dirs, requests, num_kv_blocks, budget, block_size):
    model_dir = tiny_model_dirs["gqa"]
    engine = checkpoint.LLMEngine(
        str(model_dir),
        max_num_seqs=3,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=budget,
        watermark=0.0,
    )
    shadow = Shadow(checkpoint, engine)
    accepted, aborted, finished = {}, set(), {}
    step = 0
    while step < 6 or engine.has_unfinished_requests():
        step += 1
        for index, (arrival, prefix, rest, max_tokens, n, _) in enumerate(requests):
            if arrival == step:
                prompt = PREFIXES[prefix] + rest
                params = checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)
                try:
                    engine.add_request(str(index), prompt, params)
                except ValueError:  # could never fit this pool: refused, nothing queued
                    continue
                accepted[str(index)] = (prompt, max_tokens, n)
        for index, (*_, abort_step) in enumerate(requests):
            if abort_step == step and str(index) in engine.requests:
                assert engine.abort_request(str(index))
                aborted.add(str(index))
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = [o.token_ids for o in output.outputs]
        check_blocks(engine)
        shadow.check(engine)
        assert step < 3000
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert finished.keys() == accepted.keys() - aborted
    for request_id, answers in finished.items():
        prompt, max_tokens, n = accepted[request_id]
        assert answers == [solo(checkpoint, model_dir, tuple(prompt), max_tokens)] * n
