"""Random paged-attention problems and the dense answer they must give (shared with chapter 06's tests)."""

import torch
import torch.nn.functional as F


def make_problem(
    checkpoint,
    seq_lens,
    query_lens,
    block_size,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype=torch.float32,
    seed=0,
    spare_blocks=3,
):
    """Sequences of `seq_lens` tokens whose last `query_lens` are new, stored in shuffled, non-contiguous
    blocks of a pool. Returns (query, key_cache, value_cache, metadata, dense keys, dense values)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled ids, some left unused
    tables = torch.full((len(seq_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    dense_k, dense_v = [], []
    for b, (n, needed) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[b, :needed] = torch.tensor([order.pop() for _ in range(needed)], dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for p in range(n):
            key_cache[tables[b, p // block_size], p % block_size] = k[p]
            value_cache[tables[b, p // block_size], p % block_size] = v[p]
        dense_k.append(k)
        dense_v.append(v)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    metadata = checkpoint.attention_metadata.AttentionMetadata.build(
        list(query_lens), list(seq_lens), tables, block_size, torch.device("cpu")
    )
    return query, key_cache, value_cache, metadata, dense_k, dense_v


def dense_attention(query, dense_k, dense_v, seq_lens, query_lens):
    """Masked SDPA on each sequence's contiguous keys and values, in fp32: the answer."""
    outputs, start = [], 0
    for k, v, n, q_len in zip(dense_k, dense_v, seq_lens, query_lens):
        q = query[start : start + q_len].float()
        start += q_len
        group = q.shape[1] // k.shape[1]
        positions = torch.arange(n - q_len, n)
        mask = torch.arange(n)[None, :] <= positions[:, None]  # [q_len, n]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.float().repeat_interleave(group, 1).transpose(0, 1),
            v.float().repeat_interleave(group, 1).transpose(0, 1),
            attn_mask=mask,
        )
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs)
