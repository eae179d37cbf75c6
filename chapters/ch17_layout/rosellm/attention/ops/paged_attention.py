"""Attention over the paged KV pool, in plain PyTorch: the reference that chapter 06's kernels must equal."""

import torch
import torch.nn.functional as F

from ...utils import blocks_for
from ..metadata import AttentionMetadata


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each new token's key and value into its slot of the pool (slot -1: skip the token).

    key, value:             [num_tokens, num_kv_heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:           [num_tokens]
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep]  # a flat view: slot = block * size + offset
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep]


def table_prefix(block_tables: torch.Tensor, max_seq_len: int, block_size: int) -> torch.Tensor:
    """The columns of the block tables [batch, max_blocks] that hold the first `max_seq_len` tokens, with -1
    read as block 0: [batch, blocks_for(max_seq_len)], int64. What block 0 brings in lies past its
    sequence's end, and the attention mask must hide it."""
    return block_tables[:, : blocks_for(max_seq_len, block_size)].clamp(min=0).long()


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """Each sequence's keys (or values) read through its block table.

    cache: [num_blocks, block_size, kv_heads, head_dim]; block_tables: [batch, max_blocks]
    -> [batch, num_blocks_read * block_size, kv_heads, head_dim]; slots past a sequence's end are junk.
    """
    return cache[table_prefix(block_tables, max_seq_len, cache.shape[1])].flatten(1, 2)


def causal_padding(
    query_lens: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, num_keys: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded layout of the new tokens, [batch, max_query_len] with sequence b's in row b, and what each
    may see.

    query_lens, seq_lens: [batch] -> is_query [batch, max_query_len]: which places hold a new token;
    mask [batch, max_query_len, num_keys]: new token i of sequence b sits at position
    seq_len - query_len + i and sees keys 0..position (causal, and nothing past the sequence's end).
    """
    slot = torch.arange(max_query_len, device=query_lens.device)  # [max_query_len]
    is_query = slot[None, :] < query_lens[:, None]
    positions = (seq_lens - query_lens)[:, None] + slot[None, :]  # [batch, max_query_len]
    key_index = torch.arange(num_keys, device=query_lens.device)
    return is_query, key_index[None, None, :] <= positions[:, :, None]


def paged_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata
) -> torch.Tensor:
    """Causal attention of the new tokens over their sequences' cached keys and values.

    query: [num_tokens, num_heads, head_dim] (the new tokens of every sequence, end to end)
    -> [num_tokens, num_heads, head_dim]. The new tokens' keys must already be stored (store_kv).
    Prefill (many new tokens), decode (one) and a prompt whose beginning is cached all take this path.
    """
    num_heads, head_dim = query.shape[1:]
    batch = metadata.seq_lens.shape[0]
    keys = gather_kv(key_cache, metadata.block_tables, metadata.max_seq_len)  # [batch, keys, kv_heads, head_dim]
    values = gather_kv(value_cache, metadata.block_tables, metadata.max_seq_len)
    is_query, mask = causal_padding(metadata.query_lens, metadata.seq_lens, metadata.max_query_len, keys.shape[1])
    padded = query.new_zeros(batch, metadata.max_query_len, num_heads, head_dim)
    padded[is_query] = query
    group = num_heads // keys.shape[2]
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),  # [batch, heads, max_query_len, head_dim]
        keys.transpose(1, 2).repeat_interleave(group, dim=1),  # [batch, heads, keys, head_dim]
        values.transpose(1, 2).repeat_interleave(group, dim=1),
        attn_mask=mask[:, None],
    )
    return out.transpose(1, 2)[is_query]  # back to [num_tokens, num_heads, head_dim]
