"""A faster PyTorch attention backend for mixed steps: the reference's padded SDPA, but in groups.

Under continuous batching one forward mixes decoding sequences (one new token) with prompts (hundreds).
The reference `paged_attention` pads every sequence to the longest query and the longest sequence of the
step, so a decode row next to a 500-token prompt does 500 times its work. This backend cuts the batch
into groups that pad well together and runs one padded SDPA per group:
- decode rows apart from prefill rows;
- within each kind, rows of similar length (keys are read up to the group's longest sequence).

The grouping depends only on the step's metadata, so `plan` makes it once per forward; the plan travels
with the metadata and every layer reuses it. The gathered keys and values go into buffers the plan keeps
for all the layers of its forward: a fresh tensor of tens of MB per layer costs the CPU more in page faults
than the copy into it.
It must give what the reference gives (tests check it on random batches).
"""

import torch
import torch.nn.functional as F

from ..metadata import AttentionMetadata
from ..ops.paged_attention import causal_padding, store_kv, table_prefix


def padding_groups(query_lens: list[int], seq_lens: list[int], min_fill: float = 0.7) -> list[list[int]]:
    """Rows (sequences) in groups: decode rows (one new token) apart from the others, each kind sorted by
    length and cut where a row would be shorter than `min_fill` of its group's longest (so at most ~30% of
    what a group reads and computes is padding)."""
    groups = []
    for decode in (True, False):
        rows = sorted(
            (b for b, q in enumerate(query_lens) if (q == 1) == decode),
            key=lambda b: (seq_lens[b], query_lens[b]),
            reverse=True,
        )
        group: list[int] = []
        for b in rows:
            if group and (
                seq_lens[b] < min_fill * seq_lens[group[0]] or query_lens[b] < min_fill * query_lens[group[0]]
            ):
                groups.append(group)
                group = []
            group.append(b)
        if group:
            groups.append(group)
    return groups


def row_groups(metadata: AttentionMetadata, rows: list[int] | None = None) -> list[list[int]]:
    """`padding_groups` of the batch's rows (of `rows` only, when given), as row numbers of the batch."""
    rows = list(range(metadata.seq_lens.shape[0])) if rows is None else rows
    groups = padding_groups(metadata.query_lens[rows].tolist(), metadata.seq_lens[rows].tolist())
    return [[rows[i] for i in group] for group in groups]


class GroupPlan:
    """One padded SDPA over the sequences `rows`: its index tensors and mask, built once per forward."""

    def __init__(self, rows: list[int], metadata: AttentionMetadata, block_size: int):
        index = torch.tensor(rows, device=metadata.seq_lens.device)
        starts = metadata.query_start_loc[index]
        query_lens = metadata.query_lens[index]
        seq_lens = metadata.seq_lens[index].long()
        self.size = len(rows)
        self.max_query_len = int(query_lens.max())
        self.seq_lens = seq_lens  # [size]
        self.block_tables = table_prefix(metadata.block_tables[index], int(seq_lens.max()), block_size)
        self.block_ids = self.block_tables.flatten()  # [size * blocks]
        num_keys = self.block_tables.shape[1] * block_size
        self.is_query, mask = causal_padding(query_lens, seq_lens, self.max_query_len, num_keys)
        self.mask = mask[:, None]  # [size, 1, max_query_len, keys]
        # Token j of row i in the padded layout [size, max_query_len] is query row starts[i] + j.
        slot = torch.arange(self.max_query_len, device=index.device)
        self.tokens = (starts[:, None] + slot[None, :])[self.is_query]


class GroupedAttentionPlan:
    """What `GroupedAttentionBackend.plan` makes for one forward: its groups, and the buffers that every
    layer's gather reuses."""

    def __init__(self, groups: list[GroupPlan]):
        self.groups = groups
        self.buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, like: torch.Tensor, numel: int) -> torch.Tensor:
        """A flat buffer of at least `numel` elements of `like`'s dtype and device, made once per forward."""
        buffer = self.buffers.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer[:numel]


class GroupedAttentionBackend:
    """The "torch" attention backend: `store_kv` of the reference, `paged_attention` by row groups.
    It holds nothing between calls: its plan travels with the metadata (`metadata.plan`)."""

    name = "torch"
    graph_decode = None  # nothing to attend inside a compiled graph: the custom operator runs it

    def plan(self, metadata: AttentionMetadata, block_size: int, rows: list[int] | None = None) -> GroupedAttentionPlan:
        """The groups of one forward (of the batch's `rows` only, when given), for every layer's
        `paged_attention` (set it as `metadata.plan`)."""
        return GroupedAttentionPlan([GroupPlan(group, metadata, block_size) for group in row_groups(metadata, rows)])

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        store_kv(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim], as the reference."""
        if not isinstance(metadata.plan, GroupedAttentionPlan):
            raise RuntimeError("this forward has no plan: set metadata.plan = backend.plan(metadata, block_size)")
        out = torch.empty_like(query)
        for group in metadata.plan.groups:
            attend_group(group, metadata.plan, query, key_cache, value_cache, out)
        return out


def attend_group(
    group: GroupPlan,
    plan: GroupedAttentionPlan,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """One padded SDPA: the group's rows of `out` [num_tokens, heads, head_dim] from their queries and pool."""
    keys = gather(key_cache, group, plan, "keys")  # [size, keys, kv_heads, head_dim]
    values = gather(value_cache, group, plan, "values")
    if group.max_query_len == 1:
        padded = query[group.tokens][:, None]  # decode: [size, 1, heads, head_dim], nothing to pad
    else:
        padded = query.new_zeros(group.size, group.max_query_len, *query.shape[1:])
        padded[group.is_query] = query[group.tokens]
    result = F.scaled_dot_product_attention(
        padded.transpose(1, 2),  # [size, heads, max_query_len, head_dim]
        keys.transpose(1, 2),  # [size, kv_heads, keys, head_dim]; head h reads KV head h // group
        values.transpose(1, 2),
        attn_mask=group.mask,
        enable_gqa=True,
    )
    if group.max_query_len == 1:
        out[group.tokens] = result[:, :, 0]  # [size, heads, head_dim]
    else:
        out[group.tokens] = result.transpose(1, 2)[group.is_query]


def gather(cache: torch.Tensor, group: GroupPlan, plan: GroupedAttentionPlan, name: str) -> torch.Tensor:
    """The group's blocks copied out of the pool into the plan's buffer `name` (one memcpy per block with
    index_select, several times faster than the reference's `cache[tables]`): [size, keys, kv_heads,
    head_dim]. Slots past a sequence's end are junk (block 0 stands in for -1): the mask hides them."""
    numel = group.block_ids.numel() * cache[0].numel()
    target = plan.buffer(name, cache, numel).view(group.block_ids.numel(), *cache.shape[1:])
    torch.index_select(cache, 0, group.block_ids, out=target)
    return target.view(group.size, -1, *cache.shape[2:])
