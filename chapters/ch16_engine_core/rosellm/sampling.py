"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds."""

import math
import numbers
from dataclasses import dataclass

import torch

from .structured_outputs import StructuredOutputsParams

# Temperatures below this are greedy, as in vLLM: dividing logits by a tinier one overflows to inf.
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**64  # what torch.Generator.manual_seed accepts: [0, 2**64)


@dataclass
class SamplingParams:
    """How to pick each next token. `temperature` below GREEDY_TEMPERATURE (e.g. 0) means greedy.
    `max_tokens=None`: until a stop token or `max_model_len`. `n`: answers sampled from the one prompt;
    with a seed, answer i draws from its own stream seeded `seed + i` (so answer i of a seeded request with
    n > 1 equals a request for one answer seeded `seed + i`). `stop`: strings that end an answer when its
    text contains one (stop_strings.py; a str alone is one stop string). Bad values raise ValueError naming
    the limit. `structured_outputs`: a constraint the answer must match (structured_outputs.py)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no top-p filter
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    stop: list[str] | str | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        self.temperature = real("temperature", self.temperature)
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        self.top_p = real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = integer("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens is not None and integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if integer("n", self.n) < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.seed is not None and not 0 <= integer("seed", self.seed) <= MAX_SEED - self.n:
            raise ValueError(f"seed must be an integer in [0, 2**64 - n] (n={self.n} streams from it), got {self.seed}")
        stop = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {stop!r}")
        self.stop_token_ids = [integer("stop_token_ids", t) for t in stop]
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {self.stop_token_ids}")
        stop = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(stop)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be StructuredOutputsParams, got {type(self.structured_outputs).__name__}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def integer(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest logits of each row, set the rest to -inf. logits: [batch, vocab]."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth_largest = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to at least p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already reach p.
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False  # the most likely token stays, even for a p that float32 rounds to 0
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def make_generators(params: SamplingParams, device: str | torch.device = "cpu") -> list[torch.Generator | None]:
    """A private random stream per answer of a seeded request, seeded `seed + i`; None means the global one."""
    if params.seed is None:
        return [None] * params.n
    generators = [torch.Generator(device=device) for _ in range(params.n)]
    for i, generator in enumerate(generators):
        generator.manual_seed(params.seed + i)
    return generators


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token id from one row of logits: [vocab_size]."""
    if params.greedy:
        return int(logits.argmax())
    logits = logits.float() / params.temperature
    logits = apply_top_p(apply_top_k(logits[None], params.top_k), params.top_p)[0]
    probs = logits.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_batch(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """One token id per row of logits [batch, vocab_size]: one argmax for all the greedy rows together (a
    single call instead of one per row), `sample` for each of the others."""
    greedy = [p.greedy for p in params]
    argmax = logits.argmax(dim=-1).tolist() if any(greedy) else None
    return [argmax[i] if greedy[i] else sample(logits[i], params[i], generators[i]) for i in range(len(params))]
