"""Streaming detokenization: turn a growing list of token ids into text pieces as they arrive."""


class IncrementalDetokenizer:
    """Emits the new text each token adds, holding back while the tail is an incomplete UTF-8 character.

    Decoding one token at a time breaks characters that span several byte-level tokens (emoji, CJK),
    and decoding everything at every step costs O(n) per token. Instead we decode a short window:
    the tokens since `prefix_offset`, and compare with the text of the same window up to `read_offset`
    (what was already emitted). The difference is new, unless it ends in U+FFFD, the replacement
    character a decoder produces for a cut multi-byte sequence; then we wait for the next token.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _pending_text(self) -> tuple[str, str]:
        emitted = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.token_ids[self.prefix_offset :])
        return emitted, window

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (may be empty)."""
        self.token_ids.append(token_id)
        emitted, window = self._pending_text()
        if len(window) <= len(emitted) or window.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return window[len(emitted) :]

    def save(self) -> tuple[int, int, int]:
        """Where it stands (tokens added, the window's start, emitted up to), for `restore`."""
        return len(self.token_ids), self.prefix_offset, self.read_offset

    def restore(self, saved: tuple[int, int, int]) -> None:
        """Back to where `save` found it: the tokens added since are forgotten."""
        num_tokens, self.prefix_offset, self.read_offset = saved
        del self.token_ids[num_tokens:]

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (e.g. a cut character), as decoded."""
        emitted, window = self._pending_text()
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return window[len(emitted) :]
