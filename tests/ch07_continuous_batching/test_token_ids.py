"""Token ids are checked by one rule, with one message, wherever they come in: an id is an integer (not a
bool) in [0, vocab_size). `LLM` and `LLMEngine` refuse the same ids with the same words, and queue nothing."""

import pytest

pytestmark = pytest.mark.requires("step_engine")

GOOD = [5, 6, 7]


def bad_prompts(vocab: int) -> dict:
    return {"True": [5, True], "False": [False, 6], "negative": [5, -1], "the vocabulary size": [5, vocab]}


@pytest.fixture
def llm(checkpoint, tiny_model_dirs):
    return checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=4, num_kv_blocks=40, max_model_len=64)


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as refused:
        call(*args, **kwargs)
    return str(refused.value)


def assert_nothing_queued(engine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_bad_token_ids_get_one_message_from_llm_and_engine(checkpoint, llm):
    engine, vocab = llm.llm_engine, llm.model.config.vocab_size
    for name, prompt in bad_prompts(vocab).items():
        from_engine = refusal(engine.add_request, None, prompt)
        from_llm = refusal(llm.generate, [GOOD, prompt], use_tqdm=False)
        from_dict = refusal(engine.add_request, None, {"prompt_token_ids": prompt})
        assert from_engine == from_llm == from_dict, name
        assert f"token ids outside the vocabulary [0, {vocab})" in from_engine and "bools" in from_engine
        assert_nothing_queued(engine)
    params = checkpoint.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate([GOOD], params, use_tqdm=False)[0].token_ids) == 3


def test_the_rule_is_one_function(checkpoint):
    check = checkpoint.input_processor.check_token_ids
    assert check([0, 4, 9], 10) == [0, 4, 9]
    for bad in ([True], [False], [-1], [10]):
        with pytest.raises(ValueError, match=r"token ids outside the vocabulary \[0, 10\)"):
            check(bad, 10)
