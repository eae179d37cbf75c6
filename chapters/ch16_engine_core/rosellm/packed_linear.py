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

from .operators import define_operator

_packed: dict[int, torch.Tensor] = {}  # weight.data_ptr() -> its packed copy, while the weight lives


def pack_weight(weight: torch.Tensor) -> None:
    """Reorder `weight` [out, in] for oneDNN once; `packed_linear` on it then uses the packed copy."""
    key = weight.data_ptr()
    _packed[key] = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    weakref.finalize(weight, _packed.pop, key, None)


def _output(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@define_operator(__package__, fake=_output)
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias with the packed copy of `weight`: x [rows, in] -> [rows, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, _packed[weight.data_ptr()], bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose weight has been packed (`pack_linears`); same parameters, same results within
    floating-point reordering.

    One row (a decode step of one sequence) multiplies the plain weight instead: the BLAS's matrix-vector
    kernel streams it from memory faster than oneDNN's packed GEMM does at one row. Measured on SmolLM2's 30
    layers, weights read from memory, 2 threads: 15.4 ms against 23.0 at one row, 17.2 against 24.0 at two;
    the compiled one-token step took 18 ms instead of 32. Only a row count known to be 1 while tracing takes
    that path (the one-token graph, eager code), so no graph of any number of rows gains a guard on it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] -> [rows, out]."""
        if statically_known_true(x.shape[0] == 1):
            return F.linear(x, self.weight, self.bias)
        return packed_linear(x, self.weight, self.bias)


def can_pack(weight: torch.Tensor) -> bool:
    """fp32 weights on CPU (the dtype this chapter measures; others keep `F.linear`)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_linears(model: nn.Module) -> None:
    """Every `nn.Linear` of `model` becomes a `PackedLinear` on a packed copy of its weight."""
    for module in model.modules():
        if type(module) is nn.Linear and can_pack(module.weight):
            pack_weight(module.weight)
            module.__class__ = PackedLinear
