"""Every bad sampling value raises ValueError naming its field; tiny temperatures are greedy; random valid
and invalid values never wedge the LLM. (`max_tokens=None` is valid from chapter 07 on: not tested here.)"""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PROMPT = [10, 11, 12]

BAD_VALUES = [
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -math.inf),
    ("temperature", -1),
    ("temperature", "7"),
    ("temperature", True),
    ("temperature", None),
    ("top_p", 0),
    ("top_p", -0.5),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_p", "0.5"),
    ("top_p", True),
    ("top_k", -1),
    ("top_k", 1.5),
    ("top_k", "7"),
    ("top_k", True),
    ("top_k", None),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("max_tokens", "7"),
    ("ignore_eos", "yes"),
    ("ignore_eos", 1),
    ("ignore_eos", None),
    ("seed", 1.5),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", "7"),
    ("seed", True),
    ("stop_token_ids", 5),
    ("stop_token_ids", "x"),
    ("stop_token_ids", ["x"]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", {3}),
]


@pytest.mark.parametrize("field, value", BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_bad_value_names_its_field(checkpoint, field, value):
    with pytest.raises(ValueError, match=field):
        checkpoint.SamplingParams(**{field: value})


def test_limits_are_inclusive_where_documented(checkpoint):
    edge = checkpoint.SamplingParams(temperature=0, top_p=1, top_k=0, max_tokens=1, seed=2**64 - 1, stop_token_ids=(0,))
    assert edge.stop_token_ids == [0] and edge.greedy


@pytest.mark.parametrize("top_p", [1e-300, 5e-324])
def test_top_p_below_float32_resolution_keeps_the_most_likely_token(checkpoint, top_p):
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    assert torch.isfinite(checkpoint.sampling.apply_top_p(logits, top_p)).tolist() == [[False, True, False, False]]
    params = checkpoint.SamplingParams(temperature=1.0, top_p=top_p)
    assert checkpoint.sampling.sample(logits[0], params, torch.Generator().manual_seed(0)) == 1


_llms: dict = {}


def tiny_llm(checkpoint, tiny_model_dirs):
    """One LLM per checkpoint for the whole module (hypothesis runs many examples), with its greedy
    tokens for PROMPT taken when it was new."""
    if checkpoint.__name__ not in _llms:
        llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), max_model_len=64)
        _llms[checkpoint.__name__] = llm, greedy_tokens(checkpoint, llm, 12)
    return _llms[checkpoint.__name__]


def greedy_tokens(checkpoint, llm, max_tokens: int) -> list[int]:
    params = checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("temperature", [1e-39, 5e-324, 1e-6, 9.99e-6])
def test_tiny_temperature_is_greedy(checkpoint, tiny_model_dirs, temperature):
    llm, greedy = tiny_llm(checkpoint, tiny_model_dirs)
    params = checkpoint.SamplingParams(temperature=temperature, max_tokens=12, ignore_eos=True)
    assert params.greedy
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids == greedy


VALID = {
    "temperature": st.one_of(st.just(0), st.floats(0, 5)),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(0, 500),
    "max_tokens": st.integers(1, 4),
    "ignore_eos": st.booleans(),
    "seed": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    "stop_token_ids": st.one_of(
        st.none(), st.lists(st.integers(0, 300), max_size=3), st.lists(st.integers(0, 300), max_size=3).map(tuple)
    ),
}
NOT_A_NUMBER = st.sampled_from(["1", None, True, False, [1]])
INVALID = {
    "temperature": st.one_of(st.floats(max_value=-1e-300), st.sampled_from([math.nan, math.inf]), NOT_A_NUMBER),
    "top_p": st.one_of(
        st.floats(max_value=0), st.floats(min_value=1, exclude_min=True), st.just(math.nan), NOT_A_NUMBER
    ),
    "top_k": st.one_of(st.integers(max_value=-1), st.floats(allow_nan=False), NOT_A_NUMBER),
    "max_tokens": st.one_of(st.integers(max_value=0), st.floats(), st.sampled_from(["1", True, False, [1]])),
    "ignore_eos": st.one_of(st.integers(), st.sampled_from(["yes", None, [True]])),
    "seed": st.one_of(
        st.integers(max_value=-1), st.integers(min_value=2**64), st.floats(), st.sampled_from(["1", True, False, [1]])
    ),
    "stop_token_ids": st.one_of(
        st.integers(min_value=0),
        st.sampled_from(["x", ""]),
        st.lists(st.one_of(st.integers(max_value=-1), st.floats(), st.booleans(), st.text()), min_size=1, max_size=3),
    ),
}


@st.composite
def sampling_values(draw):
    """Each field valid or not, at random: (the keyword arguments, the names of the invalid ones)."""
    invalid = draw(st.sets(st.sampled_from(sorted(VALID)), max_size=3))
    kwargs = {field: draw(INVALID[field] if field in invalid else VALID[field]) for field in VALID}
    return kwargs, invalid


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=sampling_values())
def test_random_sampling_values(checkpoint, tiny_model_dirs, values):
    kwargs, invalid = values
    llm, greedy = tiny_llm(checkpoint, tiny_model_dirs)
    if invalid:
        with pytest.raises(ValueError) as error:
            checkpoint.SamplingParams(**kwargs)
        assert any(field in str(error.value) for field in invalid), str(error.value)
        # The same values set after construction are refused by generate, which then still works.
        params = checkpoint.SamplingParams()
        for field, value in kwargs.items():
            setattr(params, field, value)
        with pytest.raises(ValueError):
            llm.generate([PROMPT, PROMPT], [checkpoint.SamplingParams(), params], use_tqdm=False)
    else:
        params = checkpoint.SamplingParams(**kwargs)
        [output] = llm.generate([PROMPT], params, use_tqdm=False)
        assert 1 <= len(output.token_ids) <= kwargs["max_tokens"]
        assert output.finish_reason in ("stop", "length")
        if params.greedy:  # the greedy tokens, possibly cut short by a stop token or the end of text
            assert output.token_ids == greedy[: len(output.token_ids)]
    assert greedy_tokens(checkpoint, llm, 12) == greedy  # the LLM never wedges
