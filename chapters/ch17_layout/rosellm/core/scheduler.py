"""The scheduler with chunked prefill and prefix caching: how many new tokens each sequence runs in the next
forward, under budgets of sequences, tokens and KV blocks. Plain bookkeeping over sequences and block ids;
it never touches the model."""

from collections import deque
from dataclasses import dataclass, field

from .block_allocator import AllocatorState
from .block_manager import BlockManager
from .sequence import Sequence, SequenceState, SequenceStatus


@dataclass
class SchedulerOutput:
    """The plan of one step: everything the forward needs, and what undoes it if the step fails."""

    scheduled: list[Sequence]  # the batch of the next forward, in row order
    num_new_tokens: list[int]  # tokens each runs, from its `num_computed_tokens` on: a chunk, or 1 (decode)
    num_prefills: int = 0  # sequences admitted this step
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source, copy) blocks, before the forward
    undo: "SchedulerState | None" = field(default=None, repr=False)
    # per row: the drafts it verifies (speculative decoding), the last of its new tokens; [] for most rows
    drafts: list[list[int]] | None = None

    def __post_init__(self):
        if self.drafts is None:
            self.drafts = [[] for _ in self.scheduled]

    @property
    def samples(self) -> list[bool]:
        """Whether each row samples a token: only a chunk that reaches the sequence's end does."""
        return [
            seq.num_computed_tokens + n - len(draft) == seq.num_tokens
            for seq, n, draft in zip(self.scheduled, self.num_new_tokens, self.drafts)
        ]


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
    3. waiting sequences are admitted in order while fewer than `max_num_seqs` run (a request for n
       samples counts n), each starting from the longest cached prefix of its tokens (prefix caching),
       with as much of the rest as the budget has left, their blocks free beyond a watermark kept for
       the running sequences to grow into. Nobody overtakes the head of the queue.
    A sequence takes blocks for exactly the tokens it computes. When the pool has no block for a running
    sequence, the most recently admitted running sequence is preempted: its blocks are freed and it goes
    back to the front of the waiting queue, to be prefilled again later, in chunks like any prompt (with
    prefix caching, its full blocks wait in the evictor: mostly a cache hit). No one is admitted in a step
    that preempted. Without chunked prefill, a prompt must fit what the budget has left whole, or it waits.
    A sequence about to write into a block it shares gets a copy first (copy on write).

    With speculative decoding, a decoding sequence may come with drafts: tokens proposed to follow its last
    one. It then runs them too (a short chunk: its last token and the drafts), as many as the budget and the
    free blocks allow, once every later decoding sequence's one token is set aside; nobody is preempted to
    make room for a draft, and no decode waits for one.

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

    @property
    def num_seats(self) -> int:
        return sum(seq.num_seats for seq in self.running)

    def schedule(self, drafts: dict[Sequence, list[int]] | None = None) -> SchedulerOutput:
        """The next step's plan; `drafts`: proposed tokens per decoding sequence (speculative decoding)."""
        drafts = drafts or {}
        undo = self._save()
        plan: dict[Sequence, int] = {}  # sequence -> new tokens, in row order
        copies: dict[Sequence, tuple[int, int]] = {}  # sequence -> the block it copies before writing
        preempted = self._schedule_running(plan, copies, drafts)
        budget = self.max_num_batched_tokens - sum(plan.values())
        num_prefills = 0
        while not preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            if self.num_seats + seq.num_seats > self.max_num_seqs:
                break
            hits = self.block_manager.cached_prefix(seq)
            num_cached = len(hits) * self.block_manager.block_size
            num_new = seq.num_tokens - num_cached
            if self.enable_chunked_prefill:
                num_new = min(num_new, budget)
            if num_new > budget or not self._blocks_free_for(seq, hits, num_cached + num_new):
                break  # first come, first served: nobody overtakes the head of the queue
            undo.sequences[seq] = seq.save()
            self.waiting.popleft()
            self.block_manager.take_prefix(seq, hits)
            if seq.num_cached_tokens is None:  # first admission: what the request found in the cache
                seq.num_cached_tokens = num_cached
            self.block_manager.grow(seq, num_cached + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan[seq] = num_new
            budget -= num_new
            num_prefills += 1
        scheduled_drafts = [
            drafts.get(seq, [])[: max(0, num_new - seq.num_uncomputed_tokens)] for seq, num_new in plan.items()
        ]
        return SchedulerOutput(
            list(plan), list(plan.values()), num_prefills, preempted, list(copies.values()), undo, scheduled_drafts
        )

    def _schedule_running(
        self, plan: dict[Sequence, int], copies: dict[Sequence, tuple[int, int]], drafts: dict[Sequence, list[int]]
    ) -> list[Sequence]:
        """Decodes first (with their drafts, as far as the budget and the free blocks go), then the next
        chunks of prompts part-way through; each gets blocks for its new tokens (and a copy of a shared
        block it writes into), preempting the newest running sequences when the pool runs out."""
        budget, preempted = self.max_num_batched_tokens, []
        decoding = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        prefilling = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
        for position, seq in enumerate(decoding + prefilling):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # already preempted to make room for an older sequence
            # Drafts never take the one token each later decode needs: every decoding sequence advances.
            reserved = sum(later.status is SequenceStatus.RUNNING for later in decoding[position + 1 :])
            num_new = min(seq.num_uncomputed_tokens + len(drafts.get(seq, ())), budget - reserved)
            if num_new == 0:
                break  # the budget is spent: the remaining chunks wait for the next step
            while num_new > seq.num_uncomputed_tokens and not self.block_manager.can_grow(
                seq, seq.num_computed_tokens + num_new
            ):
                num_new -= 1  # a draft the pool has no room for is dropped, not paid for by a preemption
            while not self.block_manager.can_grow(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                budget += plan.pop(victim, 0)  # a victim scheduled earlier in this step gives its tokens back
                copies.pop(victim, None)  # and its copy is no longer wanted
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                copy = self.block_manager.copy_on_write(seq)
                if copy is not None:
                    copies[seq] = copy
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

    def overwritten_blocks(self, plan: SchedulerOutput) -> list[int]:
        """Blocks the step writes (new tokens, copies) that, before the step, held keys and values someone
        could still read if it is undone: taken from a sequence this plan preempted, or from the prefix
        cache's evictor. A failed step must put their contents back."""
        written = set()
        for seq in plan.scheduled:
            had = set(plan.undo.sequences[seq].block_table)
            first = seq.num_computed_tokens // self.block_manager.block_size  # blocks before it are only read
            written.update(b for b in seq.block_table[first:] if b not in had)
        return sorted(b for b in written if plan.undo.allocator.holds_data(b))

    def add_forks(self, parent: Sequence, children: list[Sequence]) -> None:
        """The other samples of `parent`'s request run from now on, admitted with it."""
        at = self.running.index(parent) + 1
        self.running[at:at] = children

    def finish(self, seq: Sequence) -> None:
        """A running sequence is done: its blocks return to the pool at once."""
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def abort(self, request_id: str) -> bool:
        """Drop a request's sequences wherever they are; their blocks are freed. False if none is found."""
        waiting = [seq for seq in self.waiting if seq.request_id == request_id]
        running = [seq for seq in self.running if seq.request_id == request_id]
        for seq in waiting:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.FINISHED
        for seq in running:
            self.finish(seq)
        return bool(waiting or running)

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

    def _blocks_free_for(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        """Room beyond the watermark; a sequence alone may use the watermark too (nothing else can grow)."""
        needed = self.block_manager.num_blocks_to_admit(seq, hits, num_tokens)
        reserve = self.watermark_blocks if self.running else 0
        return needed <= self.block_manager.num_free_blocks - reserve
