"""Chunked scheduling, step by step, worked out by hand.

As in chapter 07's tables: steps are numbered from 1, a request arriving (or aborted) at step k is added
(or aborted) just before the k-th `step()`, and the state is observed right after it. `carried` is what the
step's forward ran: request id -> number of new tokens. Greedy with EOS ignored; blocks of 4 slots.
A sequence holds blocks for its computed tokens: ceil(computed / 4).
"""

from tests.ch07_continuous_batching.step_tables import Scenario, observe, prompt_tokens
from tests.engine_options import no_prefix_caching
from tests.oracle import hf_greedy

MODEL = "gqa"


def run_chunked_table(checkpoint, model_dir, scenario: Scenario, table: dict[int, dict]) -> dict[str, list[int]]:
    engine = checkpoint.LLMEngine(
        str(model_dir),
        max_num_seqs=scenario.max_num_seqs,
        block_size=scenario.block_size,
        num_kv_blocks=scenario.num_kv_blocks,
        max_num_batched_tokens=scenario.max_num_batched_tokens,
        watermark=0.0,
        **no_prefix_caching(checkpoint),
    )
    plans, schedule = [], engine.scheduler.schedule

    def recording_schedule():
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recording_schedule
    results, step = {}, 0
    while step < max(scenario.arrival_steps) or engine.has_unfinished_requests():
        step += 1
        for index, arrival in enumerate(scenario.arrival_steps):
            if arrival == step:
                params = checkpoint.SamplingParams(
                    temperature=0, max_tokens=scenario.max_tokens[index], ignore_eos=True
                )
                engine.add_request(str(index), prompt_tokens(index, scenario.prompt_lens[index]), params)
        for request_id in scenario.aborts.get(step, []):
            assert engine.abort_request(request_id)
        outputs = engine.step()
        results.update({o.request_id: list(o.token_ids) for o in outputs if o.finished})
        state = observe(engine, outputs)
        state["carried"] = {seq.request_id: n for seq, n in zip(plans[-1].scheduled, plans[-1].num_new_tokens)}
        state["preempted"] = [seq.request_id for seq in plans[-1].preempted]
        for name, expected in table.get(step, {}).items():
            assert state[name] == expected, f"step {step}, {name}: {state[name]} != {expected} (state {state})"
        assert step < 500, "the scenario does not end"
    assert set(table) <= set(range(1, step + 1)), f"the table lists steps after the last one ({step})"
    assert engine.block_manager.num_free_blocks == scenario.num_kv_blocks
    return results


def solo_tokens(tiny_hf_models, index: int, prompt_len: int, max_tokens: int) -> list[int]:
    return hf_greedy(tiny_hf_models[MODEL], prompt_tokens(index, prompt_len), max_tokens)


def test_a_long_prompt_is_chunked_while_two_requests_decode(checkpoint, tiny_model_dirs, tiny_hf_models):
    # 0: P=3, 10 tokens; 1: P=5, 10 tokens; both at step 1. 2: P=40, 3 tokens, at step 2. Budget 16.
    # step 1: 0 and 1 prefill whole (3 + 5 = 8 tokens)
    # step 2: 0 and 1 decode first (1 + 1), then 2 is admitted with what is left: 14 of its 40 tokens;
    #         a chunk that does not reach the prompt's end samples nothing, so 2 has no output yet
    # step 3: 1 + 1 + the next 14 (2 has 28 computed)
    # step 4: 1 + 1 + the last 12: 2's prompt is complete and its first token is sampled
    # steps 5, 6: three decodes; 2 gets its 2nd and 3rd token and finishes at step 6
    # blocks: 0 holds ceil(computed / 4) with computed = 3, 4, 5, 6 ...; 1 with 5, 6, 7, 8 ...; 2 with 14, 28, 40
    table = {
        1: dict(carried={"0": 3, "1": 5}, outputs=["0", "1"], used_blocks=1 + 2),
        2: dict(carried={"0": 1, "1": 1, "2": 14}, outputs=["0", "1"], running=["0", "1", "2"], used_blocks=1 + 2 + 4),
        3: dict(carried={"0": 1, "1": 1, "2": 14}, outputs=["0", "1"], used_blocks=2 + 2 + 7),
        4: dict(carried={"0": 1, "1": 1, "2": 12}, outputs=["0", "1", "2"], used_blocks=2 + 2 + 10),
        5: dict(carried={"0": 1, "1": 1, "2": 1}, used_blocks=2 + 3 + 11),
        6: dict(carried={"0": 1, "1": 1, "2": 1}, finished=["2"], running=["0", "1"], used_blocks=2 + 3),
        10: dict(carried={"0": 1, "1": 1}, finished=["0", "1"], used_blocks=0),
    }
    scenario = Scenario([3, 5, 40], [10, 10, 3], [1, 1, 2], num_kv_blocks=32, max_num_batched_tokens=16)
    results = run_chunked_table(checkpoint, tiny_model_dirs[MODEL], scenario, table)
    assert results["2"] == solo_tokens(tiny_hf_models, 2, 40, 3)


def test_a_chunk_ending_on_a_block_boundary_takes_no_extra_block(checkpoint, tiny_model_dirs, tiny_hf_models):
    # 0: P=20, 2 tokens. Budget 8: chunks of 8, 8, 4 (blocks 2, 4, 5), then one decode (21 slots: 6 blocks)
    table = {
        1: dict(carried={"0": 8}, outputs=[], used_blocks=2),
        2: dict(carried={"0": 8}, outputs=[], used_blocks=4),
        3: dict(carried={"0": 4}, outputs=["0"], used_blocks=5),
        4: dict(carried={"0": 1}, finished=["0"], used_blocks=0),
    }
    scenario = Scenario([20], [2], [1], max_num_seqs=2, num_kv_blocks=8, max_num_batched_tokens=8)
    results = run_chunked_table(checkpoint, tiny_model_dirs[MODEL], scenario, table)
    assert results["0"] == solo_tokens(tiny_hf_models, 0, 20, 2)


def test_a_half_prefilled_request_is_preempted_and_prefilled_again(checkpoint, tiny_model_dirs, tiny_hf_models):
    # Pool of 8 blocks, budget 8, two sequences. 0: P=4, 20 tokens, step 1. 1: P=28, 2 tokens, step 2.
    # step 1: 0 prefills (1 block)
    # steps 2-4: 0 decodes; 1 takes chunks of 7 (7, 14, 21 computed: 2, 4, 6 blocks); 0 reaches 7 slots
    # step 5: 0 decodes within its 2nd block; 1's next chunk (28 slots) needs a 7th block, the pool is full:
    #         1 is the newest, so 1 itself is preempted, half prefilled: its 6 blocks are freed, its
    #         computed count goes back to 0, and it waits at the front of the queue
    # step 6: 0 decodes (9 slots: 3 blocks); 1 is admitted again from its first token: a chunk of 7
    table = {
        1: dict(carried={"0": 4}, used_blocks=1),
        2: dict(carried={"0": 1, "1": 7}, used_blocks=2 + 2),
        4: dict(carried={"0": 1, "1": 7}, used_blocks=2 + 6),
        5: dict(carried={"0": 1}, preempted=["1"], waiting=["1"], running=["0"], used_blocks=2),
        6: dict(carried={"0": 1, "1": 7}, running=["0", "1"], used_blocks=3 + 2),
    }
    scenario = Scenario([4, 28], [20, 2], [1, 2], max_num_seqs=2, num_kv_blocks=8, max_num_batched_tokens=8)
    results = run_chunked_table(checkpoint, tiny_model_dirs[MODEL], scenario, table)
    assert results == {"0": solo_tokens(tiny_hf_models, 0, 4, 20), "1": solo_tokens(tiny_hf_models, 1, 28, 2)}


def test_abort_in_the_middle_of_a_prefill(checkpoint, tiny_model_dirs, tiny_hf_models):
    # Budget 8. 0: P=30, 3 tokens; 1: P=3, 4 tokens; both at step 1.
    # steps 1, 2: 0 takes the whole budget (8 + 8 computed: 2, 4 blocks); 1 waits for budget
    # step 3: 0 is aborted before the step, in the middle of its prompt: its 4 blocks are free at once;
    #         1 is admitted and prefills (1 block); it finishes at step 6
    table = {
        1: dict(carried={"0": 8}, waiting=["1"], used_blocks=2),
        2: dict(carried={"0": 8}, waiting=["1"], used_blocks=4),
        3: dict(carried={"1": 3}, running=["1"], outputs=["1"], used_blocks=1),
        6: dict(carried={"1": 1}, finished=["1"], used_blocks=0),
    }
    scenario = Scenario(
        [30, 3], [3, 4], [1, 1], max_num_seqs=2, num_kv_blocks=16, max_num_batched_tokens=8, aborts={3: ["0"]}
    )
    results = run_chunked_table(checkpoint, tiny_model_dirs[MODEL], scenario, table)
    assert results == {"1": solo_tokens(tiny_hf_models, 1, 3, 4)}
