"""The chapter's benchmark workload, `python -m benchmarks long-prompts`, on a tiny model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.workload("long-prompts")
def test_long_prompts_quick_writes_its_result_and_figure(tiny_model_dirs, tmp_path):
    json_path, figure = tmp_path / "result.json", tmp_path / "figure.png"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "long-prompts",
            "--quick",
            "--model",
            str(tiny_model_dirs["gqa"]),
            "--threads",
            "1",
            "--json",
            str(json_path),
            "--figure",
            str(figure),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(json_path.read_text())
    assert figure.stat().st_size > 0
    assert [run["budget"] for run in result["runs"]] == ["off", "16"]
    for run in result["runs"]:
        assert len(run["long_ttft_s"]) == 2 and run["decode_tpot_ms"]["p50"] > 0 and run["steps"]
    assert result["command"].startswith("python -m benchmarks long-prompts") and "--json" not in result["command"]
    assert "other_processes_cpu_share" in result["machine"] and result["machine"]["torch_threads"] == 1
