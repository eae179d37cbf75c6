"""rosellm: an LLM inference engine built from scratch, one chapter at a time."""

from .llm import LLM
from .outputs import RequestOutput
from .sampling import SamplingParams

__chapter__ = "03_batch_decode"
__capabilities__ = frozenset({"kv_cache", "contiguous_cache", "batched", "offline_scheduler", "padded_batch"})
__all__ = ["LLM", "RequestOutput", "SamplingParams"]
