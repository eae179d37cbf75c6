"""rosellm: an LLM inference engine built from scratch, one chapter at a time."""

from .llm import LLM
from .outputs import RequestOutput
from .sampling import SamplingParams

__chapter__ = "06_triton_kernels"
__capabilities__ = frozenset(
    {"kv_cache", "batched", "offline_scheduler", "block_manager", "batch_state", "paged", "triton_kernels"}
)
__all__ = ["LLM", "RequestOutput", "SamplingParams"]
