"""Verifying proposed tokens: which drafts the target model keeps, and the token it adds after them.

A proposer guesses k tokens; one forward of the target scores the sequence's last token and the k drafts
together, giving its logits at k + 1 positions. Greedy requests keep the drafts that equal the target's
argmax. Sampled requests use the rejection rule of speculative sampling (Leviathan, Kalman, Matias 2023,
"Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling"): its output is distributed exactly as tokens sampled from the
target one at a time, whatever the draft, so speculation changes the speed and never the answers' law.
"""

import torch

from ..sampling_params import SamplingParams
from .sampler import apply_top_k, apply_top_p


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sampling.sample` draws from, for each row: logits [n, vocab] -> probs [n, vocab]
    fp32, after temperature, top-k and top-p; one-hot on the argmax for a greedy request."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits.float() / params.temperature
    return apply_top_p(apply_top_k(logits, params.top_k), params.top_p).softmax(dim=-1)


def accept_greedy(target_token_ids: list[int], draft_token_ids: list[int]) -> list[int]:
    """The drafts up to the first that differs from the target's argmax, then the target's own token there.
    target_token_ids: the target's argmax at the k + 1 positions; draft_token_ids: the k drafts.
    Returns 1 .. k + 1 tokens."""
    accepted = 0
    while accepted < len(draft_token_ids) and draft_token_ids[accepted] == target_token_ids[accepted]:
        accepted += 1
    return draft_token_ids[:accepted] + [target_token_ids[accepted]]


def accept_sampled(
    logits: torch.Tensor,
    draft_token_ids: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023). Draft d_i, drawn from q_i, is kept
    with probability min(1, p_i(d_i) / q_i(d_i)). At the first rejection the token comes from
    max(0, p_i - q_i) normalised (p_i itself if that is all zero) and the later drafts are dropped; when
    every draft is kept, one more token is drawn from p_k. Each emitted token is then distributed exactly
    as if sampled from the target p.

    logits [k + 1, vocab]: the target's at the row's last k + 1 positions. draft_probs [k, vocab], or None
    for a deterministic proposal (q_i one-hot on d_i). Random numbers come from `generator`.
    Returns 1 .. k + 1 tokens."""
    k = len(draft_token_ids)
    p = target_probs(logits, params)  # [k + 1, vocab]
    drafts = torch.tensor(draft_token_ids, dtype=torch.long, device=p.device)  # [k]
    if draft_probs is None:
        q = torch.nn.functional.one_hot(drafts, p.shape[-1]).float()  # [k, vocab]
    else:
        q = draft_probs.to(device=p.device, dtype=torch.float32)  # [k, vocab]
    positions = torch.arange(k, device=p.device)
    ratio = p[positions, drafts] / q[positions, drafts]  # [k]: p_i(d_i) / q_i(d_i)
    uniform = torch.rand(k, generator=generator, device=p.device)  # [k], in [0, 1)
    kept = (uniform < ratio).tolist()  # a ratio >= 1 always keeps, p_i(d_i) = 0 never does
    accepted = k if all(kept) else kept.index(False)
    if accepted == k:
        last = p[k]  # [vocab]: every draft kept, the target adds its own next token
    else:
        residual = (p[accepted] - q[accepted]).clamp(min=0)  # [vocab]
        last = residual if residual.sum() > 0 else p[accepted]  # multinomial normalises the weights
    return draft_token_ids[:accepted] + [int(torch.multinomial(last, 1, generator=generator))]
