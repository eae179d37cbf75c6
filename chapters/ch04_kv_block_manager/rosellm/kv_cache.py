"""A contiguous KV cache for one request: every layer's keys and values, preallocated."""

import torch

from .config import ModelConfig


class KVCache:
    """Keys and values of one request, `[num_layers, num_kv_heads, capacity, head_dim]` each.

    Position i of the sequence lives at index i. Prefill writes the prompt's keys and values at once,
    each decode step writes one more; attention reads the first `length` entries.
    """

    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device):
        shape = (config.num_hidden_layers, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # tokens cached in every layer

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' k, v `[1, kv_heads, new, head_dim]` after the cached ones; return
        all of this layer's keys and values `[1, kv_heads, length + new, head_dim]`."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache holds {self.capacity} tokens, {end} were asked for")
        self.keys[layer, :, self.length : end] = k[0]
        self.values[layer, :, self.length : end] = v[0]
        return self.keys[layer, :, :end][None], self.values[layer, :, :end][None]

    def advance(self, num_tokens: int) -> None:
        """Called once every layer has stored the new tokens."""
        self.length += num_tokens

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * itemsize
