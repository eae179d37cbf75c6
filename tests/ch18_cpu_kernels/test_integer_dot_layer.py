"""Quantized layers on fp32 activations run few rows on integer dot products once `use_integer_dot` prepared
them (the engine's `int8_activations`, on by default), more rows on their dense copy; eager, compiled as one
graph, or with any number of rows in a graph; and `int8_activations=False` keeps fp32's exact products."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.ch18_cpu_kernels.formats import FORMATS, layers, quantized_weight, rounding_bound

pytestmark = pytest.mark.requires("integer_dot")


def prepared_layer(checkpoint, kind: str, dtype=torch.float32, bias: bool = True):
    ql = layers(checkpoint)[0]
    weight = quantized_weight(checkpoint, kind, 40, 96)
    layer = ql.quantized_linear(weight, torch.randn(40) if bias else None, dtype)
    layer.use_integer_dot()
    return layer


def integer_reference(checkpoint, layer, x):
    integer_dot = layers(checkpoint)[2]
    weights = (layer.dot_codes, layer.dot_scales, layer.dot_minimums)
    return integer_dot.reference_linear(x, *weights, layer.bias), rounding_bound(integer_dot, x, *weights, layer.bias)


@pytest.mark.parametrize("kind", FORMATS)
def test_few_rows_take_integer_products_and_more_the_dense_copy(checkpoint, kind):
    ql = layers(checkpoint)[0]
    layer = prepared_layer(checkpoint, kind)
    for rows in (1, 2, ql.INTEGER_DOT_ROWS, ql.INTEGER_DOT_ROWS + 1):
        x = torch.randn(rows, 96)
        if rows <= ql.INTEGER_DOT_ROWS:
            expected, bound = integer_reference(checkpoint, layer, x)
        else:
            expected, bound = F.linear(x, layer.dense, layer.bias), 0
        assert ((layer(x) - expected).abs() <= bound).all()
    tokens = torch.randn(2, 3, 96)  # any leading shape: its rows are its tokens
    torch.testing.assert_close(layer(tokens), layer(tokens.reshape(6, 96)).reshape(2, 3, 40), atol=0, rtol=0)


def test_a_layer_holds_its_integer_copy_only_when_prepared_and_the_model_prepares_fp32_only(checkpoint):
    ql, quantization, _, _ = layers(checkpoint)
    plain = ql.quantized_linear(quantized_weight(checkpoint, "Q4_1", 40, 96), None, torch.float32)
    assert not plain.uses_integer_dot
    net = torch.nn.ModuleDict(
        {
            "fp32": ql.quantized_linear(quantized_weight(checkpoint, "Q4_0", 40, 96), None, torch.float32),
            "bf16": ql.quantized_linear(quantized_weight(checkpoint, "Q8_0", 48, 96), None, torch.bfloat16),
            "in_100": ql.quantized_linear(quantization.quantize_int8(torch.randn(40, 100)), None, torch.float32),
        }
    )
    ql.use_integer_dot(net)
    assert net["fp32"].dot_codes.shape == (40, 48) and net["fp32"].dot_codes.dtype == torch.uint8
    assert not net["bf16"].uses_integer_dot  # bf16 activations keep PyTorch's packed kernels
    assert not net["in_100"].uses_integer_dot  # inputs not in blocks of 32: the dense copy
    q4_0 = net["fp32"]
    assert torch.equal(q4_0.dot_minimums, -8 * q4_0.scales)  # Q4_0's offset folded into a minimum
    assert q4_0.dot_scales.data_ptr() == q4_0.scales.data_ptr()  # shared, not copied


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "int8"])
def test_compiled_as_one_graph_equals_eager(checkpoint, kind):
    """fullgraph: the C kernel sits in the graph as an operator (ctypes itself cannot be traced); one row
    (torch.compile's specialized size) and any rows alike."""
    layer = prepared_layer(checkpoint, kind)
    one_row = torch.compile(layer, fullgraph=True, dynamic=False)
    x = torch.randn(1, 96)
    torch.testing.assert_close(one_row(x), layer(x), atol=0, rtol=0)
    any_rows = torch.compile(layer, fullgraph=True, dynamic=True)
    for rows in (3, 12):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(any_rows(x), layer(x), atol=0, rtol=0)


def test_the_engine_option_prepares_every_quantized_layer_or_none(checkpoint, tiny_model_dirs, monkeypatch):
    ql, _, _, kernel = layers(checkpoint)
    path = str(tiny_model_dirs["gqa"])
    calls = []
    linear = kernel.linear
    monkeypatch.setattr(kernel, "linear", lambda *args: calls.append(args[0].shape[0]) or linear(*args))
    params = checkpoint.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 14, 3, 7, 22, 8, 1, 30, 2], [4, 4, 6]]
    tokens = {}
    for on in (True, False):
        counters.clear()
        llm = checkpoint.LLM(path, quantization="int4", dtype="float32", int8_activations=on)  # compiled
        quantized = [m for m in llm.model.modules() if isinstance(m, ql.QuantizedLinear)]
        assert quantized and all(m.uses_integer_dot == on for m in quantized)
        calls.clear()
        tokens[on] = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        assert bool(calls) == on and all(rows <= ql.INTEGER_DOT_ROWS for rows in calls)
        assert not counters["graph_break"]  # the kernel runs inside the compiled step, as an operator
    assert tokens[True] == tokens[False]  # a tiny random model's greedy tokens are far from ties
    with pytest.raises(ValueError, match="int8_activations must be True or False"):
        checkpoint.EngineConfig(int8_activations="yes")
