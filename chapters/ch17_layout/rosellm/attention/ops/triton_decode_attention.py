"""Triton paged decode attention, flash-decoding style: one new token per sequence against its paged history.

Each sequence's history is cut into `num_splits` chunks that separate programs attend to in parallel
(split-K), each with an online softmax; a second kernel merges the partial results by log-sum-exp.
The query heads that share a KV head (a GQA group) are processed together, so every key and value is
read once per group instead of once per query head.

It replaces `paged_attention.paged_attention` (the PyTorch reference) for batches where every sequence
has exactly one new token.
"""

import math

import torch
import triton
import triton.language as tl

TOKENS_PER_SPLIT = 256  # a split should have enough keys to amortize its partial result
MAX_SPLITS = 16
BLOCK_N = 32  # keys per step of the loop inside a program


@triton.jit
def decode_split_kernel(
    query_ptr,  # [batch, num_heads, head_dim]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [batch, max_blocks] int32
    seq_lens_ptr,  # [batch]
    partial_out_ptr,  # [batch, num_heads, num_splits, head_dim] fp32
    partial_lse_ptr,  # [batch, num_heads, num_splits] fp32, log2 units
    stride_qb,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    scale_log2,  # softmax scale * log2(e): we use exp2 instead of exp
    head_dim,
    block_size,
    tokens_per_split,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of 2, at least 16 (tl.dot's minimum)
    BLOCK_D: tl.constexpr,  # head_dim padded to a power of 2, at least 16
    BLOCK_N: tl.constexpr,  # keys per loop step
    DOT_PRECISION: tl.constexpr,  # "ieee" in fp32 (no TF32 rounding), "tf32" (unused) in 16-bit
):
    """Grid: (batch, num_kv_heads, num_splits). Program (b, h, s) attends sequence b's query heads
    h * GROUP ... h * GROUP + GROUP - 1 to keys [s * tokens_per_split, (s + 1) * tokens_per_split) of
    its history, and writes their partial output (normalized) and log-sum-exp."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)  # start >= end: an empty split (short sequence)

    rows = tl.arange(0, BLOCK_G)  # [BLOCK_G] one row per query head of the group
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    dim_mask = dims < head_dim
    q = tl.load(
        query_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    # Online softmax state, one entry per row: running max, running sum of exp2, unnormalized output.
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for tile in range(start, end, BLOCK_N):
        keys = tile + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions in the sequence
        key_mask = keys < end
        # Where each key lives: its block from the block table, its slot inside the block.
        blocks = tl.load(block_tables_ptr + seq * stride_bt + keys // block_size, mask=key_mask, other=0)
        where = blocks.to(tl.int64) * stride_cb + (keys % block_size) * stride_cs + kv_head * stride_ch  # [BLOCK_N]
        kv_mask = key_mask[:, None] & dim_mask[None, :]  # [BLOCK_N, BLOCK_D]
        k = tl.load(key_cache_ptr + where[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(value_cache_ptr + where[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        scores = tl.where(key_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [BLOCK_G]
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_G] rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_D]
        m_i = m_new

    # An empty split (l_i = 0, m_i = -inf) writes output 0 and lse -inf, which the merge weighs by 0.
    l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]  # [BLOCK_G, BLOCK_D]
    lse = m_i + tl.log2(l_i)  # [BLOCK_G]: log2 of this split's sum of exp2(scores)
    tl.store(
        partial_out_ptr + seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :],
        out,
        mask=row_mask[:, None] & dim_mask[None, :],
    )
    tl.store(partial_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=row_mask)


@triton.jit
def decode_merge_kernel(
    partial_out_ptr,  # [batch, num_heads, num_splits, head_dim] fp32
    partial_lse_ptr,  # [batch, num_heads, num_splits] fp32, log2 units
    out_ptr,  # [batch, num_heads, head_dim]
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_yb,
    stride_yh,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of 2
    BLOCK_D: tl.constexpr,
):
    """Grid: (batch, num_heads). Program (b, h) merges the splits of sequence b's query head h:
    out = sum_s 2^(lse_s - lse) * out_s, where lse = log2(sum_s 2^lse_s)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    split_mask = splits < num_splits
    dim_mask = dims < head_dim
    lse = tl.load(
        partial_lse_ptr + seq * stride_lb + head * stride_lh + splits, mask=split_mask, other=float("-inf")
    )  # [BLOCK_S]
    outs = tl.load(
        partial_out_ptr + seq * stride_ob + head * stride_oh + splits[:, None] * stride_os + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    lse_max = tl.max(lse, axis=0)  # finite: split 0 always holds the sequence's first key
    weights = tl.exp2(lse - lse_max)  # [BLOCK_S]; empty splits weigh 2^-inf = 0
    out = tl.sum(weights[:, None] * outs, axis=0) / tl.sum(weights, axis=0)  # [BLOCK_D]
    tl.store(out_ptr + seq * stride_yb + head * stride_yh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def decode_split_launch(group: int, head_dim: int, dtype: torch.dtype) -> dict:
    """What `paged_decode_attention` compiles its split kernel with: the constexprs and Triton's launch options."""
    return dict(
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=padded_head_dim(head_dim),
        BLOCK_N=BLOCK_N,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=3,
    )  # Triton's defaults: three stages pipeline the loads of the key loop


def decode_merge_launch(num_splits: int, head_dim: int) -> dict:
    """What `paged_decode_attention` compiles its merge kernel with: the constexprs and Triton's launch options."""
    return dict(
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=padded_head_dim(head_dim), num_warps=4, num_stages=1
    )  # one stage: the kernel has no loop to pipeline


def padded_head_dim(head_dim: int) -> int:
    """head_dim rounded up to a power of 2, at least 16: tl.dot wants every dimension >= 16."""
    return max(16, triton.next_power_of_2(head_dim))


def choose_num_splits(max_seq_len: int) -> int:
    """Enough splits that each holds about TOKENS_PER_SPLIT keys, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, triton.cdiv(max_seq_len, TOKENS_PER_SPLIT)))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """query: [batch, num_heads, head_dim], the one new token of each sequence (its key already stored);
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]; seq_lens: [batch];
    block_tables: [batch, max_blocks] -> [batch, num_heads, head_dim].

    num_splits: None picks it from max_seq_len (`choose_num_splits`).
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    num_splits = num_splits or choose_num_splits(max_seq_len)
    # Each split covers a whole number of loop steps; splits past a short sequence's end are empty.
    tokens_per_split = triton.cdiv(triton.cdiv(max_seq_len, num_splits), BLOCK_N) * BLOCK_N
    assert query.stride(-1) == key_cache.stride(-1) == 1 and key_cache.stride() == value_cache.stride()

    partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        partial_out,
        partial_lse,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        head_dim**-0.5 * math.log2(math.e),
        head_dim,
        key_cache.shape[1],
        tokens_per_split,
        **decode_split_launch(group, head_dim, query.dtype),
    )
    out = torch.empty(batch, num_heads, head_dim, dtype=query.dtype, device=query.device)
    decode_merge_kernel[(batch, num_heads)](
        partial_out,
        partial_lse,
        out,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_out.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        head_dim,
        num_splits,
        **decode_merge_launch(num_splits, head_dim),
    )
    return out
