"""The running batch as tensors, ready for a kernel: sequence lengths and block tables, one row each."""

import torch


class BatchState:
    """Rows 0..size-1 hold the live sequences, in order; removing one compacts the rows below it up.

    seq_lens:     [max_batch_size] int32, tokens of each row (0 for empty rows)
    block_tables: [max_batch_size, max_blocks_per_seq] int32, block ids of each row, -1 for none
    """

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, block_size: int):
        self.block_size = block_size
        self.seq_ids: list[str] = []
        self.seq_lens = torch.zeros(max_batch_size, dtype=torch.int32)
        self.block_tables = torch.full((max_batch_size, max_blocks_per_seq), -1, dtype=torch.int32)

    @property
    def size(self) -> int:
        return len(self.seq_ids)

    @property
    def max_batch_size(self) -> int:
        return self.seq_lens.shape[0]

    def row(self, seq_id: str) -> int:
        return self.seq_ids.index(seq_id)

    def add(self, seq_id: str, num_tokens: int, block_ids: list[int]) -> int:
        """Put a sequence in the next free row; returns the row."""
        if self.size == self.max_batch_size:
            raise ValueError(f"the batch is full ({self.max_batch_size} sequences)")
        if seq_id in self.seq_ids:
            raise ValueError(f"sequence {seq_id!r} is already in the batch")
        if len(block_ids) * self.block_size < num_tokens or len(block_ids) > self.block_tables.shape[1]:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_tokens} tokens here")
        row = self.size
        self.seq_ids.append(seq_id)
        self.seq_lens[row] = num_tokens
        self.block_tables[row, : len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        return row

    def append_token(self, seq_id: str, new_block_id: int | None = None) -> None:
        """One more token for `seq_id`, in `new_block_id` when its last block was full."""
        row = self.row(seq_id)
        length = int(self.seq_lens[row])
        if (new_block_id is None) != (length % self.block_size != 0):
            raise ValueError(f"a new block is needed exactly when the last one is full (length {length})")
        if new_block_id is not None:
            self.block_tables[row, length // self.block_size] = new_block_id
        self.seq_lens[row] = length + 1

    def remove(self, seq_id: str) -> None:
        """Drop a sequence's row and move the rows below it up by one."""
        row = self.row(seq_id)
        last = self.size - 1
        self.seq_lens[row:last] = self.seq_lens[row + 1 : last + 1].clone()
        self.block_tables[row:last] = self.block_tables[row + 1 : last + 1].clone()
        self.seq_lens[last] = 0
        self.block_tables[last] = -1
        self.seq_ids.pop(row)

    def merge(self, other: "BatchState") -> None:
        """Move all of `other`'s sequences after ours; `other` ends empty."""
        if self.size + other.size > self.max_batch_size:
            raise ValueError(f"{self.size} + {other.size} sequences exceed max_batch_size {self.max_batch_size}")
        rows = slice(self.size, self.size + other.size)
        width = other.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError("the other batch allows longer block tables")
        self.seq_lens[rows] = other.seq_lens[: other.size]
        self.block_tables[rows, :width] = other.block_tables[: other.size]
        self.seq_ids.extend(other.seq_ids)
        other.clear()

    def clear(self) -> None:
        self.seq_ids.clear()
        self.seq_lens.zero_()
        self.block_tables.fill_(-1)
