"""Answers to the exercises of chapter 18 that a test can grade (`test_exercises.py` grades them).

Write yours in a file of your own with the same names, and grade it instead of these:

    ROSELLM_ANSWERS=path/to/yours.py .venv/bin/python -m pytest tests/ch18_cpu_kernels/test_exercises.py
"""

from dataclasses import dataclass

import torch


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 3: Q8_1 with a scale per `block` activations. x [rows, in] fp32 -> codes [rows, in] int8,
    scales d [rows, in / block] and sums s = d * sum(q) [rows, in / block] fp32 (block 32 is Q8_1 itself)."""
    grouped = x.float().reshape(x.shape[0], -1, block)  # [rows, in / block, block]
    scales = grouped.abs().amax(dim=-1) * torch.tensor(1 / 127, dtype=torch.float32)  # fp32's 1/127, as the C
    inverse = torch.where(scales > 0, 1 / scales, 0.0)
    codes = (grouped * inverse[..., None]).round().clamp(-127, 127)
    return codes.to(torch.int8).reshape(x.shape), scales, scales * codes.sum(dim=-1)


@dataclass(frozen=True)
class ScheduledPace:
    """Exercise 5: Hugging Face's schedule for the number of drafts: two more after a verify step that accepted
    every draft it checked, one fewer otherwise, never fewer than one, never more than k, and never a wait.
    The engine asks it what `DraftPace` answers: `ScheduledPace(k)`, `length`, `ready`, `after`."""

    length: int  # drafts the next verify step asks for, 1..k

    def ready(self, num_output_tokens: int) -> bool:
        return True

    def after(self, num_drafts: int, num_accepted: int, num_output_tokens: int, most: int) -> "ScheduledPace":
        if num_accepted == num_drafts:
            return ScheduledPace(min(most, self.length + 2))
        return ScheduledPace(max(1, self.length - 1))
