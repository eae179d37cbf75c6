"""`quantization` and `dtype`: each bad option is a ValueError naming what is supported, raised before any
weight is read; "auto" picks the compute dtype at each CPU level; bf16 runs at every level, with a warning
where the CPU has no native bf16; the default path stays fp32."""

import json
import logging

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from chapters import submodule
from tests.ch13_quantization.cpu_levels import NATIVE_BF16, VARIABLE, levels

pytestmark = [pytest.mark.requires("quantization"), pytest.mark.cpu_features]


@pytest.fixture
def quantization(checkpoint):
    return submodule(checkpoint, "quantization")


@pytest.fixture
def no_loading(checkpoint, quantization, monkeypatch):
    """Every way to read weights fails the test."""

    def never(*args, **kwargs):
        raise AssertionError("weights were read although an option was bad")

    loader = submodule(checkpoint, "loader")
    runner = submodule(checkpoint, "model_runner")
    for module, name in [
        (loader, "load_model"),
        (loader, "load_file"),
        (loader, "gguf_to_hf_folder"),
        (runner, "load_model"),
        (quantization, "load_gguf_model"),
    ]:
        monkeypatch.setattr(module, name, never)


def odd_sized_folder(tmp_path):
    """A Hugging Face folder (config only) whose hidden size, 48, is no multiple of 32."""
    config = dict(
        vocab_size=100,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def q5_gguf(tmp_path):
    """A .gguf file holding a Q5_0 tensor."""
    path = tmp_path / "q5.gguf"
    writer = GGUFWriter(path, "llama")
    kind = GGMLQuantizationType.Q5_0
    writer.add_tensor("blk.0.ffn_up.weight", quantize(np.ones((4, 32), dtype=np.float32), kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "case",
    ["unknown quantization", "unknown dtype", "unknown cpu level", "gguf on a folder", "tensor parallel"],
)
def test_bad_option_raises_before_loading(checkpoint, tiny_model_dirs, no_loading, monkeypatch, case):
    if case == "unknown cpu level":
        monkeypatch.setenv(VARIABLE, "avx3")
    model, options, message = {
        "unknown quantization": (tiny_model_dirs["gqa"], {"quantization": "fp8"}, "gguf, int8, int4"),
        "unknown dtype": (tiny_model_dirs["gqa"], {"dtype": "float16"}, "auto, float32, bfloat16"),
        "unknown cpu level": (tiny_model_dirs["gqa"], {}, "ROSELLM_CPU_FEATURES='avx3'.*nocc, baseline, avx2"),
        "gguf on a folder": (tiny_model_dirs["gqa"], {"quantization": "gguf"}, "a .gguf file"),
        "tensor parallel": (
            tiny_model_dirs["gqa"],
            {"quantization": "int8", "tensor_parallel_size": 2},
            "tensor_parallel_size > 1 is not supported",
        ),
    }[case]
    with pytest.raises(ValueError, match=message):
        checkpoint.LLMEngine(str(model), **options)


def test_unsupported_gguf_type_raises_before_loading(checkpoint, no_loading, tmp_path):
    with pytest.raises(ValueError, match="ffn_up.weight is Q5_0; supported types: F32, F16, BF16, Q4_0, Q4_1, Q8_0"):
        checkpoint.LLMEngine(str(q5_gguf(tmp_path)), quantization="gguf")


def test_int4_needs_inputs_in_groups_of_32(checkpoint, no_loading, tmp_path):
    with pytest.raises(ValueError, match="groups of 32 inputs; this model's hidden_size is 48"):
        checkpoint.LLMEngine(str(odd_sized_folder(tmp_path)), quantization="int4")
    checkpoint.EngineConfig(quantization="int4")  # the option itself is fine


@pytest.mark.parametrize("level", levels())
def test_auto_dtype(checkpoint, quantization, monkeypatch, level):
    """The fastest: bf16 only for quantized weights on a CPU with native bf16; on CUDA always bf16."""
    monkeypatch.setenv(VARIABLE, level)
    quantized = torch.bfloat16 if level in NATIVE_BF16 else torch.float32
    for dtype in (None, "auto"):
        assert quantization.compute_dtype(dtype, None, "cpu") == torch.float32  # no quantization: fp32
        assert quantization.compute_dtype(dtype, "int4", "cpu") == quantized
        assert quantization.compute_dtype(dtype, "gguf", "cuda") == torch.bfloat16
    assert quantization.compute_dtype("float32", "int8", "cpu") == torch.float32
    assert quantization.compute_dtype(torch.float32, None, "cpu") == torch.float32


def test_default_path_is_fp32_dense(checkpoint, tiny_model_dirs):
    engine = checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), enforce_eager=True)
    assert engine.config.quantization is None and engine.model.dtype == torch.float32
    assert type(engine.model.lm_head).__name__ == "PackedLinear"  # chapter 11's fp32 path, unchanged
    assert engine.model_runner.kv_pool.keys.dtype == torch.float32


@pytest.mark.parametrize("option", [None, "int8"])
def test_the_options_are_checked_once_per_engine(checkpoint, quantization, tiny_model_dirs, monkeypatch, option):
    """The engine checks its options before it reads anything; the loader only resolves the dtype (a GGUF
    file's header, read by the check, is not read twice)."""
    llm_engine = submodule(checkpoint, "llm_engine")
    calls = []

    def counted(*args, original=quantization.check_options):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(quantization, "check_options", counted)
    monkeypatch.setattr(llm_engine, "check_options", counted)
    checkpoint.LLMEngine(str(tiny_model_dirs["gqa"]), enforce_eager=True, quantization=option)
    assert len(calls) == 1


def slow_bf16_warnings(records) -> list:
    return [r for r in records if r.levelno == logging.WARNING and "without native bf16" in r.getMessage()]


@pytest.mark.parametrize("level", levels())
def test_bfloat16_runs_at_every_level(checkpoint, tiny_model_dirs, monkeypatch, caplog, level):
    """dtype="bfloat16" is accepted on every CPU: weights and KV cache in bf16, tokens generated (decode rows by
    the C kernel built for the level, or eagerly at "nocc"); where the CPU has no native bf16, one warning in
    the process says that fp32 may be faster."""
    cpu_features = submodule(checkpoint, "cpu_features")
    monkeypatch.setattr(cpu_features, "_warned", set())  # this process has not warned yet
    monkeypatch.setenv(VARIABLE, level)
    for _ in range(2):
        llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), dtype="bfloat16", enforce_eager=True, attention_backend="cpu")
        assert llm.model.dtype == torch.bfloat16 and llm.llm_engine.model_runner.kv_pool.keys.dtype == torch.bfloat16
        [output] = llm.generate([[5, 6, 7]], checkpoint.SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(output.token_ids) == 3
    warned = slow_bf16_warnings(caplog.records)
    assert len(warned) == (0 if level in NATIVE_BF16 else 1), warned
    assert all("float32 may be faster" in r.getMessage() for r in warned)


def test_a_mask_above_the_cpu_is_clamped_with_a_warning(checkpoint, monkeypatch, caplog):
    """On a CPU whose own level is avx2 (made so here), every level above asks for what it lacks: the engine
    runs at avx2, and says so; "none" is "nocc"; unset, the CPU's own level."""
    cpu_features = submodule(checkpoint, "cpu_features")
    monkeypatch.setattr(cpu_features, "native_level", lambda: "avx2")
    monkeypatch.setattr(cpu_features, "_warned", set())
    for level in ("avx512", "avx512_bf16", "amx"):
        monkeypatch.setenv(VARIABLE, level)
        assert cpu_features.level() == "avx2" and not cpu_features.cpu_has_bf16()
        assert f"{VARIABLE}={level} asks for more than this CPU has" in caplog.text
    for level in ("nocc", "baseline", "avx2"):
        monkeypatch.setenv(VARIABLE, level)
        assert cpu_features.level() == level and cpu_features.masked()
    monkeypatch.setenv(VARIABLE, "None")
    assert cpu_features.level() == "nocc"
    monkeypatch.delenv(VARIABLE)
    assert cpu_features.level() == "avx2" and not cpu_features.masked()
