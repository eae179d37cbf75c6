"""The step-level engine: requests in, one scheduling step at a time, outputs out (vLLM's names).

The only place where the three parts meet: schedule (bookkeeping) -> run the model (the model runner)
-> sample -> commit to the bookkeeping. Requests come in through the input processor (tokenize, check,
build the sequence) and leave through their `RequestState` (text, outputs). A step is a transaction: if the
forward or the sampler raises, the plan is rolled back and the engine is exactly as it was before the step.
"""

import itertools
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .engine_config import EngineConfig
from .input_processor import InputProcessor
from .loader import load_tokenizer, resolve_model_folder
from .model_runner import ModelRunner
from .output_processor import RequestState
from .outputs import RequestOutput
from .sampling import SamplingParams, make_generator, sample_batch
from .scheduler import Scheduler, SchedulerOutput


class StepError(RuntimeError):
    """A step's forward or sampling raised (the error is the `__cause__`); the engine is as it was before
    the step. `request_ids`: the requests the step had scheduled."""

    def __init__(self, request_ids: list[str], error: Exception):
        super().__init__(f"a step running requests {request_ids} failed: {error!r}")
        self.request_ids = request_ids


@dataclass(frozen=True)
class EngineStats:
    """The engine's load between steps, for its users: requests by queue, and the KV pool."""

    running_requests: frozenset[str]  # requests with a sequence running
    waiting_requests: frozenset[str]  # requests with a sequence waiting
    num_free_blocks: int
    num_total_blocks: int

    @property
    def unfinished_requests(self) -> frozenset[str]:
        return self.running_requests | self.waiting_requests


class LLMEngine:
    """model: None (the bundled SmolLM2-135M-Instruct), a `.gguf` file, or a Hugging Face folder.
    `engine_options` are the fields of `EngineConfig` (engine_config.py)."""

    def __init__(self, model=None, device: str = "cpu", dtype: torch.dtype | None = None, **engine_options):
        self.config = config = EngineConfig(**engine_options)
        self.tokenizer = load_tokenizer(resolve_model_folder(model))
        self.model_runner = ModelRunner(model, device, dtype, config.attention_backend)
        self.model = self.model_runner.model
        context = self.model.config.max_position_embeddings
        self.max_model_len = config.max_model_len or context
        if not 1 < self.max_model_len <= context:
            raise ValueError(f"max_model_len must be in [2, {context}], got {config.max_model_len}")
        eos = self.model.config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.eos_token_ids = {t for t in eos if t is not None}
        num_kv_blocks = config.kv_pool_blocks(self.max_model_len, self.model_runner.bytes_per_token())
        self.block_manager = BlockManager(num_kv_blocks, config.block_size)
        self.model_runner.allocate_kv_pool(num_kv_blocks, config.block_size, self.max_model_len)
        token_budget = config.max_num_batched_tokens or max(self.max_model_len, 2048)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, token_budget, config.watermark_blocks(num_kv_blocks)
        )
        self.input_processor = InputProcessor(
            self.tokenizer,
            self.model.config.vocab_size,
            self.eos_token_ids,
            self.max_model_len,
            self.scheduler,
            self.block_manager,
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
        text, seq = self.input_processor.process(request_id, prompt, sampling_params)
        generator = make_generator(seq.params.seed, self.model_runner.device)
        self.requests[request_id] = RequestState(seq, text, IncrementalDetokenizer(self.tokenizer), generator)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request, waiting or running; its blocks return to the pool at once."""
        self.requests.pop(str(request_id), None)
        return self.scheduler.abort(str(request_id)) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """A snapshot of the queues and the KV pool (what `LLM` and metrics read between steps)."""
        return EngineStats(
            frozenset(seq.request_id for seq in self.scheduler.running),
            frozenset(seq.request_id for seq in self.scheduler.waiting),
            self.block_manager.num_free_blocks,
            self.block_manager.num_total_blocks,
        )

    # --- one step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan (schedule), run (forward and sample), commit (append tokens, finish requests).
        Returns the outputs of the requests that advanced (finished ones have `.finished`).
        If running or sampling raises, the plan is rolled back and `StepError` names the requests the step
        held (an interruption such as KeyboardInterrupt propagates as it is, after the rollback)."""
        with record_function("rosellm.schedule"):  # labels for torch.profiler (benchmarks/profile)
            plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self.scheduler.waiting and not plan.preempted:  # the input processor refuses such requests
                raise RuntimeError(f"request {self.scheduler.waiting[0].request_id!r} can never be scheduled")
            return []
        states = [self.requests[seq.request_id] for seq in plan.scheduled]
        try:
            tokens = self._run(plan, states)
        except BaseException as error:
            self.scheduler.rollback(plan)
            if isinstance(error, Exception):
                raise StepError([seq.request_id for seq in plan.scheduled], error) from error
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
            state.add_token(token, finish_reason)
            if finish_reason is not None:
                self.scheduler.finish(seq)
                del self.requests[seq.request_id]
            outputs.append(state.output(finish_reason))
        return outputs

    # --- helpers --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [seq, vocab_size] at every position of one sequence (blocks borrowed for the call)."""
        _, seq = self.input_processor.process("prompt_logits", token_ids, SamplingParams(max_tokens=1))
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
