"""The C kernel of integer_dot.c, called through ctypes: activations quantized to 8 bits once per input
(`quantize_q8_1`), then integer dot products with weights in `integer_dot.dot_weight`'s layout (`linear`).

It is built per CPU level by attention/ops/c_kernels.py (one library for every shape: the shapes are
arguments); where none can be built (no compiler, level "nocc") `kernel` is None and the caller keeps its
PyTorch path. OpenMP shares the output rows between torch's threads (`torch.get_num_threads()`).
"""

import ctypes
import functools
from pathlib import Path

import torch

from ...attention.ops import c_kernels
from .integer_dot import BLOCK, check_inputs

POINTER, SIZE = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library(setting: tuple) -> ctypes.CDLL | None:
    """integer_dot.c built for `setting` (`c_kernels.setting()`: another compiler, level or cache folder
    builds again), its functions told their arguments; None where it cannot be built."""
    library = c_kernels.load("integer_dot", folder=Path(__file__).parent)
    if library is None:
        return None
    library.quantize_q8_1.argtypes = [POINTER, SIZE, SIZE, POINTER, POINTER, POINTER]
    library.quantize_q8_1.restype = None
    library.linear.argtypes = [ctypes.c_int] + [POINTER] * 6 + [SIZE, SIZE, SIZE, ctypes.c_int]
    library.linear.restype = ctypes.c_int
    return library


def kernel() -> ctypes.CDLL | None:
    """The library for the current setting, or None where no C kernel can be built."""
    return _library(c_kernels.setting())


def quantize_q8_1(x: torch.Tensor, library: ctypes.CDLL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, in] fp32 -> codes [rows, in] int8, scales and sums [rows, in / 32] fp32 (as
    `integer_dot.quantize_q8_1`). Made once per input, they serve every weight that input meets."""
    check_inputs(x.shape[-1])
    x = x.to(torch.float32).contiguous()  # the kernel reads fp32 rows one after the other
    rows, in_features = x.shape
    codes = torch.empty(rows, in_features, dtype=torch.int8)
    scales = torch.empty(rows, in_features // BLOCK)
    sums = torch.empty(rows, in_features // BLOCK)
    library.quantize_q8_1(x.data_ptr(), rows, in_features, codes.data_ptr(), scales.data_ptr(), sums.data_ptr())
    return codes, scales, sums


def linear(x, codes, scales, minimums, bias, library: ctypes.CDLL) -> torch.Tensor:
    """x [rows, in] fp32 @ w.T + bias -> [rows, out] fp32, w in `integer_dot.dot_weight`'s layout: codes
    [out, in / 2] uint8 (4 bits) or [out, in] int8 (8 bits), scales and minimums [out, in / 32] (minimums
    None for 8 bits), bias [out] or None. One call into C quantizes x (as `quantize_q8_1`) and multiplies: at
    batch 1 each crossing from Python costs about as much as a small layer's product."""
    check_inputs(x.shape[-1])
    x = x.to(torch.float32).contiguous()
    rows, in_features = x.shape
    out = torch.empty(rows, codes.shape[0])
    bits = 4 if codes.dtype == torch.uint8 else 8
    weight = (codes.data_ptr(), scales.data_ptr(), None if minimums is None else minimums.data_ptr())
    bias_pointer = None if bias is None else bias.contiguous().data_ptr()
    shape = (rows, codes.shape[0], in_features, torch.get_num_threads())
    if library.linear(bits, x.data_ptr(), *weight, bias_pointer, out.data_ptr(), *shape):
        raise MemoryError(f"no memory for the 8-bit copy of {rows} x {in_features} activations")
    return out
