"""The continuous-batching scheduler: who runs in the next forward, under budgets of sequences, tokens
and KV blocks. Plain bookkeeping over sequences and block ids; it never touches the model."""

from collections import deque
from dataclasses import dataclass, field

from .batch_state import BatchState
from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[Sequence]  # the batch of the next forward, in row order; each runs its pending tokens
    num_prefills: int = 0  # sequences admitted this step (they prefill; the rest decode one token)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    """First come, first served, with preemption by recomputation.

    Each step, every running sequence first gets a KV slot for the token it decodes. When the pool has
    no block for it, the most recently admitted running sequence is preempted: its blocks are freed and
    it goes back to the front of the waiting queue, to be prefilled again later (prompt and generated
    tokens alike). Then, if nothing was preempted, waiting sequences are admitted in order while there
    is room: fewer than `max_num_seqs` running, their tokens within `max_num_batched_tokens` for this
    step, and their blocks free beyond a watermark kept for the running sequences to grow into.
    The engine accepts only requests that could run alone (prompt + max_tokens within the pool and the
    token budget), so the head of the queue is always admitted once the running sequences are done.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 watermark_blocks: int = 0):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}), so that every running sequence can decode")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = watermark_blocks
        self.batch = BatchState(max_num_seqs, block_manager.num_total_blocks, block_manager.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the batch's rows

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        preempted = self._reserve_decode_slots()
        budget = self.max_num_batched_tokens - len(self.running)
        num_prefills = 0
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = len(seq.pending_token_ids)
            if num_new > budget or not self._blocks_free_for(num_new):
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            blocks = self.block_manager.allocate(seq.request_id, num_new)
            self.batch.add(seq.request_id, num_new, blocks)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= num_new
            num_prefills += 1
        return SchedulerOutput(list(self.running), num_prefills, preempted)

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: its blocks return to the pool at once."""
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, request_id: str) -> Sequence | None:
        """Drop a request wherever it is; its blocks are freed. Returns it, or None if unknown."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                seq.status = SequenceStatus.FINISHED
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.finish(seq)
                return seq
        return None

    def _reserve_decode_slots(self) -> list[Sequence]:
        """A slot for every running sequence's next token, preempting the newest ones when blocks run out."""
        preempted = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # already preempted to make room for an older sequence
            while not self.block_manager.can_append(seq.request_id):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                new_block = self.block_manager.append_slot(seq.request_id)
                self.batch.append_token(seq.request_id, new_block)
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_cached_tokens = 0  # its keys and values are gone: recompute them on re-admission
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq.request_id)
        self.batch.remove(seq.request_id)
        self.running.remove(seq)

    def _blocks_free_for(self, num_tokens: int) -> bool:
        """Room beyond the watermark; a sequence alone may use the watermark too (nothing else can grow)."""
        needed = self.block_manager.blocks_needed(num_tokens)
        reserve = self.watermark_blocks if self.running else 0
        return needed <= self.block_manager.num_free_blocks - reserve
