"""The offline scheduler: runs sessions in batches; a request may join at any step."""

from collections import deque

from .engine import InferenceEngine
from .session import InferenceSession


class OfflineScheduler:
    """Each `step()` advances every running session by one token.

    Sessions that joined since the last step are prefilled together (one padded batch of prompts);
    the others decode together (one padded batch of single tokens). Finished sessions leave the batch
    at once, and waiting ones take their places, up to `max_batch_size`.
    """

    def __init__(self, engine: InferenceEngine, max_batch_size: int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.waiting: deque[InferenceSession] = deque()
        self.running: list[InferenceSession] = []

    def add_request(self, session: InferenceSession) -> None:
        self.waiting.append(session)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, session: InferenceSession) -> None:
        """Drop a session wherever it is (waiting or running); a finished or unknown one is ignored."""
        if session in self.waiting:
            self.waiting.remove(session)
        if session in self.running:
            self.running.remove(session)

    def step(self) -> list[tuple[InferenceSession, str]]:
        """One token for every running session; returns (session, new text) for each of them."""
        decoding = list(self.running)
        joining = []
        while self.waiting and len(self.running) < self.max_batch_size:
            joining.append(self.waiting.popleft())
            self.running.append(joining[-1])
        outputs = [(session, piece) for group in (joining, decoding) for session, piece in self._advance(group)]
        self.running = [session for session in self.running if not session.finished]
        return outputs

    def _advance(self, sessions: list[InferenceSession]) -> list[tuple[InferenceSession, str]]:
        if not sessions:
            return []
        token_lists = [session.pending for session in sessions]
        hidden = self.engine.forward(token_lists, [session.cache for session in sessions])
        logits = self.engine.last_token_logits(hidden, token_lists)  # [batch, vocab]
        return [(session, session.append_token(row)) for session, row in zip(sessions, logits)]
