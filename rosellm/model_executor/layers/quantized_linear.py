"""Linear layers and an embedding on weights stored in fewer bytes: 4-bit or 8-bit codes per weight, and a
scale (and a minimum) per group of consecutive weights in a row.

    w = (code - offset) * scale + minimum        over a group of `group` weights of one row

`Int4Linear` holds codes 0..15 (GGUF's Q4_0: offset 8, no minimum; Q4_1 and our int4: offset 0 and a
minimum), `Int8Linear` holds int8 codes and a scale only (GGUF's Q8_0: groups of 32; our int8: one group per
row). `dequantize()` gives the exact fp32 weight these stand for: for a GGUF tensor, bit for bit what
`gguf.quants.dequantize` gives.

Each layer picks its kernel by the rows of its input. With few rows (decode, batch 1 to SMALL_BATCH_ROWS) on
bf16 activations, PyTorch's CPU kernels multiply the packed codes directly (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`): a 4-bit weight is read in an eighth of the bytes of fp32. Q8_0's scale per group of
32 fits the int4 kernel, not the int8 one (a scale per row): its codes run there as two 4-bit halves (see
`Int8Linear`). With more rows the multiply, not the reading, costs most, and a dense copy of the dequantized
weight in the compute dtype, made once at load, wins with `F.linear`. With fp32 activations the packed
kernels lose at every row count, so fp32 compute always takes the dense copy, and a layer built for it holds
no packed codes at all (packing is a third of a layer's load). The cost of the dense copy: the layer holds
its codes (0.5 or 1 byte per weight), the kernel's packed codes (bf16 only) and the dense copy (2 bytes in
bf16, 4 in fp32).

On fp32 activations with few rows (up to INTEGER_DOT_ROWS), a layer prepared by `use_integer_dot` (the
engine's `int8_activations`, on by default) multiplies its codes instead: the activations are quantized to
8 bits per block of 32 and meet the codes in integer dot products (integer_dot.py, llama.cpp's way), in a C
kernel built per CPU level; outputs move by what 8-bit activations round (integer_dot.py bounds it). Where no C
kernel can be built, or with `int8_activations` off (fp32's exact products), the dense copy serves as before.

The choice is Python, made per call. A graph whose row count is a symbol (any number of tokens) keeps it for
run time inside an operator of its own (`OPERATORS`), which Inductor calls back into Python. Where
torch.compile traces one row (it specializes a size of 1: the one-token graph of a decode step) the choice
is made while tracing instead, and the chosen kernel goes into the graph as it is: no Python per layer at run time.
"""

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ...operators import define_operator
from . import integer_dot, integer_dot_kernel, integer_dot_op

GROUP = 32  # weights per scale in GGUF's Q4_0, Q4_1, Q8_0 and in our int4

# Most rows (tokens) for which the packed kernels beat the dense copy on bf16 activations. Measured on a
# 2-core AVX-512 BF16 CPU, one thread, 20 layers of 1536x576 (ms): int4 packed 1.3 / 2.5 / 4.6 / 7.3 / 14.2
# at 1 / 4 / 8 / 16 / 32 rows, int8 per channel 3.2 / 4.0 / 6.6 / 10.7 / 19.3, dense bf16 5.5 / 5.8 / 6.5 /
# 7.8 / 10.7: int4 wins up to 8 rows, int8 ties there, dense wins from 16.
SMALL_BATCH_ROWS = 8
# Q8_0 on the int4 kernel reads twice the inputs (each code's two halves). Measured on the same CPU, on
# SmolLM2's 49152x576 LM head (ms): 1.7 / 2.1 / 3.1 / 5.6 at 1 / 2 / 4 / 8 rows, dense bf16 3.6 / 3.6 / 3.8
# / 4.4: it wins up to 4 rows.
HALVES_ROWS = 4
PACKED_DTYPES = (torch.bfloat16,)  # activations on which the packed kernels pay
# Most rows for which 8-bit activations and integer dot products (integer_dot.c, AVX-512 VNNI) beat the dense
# fp32 copy. Measured on the same CPU, one thread, ms at 1 / 2 / 4 / 8 / 16 rows: SmolLM2's 3072x576 gate-up
# on 4 bits 0.10 / 0.14 / 0.22 / 0.43 / 0.84, dense fp32 0.26 / 0.26 / 0.51 / 0.76 / 0.86; 576x1536 down 0.05
# / 0.07 / 0.11 / 0.22 / 0.40 against 0.13 / 0.13 / 0.24 / 0.36 / 0.47; the 49152x576 LM head on 8 bits 2.3 /
# 3.1 / 5.6 / 9.1 / 16.8 against 7.8 / 9.0 / 17.3 / 26.1 / 19.5. The integer products win up to 16 rows (at 16
# the gate-up ties, though its dense copy was read from cache here: in a whole model it comes from memory).
INTEGER_DOT_ROWS = 16


@dataclass(frozen=True)
class QuantizedWeight:
    """A [rows, cols] matrix as codes and per-group scales: w = (codes - offset) * scales + minimums.

    codes:    [rows, cols] uint8 (4 bits: 0..15) or int8 (8 bits)
    scales:   [rows, cols // group] fp32
    minimums: [rows, cols // group] fp32, or None (no minimum)
    """

    codes: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor | None
    offset: int
    bits: int
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [rows, cols]."""
        return dequantize(self.codes, self.scales, self.minimums, self.offset, self.group)

    def map_rows(self, fn) -> "QuantizedWeight":
        """The same weight with `fn` applied to the rows of codes, scales and minimums (a permutation)."""
        minimums = None if self.minimums is None else fn(self.minimums)
        return replace(self, codes=fn(self.codes), scales=fn(self.scales), minimums=minimums)

    @staticmethod
    def cat(parts: list["QuantizedWeight"]) -> "QuantizedWeight":
        """Rows of `parts` one after the other (all in the same format)."""
        first = parts[0]
        if any(
            (p.bits, p.offset, p.group, p.minimums is None)
            != (first.bits, first.offset, first.group, first.minimums is None)
            for p in parts
        ):
            raise ValueError("cannot concatenate weights quantized in different formats")
        minimums = None if first.minimums is None else torch.cat([p.minimums for p in parts])
        return replace(
            first,
            codes=torch.cat([p.codes for p in parts]),
            scales=torch.cat([p.scales for p in parts]),
            minimums=minimums,
        )


def dequantize(codes, scales, minimums, offset: int, group: int) -> torch.Tensor:
    """(codes - offset) * scales + minimums, each scale and minimum over its group: -> fp32. One fp32 tensor,
    worked on in place (a whole model is dequantized at load: each pass over its weights counts)."""
    weight = codes.reshape(*codes.shape[:-1], -1, group).float()  # [..., groups, group]; codes are integers: a copy
    if offset:
        weight.sub_(offset)
    weight.mul_(scales.unsqueeze(-1))
    if minimums is not None:
        weight.add_(minimums.unsqueeze(-1))
    return weight.reshape(codes.shape)


def uses_packed_kernel(x: torch.Tensor, max_rows: int) -> bool:
    """Whether the packed kernel multiplies x [rows, in] (else the dense copy does)."""
    return x.device.type == "cpu" and x.dtype in PACKED_DTYPES and x.shape[0] <= max_rows


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor | None,
    scale_and_zero: torch.Tensor | None,
    dense: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [rows, in] @ w.T + bias -> [rows, out]: the packed 4-bit kernel or the dense copy `dense` [out, in]
    (always, where the layer holds no packed codes)."""
    if packed is None or not uses_packed_kernel(x, SMALL_BATCH_ROWS):
        return F.linear(x, dense, bias)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_and_zero)
    return out if bias is None else out + bias


def halves_matmul(
    x: torch.Tensor,
    packed: torch.Tensor | None,
    scale_and_zero: torch.Tensor | None,
    dense: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [rows, in] @ w.T + bias -> [rows, out] for int8 codes packed as their two 4-bit halves side by side
    (`Int8Linear.pack_halves`): the int4 kernel on the inputs twice, [x, x]; or the dense copy."""
    if packed is None or not uses_packed_kernel(x, HALVES_ROWS):
        return F.linear(x, dense, bias)
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.cat([x, x], dim=-1), packed, GROUP, scale_and_zero)
    return out if bias is None else out + bias


def int8_matmul(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None, dense: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [rows, in] @ w.T + bias -> [rows, out]: the int8 kernel on codes [out, in] with a scale per row
    (scales [out]; None: the layer never runs it), or the dense copy `dense` [out, in]."""
    if scales is None or not uses_packed_kernel(x, SMALL_BATCH_ROWS):
        return F.linear(x, dense, bias)
    out = torch.ops.aten._weight_int8pack_mm(x, codes, scales)
    return out if bias is None else out + bias


def integer_dot_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    minimums: torch.Tensor | None,
    dense: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [rows, in] @ w.T + bias -> [rows, out]: with fp32 activations and few rows, 8-bit activations and
    integer dot products with w in `integer_dot.dot_weight`'s layout (codes, scales, minimums); else, or where
    no C kernel is built, the dense copy `dense` [out, in]."""
    library = integer_dot_kernel.kernel()
    if library is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[0] > INTEGER_DOT_ROWS:
        return F.linear(x, dense, bias)
    return integer_dot_kernel.linear(x, codes, scales, minimums, bias, library)


def _output(x: torch.Tensor, *weights) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weights[-2].shape[0])  # the dense copy [out, in] comes second to last


# Each matmul as an operator of the same name (operators.py), for graphs that choose a kernel at run time.
MATMULS = (int4_matmul, halves_matmul, int8_matmul, integer_dot_matmul)
OPERATORS = {matmul: define_operator(__package__, fake=_output)(matmul) for matmul in MATMULS}


def run_matmul(matmul, x: torch.Tensor, *weights) -> torch.Tensor:
    """`matmul(x, *weights)` itself where its choice of kernel can be made at once: in eager code, and where
    torch.compile traces x as one row (it specializes a size of 1: the one-token graph). A graph of any
    number of rows calls its operator instead, which chooses at run time."""
    any_rows_traced = torch.compiler.is_compiling() and x.shape[0] != 1
    return (OPERATORS[matmul] if any_rows_traced else matmul)(x, *weights)


# integer_dot_op's C++ operator where it is built (`use_integer_dot` sets it): a global, read once per graph.
graph_operator = None


def run_integer_dot(x: torch.Tensor, kernel_address: int, *weights) -> torch.Tensor:
    """`integer_dot_matmul(x, *weights)`: itself in eager code, its operator in any compiled graph (a C
    kernel called through ctypes cannot be traced; the operator calls it at run time). In a graph traced for
    one row of fp32 activations, where the choice is the integer kernel's, the C++ operator calls the kernel at
    `kernel_address` without Python (see integer_dot_op.py), where the layer was given one (else 0)."""
    if not torch.compiler.is_compiling():
        return integer_dot_matmul(x, *weights)
    if kernel_address and x.shape[0] == 1 and x.dtype == torch.float32:
        codes, scales, minimums, _, bias = weights
        return graph_operator(x, codes, scales, minimums, bias, kernel_address)
    return OPERATORS[integer_dot_matmul](x, *weights)


class QuantizedLinear(nn.Module):
    """What `Int4Linear` and `Int8Linear` share: `matmul` on their own kernels, or their weight held in the
    integer kernel's layout too (`use_integer_dot`) and the integer dot products."""

    uses_integer_dot = False  # whether `use_integer_dot` gave it the integer kernel's copy
    kernel_address = 0  # the C kernel's, for the C++ operator of one-row graphs (`run_integer_dot`); 0: none

    def use_integer_dot(self, kernel_address: int = 0) -> None:
        """Hold the weight in `integer_dot.dot_weight`'s layout too (buffers dot_codes, dot_scales and
        dot_minimums: 0.5 or 1 byte a weight, scales shared where they can be): fp32 activations with few rows
        then run on integer dot products."""
        codes, scales, minimums = integer_dot.dot_weight(*self.integer_dot_source())
        for name, tensor in (("dot_codes", codes), ("dot_scales", scales), ("dot_minimums", minimums)):
            self.register_buffer(name, tensor)
        self.uses_integer_dot, self.kernel_address = True, kernel_address

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if not self.uses_integer_dot:
            out = self.matmul(x2d)
        else:
            weights = (self.dot_codes, self.dot_scales, self.dot_minimums, self.dense, self.bias)
            out = run_integer_dot(x2d, self.kernel_address, *weights)
        return out.reshape(*x.shape[:-1], self.out_features)


def use_integer_dot(net: nn.Module) -> None:
    """Every quantized layer of `net` whose dense copy is fp32 on CPU (and whose inputs come in blocks of 32)
    also holds its weight for the integer kernel (`QuantizedLinear.use_integer_dot`), and, where the C kernel
    and its C++ operator are built, the two for compiled graphs (a graph keeps the kernel it was traced with)."""
    global graph_operator
    library, kernel_address = integer_dot_kernel.kernel(), 0
    if library is not None and (operator := integer_dot_op.operator(__package__)) is not None:
        graph_operator, kernel_address = operator, integer_dot_op.address(library)
    for module in net.modules():
        fp32_cpu = isinstance(module, QuantizedLinear) and module.dense.dtype == torch.float32
        if fp32_cpu and module.dense.device.type == "cpu" and module.in_features % integer_dot.BLOCK == 0:
            module.use_integer_dot(kernel_address)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[rows, cols] codes 0..15 -> [rows, cols // 2] uint8, two codes a byte (even column low)."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_nibbles`: [rows, cols // 2] -> [rows, cols] uint8."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


class Int4Linear(QuantizedLinear):
    """A linear layer on 4-bit codes, a scale and a minimum per group of 32 weights of a row."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        if weight.bits != 4 or weight.group != GROUP:
            raise ValueError(f"Int4Linear takes 4-bit codes in groups of {GROUP}")
        self.out_features, self.in_features = weight.shape
        self.offset = weight.offset
        minimums = weight.minimums if weight.minimums is not None else torch.zeros_like(weight.scales)
        self.register_buffer("codes", pack_nibbles(weight.codes))  # [out, in / 2] uint8
        self.register_buffer("scales", weight.scales)  # [out, in / 32] fp32
        self.register_buffer("minimums", minimums)  # [out, in / 32] fp32
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        packed = scale_and_zero = None  # the kernel's layout, for the activations it runs on (None: never)
        if dtype in PACKED_DTYPES:  # its formula: w = (code - 8) * scale + zero
            zeros = minimums + (8 - self.offset) * weight.scales
            packed, scale_and_zero = pack_for_int4_kernel(weight.codes, weight.scales, zeros, dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_zero", scale_and_zero)  # [in / 32, out, 2] in the compute dtype
        self.register_buffer("dense", weight.dequantize().to(dtype))  # [out, in] in the compute dtype

    def dequantize(self) -> torch.Tensor:
        """The exact fp32 weight [out, in]."""
        return dequantize(unpack_nibbles(self.codes), self.scales, self.minimums, self.offset, GROUP)

    def integer_dot_source(self) -> tuple:
        """The weight as `integer_dot.dot_weight` takes it."""
        return unpack_nibbles(self.codes), self.scales, self.minimums, self.offset, 4, GROUP

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return run_matmul(int4_matmul, x2d, self.packed, self.scale_and_zero, self.dense, self.bias)


def pack_for_int4_kernel(codes, scales, zeros, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [out, in] 0..15 and scales, zeros [out, in / 32] of w = (code - 8) * scale + zero -> the int4
    kernel's packed codes and its [in / 32, out, 2] scales and zeros in `dtype`."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    return packed, torch.stack([scales.T, zeros.T], -1).to(dtype).contiguous()


class Int8Linear(QuantizedLinear):
    """A linear layer on int8 codes and a scale per group of a row (one group per row: per channel).

    PyTorch's int8 kernel takes one scale per row. Groups of 32 (Q8_0) run on the int4 kernel instead, each
    code split in two 4-bit halves: code + 128 = 16 * high + low, with high and low in 0..15, so

        w = code * s = (high - 8) * 16s + (low - 8) * s + 8s

    two int4 weights in the kernel's form (code - 8) * scale + zero: scale 16s and zero 0 for the high half,
    scale s and zero 8s for the low one. Put side by side they are one int4 matrix [out, 2 * in] that the
    inputs meet twice: [x, x] @ [high | low].T = x @ w.T, read in the bytes of the int8 codes.
    """

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        if weight.bits != 8 or weight.minimums is not None or weight.offset != 0:
            raise ValueError("Int8Linear takes symmetric int8 codes (no offset, no minimum)")
        self.out_features, self.in_features = weight.shape
        self.group = weight.group
        if self.group not in (self.in_features, GROUP):
            raise ValueError(f"Int8Linear groups codes by one row or by {GROUP}, not {self.group}")
        self.register_buffer("codes", weight.codes)  # [out, in] int8
        self.register_buffer("scales", weight.scales)  # [out, in / group] fp32
        self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)
        self.register_buffer("dense", self.dequantize().to(dtype))  # [out, in] in the compute dtype
        packs = dtype in PACKED_DTYPES  # the kernels' copies, for the activations they run on (None: never)
        if self.group == self.in_features:  # [out] for the int8 kernel
            self.register_buffer("kernel_scales", weight.scales[:, 0].to(dtype) if packs else None)
        else:
            packed, scale_and_zero = self.pack_halves(dtype) if packs else (None, None)
            self.register_buffer("packed", packed)
            self.register_buffer("scale_and_zero", scale_and_zero)  # [2 * in / 32, out, 2]

    def pack_halves(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes as [high | low] halves [out, 2 * in] for the int4 kernel, with their scales and zeros."""
        unsigned = self.codes.int().add_(128)  # [out, in] 0..255
        halves = torch.cat([unsigned >> 4, unsigned & 15], dim=1)  # [out, 2 * in] 0..15
        scales = torch.cat([16 * self.scales, self.scales], dim=1)
        zeros = torch.cat([torch.zeros_like(self.scales), 8 * self.scales], dim=1)
        return pack_for_int4_kernel(halves, scales, zeros, dtype)

    def dequantize(self) -> torch.Tensor:
        """The exact fp32 weight [out, in]."""
        return dequantize(self.codes, self.scales, None, 0, self.group)

    def integer_dot_source(self) -> tuple:
        """The weight as `integer_dot.dot_weight` takes it."""
        return self.codes, self.scales, None, 0, 8, self.group

    def matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        if self.group == self.in_features:
            return run_matmul(int8_matmul, x2d, self.codes, self.kernel_scales, self.dense, self.bias)
        return run_matmul(halves_matmul, x2d, self.packed, self.scale_and_zero, self.dense, self.bias)


class QuantizedEmbedding(nn.Module):
    """Token embeddings from int8 codes: looks up the codes and scales of the tokens' rows and dequantizes
    those rows only. Shares its codes with a tied `Int8Linear` LM head."""

    def __init__(self, head: Int8Linear, dtype: torch.dtype):
        super().__init__()
        # Buffers, so that `.to()` moves them with the model (the head's are the same tensors until then).
        self.register_buffer("codes", head.codes)  # [vocab, hidden] int8
        self.register_buffer("scales", head.scales)  # [vocab, hidden / group] fp32
        self.group, self.dtype = head.group, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [num_tokens] -> [num_tokens, hidden]
        return dequantize(self.codes[input_ids], self.scales[input_ids], None, 0, self.group).to(self.dtype)


def quantized_linear(weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Module:
    """The layer for `weight`'s format: `Int4Linear` for 4-bit codes, `Int8Linear` for 8-bit."""
    return (Int4Linear if weight.bits == 4 else Int8Linear)(weight, bias, dtype)
