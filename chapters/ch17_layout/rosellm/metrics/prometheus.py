"""What the server's `/metrics` reports, in Prometheus' text format (names as vLLM's, prefixed `rosellm:`).

The engine's load (requests running and waiting), its KV pool (blocks used and free), its prefix cache (prompt
tokens looked up and found), speculative decoding's drafts (proposed and accepted), what clients feel (time to
first token and inter-token latency, as histograms), and the engine's own step time where it ran (in a thread
of the server's process, or in an engine core): the gap between the two is what the process around it costs.
The engine thread records, the server renders: every access holds one lock. With several engine cores
(data parallelism, engine/async_llm.py), each core's load is reported apart, labelled `engine="N"` as vLLM labels it;
the latency histograms are the front end's, over all of them.
"""

import math
import threading
from bisect import bisect_left

from .stats import EngineStats

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
        self.stats: dict[int | None, EngineStats] = {}  # per engine core; None: the one engine, unlabelled
        self.time_to_first_token = Histogram()
        self.inter_token_latency = Histogram()
        self.step_duration = Histogram()  # the engine's steps, as long as they took where they ran

    def record_stats(self, stats: EngineStats, engine: int | None = None) -> None:
        """Between steps: how many requests run and wait, how the KV pool and the prefix cache are used (of
        engine core `engine`, or of the one engine)."""
        with self._lock:
            self.stats[engine] = stats

    # Totals over the engines, for the engine's users (tests, the notebook).

    @property
    def requests_running(self) -> int:
        return self._total(lambda stats: stats.num_running_requests)

    @property
    def requests_waiting(self) -> int:
        return self._total(lambda stats: stats.num_waiting_requests)

    @property
    def blocks_used(self) -> int:
        return self._total(lambda stats: stats.num_total_blocks - stats.num_free_blocks)

    @property
    def blocks_free(self) -> int:
        return self._total(lambda stats: stats.num_free_blocks)

    def _total(self, value_of) -> int:
        with self._lock:
            return sum(value_of(stats) for stats in self.stats.values())

    def record_first_output(self, seconds: float) -> None:
        """A request's first token came `seconds` after it arrived."""
        with self._lock:
            self.time_to_first_token.observe(seconds)

    def record_step(self, seconds: float) -> None:
        """One engine step (schedule, forward, sample, commit) took `seconds`, wall clock."""
        with self._lock:
            self.step_duration.observe(seconds)

    def record_next_output(self, seconds: float) -> None:
        """A request's next token(s) came `seconds` after its previous ones."""
        with self._lock:
            self.inter_token_latency.observe(seconds)

    def render(self) -> str:
        """All metrics in Prometheus' text exposition format."""
        with self._lock:
            lines = []
            for short_name, kind, help_text, value_of in ENGINE_METRICS:
                name = f"rosellm:{short_name}"
                values = [(engine, value_of(stats)) for engine, stats in sorted(self.stats.items(), key=by_engine)]
                values = [(engine, value) for engine, value in values if value is not None]
                if values:
                    lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
                    lines += [f"{name}{label(engine)} {value}" for engine, value in values]
            for short_name, help_text, histogram in (
                ("time_to_first_token_seconds", "Arrival to first token.", self.time_to_first_token),
                ("inter_token_latency_seconds", "Between successive tokens.", self.inter_token_latency),
                ("engine_step_seconds", "One engine step, wall clock, where it ran.", self.step_duration),
            ):
                name = f"rosellm:{short_name}"
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *histogram.samples(name)]
        return "\n".join(lines) + "\n"


def by_engine(item: tuple[int | None, EngineStats]) -> int:
    return -1 if item[0] is None else item[0]


def label(engine: int | None) -> str:
    return "" if engine is None else f'{{engine="{engine}"}}'


def hit_rate(stats: EngineStats) -> float:
    return stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0


def spec(value_of):
    """A speculative-decoding metric: None (not reported) without speculation."""
    return lambda stats: None if stats.spec_decode is None else value_of(stats.spec_decode)


# (name, type, help, its value from an engine's stats; None: not reported), names as vLLM's
ENGINE_METRICS = [
    ("num_requests_running", "gauge", "Requests with sequences running.", lambda s: s.num_running_requests),
    ("num_requests_waiting", "gauge", "Requests waiting to be admitted.", lambda s: s.num_waiting_requests),
    (
        "kv_blocks_used",
        "gauge",
        "KV cache blocks held by sequences.",
        lambda s: s.num_total_blocks - s.num_free_blocks,
    ),
    ("kv_blocks_free", "gauge", "KV cache blocks free (cached ones included).", lambda s: s.num_free_blocks),
    (
        "prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
        lambda s: s.prefix_cache_queries,
    ),
    ("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits),
    ("prefix_cache_hit_rate", "gauge", "Prefix cache hits / queries.", hit_rate),
    ("spec_decode_num_drafts_total", "counter", "Verify steps with proposed tokens.", spec(lambda d: d.num_drafts)),
    ("spec_decode_num_draft_tokens_total", "counter", "Proposed tokens.", spec(lambda d: d.num_draft_tokens)),
    (
        "spec_decode_num_accepted_tokens_total",
        "counter",
        "Accepted tokens.",
        spec(lambda d: d.num_accepted_tokens),
    ),
    ("spec_decode_acceptance_rate", "gauge", "Accepted / proposed tokens.", spec(lambda d: d.acceptance_rate)),
    (
        "spec_decode_mean_acceptance_length",
        "gauge",
        "Tokens per verify step (1 + accepted / drafts).",
        spec(lambda d: d.mean_acceptance_length),
    ),
]
