"""The inference engine: a model, its tokenizer, and one batched forward. It knows nothing of requests."""

import torch

from .batch_kv_cache import BatchedKVCache
from .kv_cache import KVCache
from .loader import load_model


class InferenceEngine:
    def __init__(self, model=None, device: str = "cpu", dtype: torch.dtype | None = None):
        self.device = torch.device(device)
        self.model, self.tokenizer = load_model(model, self.device, dtype)
        self.config = self.model.config
        self.dtype = self.model.lm_head.weight.dtype

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.config, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, token_lists: list[list[int]], caches: list[KVCache]) -> torch.Tensor:
        """Run row b's new tokens after what `caches[b]` holds, all rows in one padded batch, and store
        their keys and values. Prefill passes whole prompts, decode one token per row.

        Returns hidden states [batch, width, hidden]; row b's real tokens are its first
        len(token_lists[b]), the rest is padding.
        """
        new_lens = [len(tokens) for tokens in token_lists]
        width = max(new_lens)
        input_ids = torch.zeros(len(token_lists), width, dtype=torch.long)  # [batch, width], 0-padded
        for b, tokens in enumerate(token_lists):
            input_ids[b, : len(tokens)] = torch.tensor(tokens)
        cached = torch.tensor([cache.length for cache in caches])  # [batch]
        new = torch.tensor(new_lens)  # [batch]
        # Row b's tokens sit at positions cached[b], cached[b] + 1, ...; padding slots repeat the last
        # real position, so that they have keys to attend to (their outputs are thrown away).
        offsets = torch.minimum(torch.arange(width)[None], new[:, None] - 1)
        positions = cached[:, None] + offsets  # [batch, width]
        # Each cache keeps position i at index i, padded after its last token. A query sees the keys at
        # or before its own position (causal) and never the padding after its row's end.
        key_index = torch.arange(int((cached + new).max()))
        causal = key_index[None, None, :] <= positions[:, :, None]  # [batch, width, keys]
        not_padding = key_index[None, None, :] < (cached + new)[:, None, None]  # [batch, 1, keys]
        mask = causal & not_padding
        batch_cache = BatchedKVCache(caches, new_lens)
        to = self.device
        return self.model(input_ids.to(to), positions.to(to), mask.to(to), batch_cache)

    @torch.inference_mode()
    def last_token_logits(self, hidden: torch.Tensor, token_lists: list[list[int]]) -> torch.Tensor:
        """[batch, width, hidden] -> logits [batch, vocab_size] of each row's last real token."""
        last = torch.tensor([len(tokens) - 1 for tokens in token_lists], device=hidden.device)
        return self.model.compute_logits(hidden[torch.arange(len(token_lists), device=hidden.device), last])
