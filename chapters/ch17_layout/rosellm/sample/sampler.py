"""The sampler: greedy, temperature, top-k, top-p, per-request seeds."""

import torch

from ..sampling_params import SamplingParams


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
