"""The decode step as one compiled graph: the whole forward (embedding, every layer with its attention, final
norm) is one torch.compile graph per shape, attention a custom operator in it. It gives what the eager
reference gives, token for token, under chunked prompts, preemption, prefix hits and n > 1; it is compiled at
start and never again while sequences grow over many blocks; the profiler still sees each layer's
attention; the rotary tables it looks up hold transformers' cos and sin exactly. (That `enforce_eager`
compiles nothing is chapter 11's test.)"""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from benchmarks.engines import part_of
from tests.ch09_prefix_caching.engine_runs import run

pytestmark = [pytest.mark.requires("compiled"), pytest.mark.cpu_features]

SHARED = [(j * 31) % 300 + 3 for j in range(21)]


def prompt(index: int, length: int) -> list[int]:
    return [(index * 41 + j * 13) % 300 + 3 for j in range(length)]


# (arrival step, prompt, max_tokens): arrivals over time, shared beginnings, prompts longer than a budget
REQUESTS = [
    (1, SHARED + prompt(0, 4), 11),
    (1, prompt(1, 3), 14),
    (2, SHARED + prompt(2, 9), 9),
    (3, prompt(3, 40), 6),
    (5, SHARED + prompt(0, 4), 7),
    (5, [7], 10),
    (8, prompt(4, 17), 12),
]

REFERENCE = {"enforce_eager": True, "attention_backend": "reference"}


def engine(checkpoint, path, block_size: int, budget: int, options: dict):
    largest = max(-(-(len(p) + 2 * n) // block_size) for _, p, n in REQUESTS)
    return checkpoint.LLMEngine(
        str(path),
        block_size=block_size,
        num_kv_blocks=largest + largest // 3,  # room for the largest and a third: running requests preempt
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        watermark=0.0,
        **options,
    )


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("block_size, budget", [(1, 8), (16, 8), (4, 64)])
def test_compiled_step_equals_eager_reference(checkpoint, tiny_model_dirs, block_size, budget):
    def params(index, max_tokens):  # every other request samples two answers, seeded
        if index % 2:
            return checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return checkpoint.SamplingParams(n=2, temperature=1.0, seed=index, max_tokens=max_tokens, ignore_eos=True)

    compiled_engine = engine(checkpoint, tiny_model_dirs["gqa"], block_size, budget, {})
    assert compiled_engine.model.compiled
    compiled = run(compiled_engine, REQUESTS, params)
    reference = run(engine(checkpoint, tiny_model_dirs["gqa"], block_size, budget, REFERENCE), REQUESTS, params)
    assert compiled.tokens == reference.tokens
    assert compiled.num_preemptions > 0 and sum(compiled.num_cached_tokens.values()) > 0  # both were in play
    assert block_size == 1 or compiled.copies  # n = 2 shared a part-filled last block: copied on write
    assert budget == 64 or max(len(p) for _, p, _ in REQUESTS) > budget  # under budget 8, prompts were chunked


@pytest.mark.parametrize("batch", [1, 3])
def test_the_step_compiles_at_start_and_never_again(checkpoint, tiny_model_dirs, batch):
    """One graph per shape of the step (one token, more) and the "cpu" backend's decode kernel, all at
    start, without a graph break; then sequences that grow over many blocks,
    one at a time or three together, compile nothing more."""
    torch._dynamo.reset()  # count this engine's compilations from zero
    counters.clear()
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=4, max_num_batched_tokens=32, max_num_seqs=batch)
    at_start = compiled_graphs()
    assert 2 <= at_start <= 6, at_start
    assert not counters["graph_break"], dict(counters["graph_break"])
    prompts = [prompt(i, 5 + 11 * i) for i in range(batch)]
    params = [checkpoint.SamplingParams(temperature=0, max_tokens=30 + 4 * i, ignore_eos=True) for i in range(batch)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outputs[-1].prompt_token_ids) + len(outputs[-1].token_ids) > 8 * 4  # past eight blocks
    assert compiled_graphs() == at_start
    assert not counters["graph_break"]


def test_profiler_sees_every_layers_attention(checkpoint, tiny_model_dirs):
    """The "rosellm.attention" label runs inside the compiled graph's attention operator, once per layer, and
    the benchmarks' profile counts it as attention inside the forward (a step with a prompt in it: one
    token's attention is traced into the graph)."""
    engine = checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]))
    params = checkpoint.SamplingParams(temperature=0, max_tokens=3)
    engine.add_request("a", [5, 6, 7, 8], params)
    engine.step()  # a's prompt
    engine.add_request("b", [9, 10, 11], params)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()  # a decodes, b's prompt
    labels = [event for event in prof.events() if event.name == "rosellm.attention"]
    assert len(labels) == engine.model.config.num_hidden_layers
    assert all(part_of(event) == "attention" for event in labels)


def test_a_forward_plans_once_and_the_one_token_graph_not_at_all(checkpoint, tiny_model_dirs, monkeypatch):
    """The attention operator plans at a forward's first layer, once for all of them; one sequence decoding
    runs the one-token graph, whose attention is its own, so it makes no plan."""
    llm_engine = engine(checkpoint, tiny_model_dirs["gqa"], 4, 64, {})
    backend, plans = llm_engine.model_runner.attention_backend, []
    plan = backend.plan
    monkeypatch.setattr(backend, "plan", lambda *args: plans.append(1) or plan(*args))
    llm_engine.add_request("one", prompt(0, 9), checkpoint.SamplingParams(temperature=0, max_tokens=5))
    llm_engine.step()  # the prompt: one forward of 9 tokens through the operators
    assert len(plans) == 1
    while llm_engine.has_unfinished_requests():
        llm_engine.step()  # four decode steps of one token each
    assert len(plans) == 1


@pytest.mark.parametrize("name", ["gqa", "llama3_rope"])
def test_rotary_tables_are_transformers_cos_and_sin_bit_for_bit(checkpoint, tiny_model_dirs, tiny_hf_models, name):
    """cos and sin are looked up in tables made at load (computed in the step, the compiled step evaluated
    them again for every key attention scored): every position's row is exactly what transformers computes."""
    rotary = checkpoint.LLMEngine(str(tiny_model_dirs[name]), enforce_eager=True).model.model.rotary_emb
    reference = tiny_hf_models[name].model.rotary_emb
    positions = torch.arange(rotary.cos_table.shape[0])
    cos, sin = rotary(positions)  # [positions, head_dim]
    expected_cos, expected_sin = reference(torch.zeros(1, len(positions), 1), positions[None])
    assert torch.equal(cos, expected_cos[0]) and torch.equal(sin, expected_sin[0])
