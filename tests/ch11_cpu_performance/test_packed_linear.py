"""Projections on oneDNN-packed weights equal `F.linear`, eager and compiled; the packed copy lives as long
as its weight."""

import gc

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.requires("compiled")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear(checkpoint, rows, bias):
    packed = checkpoint.packed_linear
    gen = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(96, 80, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(80, 96, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    expected = F.linear(x, layer.weight, layer.bias)
    packed.pack_linears(layer)
    assert isinstance(layer, packed.PackedLinear)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), expected, atol=1e-4, rtol=1e-5)
        compiled = torch.compile(lambda x: F.silu(layer(x)) + 1, dynamic=True)
        torch.testing.assert_close(compiled(x), F.silu(expected) + 1, atol=1e-4, rtol=1e-5)


def test_packed_copy_freed_with_its_weight(checkpoint):
    packed = checkpoint.packed_linear
    layer = torch.nn.Linear(16, 8)
    packed.pack_linears(layer)
    key = layer.weight.data_ptr()
    assert key in packed._packed
    del layer
    gc.collect()
    assert key not in packed._packed


def test_only_fp32_cpu_weights_are_packed(checkpoint, monkeypatch):
    """bf16 stays plain (from chapter 18 on, packed only on a CPU with native bf16: masked here to one without)."""
    monkeypatch.setenv("ROSELLM_CPU_FEATURES", "avx512")
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    checkpoint.packed_linear.pack_linears(layer)
    assert type(layer) is torch.nn.Linear  # left to F.linear


def test_engine_packs_every_projection(checkpoint, tiny_model_dirs):
    model = checkpoint.LLMEngine(str(tiny_model_dirs["gqa"])).model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * len(model.model.layers) + 1  # qkv, o, gate_up, down in each layer; the LM head
    assert all(isinstance(m, checkpoint.packed_linear.PackedLinear) for m in linears)
