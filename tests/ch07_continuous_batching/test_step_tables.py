"""Eight scheduling scenarios, each with its expected states worked out by hand.

Conventions (see step_tables.py): block size 4 unless stated; watermark 0; prompts are fixed token ids;
greedy with EOS ignored, so request i produces exactly max_tokens[i] tokens, one per step it runs.
A prompt of P tokens prefilled at its first step holds P slots; every later step adds one slot
(the token sampled in the step before). Blocks = ceil(slots / 4). A finished request's blocks are freed
at the end of the step that produced its last token.
"""

from tests.ch07_continuous_batching.step_tables import Scenario, prompt_tokens, run_step_table

MODEL = "gqa"


def test_a_request_joins_during_decode(checkpoint, tiny_model_dirs):
    # 0: P=5, 6 tokens, from step 1.  1: P=3, 3 tokens, from step 3.
    # step 1: 0 prefills 5 slots (2 blocks)
    # step 2: 0 decodes (6 slots, 2 blocks)
    # step 3: 0 decodes (7 slots, 2 blocks) and 1 prefills (3 slots, 1 block) in the same forward: 3 blocks
    # step 4: 0 at 8 slots (2 blocks), 1 at 4 slots (1 block)
    # step 5: 0 at 9 slots (3 blocks); 1 at 5 slots (2 blocks) gets its 3rd token, finishes, frees 2
    # step 6: 0 at 10 slots gets its 6th token, finishes; the pool is empty again
    table = {
        1: dict(waiting=[], running=["0"], outputs=["0"], finished=[], used_blocks=2, free_blocks=14),
        2: dict(running=["0"], outputs=["0"], used_blocks=2),
        3: dict(waiting=[], running=["0", "1"], outputs=["0", "1"], used_blocks=3),
        4: dict(running=["0", "1"], outputs=["0", "1"], used_blocks=3),
        5: dict(running=["0"], outputs=["0", "1"], finished=["1"], used_blocks=3, free_blocks=13),
        6: dict(running=[], outputs=["0"], finished=["0"], used_blocks=0, free_blocks=16),
    }
    run_step_table(checkpoint, tiny_model_dirs[MODEL], Scenario([5, 3], [6, 3], [1, 3]), table)


def test_two_finish_on_the_step_a_new_one_arrives(checkpoint, tiny_model_dirs):
    # 0: P=2, 3 tokens, step 1.  1: P=6, 2 tokens, step 2.  2: P=4, 2 tokens, step 3.
    # step 1: 0 prefills (1 block)
    # step 2: 0 decodes (3 slots, 1 block), 1 prefills (6 slots, 2 blocks): 3 blocks
    # step 3: 2 arrives and prefills (1 block) while 0 (4 slots) and 1 (7 slots) produce their last
    #         tokens: both finish and free their blocks; only 2's block is left
    # step 4: 2 decodes (5 slots, 2 blocks) and finishes
    table = {
        1: dict(running=["0"], used_blocks=1),
        2: dict(running=["0", "1"], outputs=["0", "1"], used_blocks=3),
        3: dict(waiting=[], running=["2"], outputs=["0", "1", "2"], finished=["0", "1"], used_blocks=1),
        4: dict(running=[], outputs=["2"], finished=["2"], used_blocks=0),
    }
    run_step_table(checkpoint, tiny_model_dirs[MODEL], Scenario([2, 6, 4], [3, 2, 2], [1, 2, 3]), table)


def test_admission_blocked_by_max_num_seqs(checkpoint, tiny_model_dirs):
    # max_num_seqs=2. 0: P=3, 4 tokens.  1: P=3, 2 tokens.  2: P=3, 2 tokens. All at step 1.
    # step 1: 0 and 1 prefill (1 block each); 2 waits: the batch is full
    # step 2: 1 finishes (4 slots, 1 block freed); 2 still waited this step (admission comes first)
    # step 3: 2 takes the free place and prefills (1 block); 0 at 5 slots (2 blocks)
    # step 4: 0 (6 slots) and 2 (4 slots) both finish
    table = {
        1: dict(waiting=["2"], running=["0", "1"], outputs=["0", "1"], used_blocks=2),
        2: dict(waiting=["2"], running=["0"], outputs=["0", "1"], finished=["1"], used_blocks=1),
        3: dict(waiting=[], running=["0", "2"], outputs=["0", "2"], used_blocks=3),
        4: dict(running=[], finished=["0", "2"], used_blocks=0),
    }
    scenario = Scenario([3, 3, 3], [4, 2, 2], [1, 1, 1], max_num_seqs=2)
    run_step_table(checkpoint, tiny_model_dirs[MODEL], scenario, table)


def test_admission_blocked_by_the_token_budget(checkpoint, tiny_model_dirs):
    # max_num_batched_tokens=8. 0: P=6, 3 tokens.  1: P=5, 2 tokens. Both at step 1.
    # step 1: budget 8: 0's 6 prompt tokens fit, 1's 5 do not fit in the 2 left: 1 waits
    # step 2: 0 decodes (1 token of budget), 7 left: 1 prefills (5). 0 at 7 slots (2), 1 at 5 (2)
    # step 3: 0 (8 slots) and 1 (6 slots) finish
    table = {
        1: dict(waiting=["1"], running=["0"], outputs=["0"], used_blocks=2),
        2: dict(waiting=[], running=["0", "1"], outputs=["0", "1"], used_blocks=4),
        3: dict(running=[], finished=["0", "1"], used_blocks=0),
    }
    scenario = Scenario([6, 5], [3, 2], [1, 1], max_num_batched_tokens=8)
    run_step_table(checkpoint, tiny_model_dirs[MODEL], scenario, table)


def test_admission_blocked_by_free_blocks_until_another_finishes(checkpoint, tiny_model_dirs):
    # 4 blocks. 0: P=9, 3 tokens (3 blocks).  1: P=7, 2 tokens (needs 2 blocks). Both at step 1.
    # step 1: 0 prefills 9 slots (3 blocks); 1 needs 2 blocks, 1 is free: it waits
    # step 2: 0 at 10 slots (3 blocks); 1 still waits
    # step 3: 0 at 11 slots finishes and frees 3 blocks; 1 was not admitted this step
    # step 4: 1 prefills (2 blocks)
    # step 5: 1 at 8 slots (2 blocks) finishes
    table = {
        1: dict(waiting=["1"], running=["0"], used_blocks=3, free_blocks=1),
        2: dict(waiting=["1"], running=["0"], used_blocks=3, free_blocks=1),
        3: dict(waiting=["1"], running=[], finished=["0"], used_blocks=0, free_blocks=4),
        4: dict(waiting=[], running=["1"], outputs=["1"], used_blocks=2, free_blocks=2),
        5: dict(running=[], finished=["1"], used_blocks=0),
    }
    scenario = Scenario([9, 7], [3, 2], [1, 1], num_kv_blocks=4)
    run_step_table(checkpoint, tiny_model_dirs[MODEL], scenario, table)


def test_preemption_and_resumption(checkpoint, tiny_model_dirs):
    # 4 blocks. 0: P=4, 8 tokens.  1: P=4, 8 tokens. Both at step 1. Each alone needs 11 slots (3 blocks).
    # step 1: both prefill 4 slots (1 block each): 2 used
    # step 2: both at 5 slots: one new block each: 4 used, 0 free
    # steps 3-5: 6, 7, 8 slots: still 2 blocks each
    # step 6: 0 needs a 3rd block for slot 9 and none is free: 1, the most recently admitted, is
    #         preempted (its 2 blocks freed, back to the front of the queue, its 5 tokens kept);
    #         0 takes a block (3 used). Nobody is admitted in a step that preempted.
    # step 7: 1 needs 9 slots (prompt + 5 generated) = 3 blocks; 1 is free: it waits. 0 at 10 slots.
    # step 8: 0 at 11 slots produces its 8th token and finishes; 1 still waited this step
    # step 9: 1 is prefilled again, all 9 tokens (3 blocks), and produces its 6th token
    # steps 10-11: 1 at 10 and 11 slots; finishes at step 11
    table = {
        1: dict(running=["0", "1"], used_blocks=2),
        2: dict(running=["0", "1"], used_blocks=4, free_blocks=0),
        5: dict(running=["0", "1"], used_blocks=4, free_blocks=0),
        6: dict(waiting=["1"], running=["0"], outputs=["0"], used_blocks=3, free_blocks=1),
        7: dict(waiting=["1"], running=["0"], outputs=["0"], used_blocks=3),
        8: dict(waiting=["1"], running=[], finished=["0"], used_blocks=0),
        9: dict(waiting=[], running=["1"], outputs=["1"], used_blocks=3),
        11: dict(running=[], finished=["1"], used_blocks=0),
    }
    scenario = Scenario([4, 4], [8, 8], [1, 1], num_kv_blocks=4)
    results = run_step_table(checkpoint, tiny_model_dirs[MODEL], scenario, table)
    # Recomputation changes nothing: the preempted request gives its solo output.
    solo = checkpoint.LLM(str(tiny_model_dirs[MODEL]))
    for index in ("0", "1"):
        params = checkpoint.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        assert results[index] == solo.generate([prompt_tokens(int(index), 4)], params, use_tqdm=False)[0].token_ids


def test_abort_a_waiting_and_a_running_request(checkpoint, tiny_model_dirs):
    # max_num_seqs=1. 0: P=3, 5 tokens.  1: P=3, 5 tokens.  2: P=2, 2 tokens. All at step 1.
    # step 1: 0 prefills (1 block); 1 and 2 wait
    # before step 2: abort 1 (waiting): it leaves the queue. step 2: 0 decodes (4 slots, 1 block)
    # before step 3: abort 0 (running): its block returns at once. step 3: 2 prefills (1 block)
    # step 4: 2 decodes (3 slots) and finishes
    table = {
        1: dict(waiting=["1", "2"], running=["0"], used_blocks=1),
        2: dict(waiting=["2"], running=["0"], outputs=["0"], used_blocks=1),
        3: dict(waiting=[], running=["2"], outputs=["2"], used_blocks=1),
        4: dict(running=[], finished=["2"], used_blocks=0),
    }
    scenario = Scenario([3, 3, 2], [5, 5, 2], [1, 1, 1], max_num_seqs=1, aborts={2: ["1"], 3: ["0"]})
    results = run_step_table(checkpoint, tiny_model_dirs[MODEL], scenario, table)
    assert set(results) == {"2"}  # aborted requests never finish normally


def test_a_prompt_that_ends_exactly_on_a_block_boundary(checkpoint, tiny_model_dirs):
    # 0: P=8 (2 full blocks), 3 tokens.  1: P=4 (1 full block), 1 token. Both at step 1.
    # step 1: 0 takes 2 blocks, 1 takes 1 and finishes at once (max_tokens 1): 2 used
    # step 2: 0's 9th slot opens a 3rd block exactly now
    # step 3: 0 at 10 slots (3 blocks) finishes
    table = {
        1: dict(running=["0"], outputs=["0", "1"], finished=["1"], used_blocks=2),
        2: dict(running=["0"], used_blocks=3),
        3: dict(running=[], finished=["0"], used_blocks=0),
    }
    run_step_table(checkpoint, tiny_model_dirs[MODEL], Scenario([8, 4], [3, 1], [1, 1]), table)
