"""The operators a step calls (packed linear layers, attention, the quantized layers' choice of kernel) are
defined on a `torch.library.Library`, not by `torch.library.custom_op` (whose Python wrapper runs at every
call); `define_operator` gives operators that equal their function, eager and compiled, writing into the
arguments they declare."""

import pytest
import torch

pytestmark = pytest.mark.requires("engine_core")


def step_operators(checkpoint) -> list:
    return [
        checkpoint.packed_linear.packed_linear,
        checkpoint.attention_op.attention,
        *checkpoint.quantized_linear.OPERATORS.values(),
    ]


def test_a_steps_operators_are_defined_on_a_library(checkpoint):
    for operator in step_operators(checkpoint):
        assert isinstance(operator, torch._ops.OpOverload), f"{operator} is not a plain operator"
        assert operator.namespace.startswith(checkpoint.__name__.replace(".", "_"))  # one set per copy


def test_defined_operators_equal_their_functions_eager_and_compiled(checkpoint):
    namespace = f"{checkpoint.__name__}.tests"  # one per checkpoint: an operator is defined once a process
    define_operator = checkpoint.operators.define_operator

    @define_operator(namespace, fake=lambda x, weight: x.new_empty(x.shape[0], weight.shape[0]))
    def project(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x @ weight.T

    @define_operator(namespace, fake=lambda x, rows, out: torch.empty_like(x), mutates_args=("out",))
    def scatter_rows(x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out[rows] = x  # written in place: the compiled graph must keep the write
        return x * 2

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 8, generator=gen)

    def step(x, rows, out):
        return scatter_rows(torch.relu(project(x, weight)), rows, out) + 1

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for num_rows in (3, 6):
        x, rows = torch.randn(num_rows, 8, generator=gen), torch.randperm(10, generator=gen)[:num_rows]
        projected = torch.relu(x @ weight.T)  # the functions' arithmetic, written out
        expected, expected_out = projected * 2 + 1, torch.zeros(10, 5).index_put_((rows,), projected)
        for run in (step, compiled):  # eager, then compiled
            out = torch.zeros(10, 5)
            torch.testing.assert_close(run(x, rows, out), expected)
            torch.testing.assert_close(out, expected_out)
        assert out[rows].abs().sum() > 0  # the write happened (the comparison above is not of zeros)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_few_rows_multiply_the_plain_weight_more_rows_the_packed_copy(checkpoint, rows, compiled, monkeypatch):
    """Up to PLAIN_ROWS rows the layer multiplies its plain weight, from one more on its packed copy; compiled
    for any number of rows, the choice is made at each call."""
    packed = checkpoint.packed_linear
    monkeypatch.setattr(packed, "PLAIN_ROWS", 3)  # Intel's value (from chapter 18 it depends on the CPU)
    layer = torch.nn.Linear(32, 16)
    packed.pack_linears(layer)
    zeros = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32), None)
    monkeypatch.setitem(packed._packed, layer.weight.data_ptr(), zeros)  # where the packed copy is read: bias alone
    x = torch.randn(rows, 32, generator=torch.Generator().manual_seed(rows))
    run = torch.compile(layer, dynamic=True, fullgraph=True) if compiled else layer
    with torch.inference_mode():
        out = run(x)
    plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
    expected = plain if rows <= packed.PLAIN_ROWS else layer.bias.detach().expand(rows, 16)
    torch.testing.assert_close(out, expected)
    assert 1 <= packed.PLAIN_ROWS < 4  # the parameters above run both sides of the choice
