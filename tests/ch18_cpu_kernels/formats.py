"""Weights in each format the integer kernel takes, in its layout, and the bound of fp32's rounding on its sums."""

import torch

from chapters import submodule

FORMATS = ["Q4_0", "Q4_1", "Q8_0", "int8", "int4"]  # GGUF's block formats, and ours quantized at load
# The kernel adds the same fp32 terms as the tensor algebra, in another order (8 lanes, fused multiply-adds):
# each output within 1e-5 of the sum of its terms' magnitudes (measured: within 6e-8 of it).
ROUNDING = 1e-5


def layers(checkpoint):
    """(quantized_linear, quantization, integer_dot, integer_dot_kernel) of `checkpoint`."""
    names = ("quantized_linear", "quantization", "model_executor.layers.integer_dot")
    return (*(submodule(checkpoint, name) for name in names), submodule(checkpoint, f"{names[2]}_kernel"))


def quantized_weight(checkpoint, kind: str, out_features: int, in_features: int, seed: int = 0):
    """A `QuantizedWeight` [out, in] of `kind`, random codes and scales (as GGUF's: fp16 values)."""
    ql, quantization, _, _ = layers(checkpoint)
    gen = torch.Generator().manual_seed(seed)
    if kind in ("int8", "int4"):
        weight = torch.randn(out_features, in_features, generator=gen) * 0.1
        return (quantization.quantize_int8 if kind == "int8" else quantization.quantize_int4)(weight)
    groups = in_features // 32
    scales = torch.rand(out_features, groups, generator=gen).half().float() * 0.02
    if kind == "Q8_0":
        codes = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
        return ql.QuantizedWeight(codes, scales, None, offset=0, bits=8, group=32)
    codes = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    if kind == "Q4_0":
        return ql.QuantizedWeight(codes, scales, None, offset=8, bits=4, group=32)
    minimums = -torch.rand(out_features, groups, generator=gen).half().float() * 0.15
    return ql.QuantizedWeight(codes, scales, minimums, offset=0, bits=4, group=32)


def dot_weight(checkpoint, weight):
    """`weight` in the integer kernel's layout: (codes, scales, minimums)."""
    _, _, integer_dot, _ = layers(checkpoint)
    return integer_dot.dot_weight(
        weight.codes, weight.scales, weight.minimums, weight.offset, weight.bits, weight.group
    )


def rounding_bound(integer_dot, x, codes, scales, minimums, bias) -> torch.Tensor:
    """ROUNDING times the sum of the magnitudes of every term the kernel adds, per output [rows, out]."""
    x_codes, x_scales, x_sums = integer_dot.quantize_q8_1(x)
    weight_codes = integer_dot.unpacked_codes(codes).float().abs()
    minimums = None if minimums is None else minimums.abs()
    terms = integer_dot.block_terms(x_codes.float().abs(), x_scales, x_sums.abs(), weight_codes, scales.abs(), minimums)
    magnitude = terms.sum(dim=-1) + (0 if bias is None else bias.abs())
    return ROUNDING * magnitude + 1e-30
