"""The one type the engine hands the model runner each step, and rank 0 sends every tensor-parallel worker.

The runner never sees a sequence or the scheduler: it gets a step's batch as plain lists, which also cross
a pipe cheaply.
"""

from dataclasses import dataclass


@dataclass
class StepInputs:
    """A step's batch, one entry per sequence (row) in the order of the forward."""

    token_ids: list[int]  # every row's new tokens, end to end
    num_new_tokens: list[int]  # per row
    seq_lens: list[int]  # per row: cached + new tokens
    block_tables: list[list[int]]  # per row: its blocks, in order
    samples: list[bool]  # per row: whether its last new token samples (its chunk reaches the sequence's end)
    num_drafts: list[int] | None = None  # per row: proposed tokens ending its new tokens (None: none anywhere)

    @classmethod
    def from_plan(cls, plan) -> "StepInputs":
        """From a scheduler's plan: what its scheduled sequences run this step (`num_new_tokens` each, from
        their `num_computed_tokens` on, the row's drafts last)."""
        num_drafts = [len(draft) for draft in plan.drafts]
        inputs = cls([], list(plan.num_new_tokens), [], [], list(plan.samples), num_drafts if any(num_drafts) else None)
        for seq, num_new, draft in zip(plan.scheduled, plan.num_new_tokens, plan.drafts):
            start = seq.num_computed_tokens
            inputs.token_ids += (seq.token_ids + draft)[start : start + num_new]
            inputs.seq_lens.append(start + num_new)
            inputs.block_tables.append(list(seq.block_table))
        return inputs
