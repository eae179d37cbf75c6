"""GGUF files: the header read as a Hugging Face config and its tensor names as Hugging Face's, and the
block formats read as they are: each tensor of a `gguf.GGUFReader` as torch tensors, quantized ones as
codes, scales and minimums (`QuantizedWeight`), without going through fp32.

A block covers 32 consecutive weights of a row, stored as (little-endian) bytes:

    Q4_0  fp16 scale d, 16 bytes of 4-bit codes      w = (q - 8) * d
    Q4_1  fp16 scale d, fp16 minimum m, 16 bytes     w = q * d + m
    Q8_0  fp16 scale d, 32 int8 codes                w = q * d

In Q4_0 and Q4_1, byte j holds code j in its low nibble and code j + 16 in its high nibble.
F32, F16 and BF16 tensors come back dense, in their own dtype.

gguf's reader parses a file's whole header when it opens it, the vocabulary and the merges one string at a
time: seconds for a real model. `open_gguf` parses each file once per process, for the engine's checks, its
shape and its tensors alike.
"""

import functools
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.gguf_reader import ReaderTensor

from ..layers.quantized_linear import GROUP, QuantizedWeight

DENSE_TYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
BLOCK_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
SUPPORTED_TYPES = (*DENSE_TYPES, *BLOCK_TYPES)


def open_gguf(path) -> GGUFReader:
    """The reader of a GGUF file, parsed at its first use in this process (again if the file changes)."""
    stat = Path(path).stat()
    return parsed_gguf(Path(path).resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def parsed_gguf(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    return GGUFReader(path)  # memory-mapped: the tensors' bytes are read when they are used


def check_supported_types(reader: GGUFReader) -> None:
    """ValueError naming the first tensor whose type this chapter cannot run (the header alone is read)."""
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(t.name for t in SUPPORTED_TYPES)
            raise ValueError(f"GGUF tensor {tensor.name} is {tensor.tensor_type.name}; supported types: {supported}")


def read_tensor(tensor: ReaderTensor) -> torch.Tensor | QuantizedWeight:
    """One tensor of the file: dense (its own dtype, shape as PyTorch lists it: [out, in] for a matrix) or
    a `QuantizedWeight` [rows, cols]."""
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest first
    data = np.ascontiguousarray(tensor.data)
    kind = tensor.tensor_type
    if kind in DENSE_TYPES:
        dtype = DENSE_TYPES[kind]
        raw = torch.from_numpy(data.view(np.uint8).copy())
        return raw.view(dtype).reshape(shape)
    if kind not in BLOCK_TYPES:
        raise ValueError(f"GGUF tensor {tensor.name}: type {kind.name} is not supported")
    rows, cols = shape
    blocks = torch.from_numpy(data.view(np.uint8).copy()).reshape(rows, cols // GROUP, -1)  # [rows, groups, bytes]
    scales = fp16_field(blocks, 0)  # [rows, groups]
    if kind == GGMLQuantizationType.Q8_0:
        codes = blocks[..., 2:].view(torch.int8).reshape(rows, cols)
        return QuantizedWeight(codes, scales, None, offset=0, bits=8, group=GROUP)
    minimums = fp16_field(blocks, 2) if kind == GGMLQuantizationType.Q4_1 else None
    nibbles = blocks[..., -GROUP // 2 :]  # [rows, groups, 16]
    codes = torch.empty(rows, cols // GROUP, GROUP, dtype=torch.uint8)  # codes j, then j + 16
    torch.bitwise_and(nibbles, 15, out=codes[..., : GROUP // 2])
    torch.bitwise_right_shift(nibbles, 4, out=codes[..., GROUP // 2 :])
    codes = codes.reshape(rows, cols)
    offset = 8 if kind == GGMLQuantizationType.Q4_0 else 0
    return QuantizedWeight(codes, scales, minimums, offset=offset, bits=4, group=GROUP)


def fp16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 number at byte `start` of every block [rows, groups, bytes] -> [rows, groups] fp32."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


# --- the header: names and config ---------------------------------------------------------------------

GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, kind = gguf_name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{GGUF_LAYER_NAMES[part]}.{kind}"
    return f"{GGUF_GLOBAL_NAMES[stem]}.{kind}"


def undo_rope_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows from [2, head_dim/2] (the Hugging Face
    rotate-half layout) to [head_dim/2, 2] (interleaved pairs). Put them back."""
    rows, cols = weight.shape  # [num_heads * head_dim, hidden]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def gguf_config(fields: dict, has_output_weight: bool, num_tokens: int) -> dict:
    arch = fields["general.architecture"]
    if arch != "llama":
        raise ValueError(f"only Llama-architecture GGUF files are supported, this one is {arch!r}")
    heads = fields["llama.attention.head_count"]
    hidden = fields["llama.embedding_length"]
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": fields.get("llama.vocab_size", num_tokens),
        "hidden_size": hidden,
        "intermediate_size": fields["llama.feed_forward_length"],
        "num_hidden_layers": fields["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": fields.get("llama.attention.head_count_kv", heads),
        "head_dim": fields.get("llama.rope.dimension_count", hidden // heads),
        "rms_norm_eps": fields["llama.attention.layer_norm_rms_epsilon"],
        "rope_theta": fields.get("llama.rope.freq_base", 10000.0),
        "max_position_embeddings": fields["llama.context_length"],
        "tie_word_embeddings": not has_output_weight,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
    }


def read_gguf_config(reader) -> dict:
    """The model's Hugging Face config from a GGUF file's header (a `gguf.GGUFReader`)."""
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if key in reader.fields:
            fields[key] = reader.fields[key].contents()
    names = {t.name for t in reader.tensors}
    return gguf_config(fields, "output.weight" in names, len(reader.fields["tokenizer.ggml.tokens"].data))
