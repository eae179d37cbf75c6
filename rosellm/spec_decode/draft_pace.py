"""How many drafts a sequence asks for next, from what it has accepted so far.

A verify step of 1 + k tokens costs more than a decode step of one token, so where the drafts are seldom
accepted, speculating is slower than not. Each sequence keeps a pace, made from counts alone (never from
timings, so that a seeded request gives the same tokens on every machine):

- a verify step that accepted all its drafts lets the next ask for one more (up to k);
- one that accepted a of them, but not all, makes the next ask for a + 1;
- one that accepted none makes the sequence wait before it proposes again: 1 token after the first such miss,
  then 2, 4, ... up to `MAX_WAIT` tokens after misses in a row. An accepted draft ends the run of misses.
"""

from dataclasses import dataclass

MAX_WAIT = 16  # tokens: the longest wait after misses in a row (a copy that starts late is found this soon)


@dataclass(frozen=True)
class DraftPace:
    length: int  # drafts the next verify step asks for, 1..k
    resume_at: int = 0  # the sequence proposes again once it holds this many output tokens
    misses: int = 0  # verify steps in a row that accepted no draft

    def ready(self, num_output_tokens: int) -> bool:
        return num_output_tokens >= self.resume_at

    def after(self, num_drafts: int, num_accepted: int, num_output_tokens: int, most: int) -> "DraftPace":
        """The pace after a verify step that checked `num_drafts` drafts and kept `num_accepted` of them; the
        sequence now holds `num_output_tokens` output tokens; `most` is k."""
        if num_accepted == 0:
            wait = min(2**self.misses, MAX_WAIT)
            return DraftPace(1, num_output_tokens + wait, self.misses + 1)
        if num_accepted == num_drafts:
            return DraftPace(min(most, max(self.length, num_drafts + 1)))
        return DraftPace(num_accepted + 1)
