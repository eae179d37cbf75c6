"""The quantized engine end to end. On tiny random models (hidden 64: two groups of 32) with fp32 compute:
compiled with the packed kernels forced equals eager with chapter 05's reference attention, token for token,
under chunking, preemption, prefix hits and n > 1; with the dense kernel it equals transformers run on the
same dequantized weights. bf16 compute stays within a stated tolerance of fp32; on SmolLM2 its greedy
tokens are fp32's for gguf and int4, or part from them only at a near tie of fp32's own logits."""

import copy
import logging
import re

import pytest
import torch

from chapters import submodule
from tests.ch09_prefix_caching.engine_runs import run
from tests.ch11_cpu_performance.test_fast_path import REFERENCE, REQUESTS, SHARED, engine, prompt
from tests.engine_options import exact_fp32_products
from tests.oracle import hf_greedy, hf_logits

pytestmark = [pytest.mark.requires("quantization"), pytest.mark.cpu_features]


@pytest.fixture
def ql(checkpoint):
    return submodule(checkpoint, "quantized_linear")


def force_packed(monkeypatch, ql) -> None:
    """Every quantized layer takes its packed kernel, fp32 activations and any row count included."""
    monkeypatch.setattr(ql, "SMALL_BATCH_ROWS", 10**6)
    monkeypatch.setattr(ql, "HALVES_ROWS", 10**6)
    monkeypatch.setattr(ql, "PACKED_DTYPES", (torch.bfloat16, torch.float32))


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_packed_compiled_equals_reference_eager(checkpoint, ql, tiny_model_dirs, monkeypatch, quantization):
    force_packed(monkeypatch, ql)
    chosen = ql.uses_packed_kernel
    calls = []
    monkeypatch.setattr(ql, "uses_packed_kernel", lambda *args: calls.append(chosen(*args)) or calls[-1])

    def params(index, max_tokens):  # every third request: two seeded samples sharing the prompt
        if index % 3 == 1:
            return checkpoint.SamplingParams(temperature=1.0, seed=index, n=2, max_tokens=max_tokens, ignore_eos=True)
        return checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    options = {"quantization": quantization, "dtype": "float32"} | exact_fp32_products(checkpoint)
    fast = run(engine(checkpoint, tiny_model_dirs["gqa"], 16, 8, options), REQUESTS, params)
    reference = run(engine(checkpoint, tiny_model_dirs["gqa"], 16, 8, options | REFERENCE), REQUESTS, params)
    assert fast.tokens == reference.tokens
    assert calls and all(calls)  # the packed kernels ran, always
    assert fast.num_preemptions > 0 and sum(fast.num_cached_tokens.values()) > 0  # both were in play
    assert max(len(p) for _, p, _ in REQUESTS) > 8  # budget 8: prompts were chunked
    assert all(len(samples) == 2 for i, samples in fast.tokens.items() if int(i) % 3 == 1)


def dequantized_twin(hf_model, model):
    """A copy of the transformers model whose projections and LM head are our model's dequantized weights
    (the fused QKV and gate-up split back apart); the embedding stays its own, untied."""
    twin = copy.deepcopy(hf_model)
    for ours, theirs in zip(model.model.layers, twin.model.layers):
        attention, mlp = theirs.self_attn, theirs.mlp
        q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
        qkv = ours.self_attn.qkv_proj.dequantize().split([q.out_features, k.out_features, v.out_features])
        gate, up = ours.mlp.gate_up_proj.dequantize().chunk(2)
        pairs = [(q, qkv[0]), (k, qkv[1]), (v, qkv[2]), (attention.o_proj, ours.self_attn.o_proj.dequantize())]
        pairs += [(mlp.gate_proj, gate), (mlp.up_proj, up), (mlp.down_proj, ours.mlp.down_proj.dequantize())]
        for linear, weight in pairs:
            linear.weight = torch.nn.Parameter(weight.clone())
    twin.lm_head.weight = torch.nn.Parameter(model.lm_head.dequantize().clone())
    return twin


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("name", ["gqa", "mha_tied"])
def test_dense_fp32_equals_transformers_on_the_dequantized_weights(
    checkpoint, tiny_model_dirs, tiny_hf_models, quantization, name
):
    exact = exact_fp32_products(checkpoint)
    llm = checkpoint.LLM(str(tiny_model_dirs[name]), dtype="float32", quantization=quantization, **exact)
    twin = dequantized_twin(tiny_hf_models[name], llm.model)
    ids = SHARED + prompt(5, 30)
    torch.testing.assert_close(llm.prompt_logits(ids), hf_logits(twin, ids), atol=2e-4, rtol=2e-5)
    prompts = [prompt(i, 5 + 7 * i) for i in range(3)]
    outputs = llm.generate(prompts, checkpoint.SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for ids, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(twin, ids, 12)


# bf16 activations over 2 layers of a tiny model: logits within 5e-2 + 2e-2 relative of fp32 compute
BF16_TINY = dict(atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_bf16_logits_within_tolerance_of_fp32(checkpoint, tiny_model_dirs, quantization):
    path = str(tiny_model_dirs["gqa"])
    bf16 = checkpoint.LLM(path, quantization=quantization, dtype="bfloat16", enforce_eager=True)
    exact = exact_fp32_products(checkpoint)
    fp32 = checkpoint.LLM(path, quantization=quantization, dtype="float32", enforce_eager=True, **exact)
    assert bf16.model.dtype == torch.bfloat16 and bf16.llm_engine.model_runner.kv_pool.keys.dtype == torch.bfloat16
    ids = SHARED + prompt(5, 30)
    torch.testing.assert_close(bf16.prompt_logits(ids), fp32.prompt_logits(ids), **BF16_TINY)


# --- SmolLM2 ---------------------------------------------------------------------------------------------

QUESTIONS = ["What is the capital of France?", "Name a color.", "What is 2 + 2?"]
# bf16 over SmolLM2's 30 layers, logits up to ~38: at most 2.0 (measured: 1.2 to 1.3) and 0.3 on average
# (measured: 0.17 to 0.20) from fp32 compute's, at every position of a chat prompt
BF16_SMOLLM2_MAX, BF16_SMOLLM2_MEAN = 2.0, 0.3


@pytest.fixture(scope="module")
def gguf_fp32_llms() -> dict:
    """Checkpoint name -> SmolLM2 on its GGUF tensors, fp32 compute, eager: built once for this module's tests."""
    return {}


def smollm2_fp32(checkpoint, quantization: str, gguf_llms: dict):
    """SmolLM2 quantized, fp32 compute (exact products), eager; the gguf one from (or into) `gguf_llms`."""
    options = {"dtype": "float32", "enforce_eager": True} | exact_fp32_products(checkpoint)
    if quantization != "gguf":
        return checkpoint.LLM(quantization=quantization, **options)
    if checkpoint.__name__ not in gguf_llms:
        gguf_llms[checkpoint.__name__] = checkpoint.LLM(quantization="gguf", **options)
    return gguf_llms[checkpoint.__name__]


@pytest.mark.model
@pytest.mark.latest_only
@pytest.mark.parametrize("quantization", ["gguf"])  # Q4_1 on the int4 kernel, and Q8_0 (the LM head) as int4 halves
def test_smollm2_bf16_greedy_equals_fp32(checkpoint, smollm2_path, gguf_fp32_llms, quantization):
    fp32 = smollm2_fp32(checkpoint, quantization, gguf_fp32_llms)
    bf16 = checkpoint.LLM(quantization=quantization, dtype="bfloat16", enforce_eager=True)
    tokenizer = fp32.tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    params = checkpoint.SamplingParams(temperature=0, max_tokens=8)
    expected = fp32.generate(prompts, params, use_tqdm=False)
    for output, fp32_output in zip(bf16.generate(prompts, params, use_tqdm=False), expected):
        assert_equal_up_to_a_near_tie(fp32, fp32_output.prompt_token_ids, fp32_output.token_ids, output.token_ids)
    ids = tokenizer(prompts[0])["input_ids"]
    difference = (bf16.prompt_logits(ids) - fp32.prompt_logits(ids)).abs()
    assert difference.max() <= BF16_SMOLLM2_MAX and difference.mean() <= BF16_SMOLLM2_MEAN


def assert_equal_up_to_a_near_tie(fp32, prompt_ids, expected, tokens) -> None:
    """bf16's greedy tokens equal fp32's; where they part, fp32 itself ranked the two tokens within the
    logit tolerance (a near tie that bf16's rounding may flip), and what follows is another text."""
    parting = next((i for i, (a, b) in enumerate(zip(expected, tokens)) if a != b), None)
    if parting is None:
        assert tokens == expected
        return
    logits = fp32.prompt_logits(prompt_ids + expected[:parting])[-1]
    assert logits[expected[parting]] - logits[tokens[parting]] <= BF16_SMOLLM2_MAX, (parting, expected, tokens)


@pytest.mark.model
def test_smollm2_gguf_fp32_equals_the_dequantized_model(checkpoint, smollm2_llm, gguf_fp32_llms):
    """The file's own tensors, dense fp32 compute: greedy tokens of the default path (the same weights,
    dequantized once into the cache) and logits within chapter 11's tolerance."""
    gguf = smollm2_fp32(checkpoint, "gguf", gguf_fp32_llms)
    assert type(gguf.model.model.embed_tokens).__name__ == "QuantizedEmbedding"
    assert type(gguf.model.lm_head).__name__ == "Int8Linear"
    ids = smollm2_llm.tokenizer("The capital of France is")["input_ids"]
    params = checkpoint.SamplingParams(temperature=0, max_tokens=12)
    assert (
        gguf.generate([ids], params, use_tqdm=False)[0].token_ids
        == smollm2_llm.generate([ids], params, use_tqdm=False)[0].token_ids
    )
    torch.testing.assert_close(gguf.prompt_logits(ids), smollm2_llm.prompt_logits(ids), atol=2e-4, rtol=2e-5)


def test_a_load_says_what_it_loads_and_its_time_quietly(checkpoint, tiny_model_dirs, caplog, capsys):
    """A quantized load takes seconds more than an fp32 one: the loader logs what it loads and then the time it
    took (INFO: shown where logging is set up, silent otherwise)."""
    with caplog.at_level(logging.INFO, logger=checkpoint.loader.__name__):
        checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), enforce_eager=True, quantization="int8", dtype="float32")
    lines = [r.getMessage() for r in caplog.records if r.name == checkpoint.loader.__name__]
    assert len(lines) == 2 and lines[0].startswith("loading ") and "int8" in lines[0], lines
    assert re.search(r" in \d+\.\d s$", lines[1]), lines
    assert capsys.readouterr().err == ""
