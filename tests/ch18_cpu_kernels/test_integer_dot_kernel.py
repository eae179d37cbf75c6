"""The integer kernel (integer_dot.c) computes what its tensor algebra (integer_dot.py) computes, within fp32's
rounding, at every CPU level it is built for (at "nocc" none is built); its 8-bit activations are the tensor
algebra's, code for code; and they move each output by no more than the bound integer_dot.py states."""

import platform
import shutil

import pytest
import torch
import torch.nn.functional as F

from tests.ch13_quantization.cpu_levels import VARIABLE, levels
from tests.ch18_cpu_kernels.formats import FORMATS, dot_weight, layers, quantized_weight, rounding_bound

pytestmark = [pytest.mark.requires("integer_dot"), pytest.mark.cpu_features]


@pytest.fixture(autouse=True)
def a_compiler():
    assert shutil.which("cc") or shutil.which("gcc"), "no C compiler: install one (Inductor needs it too)"


def inputs(rows: int, in_features: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # a block of zeros: scale 0, codes 0
    return x


def check_kernel(checkpoint, kind, rows, out_features, in_features, with_bias) -> None:
    _, _, integer_dot, kernel = layers(checkpoint)
    weight = dot_weight(checkpoint, quantized_weight(checkpoint, kind, out_features, in_features))
    bias = torch.randn(out_features) if with_bias else None
    x = inputs(rows, in_features)
    out = kernel.linear(x, *weight, bias, kernel.kernel())
    expected = integer_dot.reference_linear(x, *weight, bias)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    assert ((out - expected).abs() <= rounding_bound(integer_dot, x, *weight, bias)).all()


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("out_features, in_features", [(4, 32), (37, 96), (130, 576)])  # 37, 130: a last tile
def test_kernel_equals_its_tensor_algebra(checkpoint, kind, rows, out_features, in_features):
    assert layers(checkpoint)[3].kernel() is not None
    check_kernel(checkpoint, kind, rows, out_features, in_features, with_bias=rows % 2 == 1)


@pytest.mark.parametrize("level", levels())
@pytest.mark.parametrize("kind", FORMATS)
def test_every_cpu_level_equals_the_tensor_algebra(checkpoint, tmp_path, monkeypatch, level, kind):
    """Masked to each level, the kernel is built with that level's flags into a library of its own (AVX-512
    VNNI's dot products from avx512_bf16, AVX2's from avx2 and avx512, plain C below); at "nocc" none is built
    and the layer's dense copy multiplies, exactly."""
    monkeypatch.setenv(VARIABLE, level)
    monkeypatch.setenv("ROSELLM_CACHE", str(tmp_path))
    ql, _, _, kernel = layers(checkpoint)
    built = sorted(path.name for path in (tmp_path / "kernels").glob("*.so"))
    if level == "nocc":
        assert kernel.kernel() is None
        weight = quantized_weight(checkpoint, kind, 37, 96)
        x, dense = inputs(3, 96), weight.dequantize()
        out = ql.integer_dot_matmul(x, *dot_weight(checkpoint, weight), dense, None)
        assert torch.equal(out, F.linear(x, dense)) and built == []
        return
    for rows in (1, 5):
        check_kernel(checkpoint, kind, rows, 37, 96, with_bias=True)
    built = sorted(path.name for path in (tmp_path / "kernels").glob("*.so"))
    assert len(built) == 1 and built[0].startswith(f"integer_dot-{level}-")
    flags = kernel.c_kernels.target_flags(platform.machine(), level, masked=True)
    assert ("-mavx512vnni" in flags) == (level in ("avx512_bf16", "amx"))


@pytest.mark.parametrize("rows", [1, 3])
def test_activations_are_quantized_as_the_tensor_algebra_does(checkpoint, rows):
    """Codes, scales and sums bit for bit, a block of zeros and ties to even included."""
    _, _, integer_dot, kernel = layers(checkpoint)
    x = inputs(rows, 128)
    x[-1, 32:64] = torch.arange(32) - 15.5  # amax 16.5: codes at x * 127 / 16.5
    x[-1, 64:96] = torch.tensor([127.0, 0.5, -0.5, 1.5, 2.5, -2.5] + [0.0] * 26)  # d = 1: ties
    expected = integer_dot.quantize_q8_1(x)
    got = kernel.quantize_q8_1(x, kernel.kernel())
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert expected[0][-1, 65:70].tolist() == [0, 0, 2, 2, -2]  # round half to even


@pytest.mark.parametrize("kind", FORMATS)
def test_8_bit_activations_stay_within_their_bound_of_the_exact_product(checkpoint, kind):
    """|integer products - x @ w.T| <= sum over blocks of d / 2 * sum |w| (plus fp32's rounding); on random
    normal inputs the error is far below it: under 1% of the outputs' scale."""
    _, _, integer_dot, _ = layers(checkpoint)
    weight = quantized_weight(checkpoint, kind, 64, 576)
    layout = dot_weight(checkpoint, weight)
    x = inputs(4, 576)
    exact = x @ weight.dequantize().T
    approximate = integer_dot.reference_linear(x, *layout, None)
    bound = integer_dot.activation_error_bound(x, *layout)
    error = (approximate - exact).abs()
    assert (error <= bound + rounding_bound(integer_dot, x, *layout, None) + 1e-6).all()
    assert error.max() < 0.01 * exact.abs().max()


@pytest.mark.parametrize("in_features", [16, 48, 100])
def test_inputs_not_in_blocks_of_32_are_refused(checkpoint, in_features):
    _, _, integer_dot, kernel = layers(checkpoint)
    message = f"blocks of 32; got {in_features} inputs"
    codes = torch.zeros(4, in_features, dtype=torch.int8)
    with pytest.raises(ValueError, match=message):
        integer_dot.dot_weight(codes, torch.ones(4, 1), None, 0, 8, in_features)
    with pytest.raises(ValueError, match=message):
        kernel.quantize_q8_1(torch.zeros(1, in_features), kernel.kernel())
    with pytest.raises(ValueError, match=message):
        integer_dot.quantize_q8_1(torch.zeros(1, in_features))


def test_the_layout_packs_codes_j_and_j_plus_16_in_a_byte(checkpoint):
    _, _, integer_dot, _ = layers(checkpoint)
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = integer_dot.pack_q4_blocks(codes)
    assert packed.shape == (3, 32) and packed[1, 17].item() == codes[1, 33].item() | codes[1, 49].item() << 4
    assert torch.equal(integer_dot.unpack_q4_blocks(packed), codes)
