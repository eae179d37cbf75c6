"""The step-level engine: requests in, one scheduling step at a time, outputs out (vLLM's names).

The only place where the three parts meet: schedule (bookkeeping) -> build metadata and forward (the
model) -> sample -> update the bookkeeping.
"""

import itertools
import math

import torch

from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .engine import InferenceEngine
from .outputs import RequestOutput
from .sampling import SamplingParams, make_generator, sample_batch
from .scheduler import Scheduler
from .sequence import Sequence


class RequestState:
    """What the engine keeps per request beside the scheduler's `Sequence`."""

    def __init__(self, seq: Sequence, output: RequestOutput, detokenizer: IncrementalDetokenizer,
                 generator: torch.Generator | None):
        self.seq = seq
        self.output = output
        self.detokenizer = detokenizer
        self.generator = generator


class LLMEngine:
    """model: None (the bundled SmolLM2-135M-Instruct), a `.gguf` file, or a Hugging Face folder.

    max_model_len: longest sequence (prompt + generated), default the model's context.
    max_num_seqs: most sequences in one step. max_num_batched_tokens: most tokens in one step
    (default max(max_model_len, 2048), so that any prompt fits). block_size: KV slots per block. num_kv_blocks:
    blocks in the pool; when not given, what `kv_cache_memory` bytes hold, capped at what max_num_seqs
    sequences of max_model_len tokens need. watermark: share of blocks kept free at admission.
    attention_backend: "torch" or "triton" (chapter 06); None: "triton" on CUDA, "torch" elsewhere.
    """

    def __init__(self, model=None, device: str = "cpu", dtype: torch.dtype | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 32,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 num_kv_blocks: int | None = None, kv_cache_memory: int = 1 << 30, watermark: float = 0.01,
                 attention_backend: str | None = None):
        self.inference_engine = InferenceEngine(model, device, dtype, attention_backend)
        self.model, self.tokenizer = self.inference_engine.model, self.inference_engine.tokenizer
        config = self.model.config
        self.max_model_len = max_model_len or config.max_position_embeddings
        if not 1 < self.max_model_len <= config.max_position_embeddings:
            raise ValueError(f"max_model_len must be in [2, {config.max_position_embeddings}], got {max_model_len}")
        eos = config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.eos_token_ids = {t for t in eos if t is not None}
        if num_kv_blocks is None:
            blocks_per_seq = -(-self.max_model_len // block_size)
            affordable = kv_cache_memory // (block_size * self.inference_engine.bytes_per_token())
            num_kv_blocks = min(affordable, max_num_seqs * blocks_per_seq)
        self.block_manager = BlockManager(num_kv_blocks, block_size)
        self.inference_engine.allocate_kv_pool(num_kv_blocks, block_size)
        token_budget = max_num_batched_tokens or max(self.max_model_len, 2048)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, token_budget,
                                   watermark_blocks=math.ceil(watermark * num_kv_blocks))
        self.requests: dict[str, RequestState] = {}
        self._request_ids = itertools.count()

    # --- requests in ----------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt, sampling_params: SamplingParams | None = None) -> str:
        """Queue a request (a str or a list of token ids). Bad input raises ValueError and changes nothing."""
        request_id = str(next(self._request_ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        token_ids = self._tokenize(prompt)
        seq = Sequence(request_id, token_ids, params, self.eos_token_ids, self.max_model_len)
        self._check_request(seq)
        output = RequestOutput(request_id, prompt if isinstance(prompt, str) else None, token_ids)
        self.requests[request_id] = RequestState(
            seq, output, IncrementalDetokenizer(self.tokenizer), make_generator(params.seed, self.inference_engine.device)
        )
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request, waiting or running; its blocks return to the pool at once."""
        seq = self.scheduler.abort(str(request_id))
        state = self.requests.pop(str(request_id), None)
        if state is not None:
            state.output.finish_reason = "abort"
        return seq is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step -------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample one token per scheduled sequence, update the bookkeeping.
        Returns the outputs of the requests that advanced (finished ones have `.finished`)."""
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            if self.scheduler.waiting and not plan.preempted:  # add_request's checks make this unreachable
                raise RuntimeError(f"request {self.scheduler.waiting[0].request_id!r} can never be scheduled")
            return []
        token_lists = [seq.pending_token_ids for seq in plan.scheduled]
        batch = self.scheduler.batch  # its rows are the scheduled sequences, in order
        hidden = self.inference_engine.forward(token_lists, batch.seq_lens[: batch.size].tolist(),
                                               batch.block_tables[: batch.size])
        logits = self.inference_engine.last_token_logits(hidden, token_lists)  # [batch, vocab]
        states = [self.requests[seq.request_id] for seq in plan.scheduled]
        tokens = sample_batch(logits, [seq.params for seq in plan.scheduled], [s.generator for s in states])
        outputs = []
        for seq, state, token in zip(plan.scheduled, states, tokens):
            finish_reason = seq.append_token(token)
            output = state.output
            output.token_ids.append(token)
            output.text += state.detokenizer.add(token)
            if finish_reason is not None:
                output.text += state.detokenizer.flush()
                output.finish_reason = finish_reason
                self.scheduler.finish(seq)
                del self.requests[seq.request_id]
            outputs.append(output)
        return outputs

    # --- helpers --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits [seq, vocab_size] at every position of one sequence (blocks borrowed for the call)."""
        self._check_request(Sequence("prompt_logits", token_ids, SamplingParams(max_tokens=1), set(),
                                     self.max_model_len))
        blocks = self.block_manager.allocate("prompt_logits", len(token_ids))
        try:
            table = torch.tensor([blocks], dtype=torch.int32)
            hidden = self.inference_engine.forward([token_ids], [len(token_ids)], table)
        finally:
            self.block_manager.free("prompt_logits")
        return self.model.compute_logits(hidden)

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt) if prompt else []
        if not all(isinstance(t, int) for t in prompt):
            raise TypeError("a prompt must be a str or a list of token ids")
        return list(prompt)

    def _check_request(self, seq: Sequence) -> None:
        """Reject what could never run, even alone: after a preemption a request is prefilled again with
        everything it generated, so its longest cached sequence must fit the pool and one step's budget."""
        name, token_ids = f"request {seq.request_id!r}", seq.prompt_token_ids
        if not token_ids:
            raise ValueError(f"{name}: the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"{name}: the prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} "
                             f"leaves room for at most {self.max_model_len - 1} prompt tokens")
        vocab = self.model.config.vocab_size
        if not all(0 <= t < vocab for t in token_ids):
            raise ValueError(f"{name}: the prompt has token ids outside [0, {vocab})")
        budget = self.scheduler.max_num_batched_tokens
        if seq.max_kv_tokens > budget:
            raise ValueError(f"{name}: prompt + max_tokens may need a prefill of {seq.max_kv_tokens} tokens, more "
                             f"than max_num_batched_tokens={budget} (one step's token budget)")
        needed = self.block_manager.blocks_needed(seq.max_kv_tokens)
        if needed > self.block_manager.num_total_blocks:
            raise ValueError(f"{name}: prompt + max_tokens need {needed} KV blocks of {self.block_manager.block_size} "
                             f"tokens, the pool has num_kv_blocks={self.block_manager.num_total_blocks}")
