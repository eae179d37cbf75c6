"""The DESIGN.md §6 benchmark harness, run with --quick on a tiny random model: it checks the harness (the
result files, the checks against transformers, the figures), not the speed.

Each workload runs through the command line, as `make bench` runs it, with one torch thread (the timings
of a shared machine do not matter here; a stalled second thread would only make the test slow). A test
marked `workload(name)` runs only where that workload's chapter exists (see `tests/conftest.py`).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import chapters

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def run_quick(workload: str, model: Path, tmp_path: Path) -> dict:
    json_path, figure = tmp_path / f"{workload}.json", tmp_path / f"{workload}.png"
    done = bench(
        workload, "--quick", "--model", str(model), "--threads", "1", "--json", str(json_path), "--figure", str(figure)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert figure.is_file() and figure.stat().st_size > 0
    result = json.loads(json_path.read_text())
    assert result["workload"] == workload and result["quick"] is True
    machine = result["machine"]
    for key in ("cpu", "cpu_cores", "torch", "torch_threads", "other_processes_cpu_share"):
        assert key in machine
    assert machine["torch_threads"] == 1
    roof = result["roofline"]
    assert roof["gemm_flops"] > 0 and roof["bandwidth_bytes_per_s"] > 0
    assert roof["compute_tokens_per_s"] > 0 and roof["bandwidth_tokens_per_s"] > 0
    assert len(roof["measurements"]) == 2  # before and after the engines
    assert result["parameters"]["roofline"] == result["parameters"]["non_embedding"] + result["parameters"]["lm_head"]
    assert result["correct"] is True
    return result


@pytest.fixture(scope="module")
def tiny_gqa(tiny_model_dirs) -> Path:
    return tiny_model_dirs["gqa"]


@pytest.mark.workload("offline-cpu")
def test_offline_cpu_quick(tiny_gqa, tmp_path):
    result = run_quick("offline-cpu", tiny_gqa, tmp_path)
    engines = {e["engine"]: e for e in result["engines"]}
    assert set(engines) == {"rosellm", "hf-generate", "hf-continuous"}
    for e in engines.values():
        assert "error" not in e, e
        assert e["output_tokens_per_s"] > 0 and e["all_requests_complete"]
        assert e["useful_output_tokens"] == result["work"]["output_tokens"]
        for key in ("ttft_ms", "tpot_ms"):
            assert e[key]["median"] is not None and e[key]["p90"] >= e[key]["median"]
        assert 0 < e["share_of_roofline_output"] and 0 < e["share_of_roofline_work"]
        assert e["peak_rss_run_mib"] > 0
        assert e["check_passed"] is True  # every engine agrees with transformers one request at a time
        assert e["rosellm_ratio"] > 0
    assert engines["rosellm"]["rosellm_ratio"] == 1
    assert result["check"]["rosellm"]["passed"] and result["check"]["rosellm"]["requests"] == 2
    assert engines["hf-generate"]["padded_token_positions"] >= result["work"]["processed_tokens"]
    sweep = result["decode_sweep"]
    assert [p["batch_size"] for p in sweep] == [1, 2, 4] and all(p["share_of_roofline"] > 0 for p in sweep)
    parts = {p["part"] for p in result["profile"]["parts"]}
    assert {"gemm", "attention", "sampling", "scheduling", "python_rest"} <= parts
    assert set(result["targets"]) >= {"4x transformers generate", "beats transformers continuous batching"}


@pytest.mark.workload("latency-cpu")
def test_latency_cpu_quick(tiny_gqa, tmp_path):
    result = run_quick("latency-cpu", tiny_gqa, tmp_path)
    engines = {e["engine"]: e for e in result["engines"]}
    assert set(engines) == {"rosellm", "hf-generate"}
    for e in engines.values():
        assert e["decode_tokens_per_s"] > 0 and e["ttft_ms"] > 0 and e["share_of_bandwidth_roofline"] > 0
        assert e["check"]["passed"]
    assert engines["rosellm"]["decode_ratio_vs_transformers"] > 0
    assert result["all_tokens_identical"] is True


@pytest.mark.workload("chapters")
def test_chapters_quick(tiny_gqa, tmp_path):
    result = run_quick("chapters", tiny_gqa, tmp_path)
    rows = result["chapters"]
    assert [r["chapter"] for r in rows] == [point.number for point in chapters.checkpoints()]
    for r in rows:
        assert "error" not in r, r
        assert r["output_tokens_per_s"] > 0 and r["check"]["passed"] and r["identical_to_latest"]
    assert rows[0]["speedup_vs_first"] == 1


@pytest.mark.workload("offline-gpu")
def test_offline_gpu_without_cuda_says_so_and_exits_cleanly(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: offline-gpu would run for real")
    json_path = tmp_path / "gpu.json"
    done = bench("offline-gpu", "--quick", "--json", str(json_path), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device" in done.stderr and "Traceback" not in done.stderr
    assert not json_path.exists()


def test_every_workload_declares_a_chapter_that_exists():
    from benchmarks import WORKLOADS

    for module, chapter in WORKLOADS.values():
        assert 1 <= chapter <= chapters.latest().number, f"{module} belongs to chapter {chapter}"
    if chapters.latest().number >= 7:
        assert {"offline-cpu", "latency-cpu", "chapters", "offline-gpu"} <= set(WORKLOADS)


def test_benchmarks_page_is_up_to_date_with_the_committed_results():
    """docs/benchmarks.md's tables are generated from benchmarks/results/: a result committed without
    `python scripts/benchmarks_page.py` fails here."""
    done = subprocess.run(
        [sys.executable, "scripts/benchmarks_page.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


# --- the chapter workloads (the measurements quoted on the chapter pages), on tiny settings ------------------

CHAPTER_WORKLOADS = {
    "decode-scaling": "--checkpoint ch02 --lengths 8,16 --steps 2 --repeats 1 --total-tokens 0",
    "batch-throughput": "--batch-sizes 1,2 --prompt-len 8 --max-tokens 4 --repeats 1 --mixed-requests 3 "
    "--mixed-len 4 16 --mixed-tokens 4",
    # a 1 MiB budget holds 16 of the tiny model's requests of up to 256 tokens (part c needs it to)
    "paged-vs-padded": "--max-model-len 256 --block-size 4 --mixed-prompts 3 --mixed-lengths 4,24 "
    "--mixed-max-tokens 4 --batches 2 --throughput-requests 3 --throughput-lengths 4,16 --throughput-max-tokens 2,4 "
    "--repeats 1 --budget-mib 1 --budget-requests 16",
    "arrivals": "--requests 4 --every 1 --prompt-len 4 12 --max-tokens 4 8 --block-size 4 --num-kv-blocks 12",
}


@pytest.mark.parametrize(
    "workload", [pytest.param(name, marks=pytest.mark.workload(name)) for name in CHAPTER_WORKLOADS]
)
def test_chapter_workload_runs_and_records_its_machine(workload, tiny_gqa, tmp_path):
    json_path = tmp_path / "result.json"
    args = [
        workload,
        *CHAPTER_WORKLOADS[workload].split(),
        "--model",
        str(tiny_gqa),
        "--threads",
        "1",
        "--json",
        str(json_path),
    ]
    if workload != "arrivals":
        args += ["--figure", str(tmp_path / "figure.png")]
    done = bench(*args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(json_path.read_text())
    assert result["command"].startswith(f"python -m benchmarks {workload}") and "--json" not in result["command"]
    assert "other_processes_cpu_share" in result["machine"] and result["machine"]["torch_threads"] == 1
    if workload != "arrivals":
        assert (tmp_path / "figure.png").stat().st_size > 0
