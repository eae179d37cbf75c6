"""Quantized layers multiply like `F.linear` on their own dequantized weight, with either kernel; int8 and
int4 quantization of a float weight comes back within half a step."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from chapters import submodule

pytestmark = pytest.mark.requires("quantization")

IN, OUT = 96, 80  # three groups of 32 inputs
FORMATS = ["Q4_0", "Q4_1", "Q8_0", "int8", "int4"]
BF16_RELATIVE = 1e-2  # bf16 activations (and bf16 scales in the packed kernels): of the output's largest


@pytest.fixture
def ql(checkpoint):
    return submodule(checkpoint, "quantized_linear")


@pytest.fixture
def quantization(checkpoint):
    return submodule(checkpoint, "quantization")


def quantized_weight(ql, quantization, kind: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(OUT, IN, generator=gen) * 0.1
    if kind == "int8":
        return quantization.quantize_int8(weight)
    if kind == "int4":
        return quantization.quantize_int4(weight)
    groups = IN // 32
    scales = torch.rand(OUT, groups, generator=gen).half().float() * 0.02
    if kind == "Q8_0":
        codes = torch.randint(-127, 128, (OUT, IN), generator=gen, dtype=torch.int8)
        return ql.QuantizedWeight(codes, scales, None, offset=0, bits=8, group=32)
    codes = torch.randint(0, 16, (OUT, IN), generator=gen, dtype=torch.uint8)
    if kind == "Q4_0":
        return ql.QuantizedWeight(codes, scales, None, offset=8, bits=4, group=32)
    minimums = -torch.rand(OUT, groups, generator=gen).half().float() * 0.15
    return ql.QuantizedWeight(codes, scales, minimums, offset=0, bits=4, group=32)


def force(monkeypatch, ql, kernel: str) -> None:
    """Make every call take `kernel`: "packed" on bf16 and fp32 activations alike, or "dense"."""
    monkeypatch.setattr(ql, "SMALL_BATCH_ROWS", 10**6 if kernel == "packed" else 0)
    monkeypatch.setattr(ql, "HALVES_ROWS", 10**6 if kernel == "packed" else 0)
    monkeypatch.setattr(ql, "PACKED_DTYPES", (torch.bfloat16, torch.float32))


@pytest.mark.parametrize("kind", FORMATS)
def test_dequantize_is_the_weight_quantized(ql, quantization, kind):
    weight = quantized_weight(ql, quantization, kind)
    layer = ql.quantized_linear(weight, None, torch.float32)
    assert torch.equal(layer.dequantize(), weight.dequantize())
    assert torch.equal(layer.dense, weight.dequantize())  # fp32 compute: the dense copy is exact


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("kernel", ["packed", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_linear_equals_f_linear_on_its_dequantized_weight(monkeypatch, ql, quantization, kind, kernel, dtype, rows):
    force(monkeypatch, ql, kernel)
    gen = torch.Generator().manual_seed(rows)
    bias = torch.randn(OUT, generator=gen)
    layer = ql.quantized_linear(quantized_weight(ql, quantization, kind), bias, dtype)
    x = torch.randn(rows, IN, generator=gen)
    expected = F.linear(x, layer.dequantize(), bias)
    out = layer(x.to(dtype))
    assert out.dtype == dtype and out.shape == (rows, OUT)
    if dtype == torch.bfloat16:
        assert (out.float() - expected).abs().max() <= BF16_RELATIVE * expected.abs().max()
    elif kernel == "dense":  # the dense copy is the dequantized weight itself
        assert torch.equal(out, expected)
    else:  # the packed kernels sum in another order
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_1", "int8", "Q8_0"])
def test_kernel_is_chosen_by_rows(monkeypatch, ql, quantization, kind):
    calls = []
    for name in ("_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm"):
        kernel = getattr(torch.ops.aten, name)
        monkeypatch.setattr(torch.ops.aten, name, lambda *a, k=kernel: calls.append(1) or k(*a))
    most = ql.HALVES_ROWS if kind == "Q8_0" else ql.SMALL_BATCH_ROWS
    layer = ql.quantized_linear(quantized_weight(ql, quantization, kind), None, torch.bfloat16)
    layer(torch.randn(most + 1, IN, dtype=torch.bfloat16))
    assert not calls
    layer(torch.randn(most, IN, dtype=torch.bfloat16))
    assert calls
    calls.clear()
    fp32_layer = ql.quantized_linear(quantized_weight(ql, quantization, kind), None, torch.float32)
    fp32_layer(torch.randn(1, IN))  # fp32 activations: always the dense copy
    assert not calls


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "int4"])
def test_compiled_layer_equals_eager(monkeypatch, ql, quantization, kind):
    force(monkeypatch, ql, "packed")
    layer = ql.quantized_linear(quantized_weight(ql, quantization, kind), None, torch.float32)
    compiled = torch.compile(lambda x: F.silu(layer(x)), dynamic=True)
    for rows in (1, 5):
        x = torch.randn(rows, IN)
        torch.testing.assert_close(compiled(x), F.silu(layer(x)))


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "int8"])
def test_a_graph_of_one_row_holds_the_kernel_itself(monkeypatch, ql, quantization, kind):
    """Traced with one row, the kernel is chosen while tracing and goes into the graph; traced with a row
    count that is a symbol, the layer's custom operator keeps the choice for run time."""
    traced = []
    operators = {m: lambda *a, op=op: traced.append(op) or op(*a) for m, op in ql.OPERATORS.items()}
    monkeypatch.setattr(ql, "OPERATORS", operators)
    layer = ql.quantized_linear(quantized_weight(ql, quantization, kind), None, torch.bfloat16)
    for rows, dynamic, through_operator in ((1, False, False), (3, True, True)):
        x = torch.randn(rows, IN, dtype=torch.bfloat16)
        eager = layer(x)  # through the operator
        torch._dynamo.reset()
        traced.clear()
        torch.testing.assert_close(torch.compile(layer, dynamic=dynamic)(x), eager)
        assert bool(traced) == through_operator


def test_q8_0_on_the_int4_kernel_reads_back_every_weight(monkeypatch, ql, quantization):
    """Q8_0's codes run as two 4-bit halves; fp32 one-hot inputs read each weight back through the int4
    kernel, to fp32 rounding (the kernel folds scale and zero in its own order): the halves stand for the
    codes."""
    force(monkeypatch, ql, "packed")
    layer = ql.quantized_linear(quantized_weight(ql, quantization, "Q8_0"), None, torch.float32)
    weight = layer.dequantize()
    torch.testing.assert_close(layer(torch.eye(IN)), weight.T, rtol=0, atol=1e-6 * weight.abs().max().item())


def test_int8_codes_grouped_other_than_by_row_or_by_32_are_refused(ql):
    codes = torch.zeros(OUT, IN, dtype=torch.int8)
    weight = ql.QuantizedWeight(codes, torch.ones(OUT, IN // 48), None, offset=0, bits=8, group=48)
    with pytest.raises(ValueError, match="one row or by 32"):
        ql.quantized_linear(weight, None, torch.bfloat16)


def test_embedding_dequantizes_the_looked_up_rows(ql, quantization):
    head = ql.quantized_linear(quantized_weight(ql, quantization, "Q8_0"), None, torch.float32)
    embedding = ql.QuantizedEmbedding(head, torch.bfloat16)
    ids = torch.tensor([3, 0, 79, 3])
    assert torch.equal(embedding(ids), head.dequantize()[ids].to(torch.bfloat16))


def test_the_embedding_moves_with_the_model(ql, quantization):
    """`.to()` moves every tensor of the quantized embedding with the model (here to the "meta" device, which
    stands for a GPU on a machine without one)."""
    net = torch.nn.Module()
    net.lm_head = ql.quantized_linear(quantized_weight(ql, quantization, "Q8_0"), None, torch.float32)
    net.embed_tokens = ql.QuantizedEmbedding(net.lm_head, torch.float32)
    net.to("meta")
    tensors = dict(net.named_buffers(remove_duplicate=False)) | dict(net.named_parameters(remove_duplicate=False))
    assert {"embed_tokens.codes", "embed_tokens.scales"} <= tensors.keys()
    assert {name: t.device.type for name, t in tensors.items()} == {name: "meta" for name in tensors}


class WholeWeightPasses(TorchDispatchMode):
    """Counts the operations (views aside) whose output holds at least `size` elements: passes over a whole
    weight."""

    def __init__(self, size: int):
        super().__init__()
        self.size, self.passes = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and any(isinstance(t, torch.Tensor) and t.numel() >= self.size for t in tree_leaves(out)):
            self.passes.append(func.__name__)
        return out


# A model's load builds one layer per weight, and each pass over a weight costs about as much as reading it:
# one fp32 tensor worked on in place for the dense copy (codes to fp32, - offset, * scale, + minimum) and,
# for bf16 compute only, its cast and the packed kernels' copy: the int4 kernel's int32 codes and their
# packing (Q8_0: its two 4-bit halves: to int32, + 128, high, low, side by side, packing). Most passes with
# fp32 compute, then with bf16.
MOST_PASSES = {"Q4_0": (3, 6), "Q4_1": (3, 6), "int4": (3, 6), "int8": (2, 3), "Q8_0": (2, 9)}


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_layer_is_built_in_few_passes_over_its_weight(ql, quantization, kind, dtype):
    weight = quantized_weight(ql, quantization, kind)
    with WholeWeightPasses(weight.codes.numel()) as counter:
        ql.quantized_linear(weight, None, dtype)
    assert len(counter.passes) <= MOST_PASSES[kind][dtype == torch.bfloat16], counter.passes


@pytest.mark.parametrize("kind", FORMATS)
def test_only_a_layer_for_bf16_holds_what_the_packed_kernels_read(ql, quantization, kind):
    """The packed kernels never run on fp32 activations (the dense copy wins at every row count there)."""
    kernel_buffers = {"packed", "scale_and_zero", "kernel_scales"}
    for dtype, holds in ((torch.float32, False), (torch.bfloat16, True)):
        layer = ql.quantized_linear(quantized_weight(ql, quantization, kind), None, dtype)
        assert bool(kernel_buffers & dict(layer.named_buffers()).keys()) == holds, dtype


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantizing_rounds_to_within_half_a_step(quantization, kind):
    weight = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1))
    weight[0] = 0.25  # a constant row: its step is 0, it comes back exactly
    quantized = getattr(quantization, f"quantize_{kind}")(weight)
    step = quantized.scales.repeat_interleave(quantized.group, dim=1)  # [OUT, IN]
    error = (quantized.dequantize() - weight).abs()
    assert torch.all(error <= step / 2 + 1e-6 * weight.abs().amax())
    assert torch.equal(quantized.dequantize()[0], weight[0])
    if kind == "int4":
        assert quantized.codes.max() == 15 and quantized.codes.min() == 0 and quantized.group == 32
    else:
        assert quantized.codes.abs().max() == 127 and quantized.group == IN
