"""Drafts looked up in the sequence itself: prompt lookup, vLLM's "ngram" method.

Text often repeats itself: code edits copy the prompt, answers quote it, lists echo their own pattern. The
proposer takes the sequence's last n tokens, finds where they occurred before (the most recent earlier
occurrence, the suffix itself excluded) and proposes the tokens that followed them there. It tries the
longest n first, from `prompt_lookup_max` down to `prompt_lookup_min`: a longer match is a better guess.
A match close to the end (text that loops with a short period) is continued as the loop it is: the
draft then reads its own first tokens again. No model runs and nothing is kept between steps; when
nothing matches, the sequence gets no draft and decodes one token as usual. The drafts are deterministic
(`Draft.probs` is None).
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .proposer import Draft, DraftRequest


class NgramProposer:
    """Proposes the tokens that followed the latest earlier occurrence of the sequence's last n tokens."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(self.lookup(request.token_ids, request.num_tokens)) for request in requests]

    def forget(self, key: object) -> None:
        """Nothing to free: the proposer keeps no state."""

    def close(self) -> None:
        """Nothing to let go of."""

    def lookup(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens that followed the longest n-gram match; [] when none matches."""
        tokens = np.asarray(token_ids)  # [length]
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            # Row i is tokens[i : i + n], for every start before the suffix's own: [length - n, n].
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                return continuation(token_ids, int(starts[-1]) + n, num_tokens)
        return []


def continuation(token_ids: list[int], follow: int, num_tokens: int) -> list[int]:
    """`num_tokens` tokens from `follow` on, as if the text after the match went on repeating what came
    after it: past the sequence's end the draft reads its own tokens (a loop shorter than the draft)."""
    draft = token_ids[follow : follow + num_tokens]
    while len(draft) < num_tokens:
        draft.append(draft[follow + len(draft) - len(token_ids)])
    return draft
