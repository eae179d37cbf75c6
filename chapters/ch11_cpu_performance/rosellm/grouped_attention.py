"""A faster PyTorch attention backend for mixed steps: the reference's padded SDPA, but in groups.

Under continuous batching one forward mixes decoding sequences (one new token) with prompts (hundreds).
The reference `paged_attention` pads every sequence to the longest query and the longest sequence of the
step, so a decode row next to a 500-token prompt does 500 times its work. This backend cuts the batch
into groups that pad well together and runs one padded SDPA per group:
- decode rows apart from prefill rows;
- within each kind, rows of similar length (keys are read up to the group's longest sequence).

The grouping depends only on the step's metadata, so `begin_forward` plans it once per forward and every
layer reuses the plan. The gathered keys and values go into buffers the backend keeps from step to step:
a fresh tensor of tens of MB per layer costs the CPU more in page faults than the copy into it.
It must give what the reference gives (tests check it on random batches).
"""

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata
from .paged_attention import store_kv


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


class GroupPlan:
    """One padded SDPA over the sequences `rows`: its index tensors and mask, built once per forward."""

    def __init__(self, rows: list[int], metadata: AttentionMetadata, block_size: int):
        device = metadata.seq_lens.device
        index = torch.tensor(rows, device=device)
        starts = metadata.query_start_loc[index]
        query_lens = metadata.query_start_loc[index + 1] - starts
        seq_lens = metadata.seq_lens[index].long()
        self.size = len(rows)
        self.max_query_len = int(query_lens.max())
        needed = -(-int(seq_lens.max()) // block_size)
        self.seq_lens = seq_lens  # [size]
        self.block_tables = metadata.block_tables[index, :needed].clamp(min=0).long()  # [size, needed]
        self.block_ids = self.block_tables.flatten()  # [size * needed]
        # Token j of row i in the padded layout [size, max_query_len] is query row starts[i] + j.
        slot = torch.arange(self.max_query_len, device=device)
        self.is_query = slot[None, :] < query_lens[:, None]  # [size, max_query_len]
        self.tokens = (starts[:, None] + slot[None, :])[self.is_query]
        # New token j of a row sits at position seq_len - query_len + j; it sees keys 0..position.
        positions = (seq_lens - query_lens)[:, None] + slot[None, :]  # [size, max_query_len]
        key_index = torch.arange(needed * block_size, device=device)
        self.mask = (key_index[None, None, :] <= positions[:, :, None])[:, None]  # [size, 1, max_query_len, keys]


class GroupedAttentionBackend:
    """The "torch" attention backend: `store_kv` of the reference, `paged_attention` by row groups."""

    name = "torch"

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.metadata: AttentionMetadata | None = None  # the forward the plan below was made for
        self.plan: list[GroupPlan] = []

    def begin_forward(self, metadata: AttentionMetadata, block_size: int) -> None:
        """Plan the groups of one forward; every layer's `paged_attention` then reuses them."""
        query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).tolist()
        groups = padding_groups(query_lens, metadata.seq_lens.tolist())
        self.plan = [GroupPlan(rows, metadata, block_size) for rows in groups]
        self.metadata = metadata

    def store_kv(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        store_kv(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim], as the reference."""
        if metadata is not self.metadata:
            raise RuntimeError("begin_forward(metadata) must plan this forward before its attention runs")
        out = torch.empty_like(query)
        for group in self.plan:
            self._attend(group, query, key_cache, value_cache, out)
        return out

    def _attend(
        self,
        group: GroupPlan,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        keys = self._gather(key_cache, group, "keys")  # [size, keys, kv_heads, head_dim]
        values = self._gather(value_cache, group, "values")
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

    def _gather(self, cache: torch.Tensor, group: GroupPlan, name: str) -> torch.Tensor:
        """The group's blocks copied out of the pool (one memcpy per block with index_select, several times
        faster than `cache[block_ids]`) into a reused buffer. Slots past a sequence's end are junk (block 0
        stands in for -1): the mask hides them."""
        numel = group.block_ids.numel() * cache[0].numel()
        # a buffer made under torch.inference_mode() cannot be written outside it: one set for each mode
        key = (name, cache.dtype, cache.device, torch.is_inference_mode_enabled())
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffers[key] = torch.empty(numel, dtype=cache.dtype, device=cache.device)
        target = buffer[:numel].view(group.block_ids.numel(), *cache.shape[1:])
        torch.index_select(cache, 0, group.block_ids, out=target)
        return target.view(group.size, -1, *cache.shape[2:])
