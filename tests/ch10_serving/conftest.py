"""Chapter 10's fixtures: the OpenAI server on a tiny model, in this process (uvicorn in a thread, on a free
localhost port), and the offline `LLM` on the same model, to compare with.

From chapter 16 on, the `server` tests run on both engines a server can have: "in_process" (chapter 10's
`AsyncLLMEngine`, the engine driven by a thread of this process) and "split" (`AsyncLLM`, the engine in an
engine-core process). `in_process_server` is the first alone, for tests that reach into the engine.

Both are built once per test session and checkpoint: the tests share them, and leave them as they found
them (every request finished or aborted).
"""

import asyncio
import re
import threading
import time

import httpx
import pytest
import uvicorn

from chapters import submodule

MODEL_NAME = "tiny"


def module_of(checkpoint, name: str):
    """A module of a checkpoint's package, e.g. `rosellm.api_server`."""
    return submodule(checkpoint, name)


FRONTENDS = ("in_process", "split")


def pytest_generate_tests(metafunc):
    if "server" in metafunc.fixturenames:
        metafunc.parametrize("frontend", FRONTENDS)


def pytest_collection_modifyitems(config, items):
    """The split server exists from chapter 16 (`engine_core`): its tests on earlier checkpoints go."""
    absent = [
        item
        for item in items
        if getattr(item, "callspec", None) is not None
        and item.callspec.params.get("frontend") == "split"
        and "engine_core" not in item.callspec.params["checkpoint"].capabilities
    ]
    if absent:
        config.hook.pytest_deselected(items=absent)
        items[:] = [item for item in items if item not in absent]


class RunningServer:
    """A checkpoint's app served by uvicorn in a thread, on 127.0.0.1 and a port the system picked, over an
    engine in this process (`frontend` "in_process": `engine` is the `LLMEngine`) or in an engine-core
    process ("split": `engine` is None)."""

    def __init__(self, checkpoint, model_dir, frontend: str = "in_process", **split_options):
        api_server = module_of(checkpoint, "api_server")
        if frontend == "split":  # `split_options`: AsyncLLM's (data_parallel_size, engine options)
            self.engine = None
            self.async_engine = module_of(checkpoint, "async_llm").AsyncLLM(str(model_dir), **split_options)
            self.num_total_blocks = sum(ready.num_total_blocks for ready in self.async_engine.client.ready)
        else:
            self.engine = checkpoint.LLMEngine(str(model_dir))
            self.async_engine = module_of(checkpoint, "async_engine").AsyncLLMEngine(self.engine)
            self.num_total_blocks = self.engine.block_manager.num_total_blocks
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
        """/metrics as {sample: value}, e.g. {"rosellm:kv_blocks_used": 0.0, ...} (`parse_metrics`)."""
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def wait_idle(self, timeout: float = 10.0) -> dict[str, float]:
        """/metrics once no request runs or waits and no KV block is used (aborts apply between steps)."""
        seen = {}

        def idle() -> bool:
            seen.update(self.metrics())
            busy = ("rosellm:num_requests_running", "rosellm:num_requests_waiting", "rosellm:kv_blocks_used")
            return all(seen[name] == 0 for name in busy)

        wait_until(idle, timeout)
        return seen


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {sample: value}; the samples of engine cores (labelled `engine="N"`) are added up
    under the name without the label."""
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    totals: dict[str, float] = {}
    for name, value in samples:
        name = re.sub(r'\{engine="\d+"\}$', "", name)
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


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


@pytest.fixture(scope="session")
def started():
    """What the session started, by checkpoint: servers and offline LLMs; servers stop at the session's end."""
    started = {}
    yield started
    for thing in started.values():
        if isinstance(thing, RunningServer):
            thing.stop()


@pytest.fixture
def server(checkpoint, frontend, started, tiny_model_dirs) -> RunningServer:
    key = ("server", checkpoint.__name__, frontend)
    if key not in started:
        started[key] = RunningServer(checkpoint, tiny_model_dirs["gqa"], frontend)
    return started[key]


@pytest.fixture
def in_process_server(checkpoint, started, tiny_model_dirs) -> RunningServer:
    key = ("server", checkpoint.__name__, "in_process")
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
