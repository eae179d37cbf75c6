"""The processes of tensor parallelism: none is ever left behind. A worker killed in the middle of a run
makes rank 0 raise within seconds, naming the rank; closing (or leaving a `with` block by an exception)
stops every worker; a size the model cannot split is refused before any process starts."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.requires("tensor_parallel")


def children() -> set[int]:
    """The pids of this process's live children (zombies included: a child not waited for is left)."""
    found = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        found |= {int(pid) for pid in (task / "children").read_text().split()}
    return found


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
