"""Chapter 16's fixtures: split servers (uvicorn in a thread of this process, over an `AsyncLLM` whose engine
cores are processes of their own), built once per session and checkpoint and left as they were found; and the
offline `LLM` on the same tiny model, to compare with."""

import pytest

from tests.ch10_serving.conftest import RunningServer


@pytest.fixture(scope="session")
def split_servers():
    servers = {}
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture
def dp_server(checkpoint, split_servers, tiny_model_dirs) -> RunningServer:
    """Two engine cores (data parallelism) on the tiny model, eager (as `offline`: they start in seconds)."""
    key = ("dp2", checkpoint.__name__)
    if key not in split_servers:
        split_servers[key] = RunningServer(
            checkpoint, tiny_model_dirs["gqa"], "split", data_parallel_size=2, enforce_eager=True
        )
    return split_servers[key]


@pytest.fixture
def smollm2_server(checkpoint, split_servers, smollm2_path) -> RunningServer:
    """One engine core on the bundled SmolLM2, eager (it starts in seconds; a step takes tens of ms)."""
    key = ("smollm2", checkpoint.__name__)
    if key not in split_servers:
        split_servers[key] = RunningServer(checkpoint, smollm2_path, "split", enforce_eager=True)
    return split_servers[key]


@pytest.fixture(scope="session")
def offline_llms():
    return {}


@pytest.fixture
def offline(checkpoint, offline_llms, tiny_model_dirs):
    """The offline `LLM` on the tiny model, eager (the servers' options)."""
    if checkpoint.__name__ not in offline_llms:
        offline_llms[checkpoint.__name__] = checkpoint.LLM(str(tiny_model_dirs["gqa"]), enforce_eager=True)
    return offline_llms[checkpoint.__name__]


def idle(stats, point) -> bool:
    """No request running or waiting and every block free, in a core's `EngineStats`: its queues are id sets
    through chapter 16, counts from chapter 17 on (`point`: the test's `checkpoint_info`)."""
    if "subpackages" in point.capabilities:
        queued = stats.num_running_requests + stats.num_waiting_requests
    else:
        queued = len(stats.running_requests | stats.waiting_requests)
    return queued == 0 and stats.num_free_blocks == stats.num_total_blocks
