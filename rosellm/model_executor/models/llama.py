"""A Llama-family decoder written from scratch: RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP, tied or untied LM head.

Module and parameter names mirror Hugging Face's `LlamaForCausalLM`, except two fused projections: Q, K
and V are one `qkv_proj` and gate and up one `gate_up_proj` (one GEMM each instead of three and two); the
loaders concatenate the Hugging Face weights (`fuse_projections`, below).

`compile_step()` hands the whole forward of `LlamaModel` (embedding, every layer, final norm) to
`torch.compile` as one graph: attention, which reads the KV pool through block tables, is a custom operator
in it (`attention/layer.py`) that runs its backend's Python outside the compiled code; a step whose every
row decodes one token attends inside the graph instead (`Attention.attend_decoding_rows`).

With tensor parallelism each process holds one rank's slice (fewer heads, a narrower MLP: its config says
how many) and the two row-parallel projections, `o_proj` and `down_proj`, are followed by an all-reduce.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...attention import layer as attention_layer
from ...attention.kv_pool import KVPool
from ...attention.metadata import AttentionMetadata
from ...attention.selector import REFERENCE_BACKEND
from ...config.model import ModelConfig
from ...distributed.tensor_parallel import all_reduce


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """theta^(-2i/d) for i in [0, d/2), with the Llama 3 frequency scaling when the config asks."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / config.rope_theta**exponents  # [head_dim / 2], fp32 like the reference
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, llama3)")
    # Llama 3: long wavelengths (low frequencies) are slowed down by `factor`, short ones are kept,
    # and the band in between is interpolated smoothly.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = ((old_context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class RotaryEmbedding(nn.Module):
    """cos and sin of every position's angles, computed once into tables and looked up per step (SmolLM2:
    8192 positions x 64 x 2 tables x 4 bytes = 4 MiB). Computed in the step instead, the compiled step
    fuses them into whatever reads the rotated query, attention included, and evaluates cos and sin again for
    every key it scores."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        positions = torch.arange(config.max_position_embeddings, dtype=torch.int64, device="cpu")
        angles = positions[:, None].float() * rope_inverse_frequencies(config)
        angles = torch.cat([angles, angles], dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos_table", angles.cos(), persistent=False)
        self.register_buffer("sin_table", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [num_tokens] -> cos, sin: [num_tokens, head_dim]
        return self.cos_table[positions], self.sin_table[positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, head_dim]
    cos, sin = cos[:, None], sin[:, None]
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention: `num_attention_heads` query heads share `num_key_value_heads` KV heads."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index  # which layer of the KV cache is ours
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)  # rows: Q, then K, then V
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.backend = REFERENCE_BACKEND  # whose store_kv and paged_attention run (attention/selector.py)
        attention_layer.register_backend(self.backend)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] -> q [num_tokens, heads, head_dim], k and v [num_tokens, kv_heads, head_dim],
        q and k rotated."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        kv_pool: KVPool,
        decoding: bool,
    ) -> torch.Tensor:
        """Store the new keys and values in this layer's caches, attend over them: -> [num_tokens, heads,
        head_dim]. One custom operator, run by the backend named in it (inside
        `attention_layer.forward_context(metadata)`). A step whose every row decodes one token (`decoding`),
        traced by torch.compile for a backend that offers a `graph_decode`, is attended inside the graph
        instead (`attend_decoding_rows`) when it has at most the backend's `graph_decode_rows` rows (the compiled
        step then holds a graph for each side of that bound)."""
        in_graph = decoding and self.backend.graph_decode is not None and q.shape[0] <= self.backend.graph_decode_rows
        if torch.compiler.is_compiling() and in_graph:
            return self.attend_decoding_rows(q, k, v, metadata, kv_pool)
        return attention_layer.attention(
            q,
            k,
            v,
            kv_pool.keys,
            kv_pool.values,
            self.layer_index,
            metadata.slot_mapping,
            metadata.query_start_loc,
            metadata.query_lens,
            metadata.seq_lens,
            metadata.block_tables,
            self.backend.name,
        )

    def attend_decoding_rows(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata, kv_pool: KVPool
    ) -> torch.Tensor:
        """A step of sequences that each decode one token, written as tensor algebra that the compiled step
        takes whole: no operator call, no Python per layer. Stores each token's key and value at its slot
        (slot -1, warm-up's "nowhere": the slot keeps what it held), then each query attends to its sequence.
        q [rows, heads, head_dim], k and v [rows, kv_heads, head_dim] -> [rows, heads, head_dim]."""
        block_size = kv_pool.keys.shape[2]
        for per_row in (metadata.block_tables, metadata.seq_lens):  # their batch stands for any size: it is q's
            torch._check(per_row.shape[0] == q.shape[0])
        slot = metadata.slot_mapping.clamp(min=0)  # [rows]
        index = (torch.full_like(slot, self.layer_index), slot // block_size, slot % block_size)
        store = (metadata.slot_mapping >= 0)[:, None, None]
        for pool, new in ((kv_pool.keys, k), (kv_pool.values, v)):
            pool.index_put_(index, torch.where(store, new, pool[index]))
        key_cache, value_cache = kv_pool.layer(self.layer_index)
        tables = metadata.block_tables.clamp(min=0).long()  # a block past the sequence's end is masked
        return self.backend.graph_decode(q, key_cache, value_cache, tables, metadata.seq_lens)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=bias)  # rows: gate, then up
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [num_tokens, inner] each
        return all_reduce(self.down_proj(F.silu(gate) * up))  # with tensor parallelism: the ranks' partial sums


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
        kv_pool: KVPool,
        decoding: bool,
    ) -> torch.Tensor:
        """The residual stream x [num_tokens, hidden] -> the next x; the new keys and values go into this
        layer's part of the pool. `decoding`: every row of the step decodes one token."""
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin)
        attended = self.self_attn.attend(q, k, v, metadata, kv_pool, decoding)
        x = x + all_reduce(self.self_attn.o_proj(attended.flatten(1)))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # Weights are always loaded, never trained: skip the random init (`_weight`).
        shape = (config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self, input_ids: torch.Tensor, metadata: AttentionMetadata, kv_pool: KVPool, decoding: bool
    ) -> torch.Tensor:
        # input_ids: [num_tokens] (every sequence's new tokens, end to end) -> [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(metadata.positions)
        for layer in self.layers:
            x = layer(x, cos, sin, metadata, kv_pool, decoding)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.dtype = torch.float32  # the compute dtype (activations, KV cache); the loader sets it
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.compiled = False  # compile_step() sets it

    def forward(self, input_ids: torch.Tensor, metadata: AttentionMetadata, kv_pool: KVPool) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the new tokens. Their keys and values are stored in
        `kv_pool` at `metadata.slot_mapping`, and each attends to its sequence's cached tokens, read
        through `metadata.block_tables`."""
        if self.compiled:
            mark_dynamic_sizes(input_ids, metadata, kv_pool)
        decoding = metadata.max_query_len == 1  # a flag torch.compile guards on: a graph for each value
        with attention_layer.forward_context(metadata):
            return self.model(input_ids, metadata, kv_pool, decoding)

    def compile_step(self) -> None:
        """Compile `LlamaModel.forward` as one graph (its sizes that vary from step to step are symbolic,
        see `mark_dynamic_sizes`). Before each call torch.compile checks that its inputs still are what the
        graph was traced for: a guard per weight, hundreds here (a quantized layer holds six tensors), about
        a millisecond a step. Checked by dict tags, a module whose attributes were not reassigned since is
        passed as one check. And the compiled code leaves out its checks of each kernel's inputs' and output's
        sizes and strides (550 a step at batch 1, 0.2 ms): a compiler's own consistency checks, not the
        model's. Both settings are process-wide, like every `torch._dynamo` and `torch._inductor` setting."""
        torch._dynamo.config.use_recursive_dict_tags_for_guards = True
        torch._dynamo.config.max_saved_pointers_for_recursive_dict_tags_check = 4096
        torch._inductor.config.size_asserts = False
        self.model.compile(dynamic=False)
        self.compiled = True

    def set_attention_backend(self, backend) -> None:
        attention_layer.register_backend(backend)
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., vocab_size] in fp32."""
        return self.lm_head(hidden).float()


def mark_dynamic_sizes(input_ids: torch.Tensor, metadata: AttentionMetadata, kv_pool: KVPool) -> None:
    """The sizes a compiled forward must not be specialized on. The token count is symbolic, but
    torch.compile specializes a count of 1; with the `decoding` flag that makes three graphs: one decoding
    sequence, several (one token each, attended inside the graph), and any step with a prompt in it. The
    batch, the table width and the pool's blocks are unbacked symbols, which stand for any size, 1 included:
    one sequence or many share a graph."""
    for tensor in (input_ids, metadata.positions, metadata.slot_mapping):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    for tensor, dims in (
        (metadata.query_start_loc, (0,)),
        (metadata.query_lens, (0,)),
        (metadata.seq_lens, (0,)),
        (metadata.block_tables, (0, 1)),
        (kv_pool.keys, (1,)),
        (kv_pool.values, (1,)),
    ):
        for dim in dims:
            torch._dynamo.decorators.mark_unbacked(tensor, dim)


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
