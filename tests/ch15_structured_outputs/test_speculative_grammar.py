"""A sampled draft under a grammar keeps the target's law. The engine's own pieces on a hand-worked case:
the grammar allows the answers "a" and "b" (the regex [ab]); the target likes a and b equally, the draft
likes a and c. The draft's c is refused by the grammar; the target must then draw from max(0, p - q), which
is b alone, so that a comes out with probability 1/2, not the 3/4 of a target that draws from its own p."""

import pytest
import torch

from chapters import submodule

pytestmark = pytest.mark.requires("structured_outputs")

CRITICAL_1_DOF = 10.828  # Pearson's chi-square at p = 0.001, one degree of freedom


@pytest.fixture
def modules(checkpoint):
    return {name: submodule(checkpoint, name) for name in ("grammar", "rejection_sampler")}


def emitted_tokens(checkpoint, modules, tiny_model_dirs, num_trials: int) -> list[int]:
    """What verification emits at the grammar's first position, over `num_trials` draft draws."""
    from transformers import AutoTokenizer

    grammar, sampler = modules["grammar"], modules["rejection_sampler"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["gqa"])
    vocab = len(tokenizer)
    a, b, c = (tokenizer.encode(letter, add_special_tokens=False)[0] for letter in "abc")
    cache = grammar.GrammarCache(tokenizer, vocab, {tokenizer.eos_token_id})
    state = grammar.GrammarState(cache.compile(checkpoint.StructuredOutputsParams(regex="[ab]")))
    target = torch.full((2, vocab), -torch.inf)  # [k + 1, vocab] logits, k = 1: p = (1/2, 1/2) on a, b
    target[:, [a, b, tokenizer.eos_token_id]] = 0.0  # (the end of the answer: the grammar's mask allows it after)
    q = torch.zeros(vocab)  # [vocab]: the draft's law, 1/2 on a and on c
    q[[a, c]] = 0.5
    params = checkpoint.SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    emitted = []
    for _ in range(num_trials):
        token = int(torch.multinomial(q, 1, generator=generator))
        draft = grammar.grammar_checked(state, sampler_draft(checkpoint, [token], q[None]))
        if not draft.token_ids:  # nothing left to verify: the target samples the position alone
            logits = target[:1].clone()
            grammar.mask_logits(logits, [state])
            emitted.append(int(torch.multinomial(sampler.target_probs(logits, params)[0], 1, generator=generator)))
            continue
        logits = target[: len(draft.token_ids) + 1].clone()
        grammar.mask_draft_logits(logits, state, draft.token_ids)
        emitted.append(sampler.accept_sampled(logits, draft.token_ids, draft.probs, params, generator)[0])
    assert set(emitted) <= {a, b}
    return [token == a for token in emitted]


def sampler_draft(checkpoint, token_ids: list[int], probs: torch.Tensor):
    return submodule(checkpoint, "proposer").Draft(token_ids, probs)


def test_a_sampled_draft_cut_by_the_grammar_keeps_the_targets_law(checkpoint, modules, tiny_model_dirs):
    num_trials = 4000
    is_a = emitted_tokens(checkpoint, modules, tiny_model_dirs, num_trials)
    count_a = sum(is_a)
    expected = num_trials / 2
    statistic = 2 * (count_a - expected) ** 2 / expected  # two cells, each expected num_trials / 2
    assert statistic < CRITICAL_1_DOF, f"a came {count_a / num_trials:.3f} of the time, not 1/2"


def test_a_deterministic_draft_ends_before_the_token_the_grammar_refuses(checkpoint, modules, tiny_model_dirs):
    """A draft without probabilities (prompt lookup, or a greedy draft model) is cut before the refused token:
    it cannot be kept, and the rule of a deterministic proposal draws that position from p anyway."""
    from transformers import AutoTokenizer

    grammar = modules["grammar"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["gqa"])
    a, c = (tokenizer.encode(letter, add_special_tokens=False)[0] for letter in "ac")
    cache = grammar.GrammarCache(tokenizer, len(tokenizer), {tokenizer.eos_token_id})
    state = grammar.GrammarState(cache.compile(checkpoint.StructuredOutputsParams(regex="aa")))
    checked = grammar.grammar_checked(state, sampler_draft(checkpoint, [a, c, a], None))
    assert checked.token_ids == [a] and checked.probs is None
    sampled = grammar.grammar_checked(state, sampler_draft(checkpoint, [a, c, a], torch.full((3, 8), 0.125)))
    assert sampled.token_ids == [a, c] and sampled.probs.shape == (2, 8)
    assert grammar.grammar_checked(None, sampler_draft(checkpoint, [c], None)).token_ids == [c]
