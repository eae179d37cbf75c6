"""The step-level engine: requests in, one scheduling step at a time, outputs out (vLLM's names).

The only place where the three parts meet: schedule (bookkeeping) -> run the model (the model runner)
-> sample -> commit to the bookkeeping. Requests come in through the input processor (tokenize, check,
build the sequence) and leave through their `RequestState` (text, outputs). A step is a
transaction: if the forward, the sampler or the commit raises, the plan is rolled back and the engine is
exactly as it was before the step. A request for n samples is one sequence until its prompt is computed; at
its first token it forks into n.

With speculative decoding (`speculative_config`), a proposer first guesses the next tokens of each decoding
sequence; the step runs them with the sequence's last token, and the target keeps the longest run it agrees
with (the rejection rule: sample/rejection_sampler.py), then one token of its own. Only the accepted tokens' keys
and values count as computed; the slots of rejected ones go back to the pool.
"""

import itertools
import math

import torch
from torch.profiler import record_function

from ..config.engine import EngineConfig
from ..core.block_manager import BlockManager
from ..core.scheduler import Scheduler, SchedulerOutput
from ..core.sequence import Sequence
from ..executor.parallel_runner import TensorParallelRunner
from ..metrics.stats import EngineStats
from ..model_executor.model_loader.loader import load_tokenizer, tokenizer_folder
from ..model_executor.model_loader.quantization import check_options
from ..outputs import RequestOutput, SpecDecodeStats
from ..sample.rejection_sampler import accept_greedy, accept_sampled
from ..sample.sampler import make_generators, sample_batch
from ..sampling_params import SamplingParams
from ..spec_decode.draft_pace import DraftPace
from ..spec_decode.proposer import Draft, DraftRequest, Proposer
from ..spec_decode.proposers import check_draft_model, make_proposer
from ..structured_output.grammar import GrammarCache, grammar_checked, mask_draft_logits, mask_logits
from ..worker.model_runner import ModelRunner
from ..worker.step_inputs import StepInputs
from .input_processor import InputProcessor, check_request_id_free
from .output_processor import RequestState


class StepError(RuntimeError):
    """A step's forward or sampling raised (the error is the `__cause__`); the engine is as it was before
    the step. `request_ids`: the requests the step had scheduled."""

    def __init__(self, request_ids: list[str], error: Exception):
        super().__init__(f"a step running requests {request_ids} failed: {error!r}")
        self.request_ids = request_ids


class LLMEngine:
    """model: None (the bundled SmolLM2-135M-Instruct), a `.gguf` file, or a Hugging Face folder.
    dtype: "auto" (None), "float32", "bfloat16" or a torch.dtype (model_loader/quantization.py says which "auto"
    picks).
    `engine_options` are the fields of `EngineConfig` (config/engine.py), `quantization` among them."""

    def __init__(self, model=None, device: str = "cpu", dtype: torch.dtype | str | None = None, **engine_options):
        self.config = config = EngineConfig(**engine_options)
        dtype = check_options(model, device, dtype, config.quantization)  # before any weight is read
        if config.speculative_config is not None:
            check_draft_model(model, device, config.speculative_config)
        self.tokenizer = load_tokenizer(tokenizer_folder(model, config.quantization))
        runner_args = (model, device, dtype, config.attention_backend, config.enforce_eager)
        if config.tensor_parallel_size > 1:  # this process becomes rank 0 of tensor_parallel_size
            self.model_runner = TensorParallelRunner(*runner_args, config.tensor_parallel_size)
        else:
            self.model_runner = ModelRunner(
                *runner_args, quantization=config.quantization, int8_activations=config.int8_activations
            )
        self.proposer: Proposer | None = None
        try:
            self._build(config)
            self.proposer = make_proposer(
                config.speculative_config,
                model,
                device,
                config,
                self.block_manager.num_total_blocks,
                self.max_model_len,
            )
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
        self.vocab_size = self.model.config.vocab_size
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
        self._spec_decode = SpecDecodeStats() if config.speculative_config is not None else None
        self.grammars = GrammarCache(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)

    # --- requests in ----------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt, sampling_params: SamplingParams | None = None) -> str:
        """Queue a request: `prompt` is a str, a list of token ids, or a dict {"prompt": str} or
        {"prompt_token_ids": [...]}; request_id None picks a free one. Returns the request id.
        Bad input raises ValueError naming the limit, and nothing is queued."""
        request_id = self._new_request_id() if request_id is None else str(request_id)
        check_request_id_free(request_id, self.requests)
        text, seq = self.input_processor.process(request_id, prompt, sampling_params)
        constraint = seq.params.structured_outputs
        grammar = None if constraint is None else self.grammars.compile(constraint)  # before the step, once
        generators = make_generators(seq.params, self.model_runner.device)
        speculative = self.proposer is not None
        self.requests[request_id] = RequestState.start(
            text, seq, self.tokenizer, generators, speculative, grammar, self.config.detokenize, self._first_pace()
        )
        self.scheduler.add(seq)
        return request_id

    def _first_pace(self) -> DraftPace | None:
        """Where a new request's samples start asking for drafts: k of them (None: always k)."""
        speculative = self.config.speculative_config
        if self.proposer is None or not speculative.adaptive_draft_length:
            return None
        return DraftPace(speculative.num_speculative_tokens)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request, waiting or running, all its samples; their blocks return to the pool at once."""
        state = self.requests.pop(str(request_id), None)
        if state is not None and self.proposer is not None:
            for seq in state.seqs:
                self.proposer.forget(seq)
        return self.scheduler.abort(str(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def is_unfinished(self, request_id: str) -> bool:
        """Whether the request is still queued or running: neither finished nor aborted."""
        return str(request_id) in self.requests

    def stats(self) -> EngineStats:
        """A snapshot of the queues, the KV pool and the prefix cache (what `LLM`, the server and its
        metrics read between steps)."""
        return EngineStats(
            len({seq.request_id for seq in self.scheduler.running}),
            len({seq.request_id for seq in self.scheduler.waiting}),
            self.block_manager.num_free_blocks,
            self.block_manager.num_total_blocks,
            self._prefix_cache_queries,
            self._prefix_cache_hits,
            self._spec_decode,
        )

    def close(self) -> None:
        """Let the model runners go: with tensor parallelism, its worker processes stop."""
        if self.proposer is not None:
            self.proposer.close()
        self.model_runner.close()

    # --- one step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Propose (with speculative decoding), plan (schedule), run (forward and sample or verify), commit
        (count computed tokens, append sampled ones, finish requests). Returns the outputs of the requests
        that got tokens (finished ones have `.finished`); a request whose prompt chunk did not reach its end
        gets none this step.
        If proposing, running, sampling or committing raises, the plan is rolled back and `StepError` names the
        requests the step held (an interruption such as KeyboardInterrupt propagates as it is, after the
        rollback)."""
        streams = self._save_streams()  # a draft model draws from the requests' random streams too
        try:
            with record_function("rosellm.propose"):
                drafts = self._propose()
        except BaseException as error:
            self._restore_streams(streams)
            if isinstance(error, Exception):
                raise StepError(sorted({seq.request_id for seq in self.scheduler.running}), error) from error
            raise
        with record_function("rosellm.schedule"):  # labels for torch.profiler (benchmarks/profile)
            proposed = {seq: draft.token_ids for seq, draft in drafts.items()}
            plan = self.scheduler.schedule(proposed) if proposed else self.scheduler.schedule()
        if not plan.scheduled:
            self._forget_drafts(plan.preempted)
            if self.scheduler.waiting and not plan.preempted:  # the input processor refuses such requests
                raise RuntimeError(f"request {self.scheduler.waiting[0].request_id!r} can never be scheduled")
            return []
        draws = self._draws(plan)
        overwritten = self.scheduler.overwritten_blocks(plan)
        if overwritten:
            self.model_runner.save_blocks(overwritten)
        requests = self._save_requests(draws)
        try:
            tokens = self._run(plan, draws, drafts)
            with record_function("rosellm.commit"):
                return self._commit(plan, draws, tokens)
        except BaseException as error:
            if overwritten:
                self.model_runner.restore_blocks()
            self._restore_requests(requests)
            self.scheduler.rollback(plan)
            self._restore_streams(streams)
            if isinstance(error, Exception):
                raise StepError([seq.request_id for seq in plan.scheduled], error) from error
            raise

    def _propose(self) -> dict[Sequence, Draft]:
        """Drafts for the running sequences that decode, as many tokens as `num_speculative_tokens` (or as
        each sample's pace asks for, and none while it waits), and never so many that one could land past
        `max_tokens` or `max_model_len`; none when `disable_by_batch_size` sequences or more run. Only
        non-empty drafts are kept."""
        speculative = self.config.speculative_config
        if self.proposer is None or len(self.scheduler.running) >= (speculative.disable_by_batch_size or math.inf):
            return {}
        requests = []
        for seq in self.scheduler.running:
            if seq.num_uncomputed_tokens != 1 or not seq.output_token_ids:
                continue  # a prompt (or its last token) first: speculation starts after the first token
            sample = self.requests[seq.request_id].samples[seq.index]
            if sample.pace is not None and not sample.pace.ready(len(seq.output_token_ids)):
                continue
            wanted = speculative.num_speculative_tokens if sample.pace is None else sample.pace.length
            room = min(seq.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1
            if room >= 1:
                requests.append(DraftRequest(seq, seq.token_ids, min(wanted, room), seq.params, sample.generator))
        drafts = self.proposer.propose(requests) if requests else []
        samples = [self.requests[request.key.request_id].samples[request.key.index] for request in requests]
        drafts = [grammar_checked(sample.grammar, draft) for sample, draft in zip(samples, drafts)]
        return {request.key: draft for request, draft in zip(requests, drafts) if draft.token_ids}

    def _draws(self, plan: SchedulerOutput) -> list[tuple[RequestState, int, int]]:
        """The tokens this step samples, as (request, sample index, row among the rows that sample): one per
        row that reaches its sequence's end, and n from the same row for a prompt about to fork."""
        draws = []
        for row, seq in enumerate(seq for seq, sample in zip(plan.scheduled, plan.samples) if sample):
            state = self.requests[seq.request_id]
            draws += [(state, index, row) for index in (range(seq.params.n) if seq.will_fork else [seq.index])]
        return draws

    def _run(
        self, plan: SchedulerOutput, draws: list[tuple[RequestState, int, int]], drafts: dict[Sequence, Draft]
    ) -> list[list[int]]:
        """Copy shared blocks being written, forward, sample (the tokens of each draw: one, or the drafts the
        target accepts and one more)."""
        with record_function("rosellm.forward"):
            self.model_runner.copy_blocks(plan.copies)
            inputs = StepInputs.from_plan(plan)
            hidden = self.model_runner.forward(inputs)
        with record_function("rosellm.lm_head"):
            logits = self.model_runner.sampling_logits(hidden, inputs)  # [positions that sample, vocab]
        with record_function("rosellm.sample"):
            return self._sample(logits, plan, draws, drafts)

    def _sample(
        self,
        logits: torch.Tensor,
        plan: SchedulerOutput,
        draws: list[tuple[RequestState, int, int]],
        drafts: dict[Sequence, Draft],
    ) -> list[list[int]]:
        """logits [positions that sample, vocab]: each sampling row's drafts' positions, then its last one.
        A row without drafts samples one token per draw (`sample_batch`, all of them together); a row with
        drafts is verified against them (sample/rejection_sampler.py). With structured outputs, a constrained draw's
        logits first lose the tokens its grammar forbids (structured_output/grammar.py)."""
        rows = [(seq, draft) for seq, draft, sample in zip(plan.scheduled, plan.drafts, plan.samples) if sample]
        lasts = list(itertools.accumulate(len(draft) + 1 for _, draft in rows))  # one past each row's last
        plain = [i for i, (_, _, row) in enumerate(draws) if not rows[row][1]]
        params = [state.seqs[0].params for state, _, _ in draws]
        generators = [state.samples[index].generator for state, index, _ in draws]
        grammars = [state.samples[index].grammar for state, index, _ in draws]
        tokens: list[list[int]] = [[] for _ in draws]
        plain_logits = logits[[lasts[draws[i][2]] - 1 for i in plain]]  # [plain draws, vocab], a copy
        with record_function("rosellm.grammar_mask"):
            mask_logits(plain_logits, [grammars[i] for i in plain])
            for i, (_, _, row) in enumerate(draws):
                if rows[row][1] and grammars[i] is not None:
                    mask_draft_logits(
                        logits[lasts[row] - len(rows[row][1]) - 1 : lasts[row]], grammars[i], rows[row][1]
                    )
        sampled = sample_batch(plain_logits, [params[i] for i in plain], [generators[i] for i in plain])
        for i, token in zip(plain, sampled):
            tokens[i] = [token]
        argmax = logits.argmax(dim=-1).tolist() if len(plain) < len(draws) else []
        for i, (_, _, row) in enumerate(draws):
            seq, draft = rows[row]
            if draft:
                start, end = lasts[row] - len(draft) - 1, lasts[row]
                if params[i].greedy:
                    tokens[i] = accept_greedy(argmax[start:end], draft)
                else:
                    probs = drafts[seq].probs
                    probs = None if probs is None else probs[: len(draft)]  # the drafts the step had room for
                    tokens[i] = accept_sampled(logits[start:end], draft, probs, params[i], generators[i])
        return tokens

    def _commit(
        self, plan: SchedulerOutput, draws: list[tuple[RequestState, int, int]], tokens: list[list[int]]
    ) -> list[RequestOutput]:
        """Count the computed tokens, fork, append the sampled tokens (their text, their grammar), finish
        requests. Part of the step's transaction: if it raises (a detokenizer, a grammar refusing a token), the
        step undoes it all. The proposer lets go of finished and preempted sequences only at the end."""
        num_drafts = {seq: len(draft) for seq, draft in zip(plan.scheduled, plan.drafts) if draft}
        for seq, num_new in zip(plan.scheduled, plan.num_new_tokens):
            if seq not in num_drafts:  # a verified row counts what it accepted, below
                self.block_manager.commit_computed(seq, num_new)  # counts them, caches the blocks they filled
        for state in {id(state): state for state, _, _ in draws}.values():
            if state.seqs[0].will_fork:
                self._fork(state)
        advanced: dict[str, RequestState] = {}
        finished: list[Sequence] = []
        for (state, index, _), row_tokens in zip(draws, tokens):
            seq = state.samples[index].seq
            if index == 0 and not seq.output_token_ids:  # the request's first token: its prompt is computed
                self._prefix_cache_queries += len(seq.prompt_token_ids)
                self._prefix_cache_hits += seq.num_cached_tokens or 0
            num_kept = 0
            for token in row_tokens:  # nothing past a finish: the tokens after it are dropped
                num_kept += 1
                if (finish_reason := state.add_token(index, token, seq.append_token(token))) is not None:
                    break
            if seq in num_drafts:  # the accepted drafts it kept: all but the target's own last token, if kept
                self._commit_verified(state, seq, num_drafts[seq], num_accepted=min(num_kept, len(row_tokens) - 1))
            if finish_reason is not None:
                self.scheduler.finish(seq)
                finished.append(seq)
            advanced[seq.request_id] = state
        outputs = [state.output() for state in advanced.values()]
        for request_id, state in advanced.items():
            if state.finished:
                del self.requests[request_id]
        self._forget_drafts(plan.preempted + finished)
        return outputs

    def _commit_verified(self, state: RequestState, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A row ran its last token and `num_drafts` drafts, of which the first `num_accepted` were kept:
        those tokens' keys and values are computed (no more than the tokens it kept, if it finished among
        them); the blocks beyond them return to the pool; the sample's pace follows what it accepted."""
        num_computed = min(1 + num_accepted, seq.num_tokens - seq.num_computed_tokens)
        self.block_manager.commit_computed(seq, num_computed)
        self.block_manager.trim(seq)
        sample = state.samples[seq.index]
        if sample.pace is not None:
            most = self.config.speculative_config.num_speculative_tokens
            sample.pace = sample.pace.after(num_drafts, num_accepted, len(seq.output_token_ids), most)
        counts = SpecDecodeStats(1, num_drafts, num_accepted)
        state.spec_decode += counts
        self._spec_decode += counts

    def _save_requests(self, draws: list[tuple[RequestState, int, int]]) -> tuple:
        """What a commit changes beside the scheduler's bookkeeping: the drawing requests and the engine's
        counts."""
        states = {id(state): state for state, _, _ in draws}.values()
        counts = (self._prefix_cache_queries, self._prefix_cache_hits, self._spec_decode)
        return [(state, state.save()) for state in states], counts

    def _restore_requests(self, saved: tuple) -> None:
        requests, counts = saved
        for state, state_saved in requests:
            state.restore(state_saved)
        self._prefix_cache_queries, self._prefix_cache_hits, self._spec_decode = counts

    def _forget_drafts(self, seqs: list[Sequence]) -> None:
        """Sequences that finished or were preempted: the proposer lets go of what it holds for them (a
        preempted one's drafts are recomputed with it, like its keys and values)."""
        if self.proposer is not None:
            for seq in seqs:
                self.proposer.forget(seq)

    def _save_streams(self) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The random streams of every request a step may draw from."""
        generators = (sample.generator for state in self.requests.values() for sample in state.samples)
        return [(generator, generator.get_state()) for generator in generators if generator is not None]

    @staticmethod
    def _restore_streams(streams: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        for generator, stream in streams:
            generator.set_state(stream)

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
