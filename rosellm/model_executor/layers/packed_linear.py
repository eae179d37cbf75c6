"""Linear layers on weights packed once for oneDNN, the CPU's fast path for small batches of rows.

`F.linear` hands a row-major [out, in] weight to the BLAS at every call, which re-blocks it for its
kernel each time; at decode shapes (a few dozen rows) that costs as much as the multiply. oneDNN can
reorder a weight once, at load, into the blocked layout its kernel reads (what Inductor's freezing pass
does on CPU); the LM head, the largest matrix, gains the most.

The packed weight is an opaque oneDNN tensor that torch.compile cannot trace, so the multiply is an
operator (operators.py): compiled code calls it like any other extern kernel, with the plain weight as its
argument; the operator finds the packed copy made for that weight.
"""

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...operators import define_operator
from ...platforms import cpu_features

_packed: dict[int, torch.Tensor] = {}  # weight.data_ptr() -> its packed copy, while the weight lives


def pack_weight(weight: torch.Tensor) -> None:
    """Reorder `weight` [out, in] for oneDNN once; `packed_linear` on it then uses the packed copy."""
    key = weight.data_ptr()
    _packed[key] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    weakref.finalize(weight, _packed.pop, key, None)


def _output(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def plain_rows() -> int:
    """Up to how many rows (a decode step of a few sequences) fp32 multiplies the plain weight with `F.linear`
    instead of the packed copy: where the BLAS's matrix-vector kernels stream the weight from memory faster
    than oneDNN's packed GEMM reads it. That holds for Intel's MKL on Intel's CPUs: measured on SmolLM2's 30
    layers, weights read from memory, 2 threads (Xeon, AVX-512): 15.9 / 17.6 / 19.7 ms at 1 / 2 / 3 rows
    against 21.6 / 22.7 / 24.1 packed, and from 4 rows on the packed copy wins (24.9 against 27.9 at 4): 3.
    MKL on another maker's CPU does not take its fast paths: on a 2-core AMD EPYC with AVX2 the same layers
    took 58.8 ms at one row plain against 40.2 packed (the avx2-cpu kernel table): 0, the packed copy always.
    bf16 weights (packed where the CPU has native bf16) take their packed copy at every row count: 14.8 / 17.1
    / 31.9 ms at 1 / 4 / 16 rows against F.linear's 18.2 / 22.7 / 37.6 (Xeon, AVX-512 BF16)."""
    mkl_elsewhere = torch.backends.mkl.is_available() and cpu_features.vendor() not in ("GenuineIntel", "")
    return 0 if mkl_elsewhere else 3


PLAIN_ROWS = plain_rows()  # of fp32, for this process's CPU


@define_operator(__package__, fake=_output)
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias: x [rows, in] -> [rows, out], with the packed copy of `weight`, from PLAIN_ROWS + 1
    rows on for fp32 (the choice is made at every call, so a compiled graph of any number of rows keeps both)."""
    if weight.dtype == torch.float32 and x.shape[0] <= PLAIN_ROWS:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, _packed[weight.data_ptr()], bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose weight has been packed (`pack_linears`); same parameters, same results within
    floating-point reordering.

    A few rows of fp32 multiply the plain weight instead (`PLAIN_ROWS`, where it is not 0). A row count known
    to be 1 while tracing (the one-token graph, eager code) then calls `F.linear` in the graph itself, not the
    operator: the compiled one-token step took 18 ms instead of 32. Any other graph calls the operator, which
    chooses at each call, so no graph gains a guard on its number of rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out]."""
        if self.weight.dtype == torch.float32 and PLAIN_ROWS and statically_known_true(x.shape[0] == 1):
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self.weight, self.bias)


def can_pack(weight: torch.Tensor) -> bool:
    """fp32 weights on CPU, and bf16 ones where the CPU has native bf16 (`cpu_features.cpu_has_bf16`, which
    ROSELLM_CPU_FEATURES can mask; elsewhere bf16 is emulated and keeps `F.linear`, unmeasured here)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return cpu_features.cpu_has_bf16() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


def pack_linears(model: nn.Module) -> None:
    """Every `nn.Linear` of `model` becomes a `PackedLinear` on a packed copy of its weight."""
    for module in model.modules():
        if type(module) is nn.Linear and can_pack(module.weight):
            pack_weight(module.weight)
            module.__class__ = PackedLinear
