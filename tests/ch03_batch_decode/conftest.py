"""The LLM whose offline scheduler the step-by-step tests of this folder drive."""

import pytest


@pytest.fixture
def llm(checkpoint, tiny_model_dirs):
    return checkpoint.LLM(str(tiny_model_dirs["gqa"]), max_batch_size=3)
