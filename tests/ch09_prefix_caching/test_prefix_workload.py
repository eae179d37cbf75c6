"""The chapter's benchmark workload, `python -m benchmarks prefix`, on a tiny model."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.workload("prefix")
def test_prefix_quick_writes_its_result_and_figure(tiny_model_dirs, tmp_path):
    json_path, figure = tmp_path / "result.json", tmp_path / "figure.png"
    command = [sys.executable, "-m", "benchmarks", "prefix", "--quick", "--model", str(tiny_model_dirs["gqa"])]
    command += ["--threads", "1", "--json", str(json_path), "--figure", str(figure)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(json_path.read_text())
    assert figure.stat().st_size > 0 and result["correct"]
    runs = {(r["scenario"], r["caching"]): r for r in result["runs"]}
    assert set(runs) == {("shared", True), ("shared", False), ("chats", True), ("chats", False)}
    for scenario in ("shared", "chats"):
        on, off = runs[scenario, True], runs[scenario, False]
        assert on["prompt_tokens"] == off["prompt_tokens"] and off["cached_tokens"] == 0
        assert 0 < on["cached_tokens"] == on["prompt_tokens"] - on["computed_prompt_tokens"]
        assert on["ttft_s"]["median"] > 0 and on["output_tokens_per_s"] > 0
    assert result["command"].startswith("python -m benchmarks prefix") and "--json" not in result["command"]
