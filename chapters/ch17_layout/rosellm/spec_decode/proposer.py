"""What every proposer of speculative tokens is handed and returns (n-gram, draft model)."""

from dataclasses import dataclass
from typing import Protocol

import torch

from ..sampling_params import SamplingParams


@dataclass
class DraftRequest:
    """One sequence that wants drafts this step."""

    key: object  # the sequence itself (hashable by identity): a proposer keeps its state under it, never reads it
    token_ids: list[int]  # the sequence's tokens so far, prompt and output
    num_tokens: int  # drafts wanted, >= 1
    params: SamplingParams
    generator: torch.Generator | None  # the request's random stream (None: torch's global one)


@dataclass
class Draft:
    """Up to `num_tokens` proposed tokens, and the distributions they were drawn from."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] fp32; None: proposed deterministically


class Proposer(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """One draft per request, in order."""
        ...

    def forget(self, key: object) -> None:
        """The sequence `key` finished or was aborted: free whatever the proposer holds for it."""
        ...

    def close(self) -> None:
        """Let go of what the proposer holds (a draft model, its KV pool)."""
        ...
