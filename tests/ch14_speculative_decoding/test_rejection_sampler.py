"""The verifier of proposed tokens: greedy acceptance by hand, `target_probs` equal to what `sample` draws
from, and the rejection rule checked statistically: what it emits follows the target's law whatever the
draft's, and a wrong rule is caught by the same check."""

import math

import pytest
import torch

from chapters import submodule

pytestmark = pytest.mark.requires("speculative_decoding")


@pytest.fixture
def sampler(checkpoint):
    return submodule(checkpoint, "rejection_sampler")


@pytest.fixture
def sampling(checkpoint):
    return submodule(checkpoint, "sampling")


@pytest.fixture
def sampled(sampling):
    return sampling.SamplingParams(temperature=1.0)


@pytest.fixture
def greedy(sampling):
    return sampling.SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True)
def one_thread():
    """Tens of thousands of ops on 6-token rows: waking torch's thread pool for each (softmax splits rows
    between threads) costs far more than the op, and many times more on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- greedy -------------------------------------------------------------------------------------------


def test_greedy_keeps_every_matching_draft_then_adds_the_targets_token(sampler):
    assert sampler.accept_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]


def test_greedy_rejecting_the_first_draft_emits_the_targets_token_alone(sampler):
    assert sampler.accept_greedy([5, 6, 7], [9, 6]) == [5]


def test_greedy_stops_at_the_first_mismatch_even_when_later_drafts_match(sampler):
    assert sampler.accept_greedy([5, 8, 7, 3], [5, 6, 7]) == [5, 8]


def test_greedy_without_drafts_emits_the_targets_token(sampler):
    assert sampler.accept_greedy([4], []) == [4]


@pytest.mark.parametrize("with_probs", [False, True])
def test_the_sampled_rule_with_greedy_params_is_greedy_acceptance(sampler, greedy, with_probs):
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(4, 8, generator=generator)  # [k + 1, vocab]
        targets = logits.argmax(dim=-1).tolist()
        drafts = [t if torch.rand(1, generator=generator) < 0.7 else (t + 1) % 8 for t in targets[:3]]
        draft_probs = torch.rand(3, 8, generator=generator).softmax(dim=-1) if with_probs else None
        accepted = sampler.accept_sampled(logits, drafts, draft_probs, greedy, generator)
        assert accepted == sampler.accept_greedy(targets, drafts)


# --- target_probs -------------------------------------------------------------------------------------


def test_target_probs_applies_temperature_then_top_k(sampler, sampling):
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    probs = sampler.target_probs(logits, sampling.SamplingParams(temperature=0.5, top_k=2))
    rest = 1 / (1 + math.exp(2))  # softmax of [6, 8]: the two largest logits divided by 0.5
    assert torch.allclose(probs, torch.tensor([[0.0, 0.0, rest, 1 - rest]]))
    assert probs.dtype == torch.float32


def test_target_probs_keeps_the_smallest_set_reaching_top_p(sampler, sampling):
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]).log()  # [2, 4]
    probs = sampler.target_probs(logits, sampling.SamplingParams(top_p=0.7))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0], [0.0, 0.0, 0.375, 0.625]]))


def test_target_probs_of_a_greedy_request_is_one_hot_on_the_argmax(sampler, greedy):
    logits = torch.tensor([[0.1, 3.0, -1.0], [2.0, 0.0, 1.0]])
    assert torch.equal(sampler.target_probs(logits, greedy), torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 5},
        {"top_p": 0.8},
        {"temperature": 0.6, "top_k": 12, "top_p": 0.9},
    ],
    ids=["default", "temperature", "top-k", "top-p", "all three"],
)
def test_target_probs_is_the_distribution_sample_draws_from(sampler, sampling, options):
    """Same seed, same draw: `sample` and a draw from `target_probs` agree token for token."""
    params = sampling.SamplingParams(**options)
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1)) * 2  # [n, vocab]
    probs = sampler.target_probs(logits, params)  # [n, vocab]
    for row in range(3):
        for seed in range(40):
            sampled = sampling.sample(logits[row], params, torch.Generator().manual_seed(seed))
            drawn = int(torch.multinomial(probs[row], 1, generator=torch.Generator().manual_seed(seed)))
            assert sampled == drawn


# --- the rejection rule, statistically ----------------------------------------------------------------

# A target whose law at each position does not depend on the tokens before (so token i + 1 must follow
# P[i + 1] whatever token i was), and a draft law Q unlike it: Q above P for some tokens, below for others,
# zero for one the target likes (token 4 at position 0, token 3 at position 1). Vocabulary 6, k = 2.
P = torch.tensor(
    [
        [0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
        [0.05, 0.15, 0.35, 0.20, 0.15, 0.10],
        [0.20, 0.20, 0.10, 0.20, 0.10, 0.20],
    ]
)  # [k + 1, vocab]
Q = torch.tensor(
    [
        [0.10, 0.40, 0.20, 0.25, 0.00, 0.05],
        [0.30, 0.10, 0.10, 0.00, 0.30, 0.20],
    ]
)  # [k, vocab]
LOGITS = P.log()  # [k + 1, vocab]: temperature 1 gives P back
VOCAB = P.shape[1]

# Pearson's chi-square at p = 0.001, by degrees of freedom (vocab - 1 = 5 for one law; 25 for five laws of
# token 2, one per token 1 a draft can be: the tokens with min(P[0], Q[0]) > 0).
CRITICAL = {5: 20.515, 25: 52.620}


@pytest.fixture
def wrong_rule(sampler):
    """The ratio turned over: draft i kept with probability min(1, q/p). Not the target's law."""

    def accept(logits, draft_token_ids, draft_probs, params, generator):
        p = sampler.target_probs(logits, params)
        for i, token in enumerate(draft_token_ids):
            if torch.rand(1, generator=generator) >= draft_probs[i, token] / p[i, token]:
                residual = (p[i] - draft_probs[i]).clamp(min=0)
                return draft_token_ids[:i] + [int(torch.multinomial(residual, 1, generator=generator))]
        return draft_token_ids + [int(torch.multinomial(p[-1], 1, generator=generator))]

    return accept


def run_trials(rule, draft_probs, params, num_trials: int, fixed_drafts: list[int] | None = None) -> list[list[int]]:
    """Emitted tokens of `num_trials` verify steps, drafts drawn from Q (or always `fixed_drafts`)."""
    generator = torch.Generator().manual_seed(1234)
    if fixed_drafts is None:
        drafts = torch.multinomial(Q, num_trials, replacement=True, generator=generator).T.tolist()  # [trials, k]
    else:
        drafts = [fixed_drafts] * num_trials
    return [rule(LOGITS, d, draft_probs, params, generator) for d in drafts]


def chi_square(tokens: list[int], probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of the tokens' counts against the law `probs` [vocab] (all > 0), and its degrees
    of freedom (0 for no tokens)."""
    if not tokens:
        return 0.0, 0
    observed = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()  # [vocab]
    expected = len(tokens) * probs.double()  # [vocab]
    return float(((observed - expected) ** 2 / expected).sum()), VOCAB - 1


def law_checks(outputs: list[list[int]]) -> dict[str, tuple[float, int]]:
    """Chi-square statistics, with degrees of freedom, of each emitted token against the target's law."""
    first = chi_square([out[0] for out in outputs], P[0])
    # Token 2 exists when token 1 was a kept draft; for each such token 1 it must follow P[1].
    per_first = [chi_square([out[1] for out in outputs if len(out) > 1 and out[0] == a], P[1]) for a in range(VOCAB)]
    second = (sum(s for s, _ in per_first), sum(dof for _, dof in per_first))
    third = chi_square([out[2] for out in outputs if len(out) > 2], P[2])
    return {"token 1": first, "token 2 given token 1": second, "token 3": third}


def test_speculative_sampling_emits_the_targets_law(sampler, sampled):
    outputs = run_trials(sampler.accept_sampled, Q, sampled, num_trials=20_000)
    assert {len(out) for out in outputs} == {1, 2, 3}
    checks = law_checks(outputs)
    assert checks["token 2 given token 1"][1] == 25  # every token 1 a draft can be was seen
    for name, (statistic, dof) in checks.items():
        assert statistic < CRITICAL[dof], f"{name}: chi-square {statistic:.1f} >= {CRITICAL[dof]} (dof {dof})"


def test_the_same_check_rejects_accepting_with_q_over_p(wrong_rule, sampled):
    statistic, dof = law_checks(run_trials(wrong_rule, Q, sampled, num_trials=5_000))["token 1"]
    assert statistic > 10 * CRITICAL[dof]


def test_a_deterministic_draft_keeps_the_targets_law(sampler, sampled):
    """probs=None: q is one-hot on the draft, so draft i is kept with probability p_i(d_i)."""
    outputs = run_trials(sampler.accept_sampled, None, sampled, num_trials=10_000, fixed_drafts=[1, 2])
    assert {len(out) for out in outputs} == {1, 2, 3}
    first = chi_square([out[0] for out in outputs], P[0])
    second = chi_square([out[1] for out in outputs if len(out) > 1], P[1])  # token 1 is then the draft 1
    for statistic, dof in (first, second):
        assert statistic < CRITICAL[dof]


# --- edges --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_probs", [False, True])
def test_a_draft_the_target_rules_out_is_always_rejected(sampler, sampling, with_probs):
    """Position 0 is sure of token 2 (kept); top-k 2 leaves only tokens 4, 5 at position 1, so draft 0 is
    rejected, replaced by 4 or 5, and the third draft is never kept."""
    sure_of_2 = [-math.inf, -math.inf, 0.0, -math.inf, -math.inf, -math.inf]
    logits = torch.tensor([sure_of_2, [0.0, 1, 2, 3, 4, 5], [0.0, 1, 2, 3, 4, 5]])  # [k + 1, vocab], k = 2
    draft_probs = torch.full((2, VOCAB), 1 / VOCAB) if with_probs else None
    params = sampling.SamplingParams(top_k=2)
    generator = torch.Generator().manual_seed(0)

    def verify(drafts: list[int]) -> list[int]:
        return sampler.accept_sampled(logits, drafts, draft_probs, params, generator)

    assert {verify([2, 0])[1] for _ in range(200)} == {4, 5}
    assert all(len(verify([2, 0])) == 2 for _ in range(50))
    assert all(verify([3, 0]) == [2] for _ in range(50))


def test_a_deterministic_draft_the_target_is_sure_of_is_always_kept(sampler, sampled):
    logits = torch.full((4, VOCAB), -math.inf)  # [k + 1, vocab], k = 3
    logits[torch.arange(4), torch.tensor([3, 1, 4, 0])] = 0.0  # p one-hot on tokens 3, 1, 4 then 0
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert sampler.accept_sampled(logits, [3, 1, 4], None, sampled, generator) == [3, 1, 4, 0]


def test_without_drafts_one_token_is_drawn_from_the_target(sampler, sampled):
    logits = torch.tensor([[-math.inf, -math.inf, -math.inf, 0.0, -math.inf, -math.inf]])  # [1, vocab]
    for draft_probs in (None, torch.zeros(0, VOCAB)):
        assert sampler.accept_sampled(logits, [], draft_probs, sampled, torch.Generator().manual_seed(0)) == [3]
