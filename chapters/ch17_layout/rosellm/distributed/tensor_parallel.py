"""Tensor parallelism (Megatron-LM's split): each of N ranks holds a slice of every layer.

In each decoder layer, two matrices are split by their output rows (column-parallel) and two by their input
columns (row-parallel), so that a rank never needs another rank's slice until the end of a block:

    qkv_proj      column-parallel: rank r keeps its query heads and its KV heads (so its part of the KV pool)
    o_proj        row-parallel:    its input columns are those heads; partial sums, one all-reduce
    gate_up_proj  column-parallel: rank r keeps intermediate rows [r*I/N, (r+1)*I/N) of gate and of up
    down_proj     row-parallel:    its input columns are those rows; partial sums, one all-reduce

Norms, the embedding and the LM head are replicated: every rank needs the whole residual stream anyway,
and rank 0, which samples, then has whole logits without a gather (the head's cost per rank is in
`RankShapes.weight_bytes`; vLLM splits it by vocabulary instead, and gathers the logits).

A rank is the same model with fewer heads and a narrower MLP: `rank_config` says how many, and
`shard_weights` cuts the Hugging Face tensors to match before they are loaded. The model calls
`all_reduce` after its two row-parallel projections; with one rank it returns its input.
"""

import dataclasses
import time

import torch
import torch.distributed as dist

from ..config.model import ModelConfig


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise ValueError unless `size` ranks can split this model: whole query heads and intermediate rows
    per rank, and KV heads either split (kv_heads % size == 0) or replicated (size % kv_heads == 0)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    heads, kv_heads, inner = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if heads % size:
        raise ValueError(
            f"tensor_parallel_size={size} must divide num_attention_heads={heads} (each rank keeps whole heads)"
        )
    if inner % size:
        raise ValueError(f"tensor_parallel_size={size} must divide intermediate_size={inner} (the MLP's rows)")
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size} must divide num_key_value_heads={kv_heads} (KV heads split) "
            "or be a multiple of it (KV heads replicated)"
        )


def kv_heads_of_rank(config: ModelConfig, rank: int, size: int) -> range:
    """The KV heads rank `rank` keeps: its share when they split, else the one its query heads read."""
    kv_heads = config.num_key_value_heads
    if kv_heads % size == 0:
        share = kv_heads // size
        return range(rank * share, (rank + 1) * share)
    replicas = size // kv_heads  # ranks that hold the same KV head
    return range(rank // replicas, rank // replicas + 1)


def rank_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's model: heads and intermediate size divided by `size`."""
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=len(kv_heads_of_rank(config, 0, size)),
        intermediate_size=config.intermediate_size // size,
    )


def shard_weights(state: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int) -> dict:
    """Hugging Face tensors of the whole model -> those of rank `rank` (names unchanged, before fusing)."""
    d, inner = config.head_dim, config.intermediate_size // size
    heads = config.num_attention_heads // size
    kv = kv_heads_of_rank(config, rank, size)
    rows = {  # column-parallel: which output rows a rank keeps
        "q_proj": slice(rank * heads * d, (rank + 1) * heads * d),
        "k_proj": slice(kv.start * d, kv.stop * d),
        "v_proj": slice(kv.start * d, kv.stop * d),
        "gate_proj": slice(rank * inner, (rank + 1) * inner),
        "up_proj": slice(rank * inner, (rank + 1) * inner),
    }
    columns = {"o_proj": rows["q_proj"], "down_proj": rows["gate_proj"]}  # row-parallel: which input columns
    sharded = {}
    for name, tensor in state.items():
        module, kind = name.rsplit(".", 2)[-2:]  # e.g. ("q_proj", "weight")
        if module in rows:
            tensor = tensor[rows[module]]
        elif module in columns and kind == "weight":
            tensor = tensor[:, columns[module]]
        elif module in columns and rank > 0:  # a row-parallel bias is added once, by rank 0
            tensor = torch.zeros_like(tensor)
        sharded[name] = tensor.contiguous()
    return sharded


@dataclasses.dataclass(frozen=True)
class RankShapes:
    """What one rank holds and sends, computed from the config alone (tests check it against the real
    ranks; the chapter's tables model large models with it)."""

    qkv_proj: tuple[int, int]  # [out, in] of one layer's slice
    o_proj: tuple[int, int]
    gate_up_proj: tuple[int, int]
    down_proj: tuple[int, int]
    kv_heads: int
    weight_bytes: int  # every weight of one rank, replicated ones included (biases aside)
    kv_bytes_per_token: int  # keys and values of one token, all layers, in one rank's pool
    all_reduce_bytes_per_token: int  # what each rank contributes to the all-reduces, per token of a step

    @classmethod
    def of(cls, config: ModelConfig, size: int, itemsize: int) -> "RankShapes":
        part = rank_config(config, size)
        hidden, d, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
        q, kv = part.num_attention_heads * d, part.num_key_value_heads * d
        shapes = {
            "qkv_proj": (q + 2 * kv, hidden),
            "o_proj": (hidden, q),
            "gate_up_proj": (2 * part.intermediate_size, hidden),
            "down_proj": (hidden, part.intermediate_size),
        }
        per_layer = sum(rows * cols for rows, cols in shapes.values()) + 2 * hidden  # and two norms
        head = 0 if config.tie_word_embeddings else config.vocab_size * hidden
        params = layers * per_layer + config.vocab_size * hidden + head + hidden  # + embedding, head, norm
        return cls(
            **shapes,
            kv_heads=part.num_key_value_heads,
            weight_bytes=params * itemsize,
            kv_bytes_per_token=2 * layers * kv * itemsize,
            all_reduce_bytes_per_token=0 if size == 1 else 2 * layers * hidden * itemsize,
        )


@dataclasses.dataclass
class CommStats:
    """All-reduces this process took part in: how many, how many bytes of its own, how long they took."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


comm_stats = CommStats()
_world_size = 1  # ranks in this process's tensor-parallel group (set by `set_world_size`)


def set_world_size(size: int) -> None:
    global _world_size
    _world_size = size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks (every rank gets it); `x` itself with one rank."""
    return x if _world_size == 1 else summed_over_ranks(x)


# A custom operator, so that torch.compile calls it as an opaque kernel (one per copy of the package).
@torch.library.custom_op(f"{__package__.replace('.', '_')}::all_reduce", mutates_args=())
def summed_over_ranks(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    start = time.perf_counter()
    dist.all_reduce(out)
    comm_stats.seconds += time.perf_counter() - start
    comm_stats.calls += 1
    comm_stats.bytes += out.numel() * out.element_size()
    return out


@summed_over_ranks.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
