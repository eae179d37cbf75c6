"""Two engine cores behind one server (`data_parallel_size=2`), under chapter 10's load: 64 concurrent streaming
clients, a random third leaving mid-stream. Every request is answered once, every completed stream equals the
offline output (what one engine gives), both cores served, and afterwards every block of every core is free."""

import asyncio
import random

import httpx
import pytest

from tests.ch10_serving.conftest import parse_metrics
from tests.ch10_serving.test_load import request_body, stream_completion, watch_health
from tests.ch16_engine_core.conftest import idle

pytestmark = pytest.mark.requires("engine_core")


def test_64_streaming_clients_on_two_cores(checkpoint, checkpoint_info, dp_server, offline):
    rng = random.Random(1)
    bodies = [request_body(i) for i in range(64)]
    leaving = {i: rng.randint(1, 4) for i in rng.sample(range(64), 21)}
    engine = dp_server.async_engine
    before = [engine.metrics.stats[core].prefix_cache_queries for core in (0, 1)]

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as http:
            done = asyncio.Event()
            health = asyncio.ensure_future(watch_health(http, dp_server.url, done))
            results = await asyncio.gather(
                *(stream_completion(http, dp_server.url, body, leaving.get(i)) for i, body in enumerate(bodies))
            )
            done.set()
            return results, await health

    results, health = asyncio.run(main())
    metrics = dp_server.wait_idle()
    assert set(health) == {200}
    for core in (0, 1):
        stats = engine.metrics.stats[core]
        assert idle(stats, checkpoint_info), core
        assert stats.prefix_cache_queries > before[core], f"core {core} served nothing"
    assert metrics["rosellm:kv_blocks_free"] == dp_server.num_total_blocks
    assert engine.router.loads == [0, 0] and not engine._requests
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


def test_metrics_report_each_core(dp_server):
    """After one request of its own (the test does not count on the load test having run first)."""
    body = request_body(1) | {"stream": False}
    assert httpx.post(f"{dp_server.url}/v1/completions", json=body, timeout=60).status_code == 200
    dp_server.wait_idle()
    text = httpx.get(f"{dp_server.url}/metrics", timeout=10).text
    for core in (0, 1):
        assert f'rosellm:kv_blocks_free{{engine="{core}"}} ' in text
        assert f'rosellm:num_requests_running{{engine="{core}"}} ' in text
    assert "rosellm:time_to_first_token_seconds_count " in text  # the front end's, over both
    assert parse_metrics(text)["rosellm:engine_step_seconds_count"] > 0  # the cores' steps, timed in the cores
