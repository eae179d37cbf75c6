"""Counting fixed-size KV blocks: shared by the bookkeeping and the model side, which import nothing of each other."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold `num_tokens` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)
