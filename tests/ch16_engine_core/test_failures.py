"""When a process goes: an engine core killed mid-stream ends every client's stream with an error within seconds
(well under one on an idle machine; the bounds leave room for a busy one, far below a frozen loop's timeout), and
from then on `/health` and new requests answer 503, even with clients adding and aborting requests at the
instant it dies, and with another core that no longer answers; a core that stops reading never freezes the
front end. A server killed outright takes its engine core with it; Ctrl-C stops both. A client that disconnects
still aborts its request in the core. No process is left behind (checked from /proc)."""

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.ch10_serving.conftest import MODEL_NAME, RunningServer, module_of, wait_until
from tests.ch10_serving.test_serve_workload import process_group_members
from tests.ch16_engine_core.test_async_llm import alive

# Each test starts engine-core processes. Later chapters carry the front end and the core unchanged (chapter 17
# moved them into engine/): `make test` runs these on the latest checkpoint alone, `make test-all` on each.
pytestmark = [pytest.mark.requires("engine_core"), pytest.mark.latest_only]

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
        assert seconds < 2.0  # well under a second when idle; a full suite slows it
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


def in_own_thread(main, timeout: float):
    """`asyncio.run(main())` on an event loop of its own thread: its result, or a failure if that loop is still
    busy after `timeout` s (a frozen loop cannot time itself out)."""
    result = {}

    def run():
        try:
            result["value"] = asyncio.run(main())
        except BaseException as error:
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the clients' event loop froze (still running after {timeout} s)"
    if "error" in result:
        raise result["error"]
    return result["value"]


async def to_the_end(stream) -> None:
    async for _ in stream:
        pass


async def outcomes(*awaitables) -> list:
    """What each awaitable returned or raised (a list returned is spread out), once all have ended."""
    found = []
    for outcome in await asyncio.gather(*awaitables, return_exceptions=True):
        found += outcome if isinstance(outcome, list) else [outcome]
    return found


def test_requests_and_aborts_at_the_instant_a_core_dies_all_end_within_a_second(checkpoint, tiny_model_dirs):
    """16 streams run; the core is killed; at once half the streams are aborted and 64 clients add requests
    until the engine refuses one: every other stream and every add ends with the engine's error within a
    second (a send to the dead core must never block the event loop), and `/health` answers 503."""
    server = RunningServer(checkpoint, tiny_model_dirs["gqa"], "split", enforce_eager=True)
    engine, dead = server.async_engine, module_of(checkpoint, "async_llm").EngineDeadError
    [pid] = [ready.pid for ready in engine.client.ready]
    params = checkpoint.SamplingParams(max_tokens=240, ignore_eos=True)

    async def client(number: int) -> list:
        """Adds requests, each without waiting for the one before to be accepted, until one has ended."""
        adds = []
        while not any(add.done() for add in adds):
            adds.append(asyncio.ensure_future(engine.add_request([5 + number, 6, 7], params)))
            await asyncio.sleep(0.001)
        return await outcomes(*adds)

    async def main():
        streams = [await engine.add_request([5, 6, 7], params) for _ in range(16)]
        for stream in streams:
            await anext(stream)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for stream in streams[::2]:
            stream.abort()  # an aborted stream simply ends
        ends = await outcomes(*map(to_the_end, streams[1::2]), *map(client, range(64)))
        return ends, time.monotonic() - killed

    try:
        ends, seconds = in_own_thread(main, timeout=10)
        assert seconds < 2.0 and len(ends) >= 8 + 64
        assert all(isinstance(end, dead) for end in ends), {type(end).__name__ for end in ends}
        assert httpx.get(f"{server.url}/health", timeout=2).status_code == 503
    finally:
        server.stop()
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_core_that_stops_reading_never_freezes_the_front_end(checkpoint, tiny_model_dirs):
    """The core is stopped (SIGSTOP): 3000 requests queue for it, more than ZeroMQ's default high-water mark
    of 1000 messages, while the event loop goes on (a clock on it keeps ticking); then the core is killed and
    every request ends with the engine's error within seconds (not the 10 s a frozen loop would take)."""
    engine = checkpoint.AsyncLLM(str(tiny_model_dirs["gqa"]), enforce_eager=True)
    dead = module_of(checkpoint, "async_llm").EngineDeadError
    [pid] = [ready.pid for ready in engine.client.ready]

    async def main():
        ticks = []

        async def clock():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        ticking = asyncio.ensure_future(clock())
        os.kill(pid, signal.SIGSTOP)
        adds = []
        for number in range(3000):
            adds.append(asyncio.ensure_future(engine.add_request([5 + number % 300, 6, 7])))
            if number % 100 == 0:
                await asyncio.sleep(0)  # the adds so far are sent
        await asyncio.sleep(0.2)
        gaps = [later - earlier for earlier, later in zip(ticks, ticks[1:])]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        ends = await outcomes(*adds)
        seconds = time.monotonic() - killed
        ticking.cancel()
        return gaps, ends, seconds

    try:
        gaps, ends, seconds = in_own_thread(main, timeout=10)
        # a frozen loop never ticks again (the 10 s timeout); a gap of a second or two, or 1.5 s to end 3000
        # requests, is a busy machine (a full suite's load)
        assert max(gaps) < 3.0 and seconds < 4.0
        assert all(isinstance(end, dead) for end in ends), {type(end).__name__ for end in ends}
    finally:  # the watcher stops the engine
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_dead_core_ends_the_streams_before_the_other_cores_are_stopped(checkpoint, tiny_model_dirs):
    """Two cores; core 1 stops answering (SIGSTOP) and core 0 is killed: the streams on both end with the
    engine's error within seconds, without waiting the 5 s given to core 1 to stop; then core 1 is gone."""
    engine = checkpoint.AsyncLLM(str(tiny_model_dirs["gqa"]), data_parallel_size=2, enforce_eager=True)
    dead = module_of(checkpoint, "async_llm").EngineDeadError
    pids = [ready.pid for ready in engine.client.ready]
    params = checkpoint.SamplingParams(max_tokens=240, ignore_eos=True)

    async def main():
        streams = [await engine.add_request([5 + number, 6, 7], params) for number in range(4)]
        for stream in streams:
            await anext(stream)
        assert engine.router.loads == [2, 2]
        os.kill(pids[1], signal.SIGSTOP)
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        ends = await outcomes(*map(to_the_end, streams))
        return ends, time.monotonic() - killed

    try:
        ends, seconds = in_own_thread(main, timeout=15)
        assert seconds < 3.0 and all(isinstance(end, dead) for end in ends), (seconds, ends)
        wait_until(lambda: not any(map(alive, pids)), timeout=10)
    finally:  # the watcher stops the engine
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGKILL)


def start_server(model: Path, temporary: Path | None = None) -> tuple[subprocess.Popen, str]:
    """`python -m rosellm serve` on `model` in a session of its own, with its temporary files in `temporary`
    if given; returns it and its URL once it serves."""
    command = [sys.executable, "-m", "rosellm", "serve", "--model", str(model), "--port", "0", "--enforce-eager"]
    restore_ctrl_c = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731 (see ch10's CLI test)
    env = os.environ | ({} if temporary is None else {"TMPDIR": str(temporary)})
    process = subprocess.Popen(
        command, cwd=ROOT, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=restore_ctrl_c, env=env
    )
    for line in process.stderr:
        if address := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line):
            return process, address.group(1)
        if "Traceback" in line:  # the server failed: say how, its whole report
            process.kill()
            raise AssertionError(line + process.stderr.read())
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


def test_the_sockets_of_a_killed_server_are_removed_at_the_next_start(tiny_model_dirs, tmp_path):
    """A server killed outright leaves its `ipc://` folder; the next server to start removes it (its owner is
    dead), and a server stopped by Ctrl-C removes its own."""
    servers = []
    try:
        servers.append(start_server(tiny_model_dirs["gqa"], tmp_path)[0])
        [left] = tmp_path.glob("rosellm-*")
        servers[0].kill()
        servers[0].wait(timeout=30)
        wait_until(lambda: not process_group_members(servers[0].pid), timeout=3)
        assert left.exists()
        servers.append(start_server(tiny_model_dirs["gqa"], tmp_path)[0])
        [own] = tmp_path.glob("rosellm-*")
        assert own != left and not left.exists()
        servers[1].send_signal(signal.SIGINT)
        assert servers[1].wait(timeout=30) == 130
        assert not list(tmp_path.glob("rosellm-*"))
    finally:
        for server in servers:
            if process_group_members(server.pid):  # a failed check above: leave nothing running
                os.killpg(server.pid, signal.SIGKILL)


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
