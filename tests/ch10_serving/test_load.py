"""Under load: 64 concurrent streaming clients, a random third of them leaving mid-stream. Every completed stream
equals its offline output, /health stays OK, and once all is done every KV block is free. A client that leaves
a non-streamed request aborts it too."""

import asyncio
import json
import random
import socket
import time

import httpx
import pytest

from tests.ch10_serving.conftest import MODEL_NAME, wait_until

pytestmark = pytest.mark.requires("serving")

SHARED = "An inference engine turns a prompt into tokens, and tokens into text. "  # a prefix for the cache


def request_body(index: int) -> dict:
    """Greedy or seeded, short or long, with or without the shared prefix, one or two answers."""
    rng = random.Random(index)
    body = {"model": MODEL_NAME, "prompt": f"{SHARED * (index % 2)}Request {index}: the quick brown fox"}
    body |= {"max_tokens": rng.randint(8, 24), "ignore_eos": True, "stream": True}
    body |= {"temperature": 0} if index % 3 else {"temperature": 0.8, "seed": index}
    body |= {"n": 2} if index % 8 == 0 else {}
    return body


async def stream_completion(http: httpx.AsyncClient, url: str, body: dict, leave_after: int | None):
    """The streamed texts of every answer, or None when this client leaves after `leave_after` chunks."""
    texts, chunks = ["", ""], 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return texts[: body.get("n", 1)]
            for choice in json.loads(line.removeprefix("data: "))["choices"]:
                texts[choice["index"]] += choice["text"]
            chunks += 1
            if chunks == leave_after:
                return None  # leaving the `async with` closes the connection mid-stream
    raise AssertionError("the stream ended without [DONE]")


async def watch_health(http: httpx.AsyncClient, url: str, done: asyncio.Event) -> list[int]:
    statuses = []
    while not done.is_set():
        statuses.append((await http.get(f"{url}/health")).status_code)
        await asyncio.sleep(0.05)
    return statuses


def test_64_streaming_clients_a_third_leaving(checkpoint, server, offline):
    rng = random.Random(0)
    bodies = [request_body(i) for i in range(64)]
    leaving = {i: rng.randint(1, 4) for i in rng.sample(range(64), 21)}

    async def main():
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            done = asyncio.Event()
            health = asyncio.ensure_future(watch_health(http, server.url, done))
            results = await asyncio.gather(
                *(stream_completion(http, server.url, body, leaving.get(i)) for i, body in enumerate(bodies))
            )
            done.set()
            return results, await health

    start = time.monotonic()
    results, health = asyncio.run(main())
    elapsed = time.monotonic() - start
    metrics = server.wait_idle()
    assert metrics["rosellm:kv_blocks_free"] == server.num_total_blocks
    assert health and set(health) == {200}
    assert elapsed < 60
    wanted = offline.generate(
        [body["prompt"] for body in bodies],
        [
            checkpoint.SamplingParams(
                max_tokens=body["max_tokens"],
                temperature=body["temperature"],
                seed=body.get("seed"),
                n=body.get("n", 1),
                ignore_eos=True,
            )
            for body in bodies
        ],
        use_tqdm=False,
    )
    completed = [i for i, texts in enumerate(results) if texts is not None]
    assert set(range(64)) - set(leaving) <= set(completed)
    # Leavers did leave (the aborts were exercised). How many depends on the machine's speed, not on the server: a
    # slow reader gets the latest snapshot, so an answer may come in fewer chunks than its client meant to read.
    assert len(completed) < 64
    for i in completed:
        assert results[i] == [answer.text for answer in wanted[i].outputs], i
    assert metrics["rosellm:prefix_cache_hits_total"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_leaving_aborts_its_request_at_once(in_process_server, monkeypatch, stream):
    """A forward slowed to 20 ms: the 200 tokens asked for would take 4 s; the request ends when the client does
    (streamed: after its first chunk; whole: while it waits for the answer). (On the split server: chapter 16.)"""
    server = in_process_server
    forward = server.engine.model_runner.forward
    monkeypatch.setattr(server.engine.model_runner, "forward", lambda plan: time.sleep(0.02) or forward(plan))
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": stream}
    content = json.dumps(body)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        client.sendall(f"{head}Content-Length: {len(content)}\r\n\r\n{content}".encode())
        if stream:
            received = b""
            while b"data: " not in received:
                received += client.recv(4096)
        wait_until(lambda: server.metrics()["rosellm:num_requests_running"] == 1)
    left = time.monotonic()
    server.wait_idle(timeout=2)
    assert time.monotonic() - left < 1.5
