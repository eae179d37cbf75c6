"""Chapter 04's engine checks, at every step, that the block tables agree with the real caches.
(From chapter 05 on the block tables ARE the cache, so there is nothing left to compare.)"""

import pytest

pytestmark = pytest.mark.requires("block_check")


def test_a_disagreement_is_caught_at_the_next_step(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=4)
    session = llm.add_request([5, 6, 7], checkpoint.SamplingParams(max_tokens=5))
    llm.scheduler.step()
    session.cache.advance(1)  # the real cache drifts from the bookkeeping
    with pytest.raises(AssertionError):
        llm.scheduler.step()
