"""bf16 weights packed for oneDNN where the CPU has native bf16: the packed copy at every row count, eager and
compiled, with F.linear's results; at a CPU level without native bf16 (ROSELLM_CPU_FEATURES) they stay plain."""

import pytest
import torch

from chapters import submodule

pytestmark = pytest.mark.cpu_features


def bf16_layer(packed_linear) -> torch.nn.Linear:
    layer = torch.nn.Linear(32, 16).to(torch.bfloat16)
    packed_linear.pack_linears(layer)
    return layer


@pytest.mark.parametrize("rows", [1, 2, 5])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_bf16_layer_reads_its_packed_copy_at_every_row_count(checkpoint, rows, compiled, monkeypatch):
    packed_linear = submodule(checkpoint.__name__, "packed_linear")
    monkeypatch.setattr(submodule(checkpoint.__name__, "cpu_features"), "cpu_has_bf16", lambda: True)
    layer = bf16_layer(packed_linear)
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():  # oneDNN without bf16 kernels on this CPU: left plain
        assert type(layer) is torch.nn.Linear
        return
    assert type(layer) is packed_linear.PackedLinear
    zeros = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), None)
    run = torch.compile(layer, dynamic=True, fullgraph=True) if compiled else layer
    with torch.inference_mode():
        torch.testing.assert_close(run(x), plain)  # bf16's own rounding apart, the same products
        monkeypatch.setitem(packed_linear._packed, layer.weight.data_ptr(), zeros)  # bias alone: the copy was read
        torch.testing.assert_close(run(x), layer.bias.detach().expand(rows, 16))


@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_without_native_bf16_a_bf16_layer_stays_plain(checkpoint, level, monkeypatch):
    cpu_features = submodule(checkpoint.__name__, "cpu_features")
    monkeypatch.setenv(cpu_features.VARIABLE, level)
    assert not cpu_features.cpu_has_bf16()
    layer = bf16_layer(submodule(checkpoint.__name__, "packed_linear"))
    assert type(layer) is torch.nn.Linear
    fp32 = torch.nn.Linear(32, 16)
    submodule(checkpoint.__name__, "packed_linear").pack_linears(fp32)
    assert type(fp32) is not torch.nn.Linear  # fp32 is packed at every level
