"""Whatever ends a call early (an exception or Ctrl-C from the model, a closed stream, bad input anywhere in
a batch), the LLM is left idle: nothing queued, every KV block free, the next generate undisturbed."""

import itertools

import pytest

PROMPTS = [[10, 11, 12], [20, 21, 22, 23, 24], [30, 31]]


def chapter(checkpoint) -> int:
    return int(checkpoint.__chapter__[:2])


def greedy(checkpoint, max_tokens: int = 6):
    return checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
def tiny_llm(checkpoint, tiny_model_dirs):
    return checkpoint.LLM(str(tiny_model_dirs["gqa"]), max_model_len=64)


def tokens(checkpoint, llm) -> list[list[int]]:
    return [output.token_ids for output in llm.generate(PROMPTS, greedy(checkpoint), use_tqdm=False)]


def assert_idle(checkpoint, llm) -> None:
    """No request queued anywhere (chapter 03 on) and every KV block free (chapter 04 on)."""
    number = chapter(checkpoint)
    if number >= 7:
        assert not llm.llm_engine.has_unfinished_requests()
    elif number >= 3:
        assert not llm.scheduler.has_unfinished_requests()
    if number >= 4:
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_total_blocks


def fail_once(llm, on_call: int, error: type[BaseException]) -> None:
    """Make the model's forward raise `error` on its `on_call`-th call (once), as a fault or Ctrl-C would."""
    forward, calls = llm.model.forward, itertools.count(1)

    def failing_forward(*args, **kwargs):
        if next(calls) == on_call:
            raise error("injected by the test")
        return forward(*args, **kwargs)

    llm.model.forward = failing_forward


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_generate_interrupted_by_the_model(checkpoint, tiny_llm, error):
    expected = tokens(checkpoint, tiny_llm)
    fail_once(tiny_llm, 2, error)
    with pytest.raises(error, match="injected"):
        tiny_llm.generate(PROMPTS, greedy(checkpoint), use_tqdm=False)
    assert_idle(checkpoint, tiny_llm)
    assert tokens(checkpoint, tiny_llm) == expected


@pytest.mark.parametrize("how", ["close", "drop", "error"])
def test_stream_left_early(checkpoint, tiny_llm, how):
    expected = tokens(checkpoint, tiny_llm)
    stream = tiny_llm.stream("The quick brown fox", greedy(checkpoint, 40))
    assert next(stream)
    if how == "close":
        stream.close()
    elif how == "drop":
        del stream  # the generator is finalized as the caller lets go of it
    else:
        fail_once(tiny_llm, 1, KeyboardInterrupt)
        with pytest.raises(KeyboardInterrupt):
            list(stream)
    assert_idle(checkpoint, tiny_llm)
    assert tokens(checkpoint, tiny_llm) == expected


def test_stream_run_to_the_end_leaves_nothing_behind(checkpoint, tiny_llm):
    stream = tiny_llm.stream([10, 11, 12], greedy(checkpoint))
    pieces = list(stream)
    assert_idle(checkpoint, tiny_llm)
    assert "".join(pieces) == tiny_llm.generate([[10, 11, 12]], greedy(checkpoint), use_tqdm=False)[0].text


def test_stop_token_ids_outside_the_vocabulary(checkpoint, tiny_llm):
    vocab = tiny_llm.model.config.vocab_size
    expected = tokens(checkpoint, tiny_llm)
    outside = checkpoint.SamplingParams(stop_token_ids=[3, vocab])
    with pytest.raises(ValueError, match=rf"stop_token_ids.*\[0, {vocab}\)"):
        tiny_llm.generate(PROMPTS, [greedy(checkpoint), greedy(checkpoint), outside], use_tqdm=False)
    with pytest.raises(ValueError, match=rf"stop_token_ids.*\[0, {vocab}\)"):
        next(tiny_llm.stream("fine", outside))
    assert_idle(checkpoint, tiny_llm)
    inside = checkpoint.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[vocab - 1])
    assert tiny_llm.generate([[10, 11, 12]], inside, use_tqdm=False)[0].finish_reason in ("stop", "length")
    assert tokens(checkpoint, tiny_llm) == expected


BAD_PROMPTS = {
    "bool token": [1, True],
    "float token": [1, 2.5],
    "str token": [1, "a"],
    "nested list": [[1, 2]],
    "None": None,
    "int": 5,
    "bytes": b"ab",
    "set": {1, 2},
    "unknown dict": {"text": "hi"},
    "dict with a non-str prompt": {"prompt": 5},
    "dict with bool token ids": {"prompt_token_ids": [1, True]},
}


@pytest.mark.parametrize("bad", BAD_PROMPTS.values(), ids=BAD_PROMPTS.keys())
def test_bad_prompt_shape_is_refused_with_nothing_queued(checkpoint, tiny_llm, bad):
    expected = tokens(checkpoint, tiny_llm)
    with pytest.raises(ValueError, match="prompt"):
        tiny_llm.generate(["fine", [5, 6], bad], greedy(checkpoint), use_tqdm=False)
    assert_idle(checkpoint, tiny_llm)
    assert tokens(checkpoint, tiny_llm) == expected


def test_one_prompt_of_bools_is_refused(checkpoint, tiny_llm):
    with pytest.raises(ValueError, match="token ids"):
        tiny_llm.generate([1, True], use_tqdm=False)
    assert_idle(checkpoint, tiny_llm)


@pytest.mark.parametrize("prompt", [{"prompt": "The quick brown fox"}, {"prompt_token_ids": [10, 11, 12]}])
def test_dict_prompts_arrive_with_chapter_07(checkpoint, tiny_llm, prompt):
    """vLLM's dict prompts: chapter 07 accepts them; earlier chapters refuse them, naming what they accept."""
    if chapter(checkpoint) >= 7:
        plain = prompt.get("prompt", prompt.get("prompt_token_ids"))
        [expected] = tiny_llm.generate([plain], greedy(checkpoint), use_tqdm=False)
        [output] = tiny_llm.generate([prompt], greedy(checkpoint), use_tqdm=False)
        assert (output.prompt_token_ids, output.token_ids) == (expected.prompt_token_ids, expected.token_ids)
    else:
        with pytest.raises(ValueError, match="a str or a list of int token ids"):
            tiny_llm.generate(["fine", prompt], greedy(checkpoint), use_tqdm=False)
        with pytest.raises(ValueError, match="a str or a list of int token ids"):
            tiny_llm.generate(prompt, greedy(checkpoint), use_tqdm=False)
    assert_idle(checkpoint, tiny_llm)


def test_bad_sampling_params_in_a_batch_leave_nothing_queued(checkpoint, tiny_llm):
    expected = tokens(checkpoint, tiny_llm)
    changed = checkpoint.SamplingParams()
    changed.max_tokens = 0  # set after construction: generate must check again
    for bad in (changed, {"max_tokens": 4}):
        with pytest.raises(ValueError, match="max_tokens|SamplingParams"):
            tiny_llm.generate(PROMPTS, [greedy(checkpoint), greedy(checkpoint), bad], use_tqdm=False)
        assert_idle(checkpoint, tiny_llm)
    assert tokens(checkpoint, tiny_llm) == expected
