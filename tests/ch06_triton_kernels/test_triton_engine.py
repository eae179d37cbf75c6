"""The engine with attention_backend="triton" gives the same greedy tokens as with "torch"; choosing a backend."""

import os
import subprocess
import sys

import pytest
import torch

from chapters import submodule
from tests.ch03_batch_decode.test_batch_generate import MIXED_PROMPTS, batch_size_option
from tests.conftest import ROOT
from tests.engine_options import default_cpu_backend


def attention_backend_of(llm):
    """The backend every attention layer of the LLM's model calls."""
    [backend] = {id(layer.self_attn.backend): layer.self_attn.backend for layer in llm.model.model.layers}.values()
    return backend


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def count_kernel_calls(checkpoint, monkeypatch) -> dict[str, int]:
    kernels = submodule(checkpoint, "kernels")
    calls = {}
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        calls[name] = 0

        def counting(*args, _name=name, _original=getattr(kernels, name), **kwargs):  # noqa: B008 (bound now)
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counting)
    return calls


def test_triton_engine_gives_the_torch_engine_tokens(checkpoint, checkpoint_info, tiny_model_dirs, monkeypatch):
    """Two requests at a time, finishing at different steps: later requests are prefilled beside
    sequences that decode (the prefill kernel), and pure decode steps use the decode kernel."""
    prompts = MIXED_PROMPTS[1:5]  # 3, 7, 20 and 33 tokens
    max_tokens = (3, 9, 6, 8)
    calls = count_kernel_calls(checkpoint, monkeypatch)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = checkpoint.LLM(
            str(tiny_model_dirs["gqa"]),
            device=DEVICE,
            dtype=torch.float32,
            block_size=4,
            attention_backend=backend,
            **batch_size_option(checkpoint_info, 2),
        )
        assert attention_backend_of(llm).name == backend
        sampling = [checkpoint.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, sampling, use_tqdm=False)]
        outputs[backend + " logits"] = llm.prompt_logits(MIXED_PROMPTS[4])
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_total_blocks
    assert calls["paged_decode_attention"] > 0 and calls["paged_prefill_attention"] > 0
    assert outputs["triton"] == outputs["torch"]
    torch.testing.assert_close(outputs["triton logits"], outputs["torch logits"], atol=1e-4, rtol=1e-4)


def test_backend_names_and_defaults(checkpoint):
    choose = checkpoint.attention_backend.get_attention_backend
    assert choose(None, "cpu").name == default_cpu_backend(checkpoint)
    assert choose("torch", "cpu").name == "torch"
    assert choose(None, torch.device("cuda")).name == "triton"  # needs no GPU: nothing runs
    with pytest.raises(ValueError, match="'torch'.*'triton'"):
        choose("flash", "cpu")


def test_default_engine_backend_on_cpu(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    assert attention_backend_of(llm).name == default_cpu_backend(checkpoint)
    assert all(layer.self_attn.backend is attention_backend_of(llm) for layer in llm.model.model.layers)


def test_triton_on_cpu_needs_the_interpreter(checkpoint, tiny_model_dirs, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        checkpoint.attention_backend.get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        checkpoint.LLM(str(tiny_model_dirs["gqa"]), device="cpu", attention_backend="triton")


def test_the_torch_backend_never_imports_triton(checkpoint, tiny_model_dirs):
    """Chapters before 06 and CPU users of the torch backend do not pay for importing Triton. (From chapter 11
    on, torch.compile's Inductor imports it itself: the eager engine is the one that must not.)"""
    eager = ", enforce_eager=True" if "compiled" in checkpoint.__capabilities__ else ""
    code = (
        f"import sys; import {checkpoint.__name__} as r; r.LLM({str(tiny_model_dirs['gqa'])!r}{eager}); "
        "assert 'triton' not in sys.modules, 'triton was imported'"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
