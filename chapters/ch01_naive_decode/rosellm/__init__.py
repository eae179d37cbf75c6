"""rosellm: an LLM inference engine built from scratch, one chapter at a time."""

from .llm import LLM
from .outputs import RequestOutput
from .sampling import SamplingParams

__chapter__ = "01_naive_decode"
__capabilities__ = frozenset()
__all__ = ["LLM", "RequestOutput", "SamplingParams"]
