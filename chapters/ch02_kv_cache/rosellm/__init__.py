"""rosellm: an LLM inference engine built from scratch, one chapter at a time."""

from .llm import LLM
from .outputs import RequestOutput
from .sampling import SamplingParams

__chapter__ = "02_kv_cache"
__capabilities__ = frozenset({"kv_cache", "contiguous_cache"})
__all__ = ["LLM", "RequestOutput", "SamplingParams"]
