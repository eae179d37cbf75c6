"""The official `openai` client, unchanged, against the server: completions and chat, streamed and not, n = 2,
seeds, stop strings; every answer equals the offline `LLM`'s with the same parameters."""

import openai
import pytest

from tests.ch10_serving.conftest import MODEL_NAME, spanning_stop, token_ends

pytestmark = pytest.mark.requires("serving")

PROMPT = "Paris is the capital of France; Berlin is"


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
        yield client


def expected(checkpoint, offline, prompt, **params):
    [output] = offline.generate([prompt], checkpoint.SamplingParams(**params), use_tqdm=False)
    return output


def test_models_lists_the_served_model(client, server):
    [model] = client.models.list().data
    assert model.id == MODEL_NAME and model.owned_by == "rosellm"
    assert server.wait_idle()["rosellm:kv_blocks_free"] > 0


def test_completion_equals_offline(checkpoint, client, offline):
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0)
    want = expected(checkpoint, offline, PROMPT, max_tokens=12, temperature=0)
    [choice] = reply.choices
    assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason)
    assert reply.usage.completion_tokens == len(want.token_ids)
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_token_id_prompts_and_the_prefix_cache_count(checkpoint, client, offline):
    prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16 to find in the cache the second time
    for _ in range(2):
        reply = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0)
    assert reply.choices[0].text == expected(checkpoint, offline, prompt, max_tokens=5, temperature=0).text
    assert reply.usage.prompt_tokens_details.cached_tokens == 32


def test_streamed_completion_equals_offline_and_reports_usage(checkpoint, client, offline):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    want = expected(checkpoint, offline, PROMPT, max_tokens=20, temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert len(chunks) > 3 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_uses_the_plain_template_and_equals_offline(checkpoint, client, offline):
    """The tiny tokenizer has no chat template: "role: content" lines, then "assistant:"."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a capital."}]
    prompt = "system: Be brief.\nuser: Name a capital.\nassistant:"
    want = expected(checkpoint, offline, prompt, max_tokens=15, temperature=0)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=15, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == want.text
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=15, temperature=0, stream=True
    )
    deltas = [chunk.choices[0].delta for chunk in stream]
    assert deltas[0].role == "assistant"
    assert "".join(delta.content or "" for delta in deltas) == want.text


def test_seeded_samples_are_reproducible_and_n_answers_equal_offline(checkpoint, client, offline):
    params = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    first, again = (client.completions.create(model=MODEL_NAME, prompt=PROMPT, **params) for _ in range(2))
    assert first.choices[0].text == again.choices[0].text == expected(checkpoint, offline, PROMPT, **params).text
    reply = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, **params)
    want = expected(checkpoint, offline, PROMPT, n=2, **params)
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == [o.text for o in want.outputs]
    assert reply.usage.completion_tokens == sum(len(o.token_ids) for o in want.outputs)
    chunks = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=2, stream=True, **params)
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [o.text for o in want.outputs]


def test_a_stop_string_across_tokens_equals_offline(checkpoint, client, offline):
    params = dict(max_tokens=30, temperature=0, ignore_eos=True)
    text, _, ends = token_ends(offline, PROMPT, checkpoint.SamplingParams(**params))
    stop, end = spanning_stop(text, ends)
    want = expected(checkpoint, offline, PROMPT, stop=stop, **params)
    assert (want.text, want.finish_reason) == (text[: end - 2], "stop")
    same = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    for stops in (stop, [stop, "never there"]):
        reply = client.completions.create(stop=stops, **same)
        assert (reply.choices[0].text, reply.choices[0].finish_reason) == (want.text, "stop")
        assert reply.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.completions.create(stop=stop, stream=True, **same))
    assert "".join(chunk.choices[0].text for chunk in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop"
