"""Greedy generation equals transformers `generate(do_sample=False)` token for token; finishing rules."""

import pytest

from tests.oracle import hf_greedy
from tests.tiny_models import TINY_CONFIGS

TINY_PROMPTS = [
    "The capital of France is",
    "Café, naïve",
    "def forward(self, x):\n    return",
]

SMOLLM2_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
]


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_tiny_greedy_matches_transformers(checkpoint, tiny_model_dirs, tiny_hf_models, name):
    llm = checkpoint.LLM(str(tiny_model_dirs[name]))
    greedy = checkpoint.SamplingParams(temperature=0, max_tokens=24)
    outputs = llm.generate(TINY_PROMPTS, greedy, use_tqdm=False)
    for output in outputs:
        expected = hf_greedy(tiny_hf_models[name], output.prompt_token_ids, 24)
        assert output.token_ids == expected


@pytest.mark.model
def test_smollm2_greedy_matches_transformers(smollm2_llm, smollm2_hf, checkpoint):
    tokenizer = smollm2_llm.tokenizer
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in SMOLLM2_QUESTIONS
    ]
    # 20 tokens: the first answer ends before; chapter 01 recomputes the whole prefix for every token. The
    # oracle is transformers' 32 tokens cut to 20: the run that later chapters' tests reuse from its cache.
    outputs = smollm2_llm.generate(prompts, checkpoint.SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    for output in outputs:
        assert output.token_ids == hf_greedy(smollm2_hf, output.prompt_token_ids, 32)[:20]
    assert "Paris" in outputs[0].text
    assert outputs[0].finish_reason == "stop" and outputs[0].token_ids[-1] in smollm2_llm.eos_token_ids
    assert "<|im_end|>" not in outputs[0].text  # special tokens are not part of the text


def test_outputs_keep_input_order_and_describe_the_request(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    prompts = ["The quick brown fox", [5, 6, 7], "Paris"]
    outputs = llm.generate(prompts, checkpoint.SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["The quick brown fox", None, "Paris"]
    assert outputs[1].prompt_token_ids == [5, 6, 7]
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
    assert len({o.request_id for o in outputs}) == 3
    for output in outputs:
        assert output.text == llm.tokenizer.decode(output.token_ids, skip_special_tokens=True)


def test_a_single_string_and_a_single_token_list_are_one_prompt(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    params = checkpoint.SamplingParams(temperature=0, max_tokens=2)
    assert len(llm.generate("Paris", params, use_tqdm=False)) == 1
    assert llm.generate([5, 6, 7], params, use_tqdm=False)[0].prompt_token_ids == [5, 6, 7]


def test_max_tokens_finishes_with_length(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    for max_tokens in (1, 5):
        params = checkpoint.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        [output] = llm.generate([[10, 11, 12]], params, use_tqdm=False)
        assert len(output.token_ids) == max_tokens and output.finish_reason == "length"


def test_stop_token_ids_finish_with_stop(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    free = llm.generate(
        [[10, 11, 12]], checkpoint.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0].token_ids
    stop = free[4]
    first = free.index(stop)
    params = checkpoint.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop])
    [output] = llm.generate([[10, 11, 12]], params, use_tqdm=False)
    assert output.token_ids == free[: first + 1]  # the stop token is included
    assert output.finish_reason == "stop"


def test_eos_stops_unless_ignored(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    free = llm.generate(
        [[10, 11, 12]], checkpoint.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0].token_ids
    llm.eos_token_ids.clear()
    llm.eos_token_ids.add(free[2])  # pretend that token is the model's EOS
    stopped = llm.generate([[10, 11, 12]], checkpoint.SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert stopped.token_ids == free[: free.index(free[2]) + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate(
        [[10, 11, 12]], checkpoint.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )[0]
    assert ignored.token_ids == free and ignored.finish_reason == "length"


def test_generation_stops_at_max_model_len(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), max_model_len=12)
    params = checkpoint.SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    [output] = llm.generate([list(range(10, 18))], params, use_tqdm=False)
    assert len(output.token_ids) == 12 - 8 and output.finish_reason == "length"


def test_stream_pieces_add_up_to_the_output_text(checkpoint, tiny_model_dirs):
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    stream = llm.stream("Emoji:", checkpoint.SamplingParams(temperature=0, max_tokens=20))
    pieces = []
    while True:
        try:
            pieces.append(next(stream))
        except StopIteration as stop:
            output = stop.value
            break
    assert "".join(pieces) == output.text == llm.tokenizer.decode(output.token_ids, skip_special_tokens=True)
    assert len(output.token_ids) == 20
