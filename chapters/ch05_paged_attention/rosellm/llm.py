"""The `LLM` facade, chapter 05: batched decoding on a paged KV cache."""

import dataclasses
import itertools
from collections.abc import Generator, Sequence

import torch
from tqdm.auto import tqdm

from .block_manager import BlockManager
from .block_math import blocks_for
from .engine import InferenceEngine
from .outputs import RequestOutput
from .sampling import SamplingParams
from .scheduler import OfflineScheduler
from .session import InferenceSession

Prompt = str | Sequence[int]


class LLM:
    """Load a model and generate text.

    model: None (the bundled SmolLM2-135M-Instruct), a `.gguf` file, or a Hugging Face folder.
    max_model_len: the longest sequence (prompt + generated tokens); defaults to the model's context.
    max_batch_size: how many requests decode together.
    block_size: KV slots per block. num_kv_blocks: blocks in the pool; when not given, as many as
    `kv_cache_memory` bytes hold, but no more than max_batch_size sequences of max_model_len tokens need.
    """

    def __init__(
        self,
        model=None,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        max_model_len: int | None = None,
        max_batch_size: int = 32,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int = 1 << 30,
    ):
        self.engine = InferenceEngine(model, device, dtype)
        self.model, self.tokenizer = self.engine.model, self.engine.tokenizer
        config = self.model.config
        self.max_model_len = max_model_len or config.max_position_embeddings
        if not 1 < self.max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {config.max_position_embeddings}], got {max_model_len}")
        eos = config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.eos_token_ids = {t for t in eos if t is not None}
        self._request_ids = itertools.count()
        if num_kv_blocks is None:
            blocks_per_seq = blocks_for(self.max_model_len, block_size)
            affordable = kv_cache_memory // (block_size * self.engine.bytes_per_token())
            num_kv_blocks = min(affordable, max_batch_size * blocks_per_seq)
        self.block_manager = BlockManager(num_kv_blocks, block_size)
        self.engine.allocate_kv_pool(num_kv_blocks, block_size)
        self.scheduler = OfflineScheduler(self.engine, max_batch_size, self.block_manager)

    # --- public API -----------------------------------------------------------------------------------

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params=None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched; outputs come back in input order."""
        requests = self._make_requests(prompts, sampling_params)
        sessions = []
        try:
            for output, params in requests:
                sessions.append(self._new_session(output, params))
                self.scheduler.add_request(sessions[-1])
            with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as progress:
                while self.scheduler.has_unfinished_requests():
                    finished = sum(session.finished for session, _ in self.scheduler.step())
                    progress.update(finished)
        finally:  # left by an exception (Ctrl-C included): none of our requests stays queued
            for session in sessions:
                self.scheduler.abort(session)
        return [output for output, _ in requests]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Generator[str, None, RequestOutput]:
        """Generate for one prompt, yielding text pieces as soon as they are complete characters.
        The generator's return value (`StopIteration.value`) is the finished `RequestOutput`.
        Closing it early (or an exception) drops the request."""
        session = self.add_request(prompt, sampling_params)
        try:
            while not session.finished:
                for stepped, piece in self.scheduler.step():
                    if stepped is session and piece:
                        yield piece
        finally:
            self.scheduler.abort(session)
        return session.output

    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> InferenceSession:
        """Check one prompt and queue it on the scheduler; return its session (whose `.output` fills in as
        `self.scheduler.step()` runs). For driving the scheduler step by step; `stream` uses it."""
        [(output, params)] = self._make_requests([prompt], sampling_params)
        session = self._new_session(output, params)
        self.scheduler.add_request(session)
        return session

    @torch.inference_mode()
    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [seq, vocab_size] at every position of one sequence: what tests compare with
        transformers. Every chapter keeps this working through its own forward path."""
        token_ids = list(token_ids)
        self._check_prompt(0, token_ids)
        self._check_fits_pool(0, len(token_ids) + 1)
        blocks = self.block_manager.allocate("prompt_logits", len(token_ids))
        try:
            table = torch.tensor([blocks], dtype=torch.int32)
            hidden = self.engine.forward([token_ids], [len(token_ids)], table)
        finally:
            self.block_manager.free("prompt_logits")
        return self.model.compute_logits(hidden)

    def _new_session(self, output: RequestOutput, params: SamplingParams) -> InferenceSession:
        return InferenceSession(self.engine, output, params, self.eos_token_ids, self.max_model_len)

    # --- input checks -------------------------------------------------------------------------------

    def _make_requests(self, prompts, sampling_params) -> list[tuple[RequestOutput, SamplingParams]]:
        """Validate everything before any work starts, so bad input never leaves half-done state."""
        prompts = normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        requests = []
        for index, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            params = self._check_params(index, params)
            token_ids = self._tokenize(prompt)
            self._check_prompt(index, token_ids)
            self._check_fits_pool(index, len(token_ids) + params.max_tokens)
            text = prompt if isinstance(prompt, str) else None
            output = RequestOutput(str(next(self._request_ids)), text, token_ids)
            requests.append((output, params))
        return requests

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt) if prompt else []
        return [int(t) for t in prompt]

    def _check_prompt(self, index: int, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError(f"prompt {index} is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(token_ids)} tokens; max_model_len={self.max_model_len} leaves room "
                f"for at most {self.max_model_len - 1} prompt tokens"
            )
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt {index} has token ids outside [0, {vocab})")

    def _check_params(self, index: int, params) -> SamplingParams:
        """A checked copy (validated again: changing the caller's object later must not change this request)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params {index} must be SamplingParams, got {type(params).__name__}")
        params = dataclasses.replace(params)
        vocab = self.model.config.vocab_size
        if not all(t < vocab for t in params.stop_token_ids):
            raise ValueError(f"prompt {index}: stop_token_ids has ids outside the vocabulary [0, {vocab})")
        return params

    def _check_fits_pool(self, index: int, longest: int) -> None:
        """A request whose longest sequence needs more blocks than the whole pool could never run."""
        kv_tokens = min(longest, self.max_model_len) - 1  # the last token is never cached
        needed = self.block_manager.blocks_needed(kv_tokens)
        if needed > self.block_manager.num_total_blocks:
            raise ValueError(
                f"prompt {index} with max_tokens needs {needed} KV blocks of {self.block_manager.block_size} "
                f"tokens, the pool has only num_kv_blocks={self.block_manager.num_total_blocks}"
            )


def normalize_prompts(prompts) -> list[Prompt]:
    """A str, a list of str, one list of token ids, or a list of token-id lists -> a list of prompts.
    Any other prompt raises ValueError (dict prompts such as {"prompt": str} arrive in chapter 07)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        prompts = [prompts]
    for p in prompts:
        if not isinstance(p, str) and not (isinstance(p, (list, tuple)) and all(is_token_id(t) for t in p)):
            raise ValueError(
                f"a prompt must be a str or a list of int token ids (dict prompts come with chapter 07), got {p!r:.80}"
            )
    return prompts


def is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
