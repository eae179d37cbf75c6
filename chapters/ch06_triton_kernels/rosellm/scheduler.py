"""The offline scheduler: runs sessions in batches; a request may join at any step.

It keeps the KV block bookkeeping (a block table per sequence in a `BlockManager`, the batch's lengths
and block tables in a `BatchState`), and from chapter 05 on that bookkeeping IS the cache's layout.
"""

from collections import deque

from .batch_state import BatchState
from .block_manager import BlockManager
from .engine import InferenceEngine
from .session import InferenceSession


class OfflineScheduler:
    """Each `step()` advances every running session by one token.

    Sessions that joined since the last step are prefilled and the others decode, all in one forward
    (the new tokens laid end to end, no padding). Finished sessions leave the batch and free their
    blocks at once, and waiting ones take their places, up to `max_batch_size`, first come first served.

    A session is admitted only when the blocks for its longest possible sequence (prompt + max_tokens)
    are free beyond what the running sessions may still claim, so a running session never runs out
    of blocks. (Chapter 07 admits on the prompt alone and preempts instead.)
    """

    def __init__(self, engine: InferenceEngine, max_batch_size: int, block_manager: BlockManager):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.block_manager = block_manager
        self.batch = BatchState(max_batch_size, block_manager.num_total_blocks, block_manager.block_size)
        self.waiting: deque[InferenceSession] = deque()
        self.running: list[InferenceSession] = []

    def add_request(self, session: InferenceSession) -> None:
        self.waiting.append(session)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, session: InferenceSession) -> None:
        """Drop a session wherever it is (waiting or running); a finished or unknown one is ignored.
        Its blocks return to the pool and its row leaves the batch."""
        if session in self.waiting:
            self.waiting.remove(session)
        if session in self.running:
            self.running.remove(session)
        if session.request_id in self.block_manager.block_tables:
            self.block_manager.free(session.request_id)
        if session.request_id in self.batch.seq_ids:
            self.batch.remove(session.request_id)

    def step(self) -> list[tuple[InferenceSession, str]]:
        """One token for every running session; returns (session, new text) for each of them."""
        for session in self.running:  # a slot for the token each one is about to feed the model
            new_block = self.block_manager.append_slot(session.request_id)
            self.batch.append_token(session.request_id, new_block)
        while self.waiting and len(self.running) < self.max_batch_size and self._fits(self.waiting[0]):
            session = self.waiting.popleft()
            self.running.append(session)
            blocks = self.block_manager.allocate(session.request_id, len(session.pending))
            self.batch.add(session.request_id, len(session.pending), blocks)
        outputs = self._advance(self.running)
        for session in [s for s in self.running if s.finished]:
            self.block_manager.free(session.request_id)
            self.batch.remove(session.request_id)
        self.running = [session for session in self.running if not session.finished]
        return outputs

    def _fits(self, session: InferenceSession) -> bool:
        manager = self.block_manager
        still_claimable = sum(
            manager.blocks_needed(s.max_kv_tokens) - len(manager.block_tables[s.request_id]) for s in self.running
        )
        return manager.blocks_needed(session.max_kv_tokens) <= manager.num_free_blocks - still_claimable

    def _advance(self, sessions: list[InferenceSession]) -> list[tuple[InferenceSession, str]]:
        """One forward for the whole batch (its rows are the running sessions, in order)."""
        if not sessions:
            return []
        token_lists = [session.pending for session in sessions]
        size = self.batch.size
        seq_lens = self.batch.seq_lens[:size].tolist()
        hidden = self.engine.forward(token_lists, seq_lens, self.batch.block_tables[:size])
        logits = self.engine.last_token_logits(hidden, token_lists)  # [batch, vocab]
        return [(session, session.append_token(row)) for session, row in zip(sessions, logits)]
