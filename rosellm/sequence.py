"""A request as the scheduler sees it: token ids, counts and a status. No tensors, no model."""

import enum

from .sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: set[int], max_model_len: int):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.status = SequenceStatus.WAITING
        self.num_cached_tokens = 0  # tokens whose keys and values are in the KV pool
        # The cache holds every token but the last generated one: at most this many.
        self.max_kv_tokens = min(len(prompt_token_ids) + params.max_tokens, max_model_len) - 1

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def pending_token_ids(self) -> list[int]:
        """What the next forward must process: the prompt (prefill), the last token (decode), or
        everything (prefill again after a preemption threw the cache away)."""
        return self.token_ids[self.num_cached_tokens :]

    def append_token(self, token: int) -> str | None:
        """Record a sampled token (the pending ones are now cached); return a finish reason or None."""
        self.num_cached_tokens = self.num_tokens
        self.output_token_ids.append(token)
        params = self.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= self.max_model_len:
            return "length"
        return None
