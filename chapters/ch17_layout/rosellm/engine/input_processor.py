"""Requests in: a prompt in any accepted shape is tokenized, checked against the engine's limits and built
into the `Sequence` the scheduler queues (vLLM's input processor). It never runs the model.

A request that could never run is refused here with a ValueError naming the limit, before anything is queued.
"""

import dataclasses
import numbers

from ..core.block_manager import BlockManager
from ..core.scheduler import Scheduler
from ..core.sequence import Sequence
from ..sampling_params import SamplingParams


def check_token_ids(token_ids, vocab_size: int, what: str = "the prompt") -> list[int]:
    """`token_ids` as a list of ints; ValueError unless each is an integer (not a bool) in [0, vocab_size)."""
    bad = [t for t in token_ids if not is_token_id(t, vocab_size)]
    if bad:
        raise ValueError(
            f"{what} has token ids outside the vocabulary [0, {vocab_size}) (integers, not bools): {bad[:4]!r:.80}"
        )
    return [int(t) for t in token_ids]


def is_token_id(value, vocab_size: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and 0 <= value < vocab_size


def check_request_id_free(request_id: str, in_flight) -> None:
    """ValueError if `request_id` names a request still in flight (`in_flight`: their ids)."""
    if request_id in in_flight:
        raise ValueError(f"request id {request_id!r} is already in use")


def copy_sampling_params(sampling_params: SamplingParams | None) -> SamplingParams:
    """A copy of the caller's params, validated again (None: the defaults), so that changing the caller's object
    later does not change the request; ValueError for anything but `SamplingParams`."""
    if sampling_params is None:
        return SamplingParams()
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
    return dataclasses.replace(sampling_params)


def tokenize_prompt(prompt, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its checked token ids) from any of the accepted prompt shapes."""
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            prompt = prompt["prompt"]
        elif set(prompt) == {"prompt_token_ids"}:
            prompt = prompt["prompt_token_ids"]
        else:
            raise ValueError(
                'a dict prompt must be {"prompt": str} or {"prompt_token_ids": [int, ...]}, '
                f"got keys {sorted(prompt)}"
            )
    if isinstance(prompt, str):
        return prompt, (tokenizer.encode(prompt) if prompt else [])
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, numbers.Integral) for t in prompt):
        return None, check_token_ids(prompt, vocab_size)
    raise ValueError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")


class InputProcessor:
    """Turns (request id, prompt, sampling params) into a checked `Sequence` for `scheduler`."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: set[int],
        max_model_len: int,
        scheduler: Scheduler,
        block_manager: BlockManager,
    ):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids
        self.max_model_len = max_model_len
        self.scheduler, self.block_manager = scheduler, block_manager

    def process(self, request_id: str, prompt, sampling_params: SamplingParams | None) -> tuple[str | None, Sequence]:
        """(the prompt's text or None, the request's sequence); ValueError naming the limit for bad input."""
        params = copy_sampling_params(sampling_params)
        text, token_ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size)
        check_token_ids(params.stop_token_ids, self.vocab_size, "stop_token_ids")
        seq = Sequence(request_id, token_ids, params, self.eos_token_ids, self.max_model_len)
        self.check_fits(seq)
        return text, seq

    def check_fits(self, seq: Sequence) -> None:
        """Reject what could never run, even alone: after a preemption a request is prefilled again with
        everything it generated, so its longest cached sequence must fit the pool (and, without chunked
        prefill, one step's budget)."""
        name, num_prompt_tokens = f"request {seq.request_id!r}", len(seq.prompt_token_ids)
        if not num_prompt_tokens:
            raise ValueError(f"{name}: the prompt is empty")
        if num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"{name}: the prompt has {num_prompt_tokens} tokens; max_model_len={self.max_model_len} "
                f"leaves room for at most {self.max_model_len - 1} prompt tokens"
            )
        if seq.params.n > self.scheduler.max_num_seqs:
            raise ValueError(
                f"{name}: n={seq.params.n} samples run together, more than max_num_seqs={self.scheduler.max_num_seqs}"
            )
        budget = self.scheduler.max_num_batched_tokens
        if not self.scheduler.enable_chunked_prefill and seq.max_kv_tokens > budget:
            raise ValueError(
                f"{name}: prompt + max_tokens may need a prefill of {seq.max_kv_tokens} tokens, more "
                f"than max_num_batched_tokens={budget} (one step's token budget)"
            )
        needed = self.block_manager.blocks_needed(seq.max_kv_tokens)
        if needed > self.block_manager.num_total_blocks:
            raise ValueError(
                f"{name}: prompt + max_tokens need {needed} KV blocks of {self.block_manager.block_size} "
                f"tokens, the pool has num_kv_blocks={self.block_manager.num_total_blocks}"
            )
