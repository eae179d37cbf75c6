"""The engine's load between steps, as a snapshot of counts (vLLM's `SchedulerStats`): what `LLMEngine.stats()`
returns, what a core sends its front end, and what the metrics read."""

from dataclasses import dataclass

from ..outputs import SpecDecodeStats


@dataclass(frozen=True)
class EngineStats:
    """Requests by queue, the KV pool, the prefix cache: counts only, so that a snapshot stays a few numbers
    however many requests run."""

    num_running_requests: int  # requests with a sequence running
    num_waiting_requests: int  # requests with a sequence waiting (n > 1: a request may count in both)
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache, since the engine started
    prefix_cache_hits: int  # of those, tokens found there
    spec_decode: SpecDecodeStats | None = None  # drafts proposed and accepted since the start; None: speculation off
