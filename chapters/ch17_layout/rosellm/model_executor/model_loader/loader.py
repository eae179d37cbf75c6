"""Where weights come from: a GGUF file (dequantized once, then cached as a Hugging Face folder) or a
Hugging Face folder (`config.json` + `*.safetensors` + tokenizer files)."""

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ...config.model import ModelConfig
from ...distributed import tensor_parallel
from ...envs import cache_dir
from ..models.llama import LlamaForCausalLM, fuse_projections
from .gguf import hf_tensor_name, read_gguf_config, undo_rope_permutation
from .quantization import compute_dtype, load_gguf_model, quantize_projections
from .weight_utils import model_source

logger = logging.getLogger(__name__)


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
    the slice of tensor-parallel rank `rank` (distributed/tensor_parallel.py), whose config counts the rank's heads.
    `quantization` and `dtype`: see quantization.py (None: fp32 on CPU, bf16 on CUDA). The model's
    `dtype` is its compute dtype. Logs (INFO) what it loads, then the seconds it took."""
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
