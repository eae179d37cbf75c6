"""Attention over the paged KV pool, in plain PyTorch: the reference that chapter 06's kernels must equal."""

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each new token's key and value into its slot of the pool (slot -1: skip the token).

    key, value:             [num_tokens, num_kv_heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping:           [num_tokens]
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep]  # a flat view: slot = block * size + offset
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, batch: int, buffer: torch.Tensor) -> torch.Tensor:
    """Each sequence's keys (or values) read through its block table, copied into the front of `buffer`.

    cache: [num_blocks, block_size, kv_heads, head_dim]; block_ids: [batch * blocks_per_row] (row-major)
    -> [batch, blocks_per_row * block_size, kv_heads, head_dim]. Slots past a sequence's end are junk
    (block 0 stands in for -1), and the attention mask must hide them. index_select copies whole blocks
    (one memcpy each): several times faster than `cache[block_ids]`.
    """
    target = buffer[: block_ids.numel() * cache[0].numel()].view(block_ids.numel(), *cache.shape[1:])
    blocks = torch.index_select(cache, 0, block_ids, out=target)
    return blocks.view(batch, -1, *cache.shape[2:])


class Scratch:
    """Buffers reused by every layer and every step for the gathered keys and values.

    A fresh tensor of tens of MB per layer costs the CPU more in page faults (the allocator hands large
    blocks back to the OS, which zeroes them again on the next use) than the copy into it."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        # a buffer made under torch.inference_mode() cannot be written outside it: one set for each mode
        key = (name, like.dtype, like.device, torch.is_inference_mode_enabled())
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self.buffers[key] = buffer
        return buffer


SCRATCH = Scratch()


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    metadata: AttentionMetadata) -> torch.Tensor:
    """Causal attention of the new tokens over their sequences' cached keys and values.

    query: [num_tokens, num_heads, head_dim] (the new tokens of every sequence, end to end)
    -> [num_tokens, num_heads, head_dim]. The new tokens' keys must already be stored (store_kv).
    Prefill (many new tokens), decode (one) and a prompt whose beginning is cached all take this path.

    The batch is cut into groups of sequences that pad well together, and each group is one padded SDPA:
    decoding sequences apart from prefilling ones (a decode row padded to a 500-token prompt would do 500
    times its work), and within each kind, sequences of similar length (keys are read up to the group's
    longest sequence). Each query head reads its KV head in place (`enable_gqa`), without copies.
    The groups depend only on the metadata, so they are planned once per forward for every layer.
    """
    if metadata.torch_attention_plan is None:
        query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).tolist()
        metadata.torch_attention_plan = [GroupPlan(rows, metadata, key_cache.shape[1])
                                         for rows in padding_groups(query_lens, metadata.seq_lens.tolist())]
    out = torch.empty_like(query)
    for group in metadata.torch_attention_plan:
        group.attend(query, key_cache, value_cache, out)
    return out


def padding_groups(query_lens: list[int], seq_lens: list[int], min_fill: float = 0.7) -> list[list[int]]:
    """Rows (sequences) in groups: decode rows (one new token) apart from the others, each kind sorted by
    length and cut where a row would be shorter than `min_fill` of its group's longest (so at most ~30% of
    what a group reads and computes is padding)."""
    groups = []
    for decode in (True, False):
        rows = sorted((b for b, q in enumerate(query_lens) if (q == 1) == decode),
                      key=lambda b: (seq_lens[b], query_lens[b]), reverse=True)
        group: list[int] = []
        for b in rows:
            if group and (seq_lens[b] < min_fill * seq_lens[group[0]]
                          or query_lens[b] < min_fill * query_lens[group[0]]):
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
        self.block_ids = metadata.block_tables[index, :needed].clamp(min=0).long().flatten()  # [size * needed]
        # Token j of row i in the padded layout [size, max_query_len] is query row starts[i] + j.
        slot = torch.arange(self.max_query_len, device=device)
        self.is_query = slot[None, :] < query_lens[:, None]  # [size, max_query_len]
        self.tokens = (starts[:, None] + slot[None, :])[self.is_query]
        # New token j of a row sits at position seq_len - query_len + j; it sees keys 0..position.
        positions = (seq_lens - query_lens)[:, None] + slot[None, :]  # [size, max_query_len]
        key_index = torch.arange(needed * block_size, device=device)
        self.mask = (key_index[None, None, :] <= positions[:, :, None])[:, None]  # [size, 1, max_query_len, keys]

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        numel = self.block_ids.numel() * key_cache[0].numel()
        keys = gather_blocks(key_cache, self.block_ids, self.size, SCRATCH.get("keys", numel, key_cache))
        values = gather_blocks(value_cache, self.block_ids, self.size, SCRATCH.get("values", numel, value_cache))
        if self.max_query_len == 1:
            padded = query[self.tokens][:, None]  # decode: [size, 1, heads, head_dim], nothing to pad
        else:
            padded = query.new_zeros(self.size, self.max_query_len, *query.shape[1:])
            padded[self.is_query] = query[self.tokens]
        result = F.scaled_dot_product_attention(
            padded.transpose(1, 2),  # [size, heads, max_query_len, head_dim]
            keys.transpose(1, 2),  # [size, kv_heads, keys, head_dim]; head h reads KV head h // group
            values.transpose(1, 2),
            attn_mask=self.mask,
            enable_gqa=True,
        )
        if self.max_query_len == 1:
            out[self.tokens] = result[:, :, 0]  # [size, heads, head_dim]
        else:
            out[self.tokens] = result.transpose(1, 2)[self.is_query]
