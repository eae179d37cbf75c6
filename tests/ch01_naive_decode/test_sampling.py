"""Sampling: the filters keep exactly the right tokens; seeds reproduce; temperature -> 0 is greedy."""

import math

import pytest
import torch


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def test_top_k_keeps_the_k_largest(checkpoint):
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0, -1.0]])
    assert kept(checkpoint.sampling.apply_top_k(logits, 1)) == {1}
    assert kept(checkpoint.sampling.apply_top_k(logits, 2)) == {1, 3}
    assert kept(checkpoint.sampling.apply_top_k(logits, 4)) == {0, 1, 2, 3}
    assert kept(checkpoint.sampling.apply_top_k(logits, 0)) == {0, 1, 2, 3, 4}  # 0 disables it


@pytest.mark.parametrize(
    "top_p, expected",
    [
        (0.3, {0}),
        (0.5, {0}),
        (0.51, {0, 1}),
        (0.75, {0, 1}),
        (0.9, {0, 1, 2}),
        (0.96, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(checkpoint, top_p, expected):
    # probabilities 0.5, 0.3, 0.15, 0.05, shuffled so that the filter must sort
    probs = [0.15, 0.5, 0.05, 0.3]
    logits = torch.tensor([[math.log(p) for p in probs]])
    by_rank = [1, 3, 0, 2]  # positions of 0.5, 0.3, 0.15, 0.05
    assert kept(checkpoint.sampling.apply_top_p(logits, top_p)) == {by_rank[i] for i in expected}


def test_filters_work_row_by_row(checkpoint):
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    filtered = checkpoint.sampling.apply_top_k(logits, 1)
    assert torch.isfinite(filtered).tolist() == [[False, False, True], [True, False, False]]


def test_same_seed_same_tokens_other_seed_other_tokens(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))

    def run(seed):
        params = checkpoint.SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=seed)
        return llm.generate([[10, 11, 12]], params, use_tqdm=False)[0].token_ids

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_temperature_to_zero_converges_to_greedy(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    greedy = llm.generate(
        [[10, 11, 12]], checkpoint.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
    )[0].token_ids
    cold = checkpoint.SamplingParams(temperature=1e-4, max_tokens=16, ignore_eos=True, seed=0)
    assert llm.generate([[10, 11, 12]], cold, use_tqdm=False)[0].token_ids == greedy


def test_top_k_one_is_greedy_at_any_temperature(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["mqa_tied"]))
    greedy = llm.generate(
        [[3, 4]], checkpoint.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0].token_ids
    hot = checkpoint.SamplingParams(temperature=5.0, top_k=1, max_tokens=10, ignore_eos=True)
    assert llm.generate([[3, 4]], hot, use_tqdm=False)[0].token_ids == greedy


def test_sampled_tokens_respect_the_filters(checkpoint):
    logits = torch.tensor([0.0, 5.0, 4.0, 3.0, 2.0])
    generator = torch.Generator().manual_seed(0)
    params = checkpoint.SamplingParams(temperature=2.0, top_k=2)
    draws = {checkpoint.sampling.sample(logits, params, generator) for _ in range(200)}
    assert draws == {1, 2}
