"""Bookkeeping over ids and counts: sequences, the scheduler, the block manager and its allocators."""
