"""rosellm: an LLM inference engine built from scratch, one chapter at a time."""

from .llm import LLM
from .outputs import RequestOutput
from .sampling import SamplingParams

__chapter__ = "04_kv_block_manager"
__capabilities__ = frozenset(
    {
        "kv_cache",
        "contiguous_cache",
        "batched",
        "offline_scheduler",
        "padded_batch",
        "block_manager",
        "batch_state",
        "block_check",
    }
)
__all__ = ["LLM", "RequestOutput", "SamplingParams"]
