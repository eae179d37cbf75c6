"""Chapter 10's fixtures: the OpenAI server on a tiny model, in this process (uvicorn in a thread, on a free
localhost port), and the offline `LLM` on the same model, to compare with.

Both are built once per test module and checkpoint: a module's tests share them, and leave them as they found
them (every request finished or aborted).
"""

import asyncio
import importlib
import threading
import time

import httpx
import pytest
import uvicorn

MODEL_NAME = "tiny"


def module_of(checkpoint, name: str):
    """A module of a checkpoint's package, e.g. `rosellm.api_server`."""
    return importlib.import_module(f"{checkpoint.__name__}.{name}")


class RunningServer:
    """A checkpoint's app served by uvicorn in a thread, on 127.0.0.1 and a port the system picked."""

    def __init__(self, checkpoint, model_dir):
        api_server = module_of(checkpoint, "api_server")
        self.engine = checkpoint.LLMEngine(str(model_dir))
        self.async_engine = module_of(checkpoint, "async_engine").AsyncLLMEngine(self.engine)
        sock = api_server.listening_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = api_server.build_app(self.async_engine, MODEL_NAME)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started or not self.thread.is_alive())
        assert self.server.started, "the server did not start"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample: value}, e.g. {"rosellm:kv_blocks_used": 0.0, ...}."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        return {name: float(value) for name, value in samples}

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """/metrics once no request runs or waits and no KV block is used (aborts apply between steps)."""
        seen = {}

        def idle() -> bool:
            seen.update(self.metrics())
            busy = ("rosellm:num_requests_running", "rosellm:num_requests_waiting", "rosellm:kv_blocks_used")
            return all(seen[name] == 0 for name in busy)

        wait_until(idle, timeout)
        return seen


def wait_until(condition, timeout: float = 10.0, interval: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(interval)


async def wait_until_async(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def token_ends(offline, prompt, params) -> tuple[str, list[int], list[int]]:
    """(text, token ids, the text's length after each token) of a request run alone: a token per step."""
    engine, lengths = offline.llm_engine, []
    engine.add_request("alone", prompt, params)
    while engine.has_unfinished_requests():
        [output] = engine.step()
        assert len(output.token_ids) == len(lengths) + 1
        lengths.append(len(output.text))
    return output.text, output.token_ids, lengths


def spanning_stop(text: str, lengths: list[int]) -> tuple[str, int]:
    """A 4-character stop string across a token boundary, whose first occurrence is there, and that boundary."""
    for end in lengths[2:-2]:
        stop = text[end - 2 : end + 2]
        if len(stop) == 4 and text.find(stop) == end - 2:
            return stop, end
    raise AssertionError(f"no stop string to pick in {text!r}")


@pytest.fixture(scope="module")
def started():
    """What this module started, by checkpoint: servers and offline LLMs; servers stop at the module's end."""
    started = {}
    yield started
    for thing in started.values():
        if isinstance(thing, RunningServer):
            thing.stop()


@pytest.fixture
def server(checkpoint, started, tiny_model_dirs) -> RunningServer:
    key = ("server", checkpoint.__name__)
    if key not in started:
        started[key] = RunningServer(checkpoint, tiny_model_dirs["gqa"])
    return started[key]


@pytest.fixture
def offline(checkpoint, started, tiny_model_dirs):
    """The offline `LLM` on the server's model, with the same engine options (the defaults)."""
    key = ("offline", checkpoint.__name__)
    if key not in started:
        started[key] = checkpoint.LLM(str(tiny_model_dirs["gqa"]))
    return started[key]
