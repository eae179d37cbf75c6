"""Weights in fewer bytes: the options, checked before any weight is read, and the model's quantized layers.

quantization (vLLM's option names):
    None     fp32 weights (the default: the oracle's numbers)
    "gguf"   a .gguf file's own tensors as they are: Q4_0 / Q4_1 as `Int4Linear`, Q8_0 as `Int8Linear` (a Q8_0
             token embedding as a `QuantizedEmbedding` sharing its codes with the tied LM head), F32 / F16 /
             BF16 dense in the compute dtype
    "int8"   every projection and the LM head quantized at load: int8, one symmetric scale per output row
    "int4"   the same in 4 bits: groups of 32 weights with a scale and a minimum (as GGUF's Q4_1)
With "int8" and "int4" the token embedding keeps its dense table: a lookup reads one row per token.

dtype, the compute dtype (activations, KV cache, dense weights): "float32", "bfloat16", or "auto" (None):
bfloat16 on CUDA; on CPU float32, or bfloat16 with quantization where the CPU has native bf16
(`cpu_features.cpu_has_bf16`), the only place the packed 4- and 8-bit kernels beat dense ones. "bfloat16"
runs on every CPU (PyTorch emulates it where the CPU has no bf16 instructions, more slowly than fp32: a
warning says so, once) and halves the memory of the weights and the KV cache on each.
"""

from pathlib import Path

import torch
from torch import nn

from ...config.engine import check_quantization
from ...config.model import ModelConfig
from ...platforms import cpu_features
from ..layers.quantized_linear import GROUP, Int8Linear, QuantizedEmbedding, QuantizedWeight, quantized_linear
from ..models.llama import LlamaForCausalLM, fuse_projections
from .gguf import hf_tensor_name, read_gguf_config, undo_rope_permutation
from .weight_utils import model_source

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def compute_dtype(dtype, quantization: str | None, device) -> torch.dtype:
    """The dtype activations, the KV cache and dense weights run in (see the module docstring)."""
    on_cuda = torch.device(device).type == "cuda"
    if dtype is None or dtype == "auto":
        if on_cuda or (quantization is not None and cpu_features.cpu_has_bf16()):
            return torch.bfloat16
        return torch.float32
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
        dtype = DTYPES[dtype]
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)} or a torch.dtype; got {dtype!r}")
    if dtype == torch.bfloat16 and not on_cuda and not cpu_features.cpu_has_bf16():
        cpu_features.warn_once(
            "dtype bfloat16 on a CPU without native bf16 (AVX-512 BF16 or AMX): PyTorch emulates it, and float32 "
            "may be faster here; bf16 still halves the memory of the weights and the KV cache"
        )
    return dtype


def check_options(model, device, dtype, quantization: str | None) -> torch.dtype:
    """Every option that cannot work raises ValueError here, before a weight is read. Returns the compute
    dtype."""
    check_quantization(quantization)
    cpu_features.level()  # ROSELLM_CPU_FEATURES, if set, names a level
    dtype = compute_dtype(dtype, quantization, device)
    if quantization is None:
        return dtype
    source = model_source(model)
    if quantization == "gguf":
        if source.suffix != ".gguf":
            raise ValueError(f'quantization "gguf" runs a .gguf file as it is; {source} is a Hugging Face folder')
        from .gguf import check_supported_types, open_gguf

        check_supported_types(open_gguf(source))  # memory-mapped: only the header is read
    if quantization == "int4":
        check_int4_shapes(read_config(source))
    return dtype


def read_config(source: Path) -> ModelConfig:
    """The model's shape from a Hugging Face folder's config.json or a GGUF file's header."""
    if source.is_file():
        from .gguf import open_gguf

        return ModelConfig.from_dict(read_gguf_config(open_gguf(source)))
    return ModelConfig.from_json(source / "config.json")


def check_int4_shapes(config: ModelConfig) -> None:
    """int4's groups of 32 must tile every projection's input."""
    inputs = {
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads * head_dim": config.num_attention_heads * config.head_dim,
    }
    for name, size in inputs.items():
        if size % GROUP:
            raise ValueError(f"int4 quantizes groups of {GROUP} inputs; this model's {name} is {size}")


# --- int8 and int4 at load ----------------------------------------------------------------------------


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """[out, in] -> int8 codes with one symmetric scale per row: scale = max |w| / 127."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1, keepdim=True) / 127  # [out, 1]
    codes = torch.where(scales > 0, weight / scales, 0.0).round().clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(codes, scales, None, offset=0, bits=8, group=weight.shape[1])


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """[out, in] -> codes 0..15 per group of 32 inputs, scale = (max - min) / 15 and the minimum (Q4_1's
    formula, scales kept in fp32): each weight comes back within half a step."""
    rows, cols = weight.shape
    groups = weight.float().reshape(rows, cols // GROUP, GROUP)
    minimums = groups.amin(dim=-1)  # [out, groups]
    scales = (groups.amax(dim=-1) - minimums) / 15
    steps = (groups - minimums[..., None]) / scales[..., None]
    codes = torch.where(scales[..., None] > 0, steps, 0.0).round().clamp(0, 15).to(torch.uint8)
    return QuantizedWeight(codes.reshape(rows, cols), scales, minimums, offset=0, bits=4, group=GROUP)


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4}


def quantize_projections(net: LlamaForCausalLM, quantization: str, dtype: torch.dtype) -> None:
    """Every projection and the LM head of an fp32 or bf16 model -> `Int8Linear` or `Int4Linear` (their
    dense copies in `dtype`); then every remaining parameter (norms, embedding) to `dtype`."""
    quantize = QUANTIZERS[quantization]
    for name, module in list(net.named_modules()):
        if type(module) is nn.Linear:
            set_module(net, name, quantized_linear(quantize(module.weight.detach()), module.bias, dtype))
    for param in net.parameters():
        param.data = param.data.to(dtype)


def set_module(net: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(net.get_submodule(parent), child, module)


# --- a GGUF file's own tensors ------------------------------------------------------------------------


def load_gguf_model(path: Path, dtype: torch.dtype) -> LlamaForCausalLM:
    """The model of a GGUF file with its quantized tensors as they are (on CPU, in eval mode)."""
    from .gguf import check_supported_types, open_gguf, read_tensor

    reader = open_gguf(path)
    check_supported_types(reader)
    config = ModelConfig.from_dict(read_gguf_config(reader))
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    state = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        weight = read_tensor(tensor)
        for proj, num_heads in heads.items():
            if name.endswith(f"{proj}.weight"):
                weight = permute_rows(weight, lambda t, n=num_heads: undo_rope_permutation(t, n))
        state[name] = weight
    state = fuse_projections(state, concatenate)
    with torch.device("meta"):
        net = LlamaForCausalLM(config)
    quantized = {name: w for name, w in state.items() if isinstance(w, QuantizedWeight)}
    dense = {name: t.to(dtype) for name, t in state.items() if name not in quantized}
    biases = {name: dense.pop(name.replace(".weight", ".bias"), None) for name in quantized}
    net.load_state_dict(dense, strict=False, assign=True)
    if config.tie_word_embeddings and "model.embed_tokens.weight" not in quantized:
        net.lm_head.weight = net.model.embed_tokens.weight
    for name, weight in quantized.items():
        install_quantized(net, name.removesuffix(".weight"), weight, biases[name], dtype)
    missing = [n for n, p in [*net.named_parameters(), *net.named_buffers()] if p.is_meta]
    if missing:
        raise ValueError(f"{path}: weights missing for {missing[:5]}")
    return net


def install_quantized(net: LlamaForCausalLM, name: str, weight: QuantizedWeight, bias, dtype: torch.dtype) -> None:
    """Put the layer for `weight` at `name`. A Q8_0 token embedding becomes a `QuantizedEmbedding` (and,
    tied, the LM head on the same codes); one in another format is dequantized into a dense table."""
    if name != "model.embed_tokens":
        set_module(net, name, quantized_linear(weight, bias, dtype))
        return
    head = quantized_linear(weight, None, dtype)
    if isinstance(head, Int8Linear):
        net.model.embed_tokens = QuantizedEmbedding(head, dtype)
    else:
        net.model.embed_tokens = nn.Embedding.from_pretrained(weight.dequantize().to(dtype))
    if net.config.tie_word_embeddings:
        net.lm_head = head


def permute_rows(weight, fn):
    return weight.map_rows(fn) if isinstance(weight, QuantizedWeight) else fn(weight)


def concatenate(parts: list) -> torch.Tensor | QuantizedWeight:
    """Fused projections' rows: codes with codes when the parts share a format, else dense fp32."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        try:
            return QuantizedWeight.cat(parts)
        except ValueError:
            pass
    return torch.cat([p.dequantize() if isinstance(p, QuantizedWeight) else p.float() for p in parts])
