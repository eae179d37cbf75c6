"""The "triton" backend: Triton kernels for the paged KV pool (in attention/ops/), each equal to a PyTorch
reference of `attention/ops/paged_attention.py`.

    triton_store_kv.py           store_kv          <- paged_attention.store_kv
    triton_decode_attention.py   split-K decode    <- paged_attention.paged_attention (one new token per sequence)
    triton_prefill_attention.py  causal prefill    <- paged_attention.paged_attention (any number of new tokens)

Importing this package imports Triton, which has wheels for Linux only. On a machine without a GPU, Triton
can only run these kernels in its interpreter, and only if TRITON_INTERPRET=1 is in the environment before
this package is imported. `attention_backend.check_triton_runs` checks both before the "triton" backend
imports this package.
"""

import torch

from ..metadata import AttentionMetadata
from ..ops.triton_decode_attention import choose_num_splits, paged_decode_attention
from ..ops.triton_prefill_attention import paged_prefill_attention
from ..ops.triton_store_kv import store_kv

__all__ = ["choose_num_splits", "paged_attention", "paged_decode_attention", "paged_prefill_attention", "store_kv"]


def paged_attention(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata
) -> torch.Tensor:
    """Same contract as the reference `paged_attention.paged_attention`: the decode kernel when every
    sequence has one new token, the prefill kernel otherwise."""
    if metadata.max_query_len == 1 and query.shape[0] == metadata.seq_lens.shape[0]:
        return paged_decode_attention(
            query, key_cache, value_cache, metadata.seq_lens, metadata.block_tables, metadata.max_seq_len
        )
    return paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        metadata.query_start_loc,
        metadata.seq_lens,
        metadata.block_tables,
        metadata.max_query_len,
    )
