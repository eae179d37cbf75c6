"""Many requests' caches merged for one forward: padded to the longest, masked, split back."""

import torch

from .kv_cache import KVCache


class BatchedKVCache:
    """Presents the contiguous caches of a batch of sessions to the model as one padded tensor per layer.

    For each layer, the new keys and values of row b (its first `new_lens[b]` tokens, the rest is
    padding) go into session b's own cache; then every row's cache is copied into a zero-padded
    `[batch, kv_heads, longest, head_dim]` tensor for attention. The attention mask hides the
    padding. The copies and the padded slots are the price of this design (chapters 04-05 remove them).
    """

    def __init__(self, caches: list[KVCache], new_lens: list[int]):
        self.caches = caches
        self.new_lens = new_lens

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # k, v: [batch, kv_heads, width, head_dim] -> [batch, kv_heads, longest, head_dim]
        rows = [
            cache.update(layer, k[b : b + 1, :, :n], v[b : b + 1, :, :n])  # split: row b into its cache
            for b, (cache, n) in enumerate(zip(self.caches, self.new_lens))
        ]
        longest = max(keys.shape[2] for keys, _ in rows)
        padded_k = k.new_zeros(len(rows), k.shape[1], longest, k.shape[3])
        padded_v = torch.zeros_like(padded_k)
        for b, (keys, values) in enumerate(rows):  # merge: pad every row to the longest
            padded_k[b, :, : keys.shape[2]] = keys[0]
            padded_v[b, :, : values.shape[2]] = values[0]
        return padded_k, padded_v

    def advance(self, num_tokens: int) -> None:
        """Every layer has written the new tokens: each cache grows by its own row's count."""
        for cache, n in zip(self.caches, self.new_lens):
            cache.advance(n)
