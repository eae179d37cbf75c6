"""The "cpu" attention backend: no row copies keys and values out of the pool when it need not.

The "torch" backend copies every group's blocks out of the pool before SDPA reads them: for a decode step
that is the whole KV cache written once more and read twice, and SDPA's CPU kernel is slow for one query
per sequence. Here:
- a group of decode rows is one function of the pool and the block tables, written as plain tensor algebra
  (a gather, a product summed over head_dim, a softmax, a weighted sum over keys); torch.compile (Inductor)
  turns it into loops that load each key and value from its block where it lies (Inductor compiles the C++
  it writes: where no C++ compiler is found, or at level "nocc" of platforms/cpu_features.py, the same function runs
  eagerly, gathering the blocks; asked for by name under `enforce_eager`, which keeps the decoder layers
  eager, it is still compiled where it can be). Where the pool holds fp32 or bf16 and a C compiler works,
  the same function written by hand in C (decode_attention.c) runs instead: it reads each block front to
  back, for the scores and then for the values, and keeps its sums in vector registers;
- a prompt with nothing cached before this step attends to its own new keys and values, read from the
  slots `store_kv` has just written (a copy the size of the prompt's keys): causal SDPA on them, with no
  padding and no mask;
- a prompt chunk after a cached or computed beginning goes to the grouped backend it holds.
"""

import ctypes
import functools
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from ...platforms import cpu_features
from ..metadata import AttentionMetadata
from ..ops import c_kernels
from ..ops.paged_attention import store_kv
from .grouped_attn import GroupedAttentionBackend, GroupedAttentionPlan, GroupPlan, row_groups


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


def compiler_found() -> bool:
    """Whether torch.compile can build CPU code here: Inductor compiles the C++ it writes with $CXX, else g++
    (clang++ on macOS); never at level "nocc". Looked up again when $CXX changes."""
    if cpu_features.level() == "nocc":
        return False
    return _on_path(os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++"))


@functools.cache
def _on_path(program: str) -> bool:
    return shutil.which(program) is not None


KERNEL_ELEMENTS = {torch.float32: ("float", 0), torch.bfloat16: ("uint16_t", 1)}  # dtype -> (SCALAR, BF16)


@functools.cache
def _kernel(
    dtype: torch.dtype, head_dim: int, group: int, kv_heads: int, block_size: int, setting: tuple
) -> Callable | None:
    """decode_attention.c compiled for one model's shapes, or None where it does not serve them. `setting`
    is `c_kernels.setting()`: another compiler, level or cache folder looks again."""
    if dtype not in KERNEL_ELEMENTS or head_dim % 16:
        return None
    scalar, bf16 = KERNEL_ELEMENTS[dtype]
    shapes = dict(HEAD_DIM=head_dim, GROUP=group, KV_HEADS=kv_heads, BLOCK_SIZE=block_size)
    library = c_kernels.load("decode_attention", SCALAR=scalar, BF16=bf16, **shapes)
    if library is None:
        return None
    kernel = library.decode_attention
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    kernel.argtypes = [pointer] * 6 + [size, size, ctypes.c_float, ctypes.c_int]
    kernel.restype = size  # sequences left without memory for their scores
    return kernel


def kernel_decode_attention(
    query, key_cache, value_cache, block_tables, seq_lens, setting: tuple | None = None
) -> torch.Tensor:
    """`decode_attention` by the C kernel, where it serves the shapes, dtype and device; else compiled, or
    eagerly where nothing can be compiled. `setting`: `c_kernels.setting()`, read now when not given.

    query [batch, heads, head_dim]; key_cache, value_cache [num_blocks, block_size, kv_heads, head_dim];
    block_tables [batch, blocks] and seq_lens [batch], int64 -> [batch, heads, head_dim]
    """
    batch, heads, head_dim = query.shape
    block_size, kv_heads = key_cache.shape[1:3]
    setting = c_kernels.setting() if setting is None else setting
    kernel = _kernel(query.dtype, head_dim, heads // kv_heads, kv_heads, block_size, setting)
    tensors = (query, key_cache, value_cache, block_tables, seq_lens)
    same_dtype = key_cache.dtype == value_cache.dtype == query.dtype
    long_indices = block_tables.dtype == seq_lens.dtype == torch.long
    cpu_contiguous = all(t.is_cpu and t.is_contiguous() for t in tensors)  # the kernel takes their addresses
    if kernel is None or not (same_dtype and long_indices and cpu_contiguous):
        decode = compiled_decode_attention if compiler_found() else decode_attention
        return decode(*tensors)
    check_bounds(block_tables, seq_lens, key_cache.shape[0], block_size, batch)
    out = torch.empty_like(query)
    pointers = [t.data_ptr() for t in (*tensors, out)]
    without_memory = kernel(*pointers, batch, block_tables.shape[1], head_dim**-0.5, torch.get_num_threads())
    if without_memory:
        raise MemoryError(f"decode attention found no memory for the scores of {without_memory} of {batch} rows")
    return out


def check_bounds(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int, batch: int
) -> None:
    """The C kernel reads wherever the tables point, for `batch` rows: an IndexError here, not a read outside
    the pool or past the end of the tables or the lengths."""
    if not block_tables.shape[0] == seq_lens.shape[0] == batch:
        raise IndexError(
            f"{batch} queries, but block tables for {block_tables.shape[0]} and lengths for {seq_lens.shape[0]}"
        )
    lowest_block, highest_block = (int(v) for v in torch.aminmax(block_tables))
    shortest, longest = (int(v) for v in torch.aminmax(seq_lens))
    if lowest_block < 0 or highest_block >= num_blocks:
        raise IndexError(f"block tables name blocks {lowest_block}..{highest_block}, outside 0..{num_blocks - 1}")
    if shortest < 1 or longest > block_tables.shape[1] * block_size:
        raise IndexError(f"sequence lengths {shortest}..{longest} outside 1..{block_tables.shape[1] * block_size}")


# Up to this many decoding rows a compiled step attends inside its graph (no operator call, no Python per layer);
# more take the operator, whose C kernel reads the pool four times faster than Inductor's loops. Measured on
# SmolLM2, fp32, 2 threads (Xeon, AVX-512), decode steps at 400 tokens of context, ms a step, in the graph
# against the operator: 25.4 / 29.1 at 1 row, 29.8 / 37.0 at 2, 42.1 / 45.3 at 4, 57.4 / 54.8 at 8,
# 74.1 / 70.0 at 16, 123.5 / 98.5 at 32, 169.0 / 132.0 at 48. At 128 tokens of context the graph wins up to 32
# rows; what decides is the keys a step reads, but a graph can be chosen by shapes only. offline-cpu (contexts
# of 32 to 768) at bounds of 4 / 16 / 32 rows: 216.7 / 212.8 / 204.6 output tokens/s.
GRAPH_DECODE_ROWS = 4


@dataclass
class CpuPlan:
    """What `CpuAttentionBackend.plan` makes for one forward."""

    fresh_prompts: list[tuple[int, int]]  # query rows start:end of each prompt with nothing cached
    decode_groups: list[GroupPlan]  # decode rows, grouped by length
    others: GroupedAttentionPlan  # the rest: prompt chunks after a cached or computed beginning
    kernel_setting: tuple  # c_kernels.setting(), read once for the forward's every layer


class CpuAttentionBackend:
    """The "cpu" backend: decode groups read the pool in place, fresh prompts their own new keys, and a
    grouped ("torch") backend, which it holds, attends the other rows."""

    name = "cpu"
    graph_decode = staticmethod(decode_attention)  # a few rows' tokens, attended inside the compiled step
    graph_decode_rows = GRAPH_DECODE_ROWS

    def __init__(self):
        self.grouped = GroupedAttentionBackend()

    def plan(self, metadata: AttentionMetadata, block_size: int) -> CpuPlan:
        """Fresh prompts (every token new this step, more than one) apart; decode rows and the rest grouped
        as the grouped backend groups them (set the result as `metadata.plan`)."""
        starts, query_lens = metadata.query_start_loc.tolist(), metadata.query_lens.tolist()
        seq_lens = metadata.seq_lens.tolist()
        fresh = [b for b, (q, n) in enumerate(zip(query_lens, seq_lens)) if q == n and q > 1]
        decode = [b for b, q in enumerate(query_lens) if q == 1]
        others = [b for b, (q, n) in enumerate(zip(query_lens, seq_lens)) if 1 < q < n]
        return CpuPlan(
            fresh_prompts=[(starts[b], starts[b + 1]) for b in fresh],
            decode_groups=[GroupPlan(rows, metadata, block_size) for rows in row_groups(metadata, decode)],
            others=self.grouped.plan(metadata, block_size, others),
            kernel_setting=c_kernels.setting(),
        )

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        """As the reference; where every token has a slot (every step but warm-up's), one indexed copy per
        cache, with none of the reference's boolean masks (each a scan and a count)."""
        if slot_mapping.numel() == 0 or int(slot_mapping.min()) < 0:
            store_kv(key, value, key_cache, value_cache, slot_mapping)
            return
        key_cache.flatten(0, 1).index_copy_(0, slot_mapping, key)  # [slots, kv_heads, head_dim]
        value_cache.flatten(0, 1).index_copy_(0, slot_mapping, value)

    def paged_attention(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim], as the reference."""
        plan = metadata.plan
        if not isinstance(plan, CpuPlan):
            raise RuntimeError("this forward has no plan: set metadata.plan = backend.plan(metadata, block_size)")
        if plan.others.groups:
            out = self.grouped.paged_attention(query, key_cache, value_cache, replace(metadata, plan=plan.others))
        else:  # every row is a decode row or a fresh prompt's, written below
            out = torch.empty_like(query)
        for group in plan.decode_groups:
            out[group.tokens] = kernel_decode_attention(
                query[group.tokens], key_cache, value_cache, group.block_tables, group.seq_lens, plan.kernel_setting
            )
        keys, values = key_cache.flatten(0, 1), value_cache.flatten(0, 1)  # [slots, kv_heads, head_dim]
        for start, end in plan.fresh_prompts:
            slots = metadata.slot_mapping[start:end]  # where this step stored the prompt's keys and values
            out[start:end] = F.scaled_dot_product_attention(  # 4-D: SDPA's CPU kernel is several times slower on 3-D
                query[None, start:end].transpose(1, 2),  # [1, heads, tokens, head_dim]
                keys[None, slots].transpose(1, 2),  # [1, kv_heads, tokens, head_dim]
                values[None, slots].transpose(1, 2),
                is_causal=True,
                enable_gqa=True,
            )[0].transpose(0, 1)
        return out
