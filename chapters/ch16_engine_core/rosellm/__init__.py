"""rosellm: an LLM inference engine built from scratch, one chapter at a time."""

from .async_llm import AsyncLLM
from .engine_config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling import SamplingParams
from .structured_outputs import StructuredOutputsParams

__chapter__ = "16_engine_core"
__capabilities__ = frozenset(
    {
        "kv_cache",
        "batched",
        "block_manager",
        "paged",
        "triton_kernels",
        "step_engine",
        "preemption",
        "sequence_blocks",
        "chunked_prefill",
        "prefix_caching",
        "parallel_sampling",
        "serving",
        "compiled",
        "tensor_parallel",
        "quantization",
        "speculative_decoding",
        "structured_outputs",
        "engine_core",
    }
)
__all__ = [
    "AsyncLLM",
    "CompletionOutput",
    "EngineConfig",
    "LLM",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
