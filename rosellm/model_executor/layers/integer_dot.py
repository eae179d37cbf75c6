"""8-bit activations and integer dot products for 4- and 8-bit weights (llama.cpp's way), in tensor algebra:
the reference that the C kernel (integer_dot.c) must equal, and the weights' layout the kernel reads.

At batch 1 a quantized layer on fp32 activations that multiplies its dense fp32 copy reads 4 bytes per weight.
Multiplying the codes themselves reads 0.5 (4 bits) or 1 (8 bits), if the products stay integers: so the
activations are quantized too, per block of 32 (GGUF's Q8_1), and each weight block meets its activation
block in an integer sum, scaled once:

    x ~ d * q            q: 32 int8 codes -127..127, d = max |x| / 127, s = d * sum(q)
    w = dw * c + mw      c: 32 codes (0..15, or -128..127 with mw = 0), dw and mw per block
    sum(w * x) ~ dw * d * sum(c * q) + mw * s

Q4_0's w = dw * (c - 8) is the 4-bit case with mw = -8 dw; an int8 weight with one scale per row repeats that
scale over its blocks. The only rounding that is not fp32's is q's: each activation moves by at most d / 2,
so an output moves by at most sum over blocks of d / 2 * sum |w| (`activation_error_bound`).
"""

import torch

BLOCK = 32  # activations and weights per scale
ONE_127TH = torch.tensor(1 / 127, dtype=torch.float32)  # fp32's 1/127: the C kernel's 1.0f / 127.0f


def check_inputs(in_features: int) -> None:
    """Integer dot products take whole blocks: ValueError naming the limit otherwise."""
    if in_features % BLOCK:
        raise ValueError(f"integer dot products take inputs in blocks of {BLOCK}; got {in_features} inputs")


def quantize_q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, in] fp32 -> codes [rows, in] int8, scales d [rows, in / 32] and sums s [rows, in / 32] fp32."""
    check_inputs(x.shape[-1])
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)  # [rows, blocks, 32]
    scales = blocks.abs().amax(dim=-1) * ONE_127TH  # [rows, blocks]
    inverse = torch.where(scales > 0, 1 / scales, 0.0)
    codes = (blocks * inverse[..., None]).round().clamp(-127, 127)  # ties to even, as the kernel's nearbyintf
    sums = scales * codes.sum(dim=-1)
    return codes.to(torch.int8).reshape(x.shape), scales, sums


def pack_q4_blocks(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes 0..15 -> [out, in / 2] uint8: in each block of 32, byte j holds code j (low nibble) and
    code j + 16 (high), so that a mask and a shift give the block's codes in order."""
    blocks = codes.reshape(codes.shape[0], -1, 2, BLOCK // 2)  # [out, blocks, halves, 16]
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(codes.shape[0], -1)


def unpack_q4_blocks(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_q4_blocks`: [out, in / 2] -> [out, in] uint8."""
    blocks = packed.reshape(packed.shape[0], -1, BLOCK // 2)  # [out, blocks, 16]
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).reshape(packed.shape[0], -1)


def dot_weight(codes, scales, minimums, offset: int, bits: int, group: int):
    """A weight w = (codes - offset) * scales + minimums (per group of `group`, 32 or a whole row) in the
    kernel's layout: (codes, scales [out, in / 32], minimums [out, in / 32] or None for 8 bits), where the
    4-bit codes are packed by `pack_q4_blocks` and the offset is folded into the minimums."""
    out_features, in_features = codes.shape
    check_inputs(in_features)
    if group != BLOCK:  # one scale per row: the same scale for each of its blocks
        scales = scales.expand(out_features, in_features // BLOCK).contiguous()
    if bits == 8:
        return codes.contiguous(), scales, None
    minimums = torch.zeros_like(scales) if minimums is None else minimums
    return pack_q4_blocks(codes), scales, minimums - offset * scales if offset else minimums


def block_terms(x_codes, x_scales, x_sums, codes, scales, minimums) -> torch.Tensor:
    """Each block's share of each output: dw * d * sum(c * q) + mw * s -> [rows, out, blocks] fp32.

    x_codes [rows, in], x_scales and x_sums [rows, blocks] from `quantize_q8_1`; codes [out, in] unpacked
    (0..15 or int8), scales and minimums [out, blocks] (minimums None: 0)."""
    rows, out_features = x_codes.shape[0], codes.shape[0]
    q = x_codes.float().reshape(rows, -1, BLOCK).transpose(0, 1)  # [blocks, rows, 32]
    c = codes.float().reshape(out_features, -1, BLOCK).permute(1, 2, 0)  # [blocks, 32, out]
    products = torch.bmm(q, c).permute(1, 2, 0)  # [rows, out, blocks]: integers below 2^24, exact in fp32
    terms = scales[None] * x_scales[:, None] * products
    return terms if minimums is None else terms + minimums[None] * x_sums[:, None]


def unpacked_codes(codes: torch.Tensor) -> torch.Tensor:
    """The kernel layout's codes as [out, in]: 4-bit blocks (uint8) unpacked, int8 as they are."""
    return unpack_q4_blocks(codes) if codes.dtype == torch.uint8 else codes


def reference_linear(x, codes, scales, minimums, bias) -> torch.Tensor:
    """x [rows, in] fp32 @ w.T + bias -> [rows, out], with w in the kernel's layout (`dot_weight`): what the
    C kernel computes, summed in another order."""
    out = block_terms(*quantize_q8_1(x), unpacked_codes(codes), scales, minimums).sum(dim=-1)
    return out if bias is None else out + bias


def activation_error_bound(x, codes, scales, minimums) -> torch.Tensor:
    """The most the 8-bit activations move each output from the exact x @ w.T: sum over blocks of d / 2 times
    the block's sum |w| -> [rows, out]."""
    weight = unpacked_codes(codes).float().reshape(codes.shape[0], -1, BLOCK) * scales[..., None]
    if minimums is not None:
        weight = weight + minimums[..., None]
    _, x_scales, _ = quantize_q8_1(x)
    return (x_scales / 2) @ weight.abs().sum(dim=-1).T
