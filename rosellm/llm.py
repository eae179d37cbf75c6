"""The `LLM` facade, chapter 07: offline generation on top of the step-level `LLMEngine`."""

from collections.abc import Generator, Sequence

import torch
from tqdm.auto import tqdm

from .llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Load a model and generate text. `engine_options` go to `LLMEngine` (max_model_len, max_num_seqs,
    max_num_batched_tokens, block_size, num_kv_blocks, kv_cache_memory, watermark, attention_backend)."""

    def __init__(self, model=None, device: str = "cpu", dtype: torch.dtype | None = None, **engine_options):
        self.llm_engine = LLMEngine(model, device, dtype, **engine_options)
        self.model, self.tokenizer = self.llm_engine.model, self.llm_engine.tokenizer
        self.eos_token_ids = self.llm_engine.eos_token_ids
        self.block_manager = self.llm_engine.block_manager

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params=None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt, continuously batched; outputs come back in input order."""
        request_ids = self._add_requests(prompts, sampling_params)
        outputs = {}
        with tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm) as progress:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        outputs[output.request_id] = output
                        progress.update(1)
        return [outputs[request_id] for request_id in request_ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> Generator[str, None, RequestOutput]:
        """Generate for one prompt, yielding text pieces as soon as they are complete characters.
        The generator's return value (`StopIteration.value`) is the finished `RequestOutput`."""
        [request_id] = self._add_requests([prompt], sampling_params)
        emitted = 0
        while True:
            for output in self.llm_engine.step():
                if output.request_id == request_id:
                    if len(output.text) > emitted:
                        yield output.text[emitted:]
                        emitted = len(output.text)
                    if output.finished:
                        return output

    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [seq, vocab_size] at every position of one sequence: what tests compare with
        transformers. Every chapter keeps this working through its own forward path."""
        return self.llm_engine.prompt_logits(list(token_ids))

    def _add_requests(self, prompts, sampling_params) -> list[str]:
        """Queue every prompt, or none: bad input anywhere raises before any work starts."""
        prompts = normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_ids.append(self.llm_engine.add_request(None, prompt, params))
        except (ValueError, TypeError):
            for request_id in request_ids:
                self.llm_engine.abort_request(request_id)
            raise
        return request_ids


def normalize_prompts(prompts) -> list[Prompt]:
    """A str, a list of str, one list of token ids, or a list of token-id lists -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    for p in prompts:
        if not isinstance(p, str) and not (isinstance(p, Sequence) and all(isinstance(t, int) for t in p)):
            raise TypeError(f"a prompt must be a str or a list of token ids, got {type(p).__name__}")
    return prompts
