"""The continuous-batching scheduler: who runs in the next forward, under budgets of sequences, tokens
and KV blocks. Plain bookkeeping over sequences and block ids; it never touches the model."""

from collections import deque
from dataclasses import dataclass, field

from .block_manager import AllocatorState, BlockManager
from .sequence import Sequence, SequenceState, SequenceStatus


@dataclass
class SchedulerOutput:
    """The plan of one step: everything the forward needs, and what undoes it if the step fails."""

    scheduled: list[Sequence]  # the batch of the next forward, in row order
    num_new_tokens: list[int]  # tokens each runs: its whole prompt (prefill) or 1 (decode)
    num_prefills: int = 0  # sequences admitted this step
    preempted: list[Sequence] = field(default_factory=list)
    undo: "SchedulerState | None" = field(default=None, repr=False)

    @property
    def reused_blocks(self) -> list[int]:
        """Blocks that a sequence preempted by this plan owned and that a scheduled sequence now owns:
        the forward overwrites them, so a failed step must put their contents back."""
        freed = {b for seq in self.preempted for b in self.undo.sequences[seq].block_table}
        return sorted({b for seq in self.scheduled for b in seq.block_table} & freed)


@dataclass
class SchedulerState:
    """The queues, the allocator and every sequence a step can touch, as they were before it."""

    waiting: list[Sequence]
    running: list[Sequence]
    allocator: AllocatorState
    sequences: dict[Sequence, SequenceState]


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

    `schedule` changes the bookkeeping at once (the forward needs real block ids) and records how to
    undo it: `rollback(plan)` puts everything back if the step fails.
    """

    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, watermark_blocks: int = 0
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                f"({max_num_seqs}), so that every running sequence can decode"
            )
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.watermark_blocks = watermark_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the batch's rows

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        undo = self._save()
        preempted = self._reserve_decode_slots()
        budget = self.max_num_batched_tokens - len(self.running)
        num_prefills = 0
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = seq.num_tokens
            if num_new > budget or not self._blocks_free_for(seq, num_new):
                break  # first come, first served: nobody overtakes the head of the queue
            undo.sequences[seq] = seq.save()
            self.waiting.popleft()
            self.block_manager.grow(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            budget -= num_new
            num_prefills += 1
        scheduled = list(self.running)
        num_new_tokens = [seq.num_tokens - seq.num_computed_tokens for seq in scheduled]
        return SchedulerOutput(scheduled, num_new_tokens, num_prefills, preempted, undo)

    def rollback(self, plan: SchedulerOutput) -> None:
        """Undo `plan`: the queues, every sequence and the allocator as they were before `schedule`."""
        undo = plan.undo
        self.waiting = deque(undo.waiting)
        self.running = list(undo.running)
        for seq, state in undo.sequences.items():
            seq.restore(state)
        self.block_manager.restore(undo.allocator)

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

    def _save(self) -> SchedulerState:
        return SchedulerState(
            list(self.waiting),
            list(self.running),
            self.block_manager.save(),
            {seq: seq.save() for seq in self.running},
        )

    def _reserve_decode_slots(self) -> list[Sequence]:
        """A slot for every running sequence's next token, preempting the newest ones when blocks run out."""
        preempted = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # already preempted to make room for an older sequence
            while not self.block_manager.can_grow(seq, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.grow(seq, seq.num_tokens)
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0  # its keys and values are gone: recompute them on re-admission
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)

    def _blocks_free_for(self, seq: Sequence, num_tokens: int) -> bool:
        """Room beyond the watermark; a sequence alone may use the watermark too (nothing else can grow)."""
        needed = self.block_manager.num_missing_blocks(seq, num_tokens)
        reserve = self.watermark_blocks if self.running else 0
        return needed <= self.block_manager.num_free_blocks - reserve
