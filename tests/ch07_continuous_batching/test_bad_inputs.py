"""Every bad input is refused before anything is queued; nothing a caller does wedges the engine.

Each case: a ValueError naming the limit, at `add_request` and at `LLM.generate` (alone and inside a batch of
good prompts); afterwards nothing is queued, every block is free and the next good request is correct.
"""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

GOOD_PROMPT = [5, 6, 7]

BAD_PARAMS = [
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=-1), "temperature"),
    (dict(temperature="1"), "temperature"),
    (dict(top_p=math.nan), "top_p"),
    (dict(top_k=1.5), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(seed=1.5), "seed"),
    (dict(seed="7"), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-1), "seed"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=["x"]), "stop_token_ids"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
]

BAD_PROMPTS = [
    ([], "empty"),
    ({"prompt": ""}, "empty"),
    ([True, 5], "outside the vocabulary"),
    ([[5, 6]], "a prompt must be"),
    ({"text": "hi"}, "a dict prompt must be"),
    ({"prompt_token_ids": [5, 6], "prompt": "hi"}, "a dict prompt must be"),
    (3.5, "a prompt must be"),
    ([5, 10**6], "outside the vocabulary"),
]


@pytest.fixture
def llm(checkpoint, tiny_model_dirs):
    return checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=4, num_kv_blocks=40, max_model_len=64)


def greedy(checkpoint, **kwargs):
    return checkpoint.SamplingParams(temperature=0, **{"max_tokens": 6, "ignore_eos": True, **kwargs})


def assert_idle_and_correct(checkpoint, llm, expected_tokens):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and not engine.requests
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_total_blocks
    [output] = llm.generate([GOOD_PROMPT], greedy(checkpoint), use_tqdm=False)
    assert output.token_ids == expected_tokens


@pytest.fixture
def expected(checkpoint, tiny_model_dirs):
    fresh = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    return fresh.generate([GOOD_PROMPT], greedy(checkpoint), use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("kwargs, message", BAD_PARAMS)
def test_bad_sampling_params_are_refused_by_name(checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        checkpoint.SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", BAD_PARAMS)
def test_params_made_bad_after_construction_are_refused_when_queued(checkpoint, llm, expected, kwargs, message):
    params = checkpoint.SamplingParams()
    for name, value in kwargs.items():
        setattr(params, name, value)  # a dataclass: nothing stops this, so add_request checks again
    with pytest.raises(ValueError, match=message):
        llm.llm_engine.add_request("bad", GOOD_PROMPT, params)
    with pytest.raises(ValueError, match=message):
        llm.generate([GOOD_PROMPT, GOOD_PROMPT], [greedy(checkpoint), params], use_tqdm=False)
    assert_idle_and_correct(checkpoint, llm, expected)


@pytest.mark.parametrize("prompt, message", BAD_PROMPTS)
def test_bad_prompts_are_refused_alone_and_inside_a_batch(checkpoint, llm, expected, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.llm_engine.add_request("bad", prompt, greedy(checkpoint))
    with pytest.raises(ValueError, match=message):
        llm.generate([GOOD_PROMPT, prompt, GOOD_PROMPT], greedy(checkpoint), use_tqdm=False)
    assert_idle_and_correct(checkpoint, llm, expected)


def test_stop_token_ids_outside_the_vocabulary_are_refused(checkpoint, llm, expected):
    vocab = llm.model.config.vocab_size
    with pytest.raises(ValueError, match=f"stop_token_ids .*\\[0, {vocab}\\)"):
        llm.generate([GOOD_PROMPT], greedy(checkpoint, stop_token_ids=[vocab]), use_tqdm=False)
    assert_idle_and_correct(checkpoint, llm, expected)


def test_sampling_params_must_be_sampling_params(checkpoint, llm, expected):
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams"):
        llm.generate([GOOD_PROMPT, GOOD_PROMPT], [greedy(checkpoint), {"temperature": 0}], use_tqdm=False)
    assert_idle_and_correct(checkpoint, llm, expected)


def test_dict_prompts_in_vllms_shapes_work(checkpoint, llm, expected):
    text = llm.tokenizer.decode(GOOD_PROMPT)
    by_ids, by_text = llm.generate(
        [{"prompt_token_ids": GOOD_PROMPT}, {"prompt": text}], greedy(checkpoint), use_tqdm=False
    )
    assert by_ids.token_ids == expected and by_ids.prompt is None
    assert by_text.prompt == text and by_text.prompt_token_ids == llm.tokenizer.encode(text)


def test_a_tiny_temperature_is_greedy(checkpoint, llm, expected):
    for temperature in (1e-39, 1e-6):
        params = checkpoint.SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True)
        assert params.greedy
        assert llm.generate([GOOD_PROMPT], params, use_tqdm=False)[0].token_ids == expected


def test_max_tokens_none_runs_up_to_max_model_len(checkpoint, llm):
    [output] = llm.generate([GOOD_PROMPT], greedy(checkpoint, max_tokens=None), use_tqdm=False)
    assert len(output.token_ids) == 64 - len(GOOD_PROMPT) and output.finish_reason == "length"


def test_sampling_params_are_copied_when_queued(checkpoint, llm, expected):
    params = greedy(checkpoint)
    llm.llm_engine.add_request("a", GOOD_PROMPT, params)
    params.max_tokens, params.temperature = 1, 5.0  # changes nothing for the queued request
    finished = {}
    while llm.llm_engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in llm.llm_engine.step() if o.finished})
    assert finished["a"].token_ids == expected


def test_automatic_ids_never_collide_with_chosen_ones(checkpoint, llm):
    engine = llm.llm_engine
    engine.add_request("0", GOOD_PROMPT, greedy(checkpoint))
    engine.add_request("2", GOOD_PROMPT, greedy(checkpoint))
    automatic = [engine.add_request(None, GOOD_PROMPT, greedy(checkpoint)) for _ in range(3)]
    assert len(set(automatic) | {"0", "2"}) == 5


def test_outputs_are_snapshots(checkpoint, llm):
    engine = llm.llm_engine
    engine.add_request("a", GOOD_PROMPT, greedy(checkpoint))
    [first] = engine.step()
    seen = (list(first.token_ids), first.text, first.finish_reason)
    while engine.has_unfinished_requests():
        engine.step()
    assert (first.token_ids, first.text, first.finish_reason) == seen and len(seen[0]) == 1


def test_a_closed_stream_aborts_its_request(checkpoint, llm, expected):
    stream = llm.stream(GOOD_PROMPT, checkpoint.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    next(stream)
    assert llm.llm_engine.has_unfinished_requests()
    stream.close()
    assert_idle_and_correct(checkpoint, llm, expected)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_generate_left_by_an_exception_leaves_nothing_behind(checkpoint, llm, expected, monkeypatch, error):
    sample_batch, calls = checkpoint.llm_engine.sample_batch, []

    def failing_sample_batch(*args):
        calls.append(1)
        if len(calls) == 3:
            raise error("interrupted")
        return sample_batch(*args)

    monkeypatch.setattr(checkpoint.llm_engine, "sample_batch", failing_sample_batch)
    with pytest.raises(error):
        llm.generate([GOOD_PROMPT, [9, 10, 11, 12]], greedy(checkpoint), use_tqdm=False)
    assert_idle_and_correct(checkpoint, llm, expected)


finite = st.floats(allow_nan=False, allow_infinity=False)
values = {
    "temperature": st.one_of(finite, st.just(math.nan), st.just(math.inf), st.text(max_size=2)),
    "top_p": st.one_of(finite, st.just(math.nan)),
    "top_k": st.one_of(st.integers(-3, 50), finite),
    "max_tokens": st.one_of(st.none(), st.integers(-2, 8), st.booleans()),
    "seed": st.one_of(st.none(), st.integers(-5, 2**65), finite, st.text(max_size=2)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(-2, 400), max_size=3), st.integers(0, 5)),
}


def is_valid(kwargs) -> bool:
    def integer(v):
        return isinstance(v, int) and not isinstance(v, bool)

    t, p, k, n, s, stop = (kwargs.get(f) for f in values)
    return all(
        [
            isinstance(t, float) and 0 <= t < math.inf if "temperature" in kwargs else True,
            isinstance(p, float) and 0 < p <= 1 if "top_p" in kwargs else True,
            integer(k) and k >= 0 if "top_k" in kwargs else True,
            n is None or (integer(n) and n >= 1),
            s is None or (integer(s) and 0 <= s < 2**64),
            stop is None or (isinstance(stop, list) and all(t >= 0 for t in stop)),
        ]
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries({}, optional=values))
def test_random_sampling_params_run_or_are_refused(checkpoint, llm, kwargs):
    kwargs = {"max_tokens": 3, **kwargs}
    if not is_valid(kwargs):
        with pytest.raises(ValueError):
            checkpoint.SamplingParams(**kwargs)
    else:
        params = checkpoint.SamplingParams(**kwargs)
        try:
            [output] = llm.generate([GOOD_PROMPT], params, use_tqdm=False)
            assert output.finished and 1 <= len(output.token_ids) <= 64 - len(GOOD_PROMPT)
        except ValueError as error:  # stop ids past this vocabulary are refused when queued
            assert "stop_token_ids" in str(error)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_total_blocks


def test_a_stream_whose_request_is_aborted_ends(checkpoint, llm, expected):
    stream = llm.stream(GOOD_PROMPT, checkpoint.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    next(stream)
    [request_id] = llm.llm_engine.requests
    assert llm.llm_engine.abort_request(request_id)
    assert list(stream) == []  # the generator ends instead of stepping an idle engine forever
    assert_idle_and_correct(checkpoint, llm, expected)
