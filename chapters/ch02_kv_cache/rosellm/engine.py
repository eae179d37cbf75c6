"""The inference engine: a model, its tokenizer, and one forward pass. It knows nothing of requests."""

import torch

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
    def forward(self, token_ids: list[int], cache: KVCache) -> torch.Tensor:
        """Run the new tokens through the model after what `cache` holds, and store their keys and
        values in it. Returns the logits [len(token_ids), vocab_size].

        Prefill passes the whole prompt; each decode step passes one token.
        """
        input_ids = torch.tensor([token_ids], device=self.device)  # [1, new]
        positions = torch.arange(cache.length, cache.length + len(token_ids), device=self.device)[None]
        hidden = self.model(input_ids, positions, cache)  # [1, new, hidden]
        return self.model.compute_logits(hidden[0])
