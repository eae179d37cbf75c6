"""Under preemption pressure every request still gets exactly its solo output, and nothing leaks."""

import pytest


def solo_outputs(checkpoint, model_dir, prompts, params):
    llm = checkpoint.LLM(str(model_dir))
    return [llm.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in zip(prompts, params)]


def count_preemptions(engine) -> list:
    preempted = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        preempted.extend(seq.request_id for seq in plan.preempted)
        return plan

    engine.scheduler.schedule = recording_schedule
    return preempted


@pytest.mark.parametrize("name", ["gqa", "mqa_tied"])
def test_repeated_preemption_keeps_every_output_exact(checkpoint, tiny_model_dirs, name):
    prompts = [[(i * 13 + j * 7) % 300 + 3 for j in range(3 + 5 * i)] for i in range(6)]
    greedy = [checkpoint.SamplingParams(temperature=0, max_tokens=20 + 3 * i, ignore_eos=True) for i in range(6)]
    seeded = [
        checkpoint.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True, seed=i) for i in range(6)
    ]
    for params in (greedy, seeded):
        llm = checkpoint.LLM(str(tiny_model_dirs[name]), block_size=4, num_kv_blocks=16, watermark=0.0)
        preempted = count_preemptions(llm.llm_engine)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert len(preempted) >= 3, "the pool was meant to be too small for the batch"
        assert [o.token_ids for o in outputs] == solo_outputs(checkpoint, tiny_model_dirs[name], prompts, params)
        assert llm.block_manager.num_free_blocks == 16


@pytest.mark.model
def test_smollm2_under_preemption_matches_solo(checkpoint, smollm2_llm, smollm2_path):
    tokenizer = smollm2_llm.tokenizer
    questions = ["What is the capital of France?", "Name three fruits.", "What is 3 + 4?", "Say hello in French."]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in questions
    ]
    params = checkpoint.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [smollm2_llm.generate([p], params, use_tqdm=False)[0].token_ids for p in prompts]
    small = checkpoint.LLM(block_size=16, num_kv_blocks=9, watermark=0.0)  # 144 slots for ~4 x 52
    preempted = count_preemptions(small.llm_engine)
    outputs = small.generate(prompts, params, use_tqdm=False)
    assert preempted and [o.token_ids for o in outputs] == expected
    assert small.block_manager.num_free_blocks == 9
