"""The scheduler with chunked prefill: how many new tokens each sequence runs in the next forward, under
budgets of sequences, tokens and KV blocks. Plain bookkeeping over sequences and block ids; it never
touches the model."""

from collections import deque
from dataclasses import dataclass, field

from .block_manager import AllocatorState, BlockManager
from .sequence import Sequence, SequenceState, SequenceStatus


@dataclass
class SchedulerOutput:
    """The plan of one step: everything the forward needs, and what undoes it if the step fails."""

    scheduled: list[Sequence]  # the batch of the next forward, in row order
    num_new_tokens: list[int]  # tokens each runs, from its `num_computed_tokens` on: a chunk, or 1 (decode)
    num_prefills: int = 0  # sequences admitted this step
    preempted: list[Sequence] = field(default_factory=list)
    undo: "SchedulerState | None" = field(default=None, repr=False)

    @property
    def samples(self) -> list[bool]:
        """Whether each row samples a token: only a chunk that reaches the sequence's end does."""
        return [seq.num_computed_tokens + n == seq.num_tokens for seq, n in zip(self.scheduled, self.num_new_tokens)]

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
    """First come, first served, with chunked prefill and preemption by recomputation.

    Each step spends a budget of `max_num_batched_tokens` tokens, in this order:
    1. every running sequence that decodes gets its one token;
    2. running sequences part-way through their prompt get the next chunk of it, as much as the budget
       has left;
    3. waiting sequences are admitted in order while fewer than `max_num_seqs` run, each with as much of
       its prompt as the budget has left, their blocks free beyond a watermark kept for the running
       sequences to grow into. Nobody overtakes the head of the queue.
    A sequence takes blocks for exactly the tokens it computes. When the pool has no block for a running
    sequence, the most recently admitted running sequence is preempted: its blocks are freed and it goes
    back to the front of the waiting queue, to be prefilled again later, in chunks like any prompt. No
    one is admitted in a step that preempted. Without chunked prefill, a prompt must fit what the budget
    has left whole, or it waits.

    `schedule` changes the bookkeeping at once (the forward needs real block ids) and records how to
    undo it: `rollback(plan)` puts everything back if the step fails.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        watermark_blocks: int = 0,
        enable_chunked_prefill: bool = True,
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
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        undo = self._save()
        plan: dict[Sequence, int] = {}  # sequence -> new tokens, in row order
        preempted = self._schedule_running(plan)
        budget = self.max_num_batched_tokens - sum(plan.values())
        num_prefills = 0
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            num_new = seq.num_uncomputed_tokens
            if self.enable_chunked_prefill:
                num_new = min(num_new, budget)
            if num_new > budget or not self._blocks_free_for(seq, seq.num_computed_tokens + num_new):
                break  # first come, first served: nobody overtakes the head of the queue
            undo.sequences[seq] = seq.save()
            self.waiting.popleft()
            self.block_manager.grow(seq, seq.num_computed_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan[seq] = num_new
            budget -= num_new
            num_prefills += 1
        return SchedulerOutput(list(plan), list(plan.values()), num_prefills, preempted, undo)

    def _schedule_running(self, plan: dict[Sequence, int]) -> list[Sequence]:
        """Decodes first, then the next chunks of prompts part-way through; each gets blocks for its new
        tokens, preempting the newest running sequences when the pool runs out."""
        budget, preempted = self.max_num_batched_tokens, []
        decoding = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        prefilling = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
        for seq in decoding + prefilling:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # already preempted to make room for an older sequence
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                break  # the budget is spent: the remaining chunks wait for the next step
            while not self.block_manager.can_grow(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                budget += plan.pop(victim, 0)  # a victim scheduled earlier in this step gives its tokens back
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.grow(seq, seq.num_computed_tokens + num_new)
                plan[seq] = num_new
                budget -= num_new
        return preempted

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
