"""The `LLM` facade: offline generation on top of the step-level `LLMEngine`."""

from collections.abc import Generator, Sequence

import torch
from tqdm.auto import tqdm

from ..engine.llm_engine import LLMEngine
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

Prompt = str | Sequence[int] | dict


class LLM:
    """Load a model and generate text. `dtype`: "auto" (None), "float32", "bfloat16" or a torch.dtype.
    `engine_options` are the fields of `EngineConfig` (max_model_len, max_num_seqs, max_num_batched_tokens,
    block_size, num_kv_blocks, kv_cache_memory, watermark, attention_backend, enforce_eager,
    enable_chunked_prefill, enable_prefix_caching, tensor_parallel_size, quantization, int8_activations,
    speculative_config, detokenize).

    With tensor_parallel_size > 1 it starts worker processes: `close()` them, or use `with LLM(...) as llm:`
    (they also stop when the `LLM` is collected or the program exits, or when one of them dies)."""

    def __init__(self, model=None, device: str = "cpu", dtype: torch.dtype | str | None = None, **engine_options):
        self.llm_engine = LLMEngine(model, device, dtype, **engine_options)

    # The engine's window for the reader (its model, tokenizer, stop tokens and blocks), read from it, never copied.

    @property
    def model(self):
        return self.llm_engine.model

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def eos_token_ids(self) -> set[int]:
        return self.llm_engine.eos_token_ids

    @property
    def block_manager(self):
        return self.llm_engine.block_manager

    def close(self) -> None:
        self.llm_engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self, prompts: Prompt | Sequence[Prompt], sampling_params=None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Generate for every prompt, continuously batched; outputs come back in input order.
        Left by any exception (Ctrl-C included), it aborts its requests: nothing stays queued."""
        request_ids = self._add_requests(prompts, sampling_params)
        outputs = {}
        try:
            with tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm) as progress:
                while len(outputs) < len(request_ids):
                    for output in self.llm_engine.step():
                        if output.finished:
                            outputs[output.request_id] = output
                            progress.update(1)
        finally:
            self._abort(request_id for request_id in request_ids if request_id not in outputs)
        return [outputs[request_id] for request_id in request_ids]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Generator[str, None, RequestOutput]:
        """Generate for one prompt, yielding text pieces (of the first answer, when n > 1) as soon as they
        are complete characters.
        The generator's return value (`StopIteration.value`) is the finished `RequestOutput`.
        Closing it early (or an exception) aborts the request."""
        [request_id] = self._add_requests([prompt], sampling_params)
        emitted, final = 0, None
        try:
            while self.llm_engine.is_unfinished(request_id):  # until it finishes or is aborted
                for output in self.llm_engine.step():
                    if output.request_id == request_id:
                        final = output
                        if len(output.text) > emitted:
                            yield output.text[emitted:]
                            emitted = len(output.text)
        finally:
            self._abort([request_id])  # nothing to do if it finished
        return final

    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits [seq, vocab_size] at every position of one sequence: what tests compare with
        transformers. Every chapter keeps this working through its own forward path."""
        return self.llm_engine.prompt_logits(list(token_ids))

    def _add_requests(self, prompts, sampling_params) -> list[str]:
        """Queue every prompt, or none: any exception while queueing takes back what was queued."""
        prompts = normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        sampling_params = list(sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_ids.append(self.llm_engine.add_request(None, prompt, params))
        except BaseException:
            self._abort(request_ids)
            raise
        return request_ids

    def _abort(self, request_ids) -> None:
        for request_id in list(request_ids):
            self.llm_engine.abort_request(request_id)


def normalize_prompts(prompts) -> list[Prompt]:
    """A str, a dict, a list of token ids, or a list of those -> a list of prompts (the engine checks each
    when it is queued, token ids by `check_token_ids`)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]
    return prompts
