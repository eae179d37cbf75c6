"""GGUF's block formats read as codes and scales: the view they stand for equals `gguf.quants.dequantize`
bit for bit, on a tiny file written here and on tensors of the bundled SmolLM2 file."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from chapters import submodule
from tests.ch01_naive_decode.test_loading import count_header_reads

pytestmark = pytest.mark.requires("quantization")


@pytest.fixture
def formats(checkpoint):
    return submodule(checkpoint, "gguf_formats")


TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A GGUF file holding one [48, 96] matrix in every supported type."""
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    writer = GGUFWriter(path, "llama")
    weight = np.random.default_rng(0).standard_normal((48, 96)).astype(np.float32)
    weight[0] = 0.0  # an all-zero row: scale 0
    for name in TYPES:
        kind = GGMLQuantizationType[name]
        writer.add_tensor(name, quantize(weight, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFReader(path)


def expected(tensor) -> torch.Tensor:
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(shape).copy())


def as_fp32(read) -> torch.Tensor:
    return read.float() if isinstance(read, torch.Tensor) else read.dequantize()


@pytest.mark.parametrize("name", TYPES)
def test_every_format_reads_exactly(checkpoint, formats, tiny_gguf, name):
    [tensor] = [t for t in tiny_gguf.tensors if t.name == name]
    read = formats.read_tensor(tensor)
    assert torch.equal(as_fp32(read), expected(tensor))
    if name in ("F16", "BF16"):  # dense tensors keep their own dtype
        assert read.dtype == {"F16": torch.float16, "BF16": torch.bfloat16}[name]
    if name.startswith("Q"):
        assert read.codes.dtype == (torch.int8 if name == "Q8_0" else torch.uint8)
        assert read.scales.shape == (48, 96 // 32)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_layers_keep_the_exact_view(checkpoint, formats, tiny_gguf, name):
    [tensor] = [t for t in tiny_gguf.tensors if t.name == name]
    weight = formats.read_tensor(tensor)
    layer = checkpoint.quantized_linear.quantized_linear(weight, None, torch.float32)
    assert torch.equal(layer.dequantize(), expected(tensor))


def test_rope_permutation_of_rows_commutes_with_dequantizing(checkpoint, formats, tiny_gguf):
    [tensor] = [t for t in tiny_gguf.tensors if t.name == "Q4_1"]
    weight = formats.read_tensor(tensor)
    permute = checkpoint.loader.undo_rope_permutation
    assert torch.equal(weight.map_rows(lambda t: permute(t, 4)).dequantize(), permute(expected(tensor), 4))


def write_tiny_llama(path):
    """A one-layer Llama as a GGUF file: Q4_1 projections, a Q8_0 token embedding (tied to the LM head), F32
    norms; a vocabulary of 32 tokens and no tokenizer."""
    hidden, ffn, heads, kv_heads, vocab = 64, 128, 2, 1, 32
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_context_length(64)
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    kv_rows = kv_heads * hidden // heads
    shapes = {"attn_q": (hidden, hidden), "attn_k": (kv_rows, hidden), "attn_v": (kv_rows, hidden)}
    shapes |= {"attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden)}
    shapes |= {"ffn_down": (hidden, ffn)}
    rng = np.random.default_rng(0)
    tensors = {f"blk.0.{name}.weight": (shape, "Q4_1") for name, shape in shapes.items()}
    tensors |= {"token_embd.weight": ((vocab, hidden), "Q8_0")}
    tensors |= {name: ((hidden,), "F32") for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight")}
    tensors |= {"output_norm.weight": ((hidden,), "F32")}
    for name, (shape, kind) in tensors.items():
        weight = rng.standard_normal(shape).astype(np.float32) * 0.1
        writer.add_tensor(name, quantize(weight, GGMLQuantizationType[kind]), raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_file_is_parsed_once_for_the_checks_and_the_load(checkpoint, tmp_path, monkeypatch):
    """The engine checks a GGUF file's tensor types before it loads them; gguf's reader parses the header
    (seconds for a real vocabulary) once for both."""
    quantization = submodule(checkpoint, "quantization")
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    header_reads = count_header_reads(monkeypatch)
    quantization.check_options(str(path), "cpu", None, "gguf")
    net = quantization.load_gguf_model(path, torch.float32)
    assert len(header_reads) == 1, header_reads
    assert type(net.model.embed_tokens).__name__ == "QuantizedEmbedding"


def test_unsupported_type_is_named(checkpoint, formats, tmp_path):
    path = tmp_path / "q5.gguf"
    writer = GGUFWriter(path, "llama")
    weight = np.ones((4, 32), dtype=np.float32)
    writer.add_tensor(
        "blk.0.attn_q.weight", quantize(weight, GGMLQuantizationType.Q5_0), raw_dtype=GGMLQuantizationType.Q5_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="blk.0.attn_q.weight is Q5_0; supported types: F32, F16, BF16, Q4_0"):
        formats.check_supported_types(GGUFReader(path))


@pytest.mark.model
def test_bundled_file_reads_exactly(checkpoint, formats, smollm2_path):
    reader = GGUFReader(smollm2_path)
    formats.check_supported_types(reader)
    chosen = ["token_embd.weight", "blk.0.attn_q.weight", "blk.3.ffn_down.weight", "output_norm.weight"]
    for tensor in (t for t in reader.tensors if t.name in chosen):
        assert torch.equal(as_fp32(formats.read_tensor(tensor)), expected(tensor)), tensor.name
