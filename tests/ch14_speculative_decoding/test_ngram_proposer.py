"""Prompt lookup by hand: the longest n first, the most recent earlier match, what followed it."""

import pytest

from chapters import submodule

pytestmark = pytest.mark.requires("speculative_decoding")


@pytest.fixture
def ngram_proposer(checkpoint):
    """The checkpoint's `NgramProposer(min_n, max_n)`."""
    return submodule(checkpoint, "ngram_proposer").NgramProposer


@pytest.fixture
def request_for(checkpoint):
    """A `DraftRequest` for `num_tokens` drafts after `token_ids`, under default sampling parameters."""
    proposer = submodule(checkpoint, "proposer")

    def make(key, token_ids: list[int], num_tokens: int):
        return proposer.DraftRequest(key, token_ids, num_tokens, checkpoint.SamplingParams(), None)

    return make


@pytest.fixture
def propose(request_for):
    """The draft one proposer gives one sequence: its tokens, checked to carry no probabilities."""

    def draft_tokens(proposer, token_ids: list[int], num_tokens: int) -> list[int]:
        [draft] = proposer.propose([request_for(object(), token_ids, num_tokens)])
        assert draft.probs is None
        return draft.token_ids

    return draft_tokens


def test_the_longest_ngram_that_matches_wins(ngram_proposer, propose):
    tokens = [1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3]  # [1, 2, 3] at 0 (then 9, 7); [2, 3] last at 5 (then 8, 1)
    assert propose(ngram_proposer(2, 3), tokens, 2) == [9, 7]
    assert propose(ngram_proposer(2, 2), tokens, 2) == [8, 1]


def test_the_most_recent_earlier_occurrence_is_used(ngram_proposer, propose):
    assert propose(ngram_proposer(2, 2), [4, 5, 6, 4, 5, 7, 4, 5], 2) == [7, 4]


def test_a_match_near_the_end_continues_as_a_loop(ngram_proposer, propose):
    assert propose(ngram_proposer(2, 2), [1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]  # period 3
    assert propose(ngram_proposer(2, 2), [7, 7, 7], 4) == [7, 7, 7, 7]  # the match overlaps the suffix
    assert propose(ngram_proposer(1, 1), [5, 9, 4, 9], 5) == [4, 9, 4, 9, 4]


def test_num_tokens_caps_the_draft(ngram_proposer, propose):
    assert propose(ngram_proposer(2, 2), [1, 2, 3, 4, 5, 6, 1, 2], 3) == [3, 4, 5]


def test_no_match_gives_an_empty_draft(ngram_proposer, propose):
    assert propose(ngram_proposer(1, 3), [1, 2, 3, 4], 3) == []
    assert propose(ngram_proposer(1, 2), [1, 2], 3) == []  # the suffix itself is no match
    assert propose(ngram_proposer(1, 2), [5], 3) == []
    assert propose(ngram_proposer(1, 2), [], 3) == []


def test_min_n_is_respected(ngram_proposer, propose):
    tokens = [5, 1, 2, 5]  # only the 1-gram [5] occurs earlier
    assert propose(ngram_proposer(2, 3), tokens, 2) == []
    assert propose(ngram_proposer(1, 3), tokens, 2) == [1, 2]


def test_one_draft_per_request_in_order_and_nothing_to_forget(ngram_proposer, request_for):
    proposer = ngram_proposer(2, 2)
    first, second = object(), object()
    requests = [
        request_for(first, [1, 2, 3, 1, 2], 1),
        request_for(second, [1, 2, 3, 4], 1),
    ]
    assert [draft.token_ids for draft in proposer.propose(requests)] == [[3], []]
    proposer.forget(first)
    assert [draft.token_ids for draft in proposer.propose(requests)] == [[3], []]
