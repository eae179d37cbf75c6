"""Stop strings: end an answer when its text contains one of `SamplingParams.stop`.

A stop string is matched on the detokenized text, so it may span several tokens ("\\n\\nUser:" can arrive
as "\\n", "\\nUser" and ":"). The answer's text ends just before the stop string (which is left out, as
OpenAI's API does); its token ids keep every token sampled, the one that completed the stop string included.

Text already handed to the caller is never taken back: while the end of the text could still be the start of
a stop string (the text "...\\n" with the stop string "\\n\\nUser:"), that end is held back until the next
pieces either complete the stop string or rule it out.
"""

from collections.abc import Sequence


class StopStringMatcher:
    """Watches one answer's text for its stop strings, piece by piece as the detokenizer emits it."""

    def __init__(self, stop: Sequence[str]):
        self.stop = tuple(stop)
        self.held = ""  # text not released yet: it may be the beginning of a stop string
        self.stopped = False  # a stop string was found; nothing more is released

    def add(self, piece: str, final: bool = False) -> str:
        """Take the next piece of text; return what can be released now. When a stop string appears, the text
        before it is released, the rest dropped, and `stopped` is set. `final`: the answer ends for another
        reason (a stop token, max_tokens), so nothing is held back."""
        if self.stopped:
            return ""
        text = self.held + piece
        # No stop string ends before `text` starts: it would have been found earlier (see `held_suffix`).
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.held, self.stopped = "", True
            return text[: min(found)]
        keep = 0 if final else held_suffix(text, self.stop)
        self.held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def save(self) -> tuple[str, bool]:
        """What it holds back and whether it stopped, for `restore`."""
        return self.held, self.stopped

    def restore(self, saved: tuple[str, bool]) -> None:
        self.held, self.stopped = saved


def held_suffix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string (0 if none). Holding back
    exactly that much is enough: a stop string that starts earlier would need a longer such end."""
    longest = max((len(s) for s in stop), default=1) - 1
    for length in range(min(longest, len(text)), 0, -1):
        if any(s.startswith(text[-length:]) for s in stop):
            return length
    return 0
