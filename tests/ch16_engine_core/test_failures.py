"""When a process goes: an engine core killed mid-stream ends every client's stream with an error within a second,
and from then on `/health` and new requests answer 503; a server killed outright takes its engine core with it;
Ctrl-C stops both. A client that disconnects still aborts its request in the core. No process is left behind
(checked from /proc)."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.ch10_serving.conftest import MODEL_NAME, RunningServer, wait_until
from tests.ch10_serving.test_serve_workload import process_group_members
from tests.ch16_engine_core.test_async_llm import alive

pytestmark = pytest.mark.requires("engine_core")

ROOT = Path(__file__).resolve().parents[2]
LONG = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 240, "ignore_eos": True, "stream": True}


async def stream_events(http: httpx.AsyncClient, url: str, first_chunk: asyncio.Event) -> list[dict]:
    """Every event of one streamed completion ([DONE] as {"done": True}); sets `first_chunk` at the first."""
    events = []
    async with http.stream("POST", f"{url}/v1/completions", json=LONG) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append({"done": True} if data == "[DONE]" else json.loads(data))
                first_chunk.set()
    return events


def test_a_killed_core_ends_every_stream_with_an_error_then_503(checkpoint, tiny_model_dirs):
    server = RunningServer(checkpoint, tiny_model_dirs["gqa"], "split", enforce_eager=True)
    try:
        [pid] = [ready.pid for ready in server.async_engine.client.ready]

        async def main():
            async with httpx.AsyncClient(timeout=30) as http:
                started = [asyncio.Event() for _ in range(4)]
                streams = [asyncio.ensure_future(stream_events(http, server.url, event)) for event in started]
                await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=10)
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                results = await asyncio.gather(*streams)
                return results, time.monotonic() - killed

        results, seconds = asyncio.run(main())
        assert seconds < 1.0
        for events in results:
            assert events[-1] == {"done": True}
            assert events[-2]["error"]["type"] == "server_error"  # the stream's last word: an error
            assert not any(choice.get("finish_reason") for event in events[:-2] for choice in event["choices"])
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and not server.async_engine.is_running
        reply = httpx.post(f"{server.url}/v1/completions", json=LONG | {"stream": False}, timeout=10)
        assert reply.status_code == 503 and "engine core 0 died" in reply.json()["error"]["message"]
    finally:
        server.stop()
    assert not alive(pid)


def start_server(model: Path) -> tuple[subprocess.Popen, str]:
    """`python -m rosellm serve` on `model` in a session of its own; returns it and its URL once it serves."""
    command = [sys.executable, "-m", "rosellm", "serve", "--model", str(model), "--port", "0", "--enforce-eager"]
    restore_ctrl_c = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731 (see ch10's CLI test)
    process = subprocess.Popen(
        command, cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=restore_ctrl_c
    )
    for line in process.stderr:
        if address := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line):
            return process, address.group(1)
        assert "Traceback" not in line, line
    raise AssertionError(f"the server ended before serving (exit code {process.wait()})")


@pytest.mark.parametrize("how", ["ctrl_c", "sigkill"])
def test_no_process_outlives_the_server(tiny_model_dirs, how):
    process, url = start_server(tiny_model_dirs["gqa"])
    try:
        body = {"prompt": "hi", "max_tokens": 4}  # the model it serves is named after its folder
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        group = process.pid
        assert len(process_group_members(group)) >= 2  # the server and its engine core
        process.send_signal(signal.SIGINT if how == "ctrl_c" else signal.SIGKILL)
        assert process.wait(timeout=30) == (130 if how == "ctrl_c" else -signal.SIGKILL)
        wait_until(lambda: not process_group_members(group), timeout=3)  # the core follows within a second
    finally:
        if process_group_members(process.pid):  # a failed check above: leave nothing running
            os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.model
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_leaving_aborts_its_request_in_the_core(smollm2_server, stream):
    """SmolLM2 steps take tens of ms: the 200 tokens asked for take seconds; the request ends in the core when
    the client leaves (streamed: after its first chunk; whole: while it waits for the answer)."""
    server = smollm2_server
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": stream}
    content = json.dumps(body)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as client:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        client.sendall(f"{head}Content-Length: {len(content)}\r\n\r\n{content}".encode())
        if stream:
            received = b""
            while b"data: " not in received:
                received += client.recv(4096)
        wait_until(lambda: server.metrics()["rosellm:num_requests_running"] == 1, timeout=30)
    left = time.monotonic()
    server.wait_idle(timeout=2)
    assert time.monotonic() - left < 1.5
