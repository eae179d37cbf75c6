"""Bad requests get the right status and OpenAI's error JSON, whose message names the limit (the engine's own
words); a failure inside the server is a generic 500 that leaks nothing; the next good request is served."""

import httpx
import openai
import pytest

from tests.ch10_serving.conftest import MODEL_NAME, module_of

pytestmark = pytest.mark.requires("serving")

GOOD = {"model": MODEL_NAME, "prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0}

# name: (path, body (bytes: sent as is), status, param, words of the message)
BAD = {
    "malformed JSON": ("/v1/completions", b'{"prompt": "hi",', 400, None, "not valid JSON"),
    "not an object": ("/v1/completions", b"[1, 2]", 400, None, "must be a JSON object"),
    "negative max_tokens": ("/v1/completions", GOOD | {"max_tokens": -1}, 400, "max_tokens", "max_tokens must be >= 1"),
    "zero max_completion_tokens": (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "max_tokens must be >= 1",
    ),
    "prompt too long": ("/v1/completions", GOOD | {"prompt": list(range(3, 300))}, 400, None, "max_model_len=256"),
    "n = 0": ("/v1/completions", GOOD | {"n": 0}, 400, "n", "n must be >= 1"),
    "n above max_num_seqs": ("/v1/completions", GOOD | {"n": 33}, 400, None, "max_num_seqs=32"),
    "temperature not a number": ("/v1/completions", GOOD | {"temperature": "hot"}, 400, "temperature", "a number"),
    "empty stop string": ("/v1/completions", GOOD | {"stop": [""]}, 400, "stop", "stop must be"),
    "unsupported parameter": ("/v1/completions", GOOD | {"logprobs": 2}, 400, "logprobs", "not supported"),
    "no messages": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400, "messages", "non-empty"),
    "unknown model": ("/v1/completions", GOOD | {"model": "gpt-9"}, 404, "model", "'gpt-9' does not exist"),
    "unknown route": ("/v1/embeddings", GOOD, 404, None, "Not Found"),
}


def post(server, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    return httpx.post(server.url + path, json=body, timeout=30)


@pytest.mark.parametrize("path, body, status, param, words", BAD.values(), ids=BAD.keys())
def test_bad_request_gets_openai_error_and_the_next_is_served(server, path, body, status, param, words):
    reply = post(server, path, body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert post(server, "/v1/completions", GOOD).status_code == 200
    server.wait_idle()


def test_the_openai_client_raises_its_own_errors(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match="max_tokens must be >= 1"):
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=-5)
        with pytest.raises(openai.NotFoundError) as info:
            client.completions.create(model="gpt-9", prompt="hi")
        assert info.value.code == "model_not_found"


def test_an_internal_failure_is_a_generic_500(checkpoint, in_process_server, monkeypatch):
    def broken(body):
        raise RuntimeError("secret internals at /home/someone")

    server = in_process_server
    monkeypatch.setattr(module_of(checkpoint, "api_server"), "parse_completion_request", broken)
    reply = post(server, "/v1/completions", GOOD)
    assert reply.status_code == 500
    assert reply.json()["error"]["type"] == "server_error"
    assert "secret" not in reply.text and "Traceback" not in reply.text
    monkeypatch.undo()
    assert post(server, "/v1/completions", GOOD).status_code == 200


def test_health_and_metrics(server):
    assert post(server, "/v1/completions", GOOD).status_code == 200
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    reply = httpx.get(f"{server.url}/metrics")
    assert reply.headers["content-type"].startswith("text/plain")
    for name in ("num_requests_running", "kv_blocks_free", "prefix_cache_hit_rate", "time_to_first_token_seconds"):
        assert f"# TYPE rosellm:{name} " in reply.text
    metrics = server.wait_idle()
    assert metrics["rosellm:kv_blocks_free"] == server.num_total_blocks
    assert metrics['rosellm:inter_token_latency_seconds_bucket{le="+Inf"}'] > 0


@pytest.mark.parametrize(
    "bad", [[5, True], [False, 6], [5, -1], [5, 10**6]], ids=["True", "False", "negative", "large"]
)
def test_bad_token_ids_are_a_400_with_the_engine_s_message(server, offline, bad):
    """The server refuses the token ids `LLM` refuses, with the same words, and queues nothing."""
    with pytest.raises(ValueError) as refused:
        offline.generate([bad], use_tqdm=False)
    reply = post(server, "/v1/completions", GOOD | {"prompt": bad})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] == str(refused.value)
    assert "outside the vocabulary" in error["message"]
    assert server.wait_idle()["rosellm:num_requests_waiting"] == 0
    assert post(server, "/v1/completions", GOOD).status_code == 200
