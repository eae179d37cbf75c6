"""Prompt lookup by hand: the longest n first, the most recent earlier match, what followed it."""

from rosellm.ngram_proposer import NgramProposer
from rosellm.proposer import DraftRequest
from rosellm.sampling import SamplingParams


def propose(proposer: NgramProposer, token_ids: list[int], num_tokens: int) -> list[int]:
    [draft] = proposer.propose([DraftRequest(object(), token_ids, num_tokens, SamplingParams(), None)])
    assert draft.probs is None
    return draft.token_ids


def test_the_longest_ngram_that_matches_wins():
    tokens = [1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3]  # [1, 2, 3] at 0 (then 9, 7); [2, 3] last at 5 (then 8, 1)
    assert propose(NgramProposer(2, 3), tokens, 2) == [9, 7]
    assert propose(NgramProposer(2, 2), tokens, 2) == [8, 1]


def test_the_most_recent_earlier_occurrence_is_used():
    assert propose(NgramProposer(2, 2), [4, 5, 6, 4, 5, 7, 4, 5], 2) == [7, 4]


def test_fewer_tokens_when_the_sequence_ends_first():
    assert propose(NgramProposer(2, 2), [1, 2, 3, 1, 2], 5) == [3, 1, 2]
    assert propose(NgramProposer(2, 2), [7, 7, 7], 4) == [7]  # the match overlaps the suffix


def test_num_tokens_caps_the_draft():
    assert propose(NgramProposer(2, 2), [1, 2, 3, 4, 5, 6, 1, 2], 3) == [3, 4, 5]


def test_no_match_gives_an_empty_draft():
    assert propose(NgramProposer(1, 3), [1, 2, 3, 4], 3) == []
    assert propose(NgramProposer(1, 2), [1, 2], 3) == []  # the suffix itself is no match
    assert propose(NgramProposer(1, 2), [5], 3) == []
    assert propose(NgramProposer(1, 2), [], 3) == []


def test_min_n_is_respected():
    tokens = [5, 1, 2, 5]  # only the 1-gram [5] occurs earlier
    assert propose(NgramProposer(2, 3), tokens, 2) == []
    assert propose(NgramProposer(1, 3), tokens, 2) == [1, 2]


def test_one_draft_per_request_in_order_and_nothing_to_forget():
    proposer = NgramProposer(2, 2)
    first, second = object(), object()
    requests = [
        DraftRequest(first, [1, 2, 3, 1, 2], 1, SamplingParams(), None),
        DraftRequest(second, [1, 2, 3, 4], 1, SamplingParams(), None),
    ]
    assert [draft.token_ids for draft in proposer.propose(requests)] == [[3], []]
    proposer.forget(first)
    assert [draft.token_ids for draft in proposer.propose(requests)] == [[3], []]
