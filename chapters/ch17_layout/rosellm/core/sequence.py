"""A request as the engine sees it: the one record of its state. No tensors, no model.

Everything about a request that can change lives here, and only here: its tokens, how many of them are
in the KV pool (`num_computed_tokens`: the one counter of its progress, through a prompt that may take
several steps and then one token a step), the blocks that hold them (`block_table`) and its status. The
block manager allocates and frees *for* a sequence, and the model runner reads the batch's tensors from
the scheduled sequences; neither keeps a second copy that would have to be kept in step.

A request asking for n samples (`SamplingParams.n`) starts as one sequence, which prefills the prompt;
at its first token it forks into n sequences (`index` 0 .. n-1) that share the prompt's blocks.
"""

import enum
from dataclasses import dataclass

from ..sampling_params import SamplingParams


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
    num_cached_tokens: int | None


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: set[int],
        max_model_len: int,
        index: int = 0,
    ):
        self.request_id = request_id
        self.index = index  # which of the request's n samples
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
        self.block_hashes: list[bytes] = []  # hash chain of its full blocks of tokens, as far as needed so far
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first admitted
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

    @property
    def will_fork(self) -> bool:
        """A request's one sequence before its first token, when it asked for n > 1 samples."""
        return self.params.n > 1 and not self.output_token_ids

    @property
    def num_seats(self) -> int:
        """Places it takes among `max_num_seqs` running sequences: n for one that will fork, else 1."""
        return self.params.n if self.will_fork else 1

    def fork(self, index: int) -> "Sequence":
        """Sample `index` of the same request: same tokens and progress; the block manager shares the blocks."""
        child = Sequence(
            self.request_id, self.prompt_token_ids, self.params, self.eos_token_ids, self.max_model_len, index
        )
        child.output_token_ids = list(self.output_token_ids)
        child.status, child.num_computed_tokens = self.status, self.num_computed_tokens
        child.block_hashes, child.num_cached_tokens = list(self.block_hashes), self.num_cached_tokens
        return child

    def save(self) -> SequenceState:
        return SequenceState(self.status, self.num_computed_tokens, tuple(self.block_table), self.num_cached_tokens)

    def restore(self, state: SequenceState) -> None:
        self.status = state.status
        self.num_computed_tokens = state.num_computed_tokens
        self.block_table = list(state.block_table)
        self.num_cached_tokens = state.num_cached_tokens

    def append_token(self, token: int) -> str | None:
        """Record a sampled token; return a finish reason or None."""
        self.output_token_ids.append(token)
        params = self.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(self.output_token_ids) >= self.max_tokens or self.num_tokens >= self.max_model_len:
            return "length"
        return None
