"""The grammar's bitmask applied to the logits: a token the grammar forbids gets -inf, so no sampling rule
(greedy, temperature, top-k, top-p, the rejection rule of speculative decoding) can pick it.

Bit j of word w of a row stands for token 32 * w + j (xgrammar's layout, little-endian within a word).
"""

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [rows, words] int32 -> allowed [rows, vocab_size] bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]: an arithmetic shift, then the low bit
    return bits.flatten(1)[:, :vocab_size].bool()


@torch.inference_mode()  # logits from the forward are inference tensors: in place only in this mode
def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: logits [n, vocab] at `rows` (one per row of bitmask [len(rows), words]) lose every token
    the mask forbids. The other rows are not touched."""
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])  # [len(rows), vocab]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
