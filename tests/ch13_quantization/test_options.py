"""`quantization` and `dtype`: each bad option is a ValueError naming what is supported, raised before any
weight is read; "auto" picks the compute dtype; the default path stays fp32."""

import importlib
import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

pytestmark = pytest.mark.requires("quantization")


@pytest.fixture
def quantization(checkpoint):
    return importlib.import_module(f"{checkpoint.__name__}.quantization")


@pytest.fixture
def no_loading(checkpoint, quantization, monkeypatch):
    """Every way to read weights fails the test."""

    def never(*args, **kwargs):
        raise AssertionError("weights were read although an option was bad")

    loader = importlib.import_module(f"{checkpoint.__name__}.loader")
    runner = importlib.import_module(f"{checkpoint.__name__}.model_runner")
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
    ["unknown quantization", "unknown dtype", "bf16 without cpu support", "gguf on a folder", "tensor parallel"],
)
def test_bad_option_raises_before_loading(checkpoint, tiny_model_dirs, no_loading, monkeypatch, case):
    cpu_features = importlib.import_module(f"{checkpoint.__name__}.cpu_features")
    monkeypatch.setattr(cpu_features, "cpu_has_bf16", lambda: False)
    model, options, message = {
        "unknown quantization": (tiny_model_dirs["gqa"], {"quantization": "fp8"}, "gguf, int8, int4"),
        "unknown dtype": (tiny_model_dirs["gqa"], {"dtype": "float16"}, "auto, float32, bfloat16"),
        "bf16 without cpu support": (tiny_model_dirs["gqa"], {"dtype": "bfloat16"}, "AVX-512 BF16 or AMX"),
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


@pytest.mark.parametrize("has_bf16", [True, False])
def test_auto_dtype(checkpoint, quantization, monkeypatch, has_bf16):
    cpu_features = importlib.import_module(f"{checkpoint.__name__}.cpu_features")
    monkeypatch.setattr(cpu_features, "cpu_has_bf16", lambda: has_bf16)
    quantized = torch.bfloat16 if has_bf16 else torch.float32
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
