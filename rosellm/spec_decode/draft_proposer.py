"""The draft-model proposer: a second, cheaper model (by default the target's own weights in int4) guesses
the next tokens one forward at a time, on a paged KV pool of its own.

Per sequence it keeps a record: its block table in the draft's pool, and the tokens whose keys and values
it has written there, in order. Each call it trusts only the longest prefix those tokens share with the
sequence's tokens now, and runs the rest: after rejected drafts, a preemption or a failed step, the next
call recomputes only what differs. Then:
- one forward of every sequence's catch-up chunk, whose last position gives its first draft;
- one one-token forward per further draft, each writing the previous draft's keys and values.
The last draft's keys and values are never written: they are needed only once it is accepted, and then the
next call catches up.

Speculation is a hint: a sequence the draft's pool cannot hold gets no draft (its record is dropped), and
nobody else's record is evicted for it.
"""

from dataclasses import dataclass, field

import torch

from ..core.block_manager import BlockManager
from ..sample.rejection_sampler import target_probs
from ..worker.model_runner import ModelRunner
from ..worker.step_inputs import StepInputs
from .proposer import Draft, DraftRequest


@dataclass
class DraftRecord:
    """What the draft's pool holds for one sequence."""

    block_table: list[int] = field(default_factory=list)  # grown and freed by the block manager, as a sequence's
    token_ids: list[int] = field(default_factory=list)  # tokens whose keys and values are written, in order


@dataclass
class DraftRow:
    """One sequence being drafted in this call."""

    request: DraftRequest
    record: DraftRecord
    token_ids: list[int] = field(default_factory=list)  # drafts so far
    probs: list[torch.Tensor] = field(default_factory=list)  # [vocab] each, for sampled requests


class DraftModelProposer:
    """A `Proposer` that runs its own `ModelRunner` (model `model`, `quantization` and `int8_activations` as
    the runner takes them) with a KV pool of `num_blocks` blocks of `block_size` slots."""

    def __init__(
        self,
        model,
        device: str,
        dtype: torch.dtype | str | None,
        attention_backend: str | None,
        enforce_eager: bool,
        quantization: str | None,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        int8_activations: bool = True,
    ):
        self.runner = ModelRunner(
            model,
            device,
            dtype,
            attention_backend,
            enforce_eager,
            quantization=quantization,
            int8_activations=int8_activations,
        )
        self.max_model_len = min(max_model_len, self.runner.config.max_position_embeddings)
        try:
            self.runner.allocate_kv_pool(num_blocks, block_size, self.max_model_len)
        except BaseException:
            self.runner.close()
            raise
        self.block_manager = BlockManager(num_blocks, block_size)
        self.records: dict[object, DraftRecord] = {}

    @property
    def vocab_size(self) -> int:
        return self.runner.config.vocab_size

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_total_blocks

    def forget(self, key: object) -> None:
        record = self.records.pop(key, None)
        if record is not None:
            self.block_manager.free(record)

    def close(self) -> None:
        for key in list(self.records):
            self.forget(key)
        self.runner.close()

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        """Up to `num_tokens` drafts per request: none for a request the pool cannot hold."""
        admitted = [self._admit(request) for request in requests]
        rows = [row for row in admitted if row is not None]
        if rows:
            self._draft_step(rows, [row.request.token_ids[len(row.record.token_ids) :] for row in rows])
        for step in range(1, max((row.request.num_tokens for row in rows), default=0)):
            rows = [row for row in rows if row.request.num_tokens > step]
            self._draft_step(rows, [row.token_ids[-1:] for row in rows])
        return [self._draft(row) for row in admitted]

    def _admit(self, request: DraftRequest) -> DraftRow | None:
        """The request's record, trimmed to its valid prefix and grown for this call; None (and no record)
        when it does not fit the pool or the model's length."""
        record = self.records.setdefault(request.key, DraftRecord())
        tokens = request.token_ids
        valid = common_prefix_length(record.token_ids, tokens, limit=len(tokens) - 1)  # the last token runs
        del record.token_ids[valid:]
        num_slots = len(tokens) + request.num_tokens - 1  # the last draft is never written
        self.block_manager.shrink(record, num_slots)  # blocks of drafts since rejected go back
        missing = self.block_manager.num_new_blocks(record, num_slots)
        if num_slots > self.max_model_len or missing > self.num_free_blocks:
            self.forget(request.key)
            return None
        self.block_manager.grow(record, num_slots)
        return DraftRow(request, record)

    def _draft_step(self, rows: list[DraftRow], new_tokens: list[list[int]]) -> None:
        """One forward of each row's new tokens (written after its record's); each row draws one draft from
        its last position's logits."""
        inputs = StepInputs(
            token_ids=[token for tokens in new_tokens for token in tokens],
            num_new_tokens=[len(tokens) for tokens in new_tokens],
            seq_lens=[len(row.record.token_ids) + len(tokens) for row, tokens in zip(rows, new_tokens)],
            block_tables=[row.record.block_table for row in rows],
            samples=[True] * len(rows),
        )
        hidden = self.runner.forward(inputs)
        logits = self.runner.sampling_logits(hidden, inputs)  # [rows, vocab]
        for row, tokens in zip(rows, new_tokens):
            row.record.token_ids += tokens
        greedy = [row.request.params.greedy for row in rows]
        argmax = logits.argmax(dim=-1).tolist() if any(greedy) else None
        for index, row in enumerate(rows):
            if greedy[index]:
                row.token_ids.append(argmax[index])
                continue
            probs = target_probs(logits[index : index + 1], row.request.params)[0]  # [vocab]
            row.token_ids.append(int(torch.multinomial(probs, 1, generator=row.request.generator)))
            row.probs.append(probs)

    def _draft(self, row: DraftRow | None) -> Draft:
        if row is None:
            return Draft([])
        return Draft(row.token_ids, torch.stack(row.probs) if row.probs else None)


def common_prefix_length(first: list[int], second: list[int], limit: int) -> int:
    """How many leading tokens `first` and `second` share, at most `limit`."""
    length = 0
    for a, b in zip(first, second):
        if length == limit or a != b:
            break
        length += 1
    return length
