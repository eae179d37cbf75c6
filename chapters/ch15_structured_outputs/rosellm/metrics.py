"""What the server's `/metrics` reports, in Prometheus' text format (names as vLLM's, prefixed `rosellm:`).

The engine's load (requests running and waiting), its KV pool (blocks used and free), its prefix cache (prompt
tokens looked up and found), speculative decoding's drafts (proposed and accepted), and what clients feel:
time to first token and inter-token latency, as histograms.
The engine thread records, the server renders: every access holds one lock.
"""

import math
import threading
from bisect import bisect_left

from .llm_engine import EngineStats
from .outputs import SpecDecodeStats

# Seconds: from a millisecond (a tiny model's step) to a long queue under load.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Counts of observations per bucket (an observation counts in the first bucket whose bound is >= it)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.bounds = (*buckets, math.inf)
        self.counts = [0] * len(self.bounds)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def samples(self, name: str) -> list[str]:
        """Prometheus' cumulative buckets, then the sum and the count."""
        lines, total = [], 0
        for bound, count in zip(self.bounds, self.counts):
            total += count
            lines.append(f'{name}_bucket{{le="{"+Inf" if bound == math.inf else bound}"}} {total}')
        return [*lines, f"{name}_sum {self.sum}", f"{name}_count {total}"]


class EngineMetrics:
    """The server's metrics: gauges and counters from the engine's stats between steps, histograms fed per
    output."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests_running = self.requests_waiting = 0
        self.blocks_used = self.blocks_free = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # prompt tokens looked up / found in the cache
        self.spec_decode: SpecDecodeStats | None = None  # drafts proposed and accepted; None: no speculation
        self.time_to_first_token = Histogram()
        self.inter_token_latency = Histogram()

    def record_stats(self, stats: EngineStats) -> None:
        """From the engine thread, between steps: how many requests run and wait, how the KV pool and the
        prefix cache are used."""
        with self._lock:
            self.requests_running = len(stats.running_requests)
            self.requests_waiting = len(stats.waiting_requests)
            self.blocks_free = stats.num_free_blocks
            self.blocks_used = stats.num_total_blocks - stats.num_free_blocks
            self.prefix_cache_queries, self.prefix_cache_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
            self.spec_decode = stats.spec_decode

    def record_first_output(self, seconds: float) -> None:
        """A request's first token came `seconds` after it arrived."""
        with self._lock:
            self.time_to_first_token.observe(seconds)

    def record_next_output(self, seconds: float) -> None:
        """A request's next token(s) came `seconds` after its previous ones."""
        with self._lock:
            self.inter_token_latency.observe(seconds)

    def render(self) -> str:
        """All metrics in Prometheus' text exposition format."""
        with self._lock:
            queries, hits = self.prefix_cache_queries, self.prefix_cache_hits
            metrics = [
                ("num_requests_running", "gauge", "Requests with sequences running.", self.requests_running),
                ("num_requests_waiting", "gauge", "Requests waiting to be admitted.", self.requests_waiting),
                ("kv_blocks_used", "gauge", "KV cache blocks held by sequences.", self.blocks_used),
                ("kv_blocks_free", "gauge", "KV cache blocks free (cached ones included).", self.blocks_free),
                ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", queries),
                ("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", hits),
                ("prefix_cache_hit_rate", "gauge", "Prefix cache hits / queries.", hits / queries if queries else 0.0),
                ("time_to_first_token_seconds", "histogram", "Arrival to first token.", self.time_to_first_token),
                ("inter_token_latency_seconds", "histogram", "Between successive tokens.", self.inter_token_latency),
            ]
            if (spec := self.spec_decode) is not None:  # vLLM's counters, and what they give
                metrics += [
                    ("spec_decode_num_drafts_total", "counter", "Verify steps with proposed tokens.", spec.num_drafts),
                    ("spec_decode_num_draft_tokens_total", "counter", "Proposed tokens.", spec.num_draft_tokens),
                    ("spec_decode_num_accepted_tokens_total", "counter", "Accepted tokens.", spec.num_accepted_tokens),
                    ("spec_decode_acceptance_rate", "gauge", "Accepted / proposed tokens.", spec.acceptance_rate),
                    (
                        "spec_decode_mean_acceptance_length",
                        "gauge",
                        "Tokens per verify step (1 + accepted / drafts).",
                        spec.mean_acceptance_length,
                    ),
                ]
            lines = []
            for short_name, kind, help_text, value in metrics:
                name = f"rosellm:{short_name}"
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                lines += value.samples(name) if isinstance(value, Histogram) else [f"{name} {value}"]
        return "\n".join(lines) + "\n"
