"""fp32's plain-weight threshold follows the CPU's maker: Intel's MKL takes its fast matrix-vector paths on
Intel's CPUs only, so with MKL on another maker's CPU even one row takes the packed copy, eager and in the
one-token graph. The tests set the maker and the BLAS, not the machine."""

import pytest
import torch

from chapters import submodule

pytestmark = pytest.mark.requires("integer_dot")  # chapter 18's


@pytest.mark.parametrize(
    ("maker", "mkl", "rows"),
    [("GenuineIntel", True, 3), ("AuthenticAMD", True, 0), ("AuthenticAMD", False, 3), ("", True, 3)],
    ids=["intel-mkl", "amd-mkl", "amd-other-blas", "maker-unknown"],
)
def test_plain_rows_follow_the_cpu_maker_and_the_blas(checkpoint, monkeypatch, maker, mkl, rows):
    packed_linear = submodule(checkpoint.__name__, "packed_linear")
    monkeypatch.setattr(submodule(checkpoint.__name__, "cpu_features"), "vendor", lambda: maker)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    assert packed_linear.plain_rows() == rows


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_with_no_plain_rows_one_row_takes_the_packed_copy(checkpoint, monkeypatch, compiled):
    packed_linear = submodule(checkpoint.__name__, "packed_linear")
    monkeypatch.setattr(packed_linear, "PLAIN_ROWS", 0)
    layer = torch.nn.Linear(32, 16)
    packed_linear.pack_linears(layer)
    zeros = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32), None)
    monkeypatch.setitem(packed_linear._packed, layer.weight.data_ptr(), zeros)  # where it is read: the bias alone
    run = torch.compile(layer, dynamic=False, fullgraph=True) if compiled else layer
    with torch.inference_mode():
        out = run(torch.randn(1, 32))
    torch.testing.assert_close(out, layer.bias.detach().expand(1, 16))
