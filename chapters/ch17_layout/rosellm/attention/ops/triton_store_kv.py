"""Triton store-KV: copy each new token's keys and values into its slot of the pool.

It replaces `paged_attention.store_kv` (the PyTorch reference) and must leave the pool exactly as that does.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    key_ptr,
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,  # strides of key and value (the last one is 1)
    stride_cb,
    stride_cs,
    stride_ch,  # strides of the caches (the last one is 1)
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,  # num_kv_heads and head_dim, rounded up to powers of 2
):
    """Grid: (num_tokens,). Program t copies token t's [num_kv_heads, head_dim] keys and values."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # a token with nowhere to go
        return
    block, offset = slot // block_size, slot % block_size
    heads = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (heads < num_kv_heads)[:, None] & (dims < head_dim)[None, :]  # [BLOCK_H, BLOCK_D]
    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    where = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]  # [BLOCK_H, BLOCK_D]
    tl.store(key_cache_ptr + where, key, mask=mask)
    tl.store(value_cache_ptr + where, value, mask=mask)


def store_kv_launch(num_kv_heads: int, head_dim: int) -> dict:
    """What `store_kv` compiles its kernel with for these shapes: the constexprs and Triton's launch options."""
    return dict(
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
        num_stages=1,
    )  # one stage: the kernel has no loop to pipeline


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as the reference `paged_attention.store_kv` (slot -1: skip the token).

    key, value:             [num_tokens, num_kv_heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:           [num_tokens]
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == value.stride(-1) == key_cache.stride(-1) == 1, "the head dimension must be contiguous"
    assert key_cache.stride() == value_cache.stride()
    store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        num_kv_heads,
        head_dim,
        key_cache.shape[1],
        **store_kv_launch(num_kv_heads, head_dim),
    )
