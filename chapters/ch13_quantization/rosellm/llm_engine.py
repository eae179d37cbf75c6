"""The step-level engine: requests in, one scheduling step at a time, outputs out (vLLM's names).

The only place where the three parts meet: schedule (bookkeeping) -> run the model (the model runner)
-> sample -> commit to the bookkeeping. Requests come in through the input processor (tokenize, check,
build the sequence) and leave through their `RequestState` (text, outputs). A step is a
transaction: if the forward or the sampler raises, the plan is rolled back and the engine is exactly as it
was before the step. A request for n samples is one sequence until its prompt is computed; at its first token
it forks into n.
"""

import itertools
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from .block_manager import BlockManager
from .engine_config import EngineConfig
from .input_processor import InputProcessor
from .loader import load_tokenizer, tokenizer_folder
from .model_runner import ModelRunner
from .output_processor import RequestState
from .outputs import RequestOutput
from .parallel_runner import TensorParallelRunner
from .quantization import check_options
from .sampling import SamplingParams, make_generators, sample_batch
from .scheduler import Scheduler, SchedulerOutput
from .step_inputs import StepInputs


class StepError(RuntimeError):
    """A step's forward or sampling raised (the error is the `__cause__`); the engine is as it was before
    the step. `request_ids`: the requests the step had scheduled."""

    def __init__(self, request_ids: list[str], error: Exception):
        super().__init__(f"a step running requests {request_ids} failed: {error!r}")
        self.request_ids = request_ids


@dataclass(frozen=True)
class EngineStats:
    """The engine's load between steps, for its users: requests by queue, the KV pool, the prefix cache."""

    running_requests: frozenset[str]  # requests with a sequence running
    waiting_requests: frozenset[str]  # requests with a sequence waiting
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, since the engine started
    prefix_cache_hits: int  # of those, tokens found there

    @property
    def unfinished_requests(self) -> frozenset[str]:
        return self.running_requests | self.waiting_requests


class LLMEngine:
    """model: None (the bundled SmolLM2-135M-Instruct), a `.gguf` file, or a Hugging Face folder.
    dtype: "auto" (None), "float32", "bfloat16" or a torch.dtype (quantization.py says which "auto" picks).
    `engine_options` are the fields of `EngineConfig` (engine_config.py), `quantization` among them."""

    def __init__(self, model=None, device: str = "cpu", dtype: torch.dtype | str | None = None, **engine_options):
        self.config = config = EngineConfig(**engine_options)
        dtype = check_options(model, device, dtype, config.quantization)  # before any weight is read
        self.tokenizer = load_tokenizer(tokenizer_folder(model, config.quantization))
        runner_args = (model, device, dtype, config.attention_backend, config.enforce_eager)
        if config.tensor_parallel_size > 1:  # this process becomes rank 0 of tensor_parallel_size
            self.model_runner = TensorParallelRunner(*runner_args, config.tensor_parallel_size)
        else:
            self.model_runner = ModelRunner(*runner_args, quantization=config.quantization)
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        """Everything beside the model: limits, the block manager, the KV pool, the scheduler, the input
        processor."""
        self.model = self.model_runner.model
        context = self.model.config.max_position_embeddings
        self.max_model_len = config.max_model_len or context
        if not 1 < self.max_model_len <= context:
            raise ValueError(f"max_model_len must be in [2, {context}], got {config.max_model_len}")
        eos = self.model.config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.eos_token_ids = {t for t in eos if t is not None}
        num_kv_blocks = config.kv_pool_blocks(self.max_model_len, self.model_runner.bytes_per_token())
        self.block_manager = BlockManager(num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.model_runner.allocate_kv_pool(num_kv_blocks, config.block_size, self.max_model_len)
        default_budget = 2048 if config.enable_chunked_prefill else max(self.max_model_len, 2048)
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens or default_budget,
            config.watermark_blocks(num_kv_blocks),
            config.enable_chunked_prefill,
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
        self._prefix_cache_queries = self._prefix_cache_hits = 0

    # --- requests in ----------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt, sampling_params: SamplingParams | None = None) -> str:
        """Queue a request: `prompt` is a str, a list of token ids, or a dict {"prompt": str} or
        {"prompt_token_ids": [...]}; request_id None picks a free one. Returns the request id.
        Bad input raises ValueError naming the limit, and nothing is queued."""
        request_id = self._new_request_id() if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, seq = self.input_processor.process(request_id, prompt, sampling_params)
        generators = make_generators(seq.params, self.model_runner.device)
        self.requests[request_id] = RequestState.start(text, seq, self.tokenizer, generators)
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request, waiting or running, all its samples; their blocks return to the pool at once."""
        self.requests.pop(str(request_id), None)
        return self.scheduler.abort(str(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        """A snapshot of the queues, the KV pool and the prefix cache (what `LLM`, the server and its
        metrics read between steps)."""
        return EngineStats(
            frozenset(seq.request_id for seq in self.scheduler.running),
            frozenset(seq.request_id for seq in self.scheduler.waiting),
            self.block_manager.num_free_blocks,
            self.block_manager.num_total_blocks,
            self._prefix_cache_queries,
            self._prefix_cache_hits,
        )

    def close(self) -> None:
        """Let the model runner go: with tensor parallelism, its worker processes stop."""
        self.model_runner.close()

    # --- one step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan (schedule), run (forward and sample), commit (count computed tokens, append sampled ones,
        finish requests). Returns the outputs of the requests that got a token (finished ones have
        `.finished`); a request whose prompt chunk did not reach its end gets none this step.
        If running or sampling raises, the plan is rolled back and `StepError` names the requests the step
        held (an interruption such as KeyboardInterrupt propagates as it is, after the rollback)."""
        with record_function("rosellm.schedule"):  # labels for torch.profiler (benchmarks/profile)
            plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self.scheduler.waiting and not plan.preempted:  # the input processor refuses such requests
                raise RuntimeError(f"request {self.scheduler.waiting[0].request_id!r} can never be scheduled")
            return []
        draws = self._draws(plan)
        try:
            tokens = self._run(plan, draws)
        except BaseException as error:
            self.scheduler.rollback(plan)
            if isinstance(error, Exception):
                raise StepError([seq.request_id for seq in plan.scheduled], error) from error
            raise
        with record_function("rosellm.commit"):
            return self._commit(plan, draws, tokens)

    def _draws(self, plan: SchedulerOutput) -> list[tuple[RequestState, int, int]]:
        """The tokens this step samples, as (request, sample index, row of the sampling logits): one per
        row that reaches its sequence's end, and n from the same row for a prompt about to fork."""
        draws = []
        for row, seq in enumerate(seq for seq, sample in zip(plan.scheduled, plan.samples) if sample):
            state = self.requests[seq.request_id]
            draws += [(state, index, row) for index in (range(seq.params.n) if seq.will_fork else [seq.index])]
        return draws

    def _run(self, plan: SchedulerOutput, draws: list[tuple[RequestState, int, int]]) -> list[int]:
        """Copy shared blocks being written, forward, sample (one token per draw); on failure, put back
        what they changed outside the bookkeeping: the blocks they overwrote that a rolled-back engine
        may read again, and the random streams."""
        overwritten = self.scheduler.overwritten_blocks(plan)
        if overwritten:
            self.model_runner.save_blocks(overwritten)
        generators = [state.samples[index].generator for state, index, _ in draws]
        saved_streams = [(g, g.get_state()) for g in generators if g is not None]
        try:
            with record_function("rosellm.forward"):
                self.model_runner.copy_blocks(plan.copies)
                inputs = StepInputs.from_plan(plan)
                hidden = self.model_runner.forward(inputs)
            with record_function("rosellm.lm_head"):
                logits = self.model_runner.sampling_logits(hidden, inputs)  # [rows that sample, vocab]
                if len(draws) > len(logits):  # a forking prompt samples n times from its row
                    logits = logits[[row for _, _, row in draws]]  # [len(draws), vocab]
            with record_function("rosellm.sample"):
                return sample_batch(logits, [state.seqs[0].params for state, _, _ in draws], generators)
        except BaseException:
            if overwritten:
                self.model_runner.restore_blocks()
            for generator, state in saved_streams:
                generator.set_state(state)
            raise

    def _commit(
        self, plan: SchedulerOutput, draws: list[tuple[RequestState, int, int]], tokens: list[int]
    ) -> list[RequestOutput]:
        for seq, num_new in zip(plan.scheduled, plan.num_new_tokens):
            self.block_manager.commit_computed(seq, num_new)  # counts them, caches the blocks they filled
        for state in {id(state): state for state, _, _ in draws}.values():
            if state.seqs[0].will_fork:
                self._fork(state)
        advanced: dict[str, RequestState] = {}
        for (state, index, _), token in zip(draws, tokens):
            seq = state.samples[index].seq
            if index == 0 and not seq.output_token_ids:  # the request's first token: its prompt is computed
                self._prefix_cache_queries += len(seq.prompt_token_ids)
                self._prefix_cache_hits += seq.num_cached_tokens or 0
            if state.add_token(index, token, seq.append_token(token)) is not None:
                self.scheduler.finish(seq)
            advanced[seq.request_id] = state
        for request_id, state in advanced.items():
            if state.finished:
                del self.requests[request_id]
        return [state.output() for state in advanced.values()]

    def _fork(self, state: RequestState) -> None:
        """The prompt is computed: samples 1 .. n-1 start as copies of sample 0, sharing its blocks."""
        parent = state.seqs[0]
        children = [parent.fork(index) for index in range(1, parent.params.n)]
        for child in children:
            self.block_manager.fork(parent, child)
        self.scheduler.add_forks(parent, children)
        for child in children:
            state.samples[child.index].seq = child

    # --- helpers --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [seq, vocab_size] at every position of one sequence (blocks borrowed for the call)."""
        _, seq = self.input_processor.process("prompt_logits", token_ids, SamplingParams(max_tokens=1))
        self.block_manager.grow(seq, len(token_ids))
        try:
            hidden = self.model_runner.forward(StepInputs.from_plan(SchedulerOutput([seq], [len(token_ids)])))
        finally:
            self.block_manager.free(seq)
        return self.model.compute_logits(hidden)

    def _new_request_id(self) -> str:
        """The next number not already used by a request in flight (callers may pick numbers too)."""
        while (request_id := str(next(self._request_counter))) in self.requests:
            pass
        return request_id
