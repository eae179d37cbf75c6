"""The paged KV cache: one preallocated pool of blocks per layer, shared by all sequences."""

import torch

from ..config.model import ModelConfig


class KVPool:
    """Keys and values of every layer: `[num_layers, num_blocks, block_size, num_kv_heads, head_dim]` each.

    A sequence's token at position p lives in block `block_table[p // block_size]`, slot
    `p % block_size`; which blocks a sequence owns is the block manager's business, not ours.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device):
        shape = (config.num_hidden_layers, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[1]

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's key and value blocks, each `[num_blocks, block_size, num_kv_heads, head_dim]`."""
        return self.keys[index], self.values[index]

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize
