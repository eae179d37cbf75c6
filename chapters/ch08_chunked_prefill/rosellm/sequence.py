"""A request as the engine sees it: the one record of its state. No tensors, no model.

Everything about a request that can change lives here, and only here: its tokens, how many of them are
in the KV pool (`num_computed_tokens`: the one counter of its progress, through a prompt that may take
several steps and then one token a step), the blocks that hold them (`block_table`) and its status. The
block manager allocates and frees *for* a sequence, and the model runner reads the batch's tensors from
the scheduled sequences; neither keeps a second copy that would have to be kept in step.
"""

import enum
from dataclasses import dataclass

from .sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SequenceState:
    """What a step may change in a sequence, saved so that a failed step can put it back."""

    status: SequenceStatus
    num_computed_tokens: int
    block_table: tuple[int, ...]


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int],
        max_model_len: int,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # max_tokens=None: as many as max_model_len leaves room for
        self.max_tokens = max_model_len - len(prompt_token_ids) if params.max_tokens is None else params.max_tokens
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose keys and values are in the KV pool
        self.block_table: list[int] = []  # the pool blocks holding them, in order
        # The cache holds every token but the last generated one: at most this many.
        self.max_kv_tokens = min(len(prompt_token_ids) + self.max_tokens, max_model_len) - 1

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens not yet in the KV pool: the rest of the prompt (prefill), 1 (decode), or everything
        (prefill again after a preemption threw the cache away)."""
        return self.num_tokens - self.num_computed_tokens

    def save(self) -> SequenceState:
        return SequenceState(self.status, self.num_computed_tokens, tuple(self.block_table))

    def restore(self, state: SequenceState) -> None:
        self.status = state.status
        self.num_computed_tokens = state.num_computed_tokens
        self.block_table = list(state.block_table)

    def append_token(self, token: int) -> str | None:
        """Record a sampled token; return a finish reason or None."""
        self.output_token_ids.append(token)
        params = self.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(self.output_token_ids) >= self.max_tokens or self.num_tokens >= self.max_model_len:
            return "length"
        return None
