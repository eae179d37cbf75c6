"""One request in flight: its tokens, its KV cache, its sampling state and its output."""

import torch

from .detokenizer import IncrementalDetokenizer
from .engine import InferenceEngine
from .outputs import RequestOutput
from .sampling import SamplingParams, make_generator, sample


class InferenceSession:
    def __init__(
        self,
        engine: InferenceEngine,
        output: RequestOutput,
        params: SamplingParams,
        eos_token_ids: set[int],
        max_model_len: int,
    ):
        self.output = output
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        # The cache holds every token but the last generated one: at most max_model_len - 1.
        capacity = min(len(output.prompt_token_ids) + params.max_tokens, max_model_len) - 1
        self.cache = engine.new_cache(capacity)
        self.generator = make_generator(params.seed, engine.device)
        self.detokenizer = IncrementalDetokenizer(engine.tokenizer)
        self.pending = list(output.prompt_token_ids)  # tokens not yet in the cache

    @property
    def request_id(self) -> str:
        return self.output.request_id

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None

    def append_token(self, logits: torch.Tensor) -> str:
        """Sample the next token from this request's logits [vocab]; return the new text."""
        token = sample(logits, self.params, self.generator)
        self.pending = [token]
        self.output.token_ids.append(token)
        piece = self.detokenizer.add(token)
        self.output.finish_reason = self._finish_reason()
        if self.finished:
            piece += self.detokenizer.flush()
        self.output.text += piece
        return piece

    def _finish_reason(self) -> str | None:
        last, params = self.output.token_ids[-1], self.params
        if last in params.stop_token_ids or (not params.ignore_eos and last in self.eos_token_ids):
            return "stop"
        seq_len = len(self.output.prompt_token_ids) + len(self.output.token_ids)
        if len(self.output.token_ids) >= params.max_tokens or seq_len >= self.max_model_len:
            return "length"
        return None
