"""batch-throughput --padding: the padding of chapter 03's merged caches, counted in the engine and by replay."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.workload("batch-throughput")


def test_replay_follows_the_offline_scheduler_and_counts_the_padded_slots():
    from benchmarks.batch_throughput import padding_summary, replay_offline_scheduler

    forwards = replay_offline_scheduler([4, 2], [2, 3], max_batch_size=1)  # one request at a time
    assert [(f["kind"], f["rows"]) for f in forwards] == [
        ("prefill", [4]),
        ("decode", [5]),
        ("prefill", [2]),
        ("decode", [3]),
        ("decode", [4]),
    ]
    together = replay_offline_scheduler([4, 2], [2, 2], max_batch_size=2)
    assert [(f["kind"], f["new"], f["rows"]) for f in together] == [
        ("prefill", [4, 2], [4, 2]),
        ("decode", [1, 1], [5, 3]),
    ]
    summary = padding_summary(together)  # 2 of 8 slots, then 2 of 10
    assert summary["kv_slots_padding"] == 4 and summary["kv_slots_merged"] == 18
    assert summary["kv_padding_share_mean_per_forward"] == round((2 / 8 + 2 / 10) / 2, 4)
    assert summary["prefill_input_padding"] == 2 and summary["prefill_input_slots"] == 8


def test_padding_counted_in_the_engine_equals_the_replay(tiny_model_dirs, tmp_path):
    json_path = tmp_path / "padding.json"
    argv = ["batch-throughput", "--padding", "--quick", "--threads", "1", "--json", str(json_path)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", *argv, "--model", str(tiny_model_dirs["gqa"])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(json_path.read_text())
    mixed = result["padding"]["mixed_batch"]
    assert result["correct"] and mixed["replay_matches_engine"]
    assert len(mixed["prompt_lens"]) == 3 and mixed["forwards"] == 4  # one prefill, then 3 decode steps
    assert 0 < mixed["kv_padding_share_mean_per_forward"] < 1
    assert result["padding"]["offline_workload_replayed"]["forwards"] > 64
