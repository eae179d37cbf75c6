"""The offline scheduler step by step: joining mid-decode, early finishes, batch limits.

Chapter 07 replaces it with the continuous-batching scheduler (which has its own step tables)."""

import pytest

pytestmark = pytest.mark.requires("offline_scheduler")


def add(llm, prompt, params):
    """Queue one request on the LLM's scheduler; return its session."""
    return llm.add_request(prompt, params)


def run_to_end(llm) -> int:
    steps = 0
    while llm.scheduler.has_unfinished_requests():
        llm.scheduler.step()
        steps += 1
    return steps


def solo(checkpoint, llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].token_ids


def greedy(checkpoint, n):
    return checkpoint.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_a_request_joins_while_others_decode(checkpoint, llm):
    first = add(llm, [10, 11, 12, 13], greedy(checkpoint, 8))
    second = add(llm, [50], greedy(checkpoint, 8))
    for _ in range(3):
        llm.scheduler.step()
    assert len(first.output.token_ids) == 3
    late = add(llm, list(range(60, 75)), greedy(checkpoint, 6))  # joins at step 4
    outputs = llm.scheduler.step()
    assert {s.request_id for s, _ in outputs} == {first.request_id, second.request_id, late.request_id}
    assert len(late.output.token_ids) == 1 and len(first.output.token_ids) == 4
    run_to_end(llm)
    for session, prompt, n in ((first, [10, 11, 12, 13], 8), (second, [50], 8), (late, list(range(60, 75)), 6)):
        assert session.output.token_ids == solo(checkpoint, llm, prompt, greedy(checkpoint, n))


def test_max_tokens_one_finishes_at_once_and_frees_its_place(checkpoint, llm):
    quick = add(llm, [5, 6, 7], greedy(checkpoint, 1))
    slow = [add(llm, [8 + i], greedy(checkpoint, 4)) for i in range(3)]
    llm.scheduler.step()
    assert quick.finished and quick.output.finish_reason == "length" and len(quick.output.token_ids) == 1
    assert quick not in llm.scheduler.running
    assert len(llm.scheduler.running) == 2 and len(llm.scheduler.waiting) == 1
    llm.scheduler.step()  # the waiting one takes the free place
    assert len(llm.scheduler.running) == 3 and not llm.scheduler.waiting
    run_to_end(llm)
    assert all(len(s.output.token_ids) == 4 for s in slow)


def test_several_reach_max_tokens_on_the_same_step(checkpoint, llm):
    sessions = [add(llm, list(range(10, 10 + n)), greedy(checkpoint, 5)) for n in (1, 4, 9)]
    for step in range(1, 6):
        outputs = llm.scheduler.step()
        finished = [s for s, _ in outputs if s.finished]
        assert len(finished) == (3 if step == 5 else 0)
    assert not llm.scheduler.has_unfinished_requests()
    assert all(s.output.finish_reason == "length" for s in sessions)


def test_max_batch_size_is_never_exceeded(checkpoint, llm):
    for n in range(1, 8):
        add(llm, list(range(20, 20 + n)), greedy(checkpoint, n))
    while llm.scheduler.has_unfinished_requests():
        outputs = llm.scheduler.step()
        assert len(outputs) <= 3 and len(llm.scheduler.running) <= 3


def test_every_prompt_a_different_length(checkpoint, llm):
    prompts = [list(range(30, 30 + n)) for n in (1, 2, 3, 5, 8, 13)]
    sessions = [add(llm, p, greedy(checkpoint, 6)) for p in prompts]
    run_to_end(llm)
    for prompt, session in zip(prompts, sessions):
        assert session.output.token_ids == solo(checkpoint, llm, prompt, greedy(checkpoint, 6))
