"""A compiled decode step of at most `GRAPH_DECODE_ROWS` rows attends inside its graph; one of more rows calls
the attention operator, whose decode kernel attends (`attention/backends/cpu_attn.py`). Either way the greedy
tokens are the eager reference engine's."""

import pytest

from chapters import submodule
from tests.ch11_cpu_performance.test_fast_path import REFERENCE, prompt

pytestmark = pytest.mark.requires("integer_dot")

MAX_TOKENS = 6


def decode_step_rows(checkpoint, model_dir, batch: int, monkeypatch) -> tuple[list[int], dict]:
    """`batch` requests of equal prompts' length, compiled: the rows each call of the decode kernel was given
    during one step in which every row decodes, and every request's greedy tokens."""
    cpu_attn = submodule(checkpoint, "cpu_attention")
    kernel, calls = cpu_attn.kernel_decode_attention, []

    def counted(query, *args, **kwargs):
        calls.append(query.shape[0])
        return kernel(query, *args, **kwargs)

    monkeypatch.setattr(cpu_attn, "kernel_decode_attention", counted)
    engine = checkpoint.LLMEngine(str(model_dir), block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    assert engine.model_runner.attention_backend.name == "cpu" and not engine.model_runner.enforce_eager
    params = checkpoint.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), prompt(i, 7), params)
    while engine.scheduler.waiting or any(seq.num_uncomputed_tokens > 1 for seq in engine.scheduler.running):
        engine.step()
    calls.clear()
    finished = {o.request_id: o.token_ids for o in engine.step() if o.finished}
    rows = list(calls)
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    return rows, finished


def reference_tokens(checkpoint, model_dir, batch: int) -> dict:
    engine = checkpoint.LLMEngine(str(model_dir), block_size=4, **REFERENCE)
    params = checkpoint.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), prompt(i, 7), params)
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    return finished


def test_a_few_decoding_rows_attend_inside_the_graph_more_through_the_kernel(checkpoint, tiny_model_dirs, monkeypatch):
    bound = submodule(checkpoint, "cpu_attention").GRAPH_DECODE_ROWS
    layers = 2  # the tiny models' decoder layers (tests/tiny_models.py)
    for batch, expected in ((bound, []), (bound + 2, [bound + 2] * layers)):
        with monkeypatch.context() as patched:
            rows, tokens = decode_step_rows(checkpoint, tiny_model_dirs["gqa"], batch, patched)
        assert rows == expected, batch
        assert tokens == reference_tokens(checkpoint, tiny_model_dirs["gqa"], batch)
