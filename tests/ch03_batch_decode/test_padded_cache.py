"""The padded merge of contiguous caches (chapter 05 replaces the caches with a paged pool)."""

import pytest

from tests.ch03_batch_decode.test_offline_scheduler import add, greedy

pytestmark = pytest.mark.requires("padded_batch")


def test_padded_batch_cache_masks_and_splits(checkpoint, llm):
    """Rows of different lengths: each cache grows by its own row's count, never by the padding."""
    sessions = [add(llm, list(range(10, 10 + n)), greedy(checkpoint, 3)) for n in (2, 7)]
    llm.scheduler.step()
    assert [s.cache.length for s in sessions] == [2, 7]
    llm.scheduler.step()
    assert [s.cache.length for s in sessions] == [3, 8]
