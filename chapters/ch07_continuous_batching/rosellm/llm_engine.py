"""The step-level engine: requests in, one scheduling step at a time, outputs out (vLLM's names).

The only place where the three parts meet: schedule (bookkeeping) -> run the model (the model runner)
-> sample -> commit to the bookkeeping. A step is a transaction: if the forward or the sampler raises,
the plan is rolled back and the engine is exactly as it was before the step.
"""

import dataclasses
import itertools
import numbers

import torch
from torch.profiler import record_function

from .block_manager import BlockManager
from .block_math import blocks_for
from .detokenizer import IncrementalDetokenizer
from .engine_config import EngineConfig
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .sampling import SamplingParams, make_generator, sample_batch
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence


@dataclasses.dataclass
class RequestState:
    """What the engine keeps per request beside its `Sequence`: what it needs to build outputs."""

    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    text: str = ""

    def output(self, finish_reason: str | None = None) -> RequestOutput:
        """A snapshot for the caller: later steps never change it."""
        seq = self.seq
        return RequestOutput(
            seq.request_id,
            self.prompt,
            list(seq.prompt_token_ids),
            list(seq.output_token_ids),
            self.text,
            finish_reason,
        )


class LLMEngine:
    """model: None (the bundled SmolLM2-135M-Instruct), a `.gguf` file, or a Hugging Face folder.
    `engine_options` are the fields of `EngineConfig` (engine_config.py)."""

    def __init__(self, model=None, device: str = "cpu", dtype: torch.dtype | None = None, **engine_options):
        self.config = config = EngineConfig(**engine_options)
        self.model_runner = ModelRunner(model, device, dtype, config.attention_backend)
        self.model, self.tokenizer = self.model_runner.model, self.model_runner.tokenizer
        context = self.model.config.max_position_embeddings
        self.max_model_len = config.max_model_len or context
        if not 1 < self.max_model_len <= context:
            raise ValueError(f"max_model_len must be in [2, {context}], got {config.max_model_len}")
        eos = self.model.config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.eos_token_ids = {t for t in eos if t is not None}
        num_kv_blocks = config.num_kv_blocks
        if num_kv_blocks is None:
            blocks_per_seq = blocks_for(self.max_model_len, config.block_size)
            affordable = config.kv_cache_memory // (config.block_size * self.model_runner.bytes_per_token())
            num_kv_blocks = max(1, min(affordable, config.max_num_seqs * blocks_per_seq))
        self.block_manager = BlockManager(num_kv_blocks, config.block_size)
        self.model_runner.allocate_kv_pool(num_kv_blocks, config.block_size, self.max_model_len)
        token_budget = config.max_num_batched_tokens or max(self.max_model_len, 2048)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, token_budget, config.watermark_blocks(num_kv_blocks)
        )
        self.requests: dict[str, RequestState] = {}
        self._request_counter = itertools.count()

    # --- requests in ----------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt, sampling_params: SamplingParams | None = None) -> str:
        """Queue a request: `prompt` is a str, a list of token ids, or a dict {"prompt": str} or
        {"prompt_token_ids": [...]}; request_id None picks a free one. Returns the request id.
        Bad input raises ValueError naming the limit, and nothing is queued."""
        request_id = self._new_request_id() if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(sampling_params).__name__}")
        # A copy, validated again: changing the caller's object later must not change this request.
        params = dataclasses.replace(sampling_params) if sampling_params else SamplingParams()
        text, token_ids = self._tokenize(prompt)
        seq = Sequence(request_id, token_ids, params, self.eos_token_ids, self.max_model_len)
        self._check_request(seq)
        generator = make_generator(params.seed, self.model_runner.device)
        self.requests[request_id] = RequestState(seq, text, IncrementalDetokenizer(self.tokenizer), generator)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request, waiting or running; its blocks return to the pool at once."""
        self.requests.pop(str(request_id), None)
        return self.scheduler.abort(str(request_id)) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan (schedule), run (forward and sample), commit (append tokens, finish requests).
        Returns the outputs of the requests that advanced (finished ones have `.finished`).
        If running or sampling raises, the plan is rolled back before the exception propagates."""
        with record_function("rosellm.schedule"):  # labels for torch.profiler (benchmarks/profile)
            plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self.scheduler.waiting and not plan.preempted:  # add_request's checks make this unreachable
                raise RuntimeError(f"request {self.scheduler.waiting[0].request_id!r} can never be scheduled")
            return []
        states = [self.requests[seq.request_id] for seq in plan.scheduled]
        try:
            tokens = self._run(plan, states)
        except BaseException:
            self.scheduler.rollback(plan)
            raise
        with record_function("rosellm.commit"):
            return self._commit(plan, states, tokens)

    def _run(self, plan: SchedulerOutput, states: list[RequestState]) -> list[int]:
        """Forward and sample; on failure, put back what they changed outside the bookkeeping: the blocks
        that preemption handed to other sequences (the forward overwrote them) and the random streams."""
        reused = plan.reused_blocks
        saved_blocks = self.model_runner.save_blocks(reused) if reused else None
        generators = [state.generator for state in states]
        saved_streams = [(g, g.get_state()) for g in generators if g is not None]
        try:
            with record_function("rosellm.forward"):
                hidden = self.model_runner.forward(plan)
            with record_function("rosellm.lm_head"):
                logits = self.model_runner.last_token_logits(hidden, plan)  # [batch, vocab]
            with record_function("rosellm.sample"):
                return sample_batch(logits, [seq.params for seq in plan.scheduled], generators)
        except BaseException:
            if saved_blocks is not None:
                self.model_runner.restore_blocks(reused, saved_blocks)
            for generator, state in saved_streams:
                generator.set_state(state)
            raise

    def _commit(self, plan: SchedulerOutput, states: list[RequestState], tokens: list[int]) -> list[RequestOutput]:
        outputs = []
        for seq, state, token in zip(plan.scheduled, states, tokens):
            finish_reason = seq.append_token(token)
            state.text += state.detokenizer.add(token)
            if finish_reason is not None:
                state.text += state.detokenizer.flush()
                self.scheduler.finish(seq)
                del self.requests[seq.request_id]
            outputs.append(state.output(finish_reason))
        return outputs

    # --- helpers --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [seq, vocab_size] at every position of one sequence (blocks borrowed for the call)."""
        seq = Sequence("prompt_logits", token_ids, SamplingParams(max_tokens=1), set(), self.max_model_len)
        self._check_request(seq)
        self.block_manager.grow(seq, len(token_ids))
        try:
            hidden = self.model_runner.forward(SchedulerOutput([seq], [len(token_ids)]))
        finally:
            self.block_manager.free(seq)
        return self.model.compute_logits(hidden)

    def _new_request_id(self) -> str:
        """The next number not already used by a request in flight (callers may pick numbers too)."""
        while (request_id := str(next(self._request_counter))) in self.requests:
            pass
        return request_id

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids) from any of the accepted prompt shapes."""
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
            return prompt, (self.tokenizer.encode(prompt) if prompt else [])
        if isinstance(prompt, (list, tuple)) and all(
            isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt
        ):
            return None, [int(t) for t in prompt]
        raise ValueError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def _check_request(self, seq: Sequence) -> None:
        """Reject what could never run, even alone: after a preemption a request is prefilled again with
        everything it generated, so its longest cached sequence must fit the pool and one step's budget."""
        name, token_ids = f"request {seq.request_id!r}", seq.prompt_token_ids
        if not token_ids:
            raise ValueError(f"{name}: the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"{name}: the prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} "
                f"leaves room for at most {self.max_model_len - 1} prompt tokens"
            )
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"{name}: the prompt has token ids outside the vocabulary [0, {vocab})")
        if not all(t < vocab for t in seq.params.stop_token_ids):
            raise ValueError(f"{name}: stop_token_ids has ids outside the vocabulary [0, {vocab})")
        budget = self.scheduler.max_num_batched_tokens
        if seq.max_kv_tokens > budget:
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
