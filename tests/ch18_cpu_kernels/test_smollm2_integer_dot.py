"""What 8-bit activations cost on SmolLM2's own GGUF file (Q4_1 projections, a Q8_0 LM head), fp32 compute:
teacher-forced on pydoc's topics (as benchmarks/perplexity.py reads them), the next token each position ranks
first agrees with the exact products' at most positions, and perplexity stays within a bound of theirs."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chapters import submodule

pytestmark = [pytest.mark.requires("integer_dot"), pytest.mark.model]

WINDOWS, WINDOW = 2, 256  # the first 512 tokens of pydoc's topics, scored in 2 prompt passes of 256
# Measured on this text: 95.9% of positions rank the same token first, perplexity 13.31 against 13.26 (+0.4%);
# over 4 windows 96.3%, +0.07%.
MIN_TOP1_AGREEMENT, MAX_PERPLEXITY_RATIO = 0.93, 1.01
# Logits the exact products may rank two tokens apart where greedy answers part (measured: one parting, at a
# margin of 0.08: "The" or "L" to begin the answer to "What is the capital of France?").
NEAR_TIE = 0.5
QUESTIONS = ["What is the capital of France?", "Name a color.", "What is 2 + 2?"]


def text_windows(tokenizer) -> list[list[int]]:
    text = Path(importlib.util.find_spec("pydoc_data.topics").origin).read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [ids[start : start + WINDOW] for start in range(0, WINDOWS * WINDOW, WINDOW)]


@pytest.fixture(scope="module")
def built() -> dict:
    """(checkpoint name, "exact" or "integer") -> its LLM, built once for this module's tests."""
    return {}


@pytest.fixture
def gguf_fp32(checkpoint, smollm2_path, built) -> dict:
    """SmolLM2's GGUF tensors on fp32 compute, eager: "exact" (int8_activations off) and "integer" (on)."""
    options = {"quantization": "gguf", "dtype": "float32", "enforce_eager": True}
    for name, on in (("exact", False), ("integer", True)):
        if (checkpoint.__name__, name) not in built:
            built[checkpoint.__name__, name] = checkpoint.LLM(int8_activations=on, **options)
    return {name: built[checkpoint.__name__, name] for name in ("exact", "integer")}


def test_top1_and_perplexity_stay_close_to_the_exact_products(checkpoint, gguf_fp32, monkeypatch):
    """A prompt pass has many rows: INTEGER_DOT_ROWS raised so that each of its rows takes the integer
    products, which give every row what they give it in a decode step of one."""
    monkeypatch.setattr(submodule(checkpoint, "quantized_linear"), "INTEGER_DOT_ROWS", 10**6)
    agree, total, nll = 0, 0, {"exact": 0.0, "integer": 0.0}
    for window in text_windows(gguf_fp32["exact"].tokenizer):
        target = torch.tensor(window[1:])
        first = {}
        for name, llm in gguf_fp32.items():
            logits = llm.prompt_logits(window)[:-1]  # [WINDOW - 1, vocab]: each position's next token
            nll[name] += F.cross_entropy(logits, target, reduction="sum").item()
            first[name] = logits.argmax(dim=-1)
        agree += (first["integer"] == first["exact"]).sum().item()
        total += len(target)
    perplexity = {name: math.exp(value / total) for name, value in nll.items()}
    assert agree / total >= MIN_TOP1_AGREEMENT, agree / total
    assert perplexity["integer"] <= MAX_PERPLEXITY_RATIO * perplexity["exact"], perplexity


def test_decoding_answers_on_integer_products(checkpoint, gguf_fp32, monkeypatch):
    """Decode steps (3 rows) run on the integer kernel; each answer equals the exact products' answer, or
    parts from it where the exact logits rank the two tokens within NEAR_TIE (and what follows is another
    text)."""
    kernel = submodule(checkpoint, "model_executor.layers.integer_dot_kernel")
    linear, rows = kernel.linear, []
    monkeypatch.setattr(kernel, "linear", lambda x, *weights: rows.append(x.shape[0]) or linear(x, *weights))
    exact, integer = gguf_fp32["exact"], gguf_fp32["integer"]
    prompts = [
        exact.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in QUESTIONS
    ]
    params = checkpoint.SamplingParams(temperature=0, max_tokens=8)
    expected = exact.generate(prompts, params, use_tqdm=False)
    assert not rows
    for got, want in zip(integer.generate(prompts, params, use_tqdm=False), expected):
        parting = next((i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids)) if a != b), None)
        if parting is None:
            assert got.token_ids == want.token_ids
            continue
        logits = exact.prompt_logits(want.prompt_token_ids + want.token_ids[:parting])[-1]
        margin = logits[want.token_ids[parting]] - logits[got.token_ids[parting]]
        assert margin <= NEAR_TIE, (parting, want.token_ids, got.token_ids, margin)
    assert rows and max(rows) == len(QUESTIONS)
