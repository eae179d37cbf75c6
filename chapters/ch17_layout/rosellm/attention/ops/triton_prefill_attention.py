"""Triton paged prefill attention: each sequence's new tokens against its paged keys and values, causal.

New token i of a sequence with `query_len` new tokens and `seq_len` in all sits at position
`seq_len - query_len + i` and sees keys 0 ... that position. A whole prompt (query_len == seq_len) and
a prompt whose beginning is already cached (query_len < seq_len, chapter 08) are the same case.

It replaces `paged_attention.paged_attention` (the PyTorch reference) for batches with more than one new
token in some sequence.
"""

import math

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # rows (query token x query head of a GQA group) per program
BLOCK_N = 32  # keys per step of the loop inside a program


@triton.jit
def prefill_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [batch, max_blocks] int32
    query_start_loc_ptr,  # [batch + 1]
    seq_lens_ptr,  # [batch]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    scale_log2,  # softmax scale * log2(e): we use exp2 instead of exp
    head_dim,
    block_size,
    GROUP: tl.constexpr,  # query heads per KV head
    QUERIES: tl.constexpr,  # query tokens per program: BLOCK_M // GROUP
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of 2, at least 16
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" in fp32 (no TF32 rounding), "tf32" (unused) in 16-bit
):
    """Grid: (batch, cdiv(max_query_len, QUERIES), num_kv_heads). Program (b, j, h) computes new tokens
    j * QUERIES ... j * QUERIES + QUERIES - 1 of sequence b, for the GROUP query heads of KV head h,
    as one [BLOCK_M, head_dim] tile: row r is token r // GROUP, query head h * GROUP + r % GROUP."""
    seq = tl.program_id(0)
    first = tl.program_id(1) * QUERIES  # the first new token of this program
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if first >= query_len:  # this sequence has fewer new tokens than the longest one
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    tokens = first + rows // GROUP  # [BLOCK_M] which new token of the sequence
    heads = kv_head * GROUP + rows % GROUP  # [BLOCK_M] which query head
    row_mask = (rows < QUERIES * GROUP) & (tokens < query_len)
    positions = seq_len - query_len + tokens  # [BLOCK_M] where each new token sits in the sequence
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    dim_mask = dims < head_dim
    q_where = (query_start + tokens)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(query_ptr + q_where, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past the last position of this program's tokens are masked for every row: never load them.
    # Every row sees key 0, so no row is ever fully masked in the first step (no -inf - -inf).
    kv_end = seq_len - query_len + tl.minimum(query_len, first + QUERIES)
    for tile in range(0, kv_end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_mask = keys < kv_end
        blocks = tl.load(block_tables_ptr + seq * stride_bt + keys // block_size, mask=key_mask, other=0)
        where = blocks.to(tl.int64) * stride_cb + (keys % block_size) * stride_cs + kv_head * stride_ch  # [BLOCK_N]
        kv_mask = key_mask[:, None] & dim_mask[None, :]  # [BLOCK_N, BLOCK_D]
        k = tl.load(key_cache_ptr + where[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(value_cache_ptr + where[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        causal = (keys[None, :] <= positions[:, None]) & key_mask[None, :]  # [BLOCK_M, BLOCK_N]
        scores = tl.where(causal, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [BLOCK_M]
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_M]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_D]
        m_i = m_new

    out = acc / l_i[:, None]  # [BLOCK_M, BLOCK_D]
    o_where = (query_start + tokens)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_where, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def prefill_launch(group: int, head_dim: int, dtype: torch.dtype) -> dict:
    """What `paged_prefill_attention` compiles its kernel with: the constexprs and Triton's launch options."""
    block_m = max(BLOCK_M, triton.next_power_of_2(group))  # a GQA group wider than BLOCK_M: one token per program
    return dict(
        GROUP=group,
        QUERIES=block_m // group,
        BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=BLOCK_N,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=3,
    )  # Triton's defaults: three stages pipeline the loads of the key loop


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
) -> torch.Tensor:
    """query: [num_tokens, num_heads, head_dim], every sequence's new tokens end to end (their keys already
    stored); key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    query_start_loc: [batch + 1]; seq_lens: [batch]; block_tables: [batch, max_blocks]
    -> [num_tokens, num_heads, head_dim]."""
    num_tokens, num_heads, head_dim = query.shape
    batch, num_kv_heads = seq_lens.shape[0], key_cache.shape[2]
    group = num_heads // num_kv_heads
    launch = prefill_launch(group, head_dim, query.dtype)
    assert query.stride(-1) == key_cache.stride(-1) == 1 and key_cache.stride() == value_cache.stride()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    prefill_kernel[(batch, triton.cdiv(max_query_len, launch["QUERIES"]), num_kv_heads)](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        head_dim**-0.5 * math.log2(math.e),
        head_dim,
        key_cache.shape[1],
        **launch,
    )
    return out
