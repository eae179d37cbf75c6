"""A step whose every row decodes one token runs a compiled graph of its own, attention included: no operator
call, no plan, no Python per layer (the step a server under overlapping requests runs most). It gives what the
eager reference gives, token for token, with rows of ragged lengths and table widths, under preemption,
chunking, prefix hits and n > 1; a step with a prompt in it still goes through the attention operator."""

import pytest
from torch.profiler import ProfilerActivity, profile

from tests.ch09_prefix_caching.engine_runs import run
from tests.ch13_quantization.test_compiled_step import REFERENCE, REQUESTS, engine, prompt

pytestmark = [pytest.mark.requires("compiled"), pytest.mark.cpu_features]


def attention_calls(engine_to_step) -> int:
    """How many times one step of `engine_to_step` entered the attention operator."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine_to_step.step()
    return sum(event.name == "rosellm.attention" for event in prof.events())


def test_decoding_rows_attend_inside_the_graph(checkpoint, tiny_model_dirs, monkeypatch):
    """Three sequences of different lengths decode: no plan, no operator call; a newcomer's prompt in the
    step sends the step back through the operator, one plan for its every layer."""
    llm_engine = checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), block_size=4, max_num_seqs=4)
    backend, plans = llm_engine.model_runner.attention_backend, []
    plan = backend.plan
    monkeypatch.setattr(backend, "plan", lambda *args: plans.append(1) or plan(*args))
    params = checkpoint.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for index, length in enumerate((3, 9, 14)):
        llm_engine.add_request(str(index), prompt(index, length), params)
    llm_engine.step()  # the three prompts
    assert len(plans) == 1
    for _ in range(3):
        assert attention_calls(llm_engine) == 0  # three rows, one token each
    assert len(plans) == 1
    llm_engine.add_request("late", prompt(3, 6), params)
    assert attention_calls(llm_engine) == llm_engine.model.config.num_hidden_layers  # three decode rows, a prompt
    assert len(plans) == 2


@pytest.mark.parametrize("block_size, budget", [(1, 8), (16, 8), (4, 64)])
def test_decoding_graph_equals_eager_reference(checkpoint, tiny_model_dirs, block_size, budget):
    """Chapter 13's requests (arrivals over time, shared beginnings, prompts longer than a budget) with up to
    four rows a step, so that most steps are several rows decoding: the same tokens as the eager reference."""

    def params(index, max_tokens):  # every other request samples two answers, seeded
        if index % 2:
            return checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return checkpoint.SamplingParams(n=2, temperature=1.0, seed=index, max_tokens=max_tokens, ignore_eos=True)

    compiled = run(engine(checkpoint, tiny_model_dirs["gqa"], block_size, budget, {}), REQUESTS, params)
    reference = run(engine(checkpoint, tiny_model_dirs["gqa"], block_size, budget, REFERENCE), REQUESTS, params)
    assert compiled.tokens == reference.tokens
    decoding_steps = [plan for plan in compiled.plans if len(plan.num_new_tokens) > 1 and max(plan.num_new_tokens) == 1]
    assert len(decoding_steps) > 10  # the decoding graph of several rows ran
    assert compiled.num_preemptions > 0 and sum(compiled.num_cached_tokens.values()) > 0
