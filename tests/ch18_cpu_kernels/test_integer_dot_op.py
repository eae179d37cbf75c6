"""The C++ operator through which a one-row graph calls the integer kernel: equal to the kernel called from
Python, called by a compiled layer's graph without a call into Python, and, where no C++ compiler builds it,
absent: the graph then keeps the Python operator."""

import pytest
import torch

from chapters import submodule
from tests.ch18_cpu_kernels.formats import FORMATS, layers, quantized_weight

pytestmark = pytest.mark.requires("integer_dot")


def operator_module(checkpoint):
    return submodule(checkpoint, "model_executor.layers.integer_dot_op")


def prepared(checkpoint, kind: str = "Q4_1"):
    """A layer of `kind` [40, 96] with a bias, prepared as the model runner prepares a model."""
    ql = layers(checkpoint)[0]
    net = torch.nn.ModuleDict(
        {"layer": ql.quantized_linear(quantized_weight(checkpoint, kind, 40, 96), torch.randn(40), torch.float32)}
    )
    ql.use_integer_dot(net)
    return net["layer"]


def counting_calls(checkpoint, monkeypatch) -> list[int]:
    """The row counts of every call of the kernel from Python, from now on."""
    kernel, calls = layers(checkpoint)[3], []
    linear = kernel.linear
    monkeypatch.setattr(kernel, "linear", lambda *args: calls.append(args[0].shape[0]) or linear(*args))
    return calls


@pytest.mark.parametrize("kind", FORMATS)
def test_the_operator_equals_the_kernel_called_from_python(checkpoint, kind):
    ql, _, _, kernel = layers(checkpoint)
    module = operator_module(checkpoint)
    operator = module.operator(ql.__package__)
    assert operator is not None, "the C++ operator did not build: install g++ (Inductor needs a C++ compiler too)"
    layer, library = prepared(checkpoint, kind), kernel.kernel()
    assert layer.kernel_address == module.address(library)
    weights = (layer.dot_codes, layer.dot_scales, layer.dot_minimums)
    for rows, bias in ((1, layer.bias), (3, None)):
        x = torch.randn(rows, 96)
        assert torch.equal(operator(x, *weights, bias, layer.kernel_address), kernel.linear(x, *weights, bias, library))


def test_a_one_row_graph_calls_the_kernel_without_python_and_any_rows_through_python(checkpoint, monkeypatch):
    layer = prepared(checkpoint)
    x1, x3 = torch.randn(1, 96), torch.randn(3, 96)
    eager1, eager3 = layer(x1), layer(x3)
    calls = counting_calls(checkpoint, monkeypatch)
    assert torch.equal(torch.compile(layer, fullgraph=True, dynamic=False)(x1), eager1)
    assert calls == []  # the C++ operator reached the kernel
    assert torch.equal(torch.compile(layer, fullgraph=True, dynamic=True)(x3), eager3)
    assert calls == [3]  # a graph of any rows chooses at run time, in Python


def test_without_a_cxx_compiler_no_operator_is_built_and_the_graph_keeps_the_python_one(checkpoint, monkeypatch):
    module = operator_module(checkpoint)
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert module.build("rosellm_without_a_compiler") is None
    monkeypatch.setattr(module, "operator", lambda package: None)
    layer = prepared(checkpoint, "Q8_0")
    assert layer.kernel_address == 0
    x = torch.randn(1, 96)
    eager = layer(x)
    calls = counting_calls(checkpoint, monkeypatch)
    assert torch.equal(torch.compile(layer, fullgraph=True, dynamic=False)(x), eager) and calls == [1]
