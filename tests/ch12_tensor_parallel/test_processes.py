"""The processes of tensor parallelism: none is ever left behind. A worker killed in the middle of a run
makes rank 0 raise within seconds, naming the rank; a rank 0 killed outright while its workers start takes
them with it; closing (or leaving a `with` block by an exception) stops every worker; a size the model
cannot split is refused before any process starts."""

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.ch10_serving.conftest import wait_until

pytestmark = pytest.mark.requires("tensor_parallel")


ROOT = Path(__file__).resolve().parents[2]


def children(parent: int | None = None) -> set[int]:
    """The pids of the live children of `parent` (default: this process), zombies included: a child not
    waited for is left."""
    found = set()
    for task in Path(f"/proc/{parent or os.getpid()}/task").iterdir():
        found |= {int(pid) for pid in (task / "children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie), from /proc."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def worker_pids(llm) -> list[int]:
    return [worker.pid for worker in llm.llm_engine.model_runner.workers]


def test_a_killed_worker_stops_the_engine_within_seconds(checkpoint, tiny_model_dirs):
    before = children()
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), tensor_parallel_size=4, enforce_eager=True, max_num_seqs=4)
    pids = worker_pids(llm)
    assert len(pids) == 3 and set(pids) <= children()
    params = checkpoint.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    killed_at = []
    killer = threading.Timer(1.0, lambda: (killed_at.append(time.monotonic()), os.kill(pids[1], signal.SIGKILL)))
    killer.start()
    with pytest.raises(RuntimeError, match=rf"rank 2 \(pid {pids[1]}\) died, exit code -9"):
        while True:  # generate until the kill lands (200 tokens x 4 prompts take longer than a second)
            llm.generate([[5, 6, 7]] * 4, params, use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 10
    assert children() == before  # every worker gone and waited for
    assert not llm.llm_engine.has_unfinished_requests()  # generate took its requests back
    with pytest.raises(RuntimeError, match="processes were stopped"):
        llm.generate("again", use_tqdm=False)
    llm.close()  # closing a stopped engine is harmless


def test_a_rank_0_killed_while_its_worker_starts_takes_it_along(checkpoint, tiny_model_dirs):
    """Rank 0 (an `LLM` in a process of its own) is killed outright just after it started its worker, which
    is still importing torch: the worker ends within seconds, not after the 5 minutes a rank waits for the
    others to join its group."""
    model = str(tiny_model_dirs["gqa"])
    start = f"from {checkpoint.__name__} import LLM; LLM({model!r}, tensor_parallel_size=2, enforce_eager=True)"
    rank_0 = subprocess.Popen([sys.executable, "-c", start], cwd=ROOT, start_new_session=True)
    try:
        wait_until(lambda: children(rank_0.pid), timeout=60)
        [worker] = children(rank_0.pid)
        time.sleep(0.2)  # rank 0 has sent the worker its rank and opened the group
        rank_0.kill()
        rank_0.wait()
        wait_until(lambda: not alive(worker), timeout=15)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a failed check above: leave nothing running
            os.killpg(rank_0.pid, signal.SIGKILL)


def test_close_and_with_leave_no_process(checkpoint, tiny_model_dirs):
    before = children()
    llm = checkpoint.LLM(str(tiny_model_dirs["mha_tied"]), tensor_parallel_size=2, enforce_eager=True)
    assert len(children() - before) == 1
    llm.close()
    assert children() == before
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate("after close", use_tqdm=False)
    with pytest.raises(KeyError):
        with checkpoint.LLM(str(tiny_model_dirs["mha_tied"]), tensor_parallel_size=2, enforce_eager=True):
            assert len(children() - before) == 1
            raise KeyError("anything")
    assert children() == before


def test_what_cannot_split_starts_nothing(checkpoint, tiny_model_dirs):
    before = children()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=4"):
        checkpoint.LLM(str(tiny_model_dirs["gqa"]), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        checkpoint.LLM(str(tiny_model_dirs["gqa"]), tensor_parallel_size=0)
    with pytest.raises(ValueError, match="max_model_len must be in"):  # after the workers started: stopped
        checkpoint.LLM(str(tiny_model_dirs["gqa"]), tensor_parallel_size=2, enforce_eager=True, max_model_len=10**6)
    assert children() == before
