"""What one forward needs to know about the batch, as tensors: the only view of it the model gets."""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """The new tokens of all sequences are laid end to end: no padding anywhere.

    positions:       [num_tokens]  position of each new token in its sequence
    slot_mapping:    [num_tokens]  where its key and value go: block_id * block_size + offset (-1: nowhere)
    query_start_loc: [batch + 1]   sequence b's new tokens are rows query_start_loc[b] : query_start_loc[b + 1]
    query_lens:      [batch]       new tokens of each sequence
    seq_lens:        [batch]       tokens of each sequence once this step's are stored (cached + new)
    block_tables:    [batch, max_blocks]  the blocks of each sequence, in order, -1 for none
    plan:            what the attention backend planned for this forward (`backend.plan`), read by every layer
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    query_lens: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    plan: Any = None

    @classmethod
    def build(
        cls, new_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int, device: torch.device
    ) -> "AttentionMetadata":
        """From each sequence's count of new tokens, its length after them, and its block table."""
        new = torch.tensor(new_lens)  # [batch]
        lens = torch.tensor(seq_lens)  # [batch]
        sequence = torch.repeat_interleave(torch.arange(len(new_lens)), new)  # [num_tokens]: whose token
        query_start_loc = torch.zeros(len(new_lens) + 1, dtype=torch.long)
        query_start_loc[1:] = new.cumsum(0)
        offset_in_step = torch.arange(int(new.sum())) - query_start_loc[sequence]
        positions = (lens - new)[sequence] + offset_in_step  # [num_tokens]
        tables = block_tables.long()
        blocks = tables[sequence, positions // block_size]
        slot_mapping = blocks * block_size + positions % block_size  # [num_tokens]
        return cls(
            positions=positions.to(device),
            slot_mapping=slot_mapping.to(device),
            query_start_loc=query_start_loc.to(device),
            query_lens=new.to(device),
            seq_lens=lens.to(device),
            block_tables=block_tables.to(device),
            max_query_len=max(new_lens),
            max_seq_len=max(seq_lens),
        )
