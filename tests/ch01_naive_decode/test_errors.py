"""Bad input raises ValueError naming the limit, before any work, and the engine keeps working."""

import pytest


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
    ],
)
def test_bad_sampling_params(checkpoint, kwargs, message):
    with pytest.raises(ValueError, match=message):
        checkpoint.SamplingParams(**kwargs)


@pytest.fixture
def tiny_llm(checkpoint, tiny_model_dirs):
    return checkpoint.LLM(str(tiny_model_dirs["gqa"]), max_model_len=64)


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt(tiny_llm, prompt):
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate(["fine", prompt], use_tqdm=False)


def test_prompt_longer_than_max_model_len(tiny_llm):
    with pytest.raises(ValueError, match="max_model_len=64"):
        tiny_llm.generate([[5] * 64], use_tqdm=False)


def test_token_ids_outside_the_vocabulary(tiny_llm):
    with pytest.raises(ValueError, match="token ids outside"):
        tiny_llm.generate([[5, 10**6]], use_tqdm=False)


def test_one_sampling_params_per_prompt(checkpoint, tiny_llm):
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        tiny_llm.generate(["a", "b", "c"], [checkpoint.SamplingParams()] * 2, use_tqdm=False)


def test_max_model_len_beyond_the_model(checkpoint, tiny_model_dirs):
    with pytest.raises(ValueError, match="max_model_len"):
        checkpoint.LLM(str(tiny_model_dirs["gqa"]), max_model_len=10**6)


def test_the_engine_keeps_working_after_bad_input(checkpoint, tiny_llm):
    params = checkpoint.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    before = tiny_llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
    with pytest.raises(ValueError):
        tiny_llm.generate([[5, 6, 7], [5] * 100], params, use_tqdm=False)
    assert tiny_llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids == before
