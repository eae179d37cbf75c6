"""The engine's options, in one typed place: `LLM(model, **options)` and `LLMEngine(model, **options)`."""

import math
from dataclasses import dataclass

from ..utils import blocks_for
from .speculative import SpeculativeConfig

QUANTIZATIONS = ("gguf", "int8", "int4")  # model_executor/model_loader/quantization.py


def check_quantization(quantization) -> None:
    """None or one of QUANTIZATIONS; ValueError naming them otherwise."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(QUANTIZATIONS)}; got {quantization!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Options of the continuous-batching engine. None means "derived", as each field says.

    max_model_len:          longest sequence, prompt + generated; None: the model's context length
    max_num_seqs:           most sequences in one step
    max_num_batched_tokens: most tokens in one step (prefills and decodes together); None: 2048 with
                            chunked prefill, else max(max_model_len, 2048) so that any request fits one step
    block_size:             KV slots per block
    num_kv_blocks:          blocks in the KV pool; None: what `kv_cache_memory` bytes hold, capped at what
                            max_num_seqs sequences of max_model_len tokens need
    kv_cache_memory:        bytes for the KV pool when num_kv_blocks is None
    watermark:              share of the pool kept free when admitting (room for running sequences to grow)
    attention_backend:      "reference", "torch", "cpu" or "triton" (attention/selector.py); None: "triton"
                            on CUDA, else "cpu" ("torch" when enforce_eager)
    enforce_eager:          run the decoder layers as plain PyTorch, never `torch.compile`d
    enable_chunked_prefill: split prompts longer than what a step's budget has left over several steps
    enable_prefix_caching:  remember full KV blocks by the hash of their tokens; a prompt starting with
                            remembered blocks reuses them instead of computing them again
    tensor_parallel_size:   processes that split each layer between them (distributed/tensor_parallel.py); with more
                            than one, `kv_cache_memory` is each rank's
    quantization:           weights in fewer bytes (model_executor/model_loader/quantization.py): None (fp32
                            weights), "gguf" (a .gguf file's own quantized tensors), "int8" or "int4" (quantized
                            at load); not with tensor parallelism
    int8_activations:       with quantized weights and fp32 compute on CPU, few rows (decode) quantize the
                            activations to 8 bits per block of 32 and multiply the weights' codes in integer
                            dot products (model_executor/layers/integer_dot.py, llama.cpp's way); False: the
                            exact fp32 product with the dequantized weights
    speculative_config:     speculative decoding (speculative.py): vLLM's dict, e.g. {"method": "ngram",
                            "num_speculative_tokens": 4}; None: off
    detokenize:             turn tokens into text and match stop strings in the engine; False leaves both to
                            the caller (a split server's front end: engine/async_llm.py), whose outputs then carry
                            token ids and no text
    """

    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 1 << 30
    watermark: float = 0.01
    attention_backend: str | None = None
    enforce_eager: bool = False
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    quantization: str | None = None
    int8_activations: bool = True
    speculative_config: SpeculativeConfig | dict | None = None
    detokenize: bool = True

    def __post_init__(self):
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "num_kv_blocks",
            "kv_cache_memory",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)
            if value is None and name in ("max_model_len", "max_num_batched_tokens", "num_kv_blocks"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.watermark, (int, float)) and 0 <= self.watermark < 1):
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        for name in (
            "enable_chunked_prefill",
            "enable_prefix_caching",
            "enforce_eager",
            "detokenize",
            "int8_activations",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_quantization(self.quantization)
        if self.quantization is not None and self.tensor_parallel_size > 1:
            raise ValueError(
                f"quantization {self.quantization!r} with tensor_parallel_size > 1 is not supported: "
                "quantized layers run in one process"
            )

        if self.speculative_config is not None:
            self._check_speculative(SpeculativeConfig.from_dict(self.speculative_config))

    def _check_speculative(self, speculative: SpeculativeConfig) -> None:
        """k drafts and the token before them must fit one step's budget, and a sequence."""
        object.__setattr__(self, "speculative_config", speculative)
        budget = self.max_num_batched_tokens or 2048  # the smallest default budget (see the docstring)
        k = speculative.num_speculative_tokens
        if k + 1 > budget:
            raise ValueError(f"num_speculative_tokens ({k}) + 1 must fit max_num_batched_tokens ({budget})")
        if self.max_model_len is not None and k + 1 >= self.max_model_len:
            raise ValueError(f"num_speculative_tokens ({k}) + 1 must be < max_model_len ({self.max_model_len})")

    def watermark_blocks(self, num_kv_blocks: int) -> int:
        return math.ceil(self.watermark * num_kv_blocks)

    def kv_pool_blocks(self, max_model_len: int, bytes_per_token: int) -> int:
        """`num_kv_blocks`, or what `kv_cache_memory` holds at `bytes_per_token` (all layers' keys and values
        of one token), capped at what max_num_seqs sequences of max_model_len tokens need."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        blocks_per_seq = blocks_for(max_model_len, self.block_size)
        affordable = self.kv_cache_memory // (self.block_size * bytes_per_token)
        return max(1, min(affordable, self.max_num_seqs * blocks_per_seq))
