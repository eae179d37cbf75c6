"""The "cpu" attention backend: no row copies keys and values out of the pool when it need not.

Chapter 07's "torch" backend copies every group's blocks out of the pool before SDPA reads them: for a
decode step that is the whole KV cache written once more and read twice, and SDPA's CPU kernel is slow
for one query per sequence. Here:
- a group of decode rows is one function of the pool and the block tables, written as plain tensor algebra
  (a gather, a product summed over head_dim, a softmax, a weighted sum over keys); torch.compile (Inductor)
  turns it into loops that load each key and value from its block where it lies;
- a prompt with nothing cached before this step attends to its own new keys and values, which `store_kv`
  has just been given: causal SDPA on them, nothing read from the pool;
- a prompt chunk after a cached or computed beginning keeps the grouped SDPA.
"""

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata
from .grouped_attention import GroupedAttentionBackend, GroupPlan, padding_groups


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """One new token per sequence attends to all of its sequence's keys.

    query:                  [batch, heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, kv_heads, head_dim]
    block_tables:           [batch, blocks] (no -1: a slot past a sequence's end is masked, not read as -1)
    seq_lens:               [batch]
    -> [batch, heads, head_dim]
    """
    batch, heads, head_dim = query.shape
    blocks, (block_size, kv_heads) = block_tables.shape[1], key_cache.shape[1:3]
    group = heads // kv_heads  # query head h reads KV head h // group
    keys = key_cache[block_tables]  # [batch, blocks, block_size, kv_heads, head_dim]: compiled, loads, not a copy
    values = value_cache[block_tables]
    grouped = query.view(batch, 1, 1, kv_heads, group, head_dim)
    scores = (keys[..., None, :] * grouped).sum(-1) * head_dim**-0.5  # [batch, blocks, block_size, kv_heads, group]
    scores = scores.flatten(1, 2)  # [batch, keys, kv_heads, group]
    visible = torch.arange(blocks * block_size, device=query.device)[None, :] < seq_lens[:, None]  # [batch, keys]
    weights = scores.masked_fill(~visible[:, :, None, None], float("-inf")).softmax(dim=1)
    weights = weights.view(batch, blocks, block_size, kv_heads, group, 1)
    out = (weights * values[..., None, :]).sum((1, 2))  # [batch, kv_heads, group, head_dim]
    return out.reshape(batch, heads, head_dim)


@functools.cache
def _compiled() -> Callable:
    """Compiled on first use (importing torch.compile's machinery costs seconds, and imports Triton)."""
    return torch.compile(decode_attention, dynamic=False)


def compiled_decode_attention(query, key_cache, value_cache, block_tables, seq_lens) -> torch.Tensor:
    """`decode_attention` compiled for every batch, table width and pool size, but for one model's heads,
    head_dim and block size: Inductor's loops are much tighter when those are constants."""
    for tensor, dims in (
        (query, (0,)),
        (key_cache, (0,)),
        (value_cache, (0,)),
        (block_tables, (0, 1)),
        (seq_lens, (0,)),
    ):
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return _compiled()(query, key_cache, value_cache, block_tables, seq_lens)


class CpuAttentionBackend(GroupedAttentionBackend):
    """The "cpu" backend: decode groups read the pool in place, fresh prompts their own new keys."""

    name = "cpu"

    def begin_forward(self, metadata: AttentionMetadata, block_size: int) -> None:
        """Fresh prompts (every token new this step) apart; the other rows grouped as chapter 07 groups them."""
        starts = metadata.query_start_loc.tolist()
        query_lens, seq_lens = [b - a for a, b in zip(starts, starts[1:])], metadata.seq_lens.tolist()
        fresh = {b for b, (q, n) in enumerate(zip(query_lens, seq_lens)) if q == n and q > 1}
        self.fresh_prompts = [(starts[b], starts[b + 1]) for b in sorted(fresh)]
        rest = [b for b in range(len(query_lens)) if b not in fresh]
        groups = padding_groups([query_lens[b] for b in rest], [seq_lens[b] for b in rest])
        self.plan = [GroupPlan([rest[i] for i in group], metadata, block_size) for group in groups]
        self.metadata = metadata

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        """Store them, and keep this layer's new keys and values [num_tokens, kv_heads, head_dim] for the
        fresh prompts of `paged_attention`."""
        super().store_kv(key, value, key_cache, value_cache, slot_mapping)
        self.new_keys, self.new_values = key, value

    def paged_attention(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        out = super().paged_attention(query, key_cache, value_cache, metadata)  # the groups (fresh rows in none)
        for start, end in self.fresh_prompts:
            out[start:end] = F.scaled_dot_product_attention(  # 4-D: SDPA's CPU kernel is several times slower on 3-D
                query[None, start:end].transpose(1, 2),  # [1, heads, tokens, head_dim]
                self.new_keys[None, start:end].transpose(1, 2),  # [1, kv_heads, tokens, head_dim]
                self.new_values[None, start:end].transpose(1, 2),
                is_causal=True,
                enable_gqa=True,
            )[0].transpose(0, 1)
        return out

    def _attend(
        self,
        group: GroupPlan,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        if group.max_query_len > 1:
            super()._attend(group, query, key_cache, value_cache, out)
            return
        out[group.tokens] = compiled_decode_attention(
            query[group.tokens], key_cache, value_cache, group.block_tables, group.seq_lens
        )
