"""The step-level engine: requests in, one scheduling step at a time, outputs out (vLLM's names).

The only place where the three parts meet: schedule (bookkeeping) -> run the model (the model runner)
-> sample -> commit to the bookkeeping. A step is a transaction: if the forward or the sampler raises,
the plan is rolled back and the engine is exactly as it was before the step. A request for n samples
is one sequence until its prompt is computed; at its first token it forks into n.
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
from .outputs import CompletionOutput, RequestOutput
from .sampling import SamplingParams, make_generators, sample_batch
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Sequence
from .stop_strings import StopStringMatcher


@dataclasses.dataclass
class RequestState:
    """What the engine keeps per request beside its sequences (one per sample, indexed by `seq.index`;
    only the first until the prompt is computed): what it needs to sample and to build outputs."""

    seqs: list[Sequence]
    prompt: str | None
    detokenizers: list[IncrementalDetokenizer]
    generators: list[torch.Generator | None]  # one per sample
    texts: list[str]  # released text: a possible start of a stop string is held back by its matcher
    finish_reasons: list[str | None]
    stop_matchers: list[StopStringMatcher]

    @property
    def finished(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)

    def output(self) -> RequestOutput:
        """A snapshot for the caller: later steps never change it."""
        first = self.seqs[0]
        completions = [
            CompletionOutput(
                seq.index, list(seq.output_token_ids), self.texts[seq.index], self.finish_reasons[seq.index]
            )
            for seq in self.seqs
        ]
        return RequestOutput(
            first.request_id, self.prompt, list(first.prompt_token_ids), completions, first.num_cached_tokens or 0
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
        n = params.n
        self.requests[request_id] = RequestState(
            [seq],
            text,
            [IncrementalDetokenizer(self.tokenizer) for _ in range(n)],
            make_generators(params, self.model_runner.device),
            [""] * n,
            [None] * n,
            [StopStringMatcher(params.stop) for _ in range(n)],
        )
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request, waiting or running, all its samples; their blocks return to the pool at once."""
        self.requests.pop(str(request_id), None)
        return self.scheduler.abort(str(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Plan (schedule), run (forward and sample), commit (count computed tokens, append sampled ones,
        finish requests). Returns the outputs of the requests that got a token (finished ones have
        `.finished`); a request whose prompt chunk did not reach its end gets none this step.
        If running or sampling raises, the plan is rolled back before the exception propagates."""
        with record_function("rosellm.schedule"):  # labels for torch.profiler (benchmarks/profile)
            plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self.scheduler.waiting and not plan.preempted:  # add_request's checks make this unreachable
                raise RuntimeError(f"request {self.scheduler.waiting[0].request_id!r} can never be scheduled")
            return []
        draws = self._draws(plan)
        try:
            tokens = self._run(plan, draws)
        except BaseException:
            self.scheduler.rollback(plan)
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
        saved_blocks = self.model_runner.save_blocks(overwritten) if overwritten else None
        generators = [state.generators[index] for state, index, _ in draws]
        saved_streams = [(g, g.get_state()) for g in generators if g is not None]
        try:
            with record_function("rosellm.forward"):
                self.model_runner.copy_blocks(plan.copies)
                hidden = self.model_runner.forward(plan)
            with record_function("rosellm.lm_head"):
                logits = self.model_runner.sampling_logits(hidden, plan)  # [rows that sample, vocab]
                if len(draws) > len(logits):  # a forking prompt samples n times from its row
                    logits = logits[[row for _, _, row in draws]]  # [len(draws), vocab]
            with record_function("rosellm.sample"):
                return sample_batch(logits, [state.seqs[0].params for state, _, _ in draws], generators)
        except BaseException:
            if saved_blocks is not None:
                self.model_runner.restore_blocks(overwritten, saved_blocks)
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
            seq = state.seqs[index]
            finish_reason = seq.append_token(token)
            piece = state.detokenizers[index].add(token)
            if finish_reason is not None:
                piece += state.detokenizers[index].flush()
            matcher = state.stop_matchers[index]
            state.texts[index] += matcher.add(piece, final=finish_reason is not None)
            if matcher.stopped:
                finish_reason = "stop"
            if finish_reason is not None:
                state.finish_reasons[index] = finish_reason
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
        state.seqs += children

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
        everything it generated, so its longest cached sequence must fit the pool (and, without chunked
        prefill, one step's budget)."""
        name, token_ids = f"request {seq.request_id!r}", seq.prompt_token_ids
        if not token_ids:
            raise ValueError(f"{name}: the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"{name}: the prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} "
                f"leaves room for at most {self.max_model_len - 1} prompt tokens"
            )
        if seq.params.n > self.scheduler.max_num_seqs:
            raise ValueError(
                f"{name}: n={seq.params.n} samples run together, more than max_num_seqs={self.scheduler.max_num_seqs}"
            )
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"{name}: the prompt has token ids outside the vocabulary [0, {vocab})")
        if not all(t < vocab for t in seq.params.stop_token_ids):
            raise ValueError(f"{name}: stop_token_ids has ids outside the vocabulary [0, {vocab})")
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
