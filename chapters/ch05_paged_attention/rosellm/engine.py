"""The inference engine: a model, its tokenizer, the paged KV pool, and one forward. It knows nothing
of requests: sequences reach it as token lists, lengths and block tables."""

import torch

from .attention_metadata import AttentionMetadata
from .kv_pool import KVPool
from .loader import load_model


class InferenceEngine:
    def __init__(self, model=None, device: str = "cpu", dtype: torch.dtype | None = None):
        self.device = torch.device(device)
        self.model, self.tokenizer = load_model(model, self.device, dtype)
        self.config = self.model.config
        self.dtype = self.model.lm_head.weight.dtype
        self.kv_pool: KVPool | None = None

    def bytes_per_token(self) -> int:
        return KVPool.bytes_per_token(self.config, self.dtype)

    def allocate_kv_pool(self, num_blocks: int, block_size: int) -> None:
        self.kv_pool = KVPool(self.config, num_blocks, block_size, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, token_lists: list[list[int]], seq_lens: list[int], block_tables: torch.Tensor) -> torch.Tensor:
        """Run every sequence's new tokens (prefill: the prompt; decode: one token) in one forward.

        seq_lens[b]: sequence b's length once its new tokens are stored; block_tables: [batch, max_blocks]
        with enough blocks for that. Returns hidden states [num_tokens, hidden], sequences end to end.
        """
        metadata = AttentionMetadata.build(
            [len(t) for t in token_lists], seq_lens, block_tables, self.kv_pool.block_size, self.device
        )
        input_ids = torch.tensor([t for tokens in token_lists for t in tokens], device=self.device)  # [num_tokens]
        return self.model(input_ids, metadata, self.kv_pool)

    @torch.inference_mode()
    def last_token_logits(self, hidden: torch.Tensor, token_lists: list[list[int]]) -> torch.Tensor:
        """[num_tokens, hidden] -> logits [batch, vocab_size] of each sequence's last new token."""
        ends = torch.tensor([len(t) for t in token_lists], device=hidden.device).cumsum(0) - 1
        return self.model.compute_logits(hidden[ends])
