"""The benchmark harness, run with --quick on a tiny random model: it checks the harness (the result files, the
checks against transformers, the figures), not the speed. The peers are not installed here (minutes of
building); their plumbing runs against fake peers that speak the same JSON protocol.

Each workload runs through the command line with one torch thread. rosellm's engines run uncompiled
(`TORCH_COMPILE_DISABLE=1` in the processes a run starts: compiling costs seconds a process and no check here
reads a speed) but where the compiled engine is what a test checks: offline-cpu's profile, cpu-ablation's steps.
A test marked `workload(name)` runs only where that workload's chapter exists (see `tests/conftest.py`).
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import chapters
from benchmarks import harness

ROOT = Path(__file__).resolve().parent.parent


def bench(*args: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def run_quick(
    workload: str, model: Path, tmp_path: Path, *extra: str, fakes: dict | None = None, compiled: bool = False
) -> dict:
    """`python -m benchmarks WORKLOAD --quick ...`: in a process of its own, or, with `fakes` (peer name ->
    fake `Peer`), in this one with the peers replaced by the fakes. The processes it starts compile nothing
    unless `compiled` (this process compiles as it would have: its torch read the variable at import)."""
    json_path, figure = tmp_path / f"{workload}.json", tmp_path / f"{workload}.png"
    argv = [workload, "--quick", "--model", str(model), "--threads", "1", "--json", str(json_path)]
    argv += ["--figure", str(figure), *extra]
    uncompiled = {} if compiled else {"TORCH_COMPILE_DISABLE": "1"}
    if fakes is None:
        done = bench(*argv, env=os.environ | uncompiled)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    else:
        with mock.patch.dict(os.environ, uncompiled):
            run_with_fake_peers(argv, fakes)
    assert figure.is_file() and figure.stat().st_size > 0
    text = json_path.read_text()
    assert str(tmp_path) not in text and str(model) not in text  # the model's temporary folder: by its name
    result = json.loads(text)
    assert result["workload"] == workload and result["quick"] is True and result["correct"] is True
    level = os.environ.get("ROSELLM_CPU_FEATURES")  # a masked run says so first
    command = f"{f'ROSELLM_CPU_FEATURES={level} ' if level else ''}python -m benchmarks {workload}"
    assert result["command"].startswith(command) and "--json" not in result["command"]
    assert result["machine"]["torch_threads"] == 1 and "other_processes_cpu_share" in result["machine"]
    return result


def run_with_fake_peers(argv: list[str], fakes: dict) -> None:
    """The command line in this process, `benchmarks.peers.PEERS` being `fakes` meanwhile."""
    from benchmarks import peers
    from benchmarks.__main__ import main

    saved, threads = (peers.PEERS, sys.argv), torch.get_num_threads()
    peers.PEERS, sys.argv = fakes, ["benchmarks", *argv]  # the result's command is read from sys.argv
    try:
        main(argv)
    finally:
        (peers.PEERS, sys.argv), _ = saved, torch.set_num_threads(threads)


def check_roofline(result: dict) -> None:
    roof = result["roofline"]
    assert roof["compute_tokens_per_s"] > 0 and roof["bandwidth_tokens_per_s"] > 0
    assert len(roof["measurements"]) == 2  # before and after the engines
    assert result["parameters"]["roofline"] == result["parameters"]["non_embedding"] + result["parameters"]["lm_head"]


@pytest.fixture(scope="module")
def tiny_gqa(tiny_model_dirs) -> Path:
    return tiny_model_dirs["gqa"]


@pytest.mark.workload("offline-cpu")
def test_offline_cpu_quick(tiny_gqa, tmp_path):
    """With both peers faked: vLLM's answers the checked sample right and is timed, llama.cpp's does not and is
    not; the rest of the table as without peers."""
    fakes = {"vllm": fake_peer(tmp_path, "vllm", HONEST), "llamacpp": fake_peer(tmp_path, "llamacpp", LIAR)}
    result = run_quick("offline-cpu", tiny_gqa, tmp_path, "--peers", "vllm,llamacpp", fakes=fakes, compiled=True)
    check_roofline(result)
    engines = {e["engine"]: e for e in result["engines"]}
    assert set(engines) == {"rosellm", "hf-generate", "hf-continuous", "vllm", "llamacpp"}
    liar, honest = engines.pop("llamacpp"), engines.pop("vllm")
    assert liar["check_passed"] is False and "not timed" in liar["error"] and "output_tokens_per_s" not in liar
    assert honest["check_passed"] is True and honest["output_tokens_per_s"] > 0 and honest["version"] == "1.0"
    assert honest["settings"]["max_num_seqs"] == result["settings"]["rosellm_engine_options"]["max_num_seqs"]
    assert engines["rosellm"]["label"] == harness.rosellm_label(chapters.latest())
    assert engines["rosellm"]["checkpoint"] == chapters.latest().module
    for e in engines.values():
        assert "error" not in e, e
        assert e["output_tokens_per_s"] > 0 and e["all_requests_complete"] and e["check_passed"] is True
        assert e["useful_output_tokens"] == result["work"]["output_tokens"] and e["peak_rss_run_mib"] > 0
        assert e["ttft_ms"]["p90"] >= e["ttft_ms"]["median"] > 0 and e["rosellm_ratio"] > 0
    assert engines["rosellm"]["rosellm_ratio"] == 1 and result["check"]["rosellm"]["requests"] == 2
    assert engines["hf-generate"]["padded_token_positions"] >= result["work"]["processed_tokens"]
    assert [p["batch_size"] for p in result["decode_sweep"]] == [1, 2, 4]
    parts = {p["part"]: p["seconds"] for p in result["profile"]["parts"]}
    assert {"gemm", "attention", "other_model", "lm_head", "schedule", "sample", "commit"} <= set(parts)
    # torch.profiler saw the GEMMs inside the forward, and the rest of it (decode steps attend inside the graph)
    assert parts["gemm"] > 0 and parts["other_model"] > 0
    assert result["agreement"]["rosellm vs hf-continuous"]["identical_requests"] == result["work"]["requests"]


@pytest.mark.workload("latency-cpu")
def test_latency_cpu_quick(tiny_gqa, tmp_path):
    """fp32 rows checked against transformers; a bf16 peer (faked, with wrong tokens) timed all the same, its
    agreement with the fp32 peer recorded; each row's bytes per token and its own roofline."""
    fakes = {"vllm": fake_peer(tmp_path, "vllm", HONEST), "vllm-bf16": fake_peer(tmp_path, "vllm-bf16", LIAR)}
    fakes["vllm-bf16"].dtype, fakes["vllm-bf16"].home = "bfloat16", "vllm"
    result = run_quick(
        "latency-cpu", tiny_gqa, tmp_path, "--peers", "vllm,vllm-bf16", "--variants", "fp32", fakes=fakes
    )
    check_roofline(result)
    engines = {e["engine"]: e for e in result["engines"]}
    assert set(engines) == {"rosellm", "hf-generate", "vllm", "vllm-bf16"}
    assert engines["rosellm"]["label"] == harness.rosellm_label(chapters.latest(), short=True)
    fp32_bytes = 4 * result["parameters"]["roofline"]
    for e in engines.values():
        assert e["decode_tokens_per_s"] > 0 and e["tpot_ms"] > 0
        share = e["decode_tokens_per_s"] / e["bandwidth_roofline_tokens_per_s"]
        assert e["share_of_bandwidth_roofline"] == pytest.approx(share, abs=1e-4)
    bf16 = engines.pop("vllm-bf16")
    assert bf16["weight_bytes_per_token"] == fp32_bytes // 2 and bf16["check"]["passed"] is False
    assert bf16["check"]["required"] is False and bf16["check_passed"] is None
    assert bf16["agreement_with_fp32"]["requests"] == 1 and bf16["agreement_with_fp32"]["identical_requests"] == 0
    for e in engines.values():
        assert e["check"]["passed"] and e["check"]["required"] and e["weight_bytes_per_token"] == fp32_bytes
        assert e["ttft_ms"] > 0
    assert engines["rosellm"]["decode_ratio_vs_transformers"] > 0 and result["all_tokens_identical"] is True


@pytest.mark.workload("latency-cpu", "perplexity")  # the formats are chapter 13's
def test_latency_cpu_quick_runs_each_weight_format(tiny_gqa, tmp_path):
    """rosellm once per format: a quantized row reads fewer bytes and records its agreement with the fp32 row;
    "gguf" on a model that is not a GGUF file is an error row, and the run goes on (bf16's row: the offline-cpu
    bf16 test)."""
    result = run_quick("latency-cpu", tiny_gqa, tmp_path, "--engines", "rosellm", "--variants", "fp32,int4,gguf")
    engines = {e["engine"]: e for e in result["engines"]}
    assert list(engines) == ["rosellm", "rosellm-int4", "rosellm-gguf"]
    assert "exited with status" in engines.pop("rosellm-gguf")["error"]
    fp32 = engines["rosellm"]
    assert fp32["check"]["passed"] and fp32["label"].endswith("fp32")
    sizes = [engines[name]["weight_bytes_per_token"] for name in ("rosellm", "rosellm-int4")]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 4 * result["parameters"]["roofline"]
    e = engines["rosellm-int4"]
    assert "error" not in e and e["decode_tokens_per_s"] > 0 and e["check"]["required"] is False
    assert 0 <= e["agreement_with_fp32"]["equal_token_share"] <= 1 and e["agreement_with_fp32"]["requests"] == 1


@pytest.mark.workload("offline-cpu")
@pytest.mark.cpu_features
def test_offline_cpu_quick_in_bfloat16(tiny_gqa, tmp_path, monkeypatch):
    """--dtype bfloat16: rosellm, transformers and the vLLM peer (faked) in bf16, each check recorded, not required;
    the roofline from 2 bytes a weight and the GEMM rate in bf16. On any CPU: rosellm runs masked to AVX-512
    without BF16 (ROSELLM_CPU_FEATURES), where bf16 is emulated, as on most readers' CPUs."""
    monkeypatch.setenv("ROSELLM_CPU_FEATURES", "avx512")
    fakes = {"vllm": fake_peer(tmp_path, "vllm", LIAR)}
    argv = ["--dtype", "bfloat16", "--engines", "rosellm,hf-generate", "--peers", "vllm"]
    result = run_quick("offline-cpu", tiny_gqa, tmp_path, *argv, fakes=fakes)
    assert result["dtype"] == "bfloat16" and result["settings"]["dtype"] == "bfloat16"
    assert result["roofline"]["weight_bytes"] == 2 * result["parameters"]["roofline"]
    assert {m["gemm"]["dtype"] for m in result["roofline"]["measurements"]} == {"bfloat16"}
    engines = {e["engine"]: e for e in result["engines"]}
    assert set(engines) == {"rosellm", "hf-generate", "vllm"} and engines["rosellm"]["compute_dtype"] == "bfloat16"
    for e in engines.values():
        assert "error" not in e and e["output_tokens_per_s"] > 0 and e["check"]["required"] is False
    assert engines["vllm"]["check"]["passed"] is False  # timed all the same


@pytest.mark.workload("offline-cpu")
def test_the_bf16_result_has_a_file_of_its_own():
    from argparse import Namespace

    from benchmarks import offline_cpu

    args = Namespace(quick=False, json=None, figure=None)
    assert harness.output_paths(args, offline_cpu.DTYPES["bfloat16"])[0].name == "offline_cpu_bf16.json"
    done = bench("offline-cpu", "--dtype", "float16", "--quick", timeout=60)
    assert done.returncode != 0 and "choose from float32, bfloat16" in done.stderr


@pytest.mark.workload("perplexity")
def test_perplexity_quick(tiny_gqa, tmp_path):
    """fp32's perplexity is transformers' on the same windows; every format's greedy agreement with fp32."""
    from transformers import AutoModelForCausalLM

    from benchmarks import perplexity

    result = run_quick("perplexity", tiny_gqa, tmp_path, "--variants", "fp32,int8")
    rows = {row["variant"]: row for row in result["variants"]}
    assert list(rows) == ["fp32", "int8"]  # no "gguf": the model is not a GGUF file
    text = result["text"]
    assert text["windows"] == 3 and text["tokens"] == 192 and text["scored_tokens_per_window"] == 63
    windows = torch.tensor(perplexity.text_windows(str(tiny_gqa), 192, 64))  # [windows, 64]
    hf = AutoModelForCausalLM.from_pretrained(tiny_gqa, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(windows).logits  # [windows, 64, vocab]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten()).item()
    assert rows["fp32"]["perplexity"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert rows["fp32"]["agreement_with_fp32"]["equal_token_share"] == 1 and rows["fp32"]["vs_fp32"] == 1
    for row in rows.values():
        assert row["error"] is None and 0.5 < row["vs_fp32"] < 2 and len(row["window_perplexity"]) == 3
        shares = row["agreement_with_fp32"]["share_identical_for_first_k_tokens"]
        assert list(shares) == ["1", "4", "16", "64"] and list(shares.values()) == sorted(shares.values(), reverse=True)


@pytest.mark.workload("quant-kernels")
@pytest.mark.cpu_features
def test_quant_kernels_quick(tiny_gqa, tmp_path):
    result = run_quick("quant-kernels", tiny_gqa, tmp_path)
    assert set(result["machine"]["cpu_flags"]) == {"avx2", "avx512", "avx512_bf16", "avx512_vnni", "amx"}
    kinds = {(r["kernel"], r["activation"]) for r in result["rows"]}
    assert kinds == {(k, a) for k, activations in quant_kernels_module().KERNELS.items() for a in activations}
    assert len(result["rows"]) == len(kinds) * len(result["shapes"]) * 2 and all(
        r["ms_per_matrix"] > 0 for r in result["rows"]
    )
    assert [s["name"] for s in result["shapes"]] == ["qkv", "o", "gate_up", "down", "lm_head"]
    assert {r["copies"] for r in result["rows"] if r["shape"] == "lm_head"} == {1}
    assert set(result["crossover_rows"]) == {
        "int8pack (bfloat16)",
        "int8pack (float32)",
        "int4pack (bfloat16)",
        "int4pack (float32)",
    }
    assert all(rows in (None, 1, 4) for rows in result["crossover_rows"].values())
    attention = {(r["way"], r["dtype"], r["batch"]): r for r in result["attention"]}
    assert set(attention) == {
        (w, d, b) for w in ("compiled", "C kernel") for d in ("float32", "bfloat16") for b in (1, 4)
    }
    assert all(r["ms_per_step"] > 0 and r["gb_per_s"] > 0 and 8 * r["batch"] <= r["keys"] for r in attention.values())
    assert result["attention_shape"]["layers"] == harness.model_config(tiny_gqa).num_hidden_layers
    assert result["checkpoint"] == chapters.checkpoint(13).module and "choice" not in result
    assert result["cpu_level"]["level"] in chapters.submodule(result["checkpoint"], "cpu_features").LEVELS


# the kernel a chapter 18 layer runs at 1, 4 and 64 rows, per weight format and activation dtype, where the CPU
# level packs bf16 weights (elsewhere "bf16 plain" for "bf16 packed") and PLAIN_ROWS is Intel's (elsewhere "fp32
# packed" at 1 row): PLAIN_ROWS, INTEGER_DOT_ROWS, SMALL_BATCH_ROWS and HALVES_ROWS lie between them
PICKS = {
    ("fp32", "float32"): ["fp32 plain", "fp32 packed", "fp32 packed"],
    ("Q4_1", "float32"): ["Q4_1 integer dot", "Q4_1 integer dot", "fp32 plain"],  # the dense copy as it is
    ("Q8_0", "float32"): ["Q8_0 integer dot", "Q8_0 integer dot", "fp32 plain"],
    ("bf16", "bfloat16"): ["bf16 packed", "bf16 packed", "bf16 packed"],
    ("Q4_1", "bfloat16"): ["Q4_1 int4pack", "Q4_1 int4pack", "bf16 plain"],
    ("Q8_0", "bfloat16"): ["Q8_0 int4pack halves", "Q8_0 int4pack halves", "bf16 plain"],
}
CHOICE_ROWS = (1, 4, 64)


@pytest.mark.workload("quant-kernels")
@pytest.mark.cpu_features
@pytest.mark.parametrize("level", ["as set", "avx2"])
def test_quant_kernels_quick_from_chapter_18_names_the_fastest_kernel_and_the_pick(
    level, tiny_gqa, tmp_path, monkeypatch
):
    """Chapter 18's kernels at the level the suite runs at and at AVX2: every format's candidates and its layer's
    own forward, measured on every shape; per format and rows, the fastest is one of its candidates and the pick
    is the kernel the layer's rule names, never faster; the kernel-choice block renders the result."""
    if level != "as set":
        monkeypatch.setenv("ROSELLM_CPU_FEATURES", level)
    point = chapters.checkpoint(18)
    features = chapters.submodule(point.module, "cpu_features")
    packs_bf16 = chapters.submodule(point.module, "packed_linear").can_pack(torch.empty(1, 1, dtype=torch.bfloat16))
    rows = ",".join(map(str, CHOICE_ROWS))
    result = run_quick("quant-kernels", tiny_gqa, tmp_path, "--checkpoint", "18", "--rows", rows)
    assert result["checkpoint"] == point.module and result["errors"] == [] and "crossover_rows" not in result
    at = dict(level=features.level(), native=features.native_level(), masked=features.masked())
    assert result["cpu_level"] == at | {"torch": torch.backends.cpu.get_cpu_capability()}
    assert list(result["absent"]) == ([] if packs_bf16 else ["bf16 packed"])
    check_every_kernel_measured(result)
    check_the_choice(result)
    plain_rows = chapters.submodule(point.module, "packed_linear").PLAIN_ROWS  # by the CPU's maker: 0 or 3
    for (weights, activation), picks in PICKS.items():
        expected = [pick if packs_bf16 else pick.replace("bf16 packed", "bf16 plain") for pick in picks]
        if (weights, activation) == ("fp32", "float32") and not plain_rows:
            expected[0] = "fp32 packed"  # MKL on a CPU not Intel's: the packed copy from one row (test_plain_rows.py)
        assert [
            c["pick"] for c in result["choice"] if (c["weights"], c["activation"]) == (weights, activation)
        ] == expected
    check_the_kernel_choice_block(result, tmp_path)


def check_every_kernel_measured(result: dict) -> None:
    """The groups are the formats in order, each with its candidates (less the absent ones) and its choice,
    every one timed on every shape at every row count; each choice row names the kernel the layer ran."""
    qk = quant_kernels_module()
    assert [(g["weights"], g["activation"]) for g in result["groups"]] == qk.FORMATS
    measured = {(r["kernel"], r["activation"], r["shape"], r["rows"]) for r in result["rows"]}
    for g in result["groups"]:
        assert set(g["kernels"]) == set(qk.candidates(g["weights"], g["activation"])) - set(result["absent"])
        for kernel in [*g["kernels"], g["choice"]]:
            expected = {(kernel, g["activation"], shape["name"], n) for shape in result["shapes"] for n in CHOICE_ROWS}
            assert expected <= measured, kernel
    assert all(r["ms_per_matrix"] > 0 for r in result["rows"])
    assert all(r["picked"] for r in result["rows"] if r["kernel"].endswith(" choice"))


def check_the_choice(result: dict) -> None:
    """Per group and rows: the fastest is the candidate of least step time, the pick's time is its kernel's and
    the ratio pick / fastest is at least 1 (1 where the pick is the fastest); `choice_ms` is the layer's own."""
    steps = {(p["kernel"], p["activation"], p["rows"]): p["ms"] for p in result["per_step"]}
    found = {(c["weights"], c["activation"], c["rows"]): c for c in result["choice"]}
    groups = {(g["weights"], g["activation"]): g for g in result["groups"]}
    assert list(found) == [(w, a, n) for w, a in groups for n in CHOICE_ROWS]
    for (weights, activation, n), c in found.items():
        group = groups[weights, activation]
        times = {kernel: steps[kernel, activation, n] for kernel in group["kernels"]}
        assert c["fastest"] in times and c["pick"] in times
        assert c["fastest_ms"] == pytest.approx(min(times.values()), abs=2e-3)
        assert c["pick_ms"] == pytest.approx(times[c["pick"]], abs=2e-3) and c["pick_vs_fastest"] >= 1
        assert c["pick"] != c["fastest"] or c["pick_vs_fastest"] == 1
        assert c["choice_ms"] == pytest.approx(steps[group["choice"], activation, n], abs=2e-3)


def check_the_kernel_choice_block(result: dict, tmp_path: Path) -> None:
    """`<!-- measured: kernel-choice FILE.json -->` in a page: the CPU level, what did not run, and a row per row
    count with a cell per group: the fastest kernel, then ✓ where it is the pick, else the pick and its ratio."""
    docs_results = load_docs_results()
    results = tmp_path / "book" / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "kernels.json").write_text(json.dumps(result))
    config = SimpleNamespace(config_file_path=str(tmp_path / "book" / "mkdocs.yml"))
    page = SimpleNamespace(file=SimpleNamespace(src_path="page.md"))
    block = docs_results.on_page_markdown("<!-- measured: kernel-choice kernels.json -->\n", page, config, None)
    assert block == docs_results.block_kernel_choice(results, "kernels.json") + "\n"
    level = result["cpu_level"]
    assert f"CPU level **{level['level']}**" in block and ("ROSELLM_CPU_FEATURES on a CPU" in block) == level["masked"]
    assert ("Not run at this level: bf16 packed" in block) == ("bf16 packed" in result["absent"])
    assert "| rows | fp32 weights, fp32 activations | Q4_1 weights, fp32 activations |" in block
    table = [
        line.strip("| ").split(" | ") for line in block.splitlines() if line.startswith("| ") and line[2].isdigit()
    ]
    assert [cells[0] for cells in table] == [str(n) for n in CHOICE_ROWS]
    for cells, n in zip(table, CHOICE_ROWS):
        choices = [c for c in result["choice"] if c["rows"] == n]
        assert len(cells) == 1 + len(choices)
        for cell, c in zip(cells[1:], choices):
            picked = " ✓" if c["pick"] == c["fastest"] else f"; picks **{c['pick']}**: {c['pick_vs_fastest']:.2f}×"
            assert cell == f"{c['fastest']}, {c['fastest_ms']:.1f} ms{picked}"


@pytest.mark.workload("speculative")
def test_speculative_quick(tiny_gqa, tmp_path):
    """Without speculation, n-gram and a draft model (the tiny model itself, unquantized) at batch 1 and 2 on
    both sets of requests: every row's greedy tokens those of the row without speculation, the counts in
    their bounds; vLLM (faked) checked against rosellm's tokens, each of its rows with its own limits; the
    docs block rendered from the result file."""
    fakes = {"vllm": fake_peer(tmp_path, "vllm", HONEST)}
    argv = ["--draft-quantization", "none", "--peers", "vllm"]
    result = run_quick("speculative", tiny_gqa, tmp_path, *argv, fakes=fakes)
    ours = [row for row in result["rows"] if row["engine"] == "rosellm"]
    runs = {(row["method"], row["set"], row["batch"]) for row in ours}
    assert runs == {
        (m, name, b) for m in ("none", "ngram", "draft_model") for name in ("copy", "random") for b in (1, 2)
    }
    for row in ours:
        assert "error" not in row and row["identical"] and row["agreement"]["identical_requests"] == 2, row
        assert row["output_tokens"] == 2 * 8 and row["output_tokens_per_s"] > 0 and row["speedup"] > 0
        if row["method"] == "none":
            assert row["tokens_per_target_forward"] == 1 and "acceptance_rate" not in row
        else:
            assert 0 <= row["num_accepted_tokens"] <= row["num_draft_tokens"] and 0 <= row["acceptance_rate"] <= 1
            assert row["tokens_per_target_forward"] == round(16 / (16 - row["num_accepted_tokens"]), 3)
    drafts = [row for row in ours if row["method"] == "draft_model"]
    assert all(row["num_accepted_tokens"] > 0 and row["mean_acceptance_length"] > 1 for row in drafts)
    assert result["speculative_configs"]["draft_model"]["quantization"] is None
    vllm = [row for row in result["rows"] if row["engine"] == "vllm"]
    assert [(row["set"], row["batch"]) for row in vllm] == [("copy", 1), ("copy", 2), ("random", 1), ("random", 2)]
    for row in vllm:
        assert row["check"]["passed"] and row["output_tokens_per_s"] > 0
        assert row["settings"]["max_num_seqs"] == row["batch"]
        assert row["settings"]["speculative_config"] == result["speculative_configs"]["ngram"]
    block = load_docs_results().block_speculative(tmp_path, "speculative.json")
    assert block.count("| copy |") == 8 and "| random | 2 | draft model |" in block
    assert block.count("**no**") == len(vllm)  # the fake peer's tokens after the checked ones are its own


@pytest.mark.workload("structured")
def test_structured_quick(tiny_gqa, tmp_path):
    """At batch 1 and 2, unconstrained, all constrained and (at 2) half: the grammar's work timed only where
    there is a constraint, the mixed batch's unconstrained tokens unchanged, every answer that ended valid
    JSON; each schema compiled once, then found; vLLM (faked) with and without the schemas, its requests
    carrying them; the docs block rendered from the result file."""
    fakes = {"vllm": fake_peer(tmp_path, "vllm", HONEST.replace("(prompt, max_tokens)", "(prompt, max_tokens, *_)"))}
    result = run_quick("structured", tiny_gqa, tmp_path, "--peers", "vllm", fakes=fakes)
    rows = {(row["batch"], row["constrained"]): row for row in result["steps"]}
    assert set(rows) == {(1, "none"), (1, "all"), (2, "none"), (2, "all"), (2, "half")}
    for (batch, kind), row in rows.items():
        assert row["full_steps"] > 0 and row["step_ms"] > 0 and 0 <= row["grammar_share"] < 1, row
        assert row["output_tokens"] <= batch * 8 and row["output_tokens_per_s"] > 0
        if kind == "none":
            assert row["accept_ms"] == 0 and row["overhead_pct"] == 0 and "valid_json" not in row
        else:
            assert row["mask_ms"] > 0 and row["accept_ms"] > 0 and row["grammar_ms"] >= row["mask_ms"]
            assert row["valid_json"] == row["constrained_finished_by_eos"]
    assert rows[(2, "half")]["identical"] is True
    assert [c["schema"] for c in result["compile"]] == ["person", "shopping", "ticket", "rating"]
    assert result["tokenizer_analysis_ms"] > 0
    assert all(0 < c["cached_ms"] < c["cold_ms"] for c in result["compile"])
    vllm = result["peers"]["vllm"]
    assert [(r["batch"], r["constrained"]) for r in vllm["rows"]] == [(1, "none"), (1, "all"), (2, "none"), (2, "all")]
    assert all(r["check"]["passed"] and r["output_tokens_per_s"] > 0 and r["agreement"] for r in vllm["rows"])
    assert [r["check"]["tokens_each"] for r in vllm["rows"]] == [4, 4, 4, 4]
    assert "overhead_pct" in vllm["rows"][-1] and vllm["settings"]["structured_outputs_config"]["backend"] == "xgrammar"
    block = load_docs_results().block_structured(tmp_path, "structured.json")
    assert "| 2 | half | " in block and block.count("| person |") == 1 and "| vllm peer tokens/s |" in block
    assert "vllm peer, the same requests" in block and block.count("| 2 | all | ") == 2


def load_docs_results():
    spec = importlib.util.spec_from_file_location("docs_results", ROOT / "scripts" / "docs_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quant_kernels_module():
    return importlib.import_module("benchmarks.quant_kernels")


@pytest.mark.workload("quant-kernels")
def test_a_step_time_and_the_crossover_from_made_up_timings():
    qk = quant_kernels_module()
    shapes = [dict(name="a", per_step=3), dict(name="head", per_step=1)]
    timings = {("fp32 dense", "float32"): [1.0, 2.0, 3.0], ("int8pack", "float32"): [0.5, 2.5, 9.0]}
    rows = [
        dict(shape=shape, kernel=kernel, activation=activation, rows=n, ms_per_matrix=ms)
        for (kernel, activation), times in timings.items()
        for n, ms in zip((1, 2, 4), times)
        for shape in ("a", "head")
    ]
    steps = qk.step_times(rows, shapes)
    assert {(p["kernel"], p["rows"]): p["ms"] for p in steps}[("int8pack", 2)] == 4 * 2.5
    assert qk.crossovers(steps) == {"int8pack (float32)": 2}
    assert qk.crossovers([p for p in steps if p["rows"] == 1]) == {"int8pack (float32)": None}


@pytest.mark.workload("quant-kernels")
def test_the_fastest_kernel_and_the_pick_from_made_up_timings():
    """The fastest is the least time for a whole step (not for one shape), among the candidates measured on every
    shape; the pick's time is that of the kernels the layer ran, shape by shape; a row count at which one of
    those was not measured is left out."""
    qk = quant_kernels_module()
    shapes = [dict(name="a", per_step=3), dict(name="head", per_step=1)]
    timings = {  # (kernel, shape) -> ms per matrix at 1 and 2 rows
        ("fp32 plain", "a"): [1.0, 1.0],
        ("fp32 plain", "head"): [1.0, 1.0],
        ("fp32 packed", "a"): [2.0, 0.5],
        ("fp32 packed", "head"): [0.5, 0.5],
        ("Q4_1 integer dot", "a"): [0.8, 3.0],
        ("Q4_1 integer dot", "head"): [9.0],  # not measured at 2 rows
        ("Q4_1 choice", "a"): [0.9, 3.1],
        ("Q4_1 choice", "head"): [9.1, 1.1],
    }
    picked = {
        1: {"a": "Q4_1 integer dot", "head": "Q4_1 integer dot"},
        2: {"a": "Q4_1 integer dot", "head": "fp32 plain"},
    }
    rows = [
        dict(shape=shape, kernel=kernel, activation="float32", rows=n, ms_per_matrix=ms)
        | ({"picked": picked[n][shape]} if kernel == "Q4_1 choice" else {})
        for (kernel, shape), times in timings.items()
        for n, ms in zip((1, 2), times)
    ]
    groups = [g for g in qk.kernel_groups({}) if (g["weights"], g["activation"]) == ("Q4_1", "float32")]
    candidates = ["fp32 plain", "fp32 packed", "Q4_1 integer dot"]
    assert groups == [dict(weights="Q4_1", activation="float32", kernels=candidates, choice="Q4_1 choice")]
    one, two = qk.choices(rows, shapes, groups)
    assert (one["rows"], one["fastest"], one["fastest_ms"]) == (1, "fp32 plain", 4.0)  # not integer dot's 0.8 on `a`
    assert (one["pick"], one["pick_ms"], one["pick_vs_fastest"], one["choice_ms"]) == (
        "Q4_1 integer dot",
        11.4,
        2.85,
        11.8,
    )
    assert (two["rows"], two["fastest"], two["fastest_ms"]) == (2, "fp32 packed", 2.0)
    assert (two["pick"], two["pick_ms"], two["pick_vs_fastest"]) == ("Q4_1 integer dot + fp32 plain", 10.0, 5.0)
    unmeasured = [r for r in rows if (r["kernel"], r["shape"], r["rows"]) != ("fp32 plain", "head", 2)]
    assert [c["rows"] for c in qk.choices(unmeasured, shapes, groups)] == [1]
    assert qk.kernel_groups({"bf16 packed": "not at this level"})[3]["kernels"] == ["bf16 plain"]


def test_agreement_with_a_baseline():
    baseline = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    out = harness.agreement([[1, 2, 0, 4], [5, 6], [0, 8, 9]], baseline, after=(1, 2, 4))
    assert out["first_difference_at"] == [2, None, 0] and out["identical_requests"] == 1
    assert out["equal_token_share"] == round(7 / 9, 4)
    assert out["share_identical_for_first_k_tokens"] == {
        "1": round(2 / 3, 4),
        "2": round(2 / 3, 4),
        "4": round(1 / 3, 4),
    }
    assert harness.agreement([[1, 2]], [[1, 2, 3]])["first_difference_at"] == [
        2
    ]  # a shorter answer differs where it ends


@pytest.mark.model  # SmolLM2's config and its GGUF file
def test_bytes_of_weights_per_token_of_each_format():
    from benchmarks import variants
    from chapters import submodule

    loader = submodule("rosellm", "loader")

    config = harness.model_config(None)
    fp32 = variants.bytes_per_token("fp32", config)
    assert fp32 == 4 * harness.parameter_counts(config)["roofline"]
    assert variants.bytes_per_token("bf16", config) == fp32 // 2
    assert variants.read_format("int4", "float32") == "float32"  # fp32 compute multiplies the dense copy
    assert variants.read_format("int4", "bfloat16") == "int4" and variants.read_format("bf16", "bfloat16") == "bf16"
    int8, int4 = (variants.bytes_per_token(form, config) for form in ("int8", "int4"))
    gguf = variants.bytes_per_token("gguf", config, loader.model_source(None))
    assert fp32 / 4 < int8 < fp32 / 3.9 and int4 == pytest.approx(fp32 * 0.625 / 4, rel=0.01)
    # the bundled file: Q4_1 layers (5 bits a weight), the tied Q8_0 head (8.5 bits) read as the LM head
    assert int4 < gguf < int8


@pytest.mark.workload("perplexity")  # chapter 13 runs them all
def test_variants_are_chosen_by_what_the_checkpoint_can_do():
    from benchmarks import variants

    earlier, latest = chapters.checkpoint(12), chapters.latest()
    assert [v.name for v in variants.chosen("all", earlier)] == ["fp32"]
    with pytest.raises(SystemExit, match="runs only fp32"):
        variants.chosen("fp32,int4", earlier)
    with pytest.raises(SystemExit, match="unknown variants"):
        variants.chosen("int3", latest)
    assert [v.name for v in variants.chosen("all", latest)] == list(variants.VARIANTS)
    assert variants.VARIANTS["int4"].engine_options() == {"quantization": "int4"}
    assert variants.VARIANTS["gguf-exact"].engine_options() == {"quantization": "gguf", "int8_activations": False}
    before_integer_dot = chapters.checkpoint(17)
    assert "gguf-exact" not in [v.name for v in variants.chosen("all", before_integer_dot)]
    with pytest.raises(SystemExit, match="not gguf-exact"):
        variants.chosen("gguf-exact", before_integer_dot)


@pytest.mark.workload("speculative")
def test_speculative_sets_and_methods_on_a_chosen_checkpoint(tiny_gqa, tmp_path):
    """The latest checkpoint, the chat set beside the others, n-gram with and without chapter 18's pace: every
    row's greedy tokens those of the row without speculation; the pace proposes no more drafts than k every
    step; the docs block names the sets and both n-gram rows."""
    argv = ["--checkpoint", "18", "--batch", "1", "--sets", "copy,chat,random", "--methods", "none,ngram,ngram-fixed"]
    result = run_quick("speculative", tiny_gqa, tmp_path, *argv)
    assert result["checkpoint"] == chapters.checkpoint(18).module
    rows = {(row["method"], row["set"]): row for row in result["rows"]}
    assert set(rows) == {(m, name) for m in ("none", "ngram", "ngram-fixed") for name in ("copy", "chat", "random")}
    assert all("error" not in row and row["identical"] for row in rows.values())
    for name in ("copy", "chat", "random"):
        assert rows["ngram", name]["num_draft_tokens"] <= rows["ngram-fixed", name]["num_draft_tokens"]
    assert result["speculative_configs"]["ngram-fixed"]["adaptive_draft_length"] is False
    assert "adaptive_draft_length" not in result["speculative_configs"]["ngram"]
    block = load_docs_results().block_speculative(tmp_path, "speculative.json")
    assert "*chat*:" in block and "| chat | 1 | n-gram, k every step |" in block and "draft model" not in block


@pytest.mark.workload("chapters")
def test_chapters_quick(tiny_gqa, tmp_path):
    """The first chapter, the first that steps, the latest (every checkpoint runs in its own tests)."""
    chosen = sorted({1, 7, chapters.latest().number})
    result = run_quick("chapters", tiny_gqa, tmp_path, "--only", ",".join(map(str, chosen)))
    rows = result["chapters"]
    assert [r["chapter"] for r in rows] == chosen
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


# long-prompts and prefix run with run_quick in their chapters' tests (tests/ch08_*, tests/ch09_*)
CHAPTER_WORKLOADS = {  # workload -> options beyond --quick; each measures its own chapter's checkpoint by default
    "decode-scaling": [],
    "batch-throughput": [],
    "paged-vs-padded": [],
    "arrivals": [],
    "cpu-ablation": [],
    "tensor-parallel": [],
}


@pytest.mark.parametrize(
    "workload", [pytest.param(name, marks=pytest.mark.workload(name)) for name in CHAPTER_WORKLOADS]
)
def test_chapter_workload_quick(workload, tiny_gqa, tmp_path):
    from benchmarks import WORKLOADS

    compiled = workload == "cpu-ablation"  # its steps are what compiling adds
    result = run_quick(workload, tiny_gqa, tmp_path, *CHAPTER_WORKLOADS[workload], compiled=compiled)
    own = chapters.checkpoint(WORKLOADS[workload][1])
    if "checkpoint" in result:
        assert result["checkpoint"] == own.module
    if workload == "arrivals":
        assert result["requests_with_identical_tokens"] == "6/6"
    if workload == "cpu-ablation":
        assert result["correct"] and [row["speedup"] > 0 for row in result["steps"]] == [True] * 4
        before = chapters.checkpoint(own.number - 1)
        assert [row["checkpoint"] for row in result["steps"]] == [before.module] + [own.module] * 3
        assert result["steps"][0]["label"] == f"ch{before.number:02d}" and result["steps"][-1]["label"].endswith(
            f"(ch{own.number:02d})"
        )
        profiled = [row["profile"] for row in result["steps"] if row.get("profile")]
        assert len(profiled) == 2 and all(p["sampled_steps"] >= 1 for p in profiled)
    if workload == "tensor-parallel":
        assert [e["ranks"] for e in result["engines"]] == [1, 2] and all(e["same_tokens"] for e in result["engines"])
        assert result["engines"][1]["all_reduce"]["calls"] > 0 == result["engines"][0]["all_reduce"]["calls"]
        assert [row["median_us"] > 0 for row in result["all_reduce"][0]["rows"]] == [True, True]
        assert {row["ranks"] for row in result["modelled"]["rows"] if row["model"].startswith("SmolLM2")} == {1, 3}
    if workload == "paged-vs-padded":
        kv = result["kv_use"]
        assert 0 < kv["ch05"]["pool_blocks_in_use"]["mean_share_over_steps"] <= 1
        assert kv["ch03"]["padded_merged_cache"]["mean_share_over_steps"] <= 1
        assert result["budget"]["measured_peak_running"] >= 1


# --- which checkpoint each workload measures ------------------------------------------------------------------

NAMED = {  # the workloads that name their checkpoints; every other one measures its own chapter's
    "cpu-ablation": lambda chapter: {chapter - 1, chapter},
    "arrivals": lambda chapter: {5, chapter},
    "paged-vs-padded": lambda chapter: {3, chapter},
    "chapters": lambda chapter: {point.number for point in chapters.checkpoints()},
}
# rosellm against its peers: the engine at its latest chapter unless `--checkpoint` names another
MEASURES_LATEST = {"offline-cpu", "latency-cpu", "offline-gpu"}


class Measured(Exception):
    """Raised where a workload would start measuring: what it chose has been noted by then."""


class NotLoaded:
    """What a stubbed `Checkpoint.load` returns: the workload's first use of the package stops it."""

    def __getattr__(self, name):
        raise Measured(name)


@pytest.fixture
def a_later_chapter(monkeypatch):
    """A chapter 13 after the latest, that nothing may load: each workload must still measure its own chapter."""
    from benchmarks import WORKLOADS, harness

    real = chapters.checkpoints()
    later = chapters.Checkpoint(
        real[-1].number + 1, "later", f"ch{real[-1].number + 1:02d}_later", "later_chapter", ROOT, frozenset()
    )
    monkeypatch.setattr(chapters, "checkpoints", lambda: [*real, later])
    chosen = []

    def load(point):
        chosen.append(point.module)
        return NotLoaded()

    def run_engine(task, spec, label):
        if task in (
            "rosellm",
            "checkpoint",
            "perplexity",
            "speculative",
        ):  # without a module, the rosellm task runs `rosellm`
            chosen.append(spec["checkpoint"] if task == "checkpoint" else spec.get("module", "rosellm"))
        return {"error": "not run"}  # what a failed engine process gives

    def run_process(argv, spec, label, env=None):
        if "module" in spec:
            chosen.append(spec["module"])
        return {"rows": []}

    def start_server(server):
        if server.name == "rosellm":
            chosen.append(server.argv[server.argv.index("-m") + 1])
        raise Measured(server.name)

    rates = {"gemm": {"flops_best": 1e10}, "bandwidth": {"bytes_per_s_best": 1e10}}
    monkeypatch.setattr(chapters.Checkpoint, "load", load)
    monkeypatch.setattr(harness, "run_engine", run_engine)
    monkeypatch.setattr(harness, "run_process", run_process)
    monkeypatch.setattr(harness, "describe_machine", lambda *args: {})
    monkeypatch.setattr(harness, "measure_rates", lambda *args, **kwargs: rates)
    monkeypatch.setattr(harness, "write", lambda *args: (_ for _ in ()).throw(Measured("write")))
    if "serve" in WORKLOADS:  # chapter 10's workload: absent at the tags of earlier chapters
        monkeypatch.setattr(importlib.import_module("benchmarks.serve").Server, "__enter__", start_server)
    return later, chosen


def test_every_workload_measures_its_own_chapter_whatever_the_latest(a_later_chapter, tiny_gqa, tmp_path):
    """With a chapter after the latest, each workload still runs the checkpoints of its chapter (or those it
    names) and never the latest; workloads that take `--checkpoint` default to their own chapter, but for the
    comparisons with the peers, which measure the latest."""
    from benchmarks import WORKLOADS, harness
    from benchmarks.__main__ import workload_parser

    later, chosen = a_later_chapter
    for name, (_, chapter) in WORKLOADS.items():
        parser, module = workload_parser(name)
        if name in MEASURES_LATEST:
            chapter = later.number
        if "checkpoint" in module.FULL:
            assert harness.named_checkpoint(module.FULL["checkpoint"]).number == chapter, name
        if name == "offline-gpu":
            continue  # offline-cpu's engines on a GPU: measured where CUDA exists (its default checked above)
        argv = [
            "--quick",
            "--model",
            str(tiny_gqa),
            "--json",
            str(tmp_path / "r.json"),
            "--figure",
            str(tmp_path / "r.png"),
        ]
        args = parser.parse_args(argv)
        chosen.clear()
        with pytest.raises(Measured):
            module.run(args, harness.settings(args, module.FULL, module.QUICK))
        expected = {chapters.checkpoint(n).module for n in NAMED.get(name, lambda c: {c})(chapter)}
        assert set(chosen) == expected, f"{name} (chapter {chapter}) measured {sorted(set(chosen))}"


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


# --- the peers' plumbing, with fake peers ---------------------------------------------------------------------

# the greedy tokens of the checked sample right; a millisecond a token, like an engine that prefills and decodes
HONEST = """
    import sys, time
    sys.path.insert(0, BENCHMARKS)
    from peer_protocol import Clock, serve

    def load(spec):
        known = {tuple(spec["requests"][int(k)][0]): tokens for k, tokens in spec["reference"].items()}
        return known, {"engine": "fake", "version": "1.0", "settings": {"threads": spec["threads"], **spec["options"]}}

    def generate(known, requests):
        clock = Clock(len(requests))
        for i, (prompt, max_tokens) in enumerate(requests):
            time.sleep(0.001)  # its prefill
            clock.token(i)
            time.sleep(0.001 * (max_tokens - 1))
            clock.token(i, (known.get(tuple(prompt), []) + [7] * max_tokens)[:max_tokens])
        return clock.result()

    serve(load, generate)
"""
# wrong tokens, and timings all the same: the harness must not put them in the table
LIAR = """
    import json, sys
    spec = json.load(open(sys.argv[1]))
    n = len(spec["requests"])
    json.dump({"engine": "liar", "version": "0.1", "settings": {}, "load_s": 0.1,
               "check_tokens": {k: [t + 1 for t in v] for k, v in spec["reference"].items()},
               "wall_s": 0.001, "first_token_s": [0.0] * n, "last_token_s": [0.001] * n,
               "tokens": [[1] * m for _, m in spec["requests"]]}, open(sys.argv[2], "w"))
"""


# vLLM's OpenAI server as the serve workload meets it: its command line (vLLM's own flags, strictly parsed),
# /health, /version and streamed /v1/completions: one chunk a token, then the usage, then [DONE]
FAKE_VLLM_SERVER = """
    import argparse, json, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    parser = argparse.ArgumentParser()
    for flag in ("--model", "--served-model-name", "--host", "--dtype", "--uvicorn-log-level"):
        parser.add_argument(flag, required=True)
    for flag in ("--port", "--seed", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--gpu-memory-utilization", type=float, required=True)
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    args = parser.parse_args()

    class Handler(BaseHTTPRequestHandler):
        def reply(self, body, kind="application/json"):
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body.encode())

        def do_GET(self):
            self.reply("" if self.path == "/health" else json.dumps({"version": "0.0.fake"}))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["model"] == args.served_model_name and body["stream"] and body["ignore_eos"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(body["max_tokens"]):
                time.sleep(0.001)
                self.wfile.write(b'data: {"choices": [{"index": 0, "text": " a"}]}\\n\\n')
                self.wfile.flush()
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\\n\\ndata: [DONE]\\n\\n".encode())

        def log_message(self, *_):
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
"""


def fake_vllm_server(tmp_path: Path, monkeypatch) -> dict:
    """A `vllm` package holding only `entrypoints.openai.api_server` (FAKE_VLLM_SERVER), found by the peer's
    processes: the peers, as serve sees them."""
    from benchmarks import peers

    package = tmp_path / "fake_vllm" / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    (package / "api_server.py").write_text(textwrap.dedent(FAKE_VLLM_SERVER))
    environment = peers.environment
    monkeypatch.setattr(
        peers, "environment", lambda peer, threads: environment(peer, threads) | {"PYTHONPATH": str(package.parents[2])}
    )
    return {"vllm": peers.Peer("vllm", "vLLM (fake)", package / "api_server.py", python=Path(sys.executable))}


@pytest.mark.workload("serve")
def test_serve_quick_against_a_fake_vllm_server(tiny_gqa, tmp_path, monkeypatch):
    """Chapter 10's server and vLLM's (faked) under the same Poisson schedules, each stopped before the next."""
    fakes = fake_vllm_server(tmp_path, monkeypatch)
    result = run_quick("serve", tiny_gqa, tmp_path, "--peers", "vllm", fakes=fakes)
    servers = {server["server"]: server for server in result["servers"]}
    assert set(servers) == {"rosellm", "vllm"} and all("error" not in server for server in servers.values())
    assert servers["rosellm"]["label"] == harness.rosellm_label(chapters.checkpoint(10))
    assert chapters.checkpoint(10).module in servers["rosellm"]["argv"] and servers["vllm"]["version"] == "0.0.fake"
    assert "--max-num-batched-tokens" in servers["vllm"]["argv"]
    for run in result["runs"]:
        assert run["completed"] == run["requests"] == 6 and run["ttft_s"]["p50"] > 0, run
    assert [(r["server"], r["rate"]) for r in result["runs"]] == [
        ("rosellm", 4.0),
        ("rosellm", 16.0),
        ("vllm", 4.0),
        ("vllm", 16.0),
    ]
    assert [r["requests"] for r in result["agreement"]["rosellm vs vllm"]] == [6, 6]


@pytest.mark.workload("serve")
def test_serve_stress_test_sends_every_request_through_a_closed_loop_of_clients(tiny_gqa, tmp_path, monkeypatch):
    """--clients 3: after the rates, each server (chapter 16's split server, vLLM's faked) serves the stress
    requests to three clients that each send their next as soon as their last has ended."""
    fakes = fake_vllm_server(tmp_path, monkeypatch)
    result = run_quick(
        "serve", tiny_gqa, tmp_path, "--rosellm", "split", "--peers", "vllm", "--clients", "3", fakes=fakes
    )
    assert result["settings"]["clients"] == 3 and result["correct"]
    assert [row["server"] for row in result["stress"]] == ["rosellm-split", "vllm"]
    for row in result["stress"]:
        assert row["clients"] == 3 and row["completed"] == row["requests"] == result["settings"]["stress_requests"]
        assert row["request_throughput"] > 0 and "rate" not in row
        sends = sorted(detail["sent_s"] for detail in row["request_details"])
        first_end = min(detail["last_chunk_s"] for detail in row["request_details"])
        assert sends[2] < first_end <= sends[3]  # three at once, the fourth once one of them has ended
    block = load_docs_results().block_serve(tmp_path, "serve.json")
    assert "Stress test: 3 clients" in block and "| vLLM (fake) | 6 of 6 |" in block


@pytest.mark.workload("serve")
def test_serve_refuses_a_negative_number_of_clients():
    from benchmarks import serve

    with pytest.raises(SystemExit, match="--clients -1: a number of clients, 0 for no stress test"):
        serve.run(SimpleNamespace(clients=-1, peers="", rosellm="split"), dict(serve.FULL))


def fake_peer(tmp_path: Path, name: str, source: str):
    from benchmarks import peers

    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(source).replace("BENCHMARKS", repr(str(ROOT / "benchmarks"))))
    return peers.Peer(name, f"{name} peer", script, python=Path(sys.executable))


@pytest.mark.workload("offline-cpu")  # the peers are rows of its table
def test_peers_are_checked_before_they_are_timed_and_rendered_with_their_ratio(tiny_gqa, tmp_path):
    from benchmarks import harness, offline_cpu, peers

    requests = harness.random_requests(3, [4, 8], [3, 5], 100, 0)
    reference = {"0": [5, 6, 7], "1": [8, 9, 10]}
    spec = {"threads": 1, "requests": requests, "warmup": requests[:1], "reference": reference, "options": {}}
    honest = peers.run_peer(fake_peer(tmp_path, "honest", HONEST), spec, str(tiny_gqa))
    liar = peers.run_peer(fake_peer(tmp_path, "liar", LIAR), spec, str(tiny_gqa))
    assert honest["check"]["passed"] and honest["version"] == "1.0" and honest["settings"] == {"threads": 1}
    assert not liar["check"]["passed"] and "tokens" not in liar and "not timed" in liar["error"]

    ours = {
        "tokens": [(reference.get(str(i), []) + [7] * m)[:m] for i, (_, m) in enumerate(requests)],
        "wall_s": 1.0,
        "first_token_s": [0.1] * 3,
        "last_token_s": [1.0] * 3,
        "memory": {"peak_rss_run_mib": 1.0},
    }
    config = SimpleNamespace(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=100,
        tie_word_embeddings=True,
    )
    params = harness.parameter_counts(config)
    rates = {"gemm": {"flops_best": 1e10}, "bandwidth": {"bytes_per_s_best": 1e10}}
    work = offline_cpu.workload_work(requests, config, params)
    rows = offline_cpu.summarize(
        {"rosellm": ours, "honest": honest, "liar": liar}, requests, work, harness.rooflines([rates], params), reference
    )
    by = {row["engine"]: row for row in rows}
    assert by["honest"]["check_passed"] is True and by["honest"]["output_tokens_per_s"] > 0
    assert by["rosellm"]["rosellm_ratio"] == 1
    assert by["honest"]["rosellm_ratio"] == round(
        by["rosellm"]["output_tokens_per_s"] / by["honest"]["output_tokens_per_s"], 2
    )
    assert by["liar"]["check_passed"] is False and "output_tokens_per_s" not in by["liar"]

    page = load_page_generator()
    table = page.table(page.ENGINE_HEADINGS, page.engine_rows({"engines": rows}))
    liar_line = next(line for line in table.splitlines() if line.startswith("| liar peer"))
    assert "not timed" in liar_line and "**FAILED**" in liar_line
    assert "| honest peer |" in table and f"**{by['honest']['rosellm_ratio']:.2f}x**" in table
    assert "honest peer" in page.peer_lines({"engines": rows}) and page.peer_lines({"engines": [by["rosellm"]]}) == ""


def load_page_generator():
    spec = importlib.util.spec_from_file_location("benchmarks_page", ROOT / "scripts" / "benchmarks_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_quantized_gguf_is_rewritten_in_float32_with_its_names_and_metadata(tmp_path):
    import gguf
    import numpy as np

    from benchmarks import peers

    source = tmp_path / "tiny.gguf"
    weight = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_uint32("llama.block_count", 1)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_token_list(["a", "b"])
    writer.add_tensor(
        "blk.0.w",
        gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.add_tensor("norm", np.ones(64, dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()

    out = tmp_path / "tiny.F32.gguf"
    peers.write_f32_gguf(source, out)
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(out)
    assert after.fields["llama.block_count"].contents() == 1 and after.fields["general.file_type"].contents() == 0
    assert after.fields["tokenizer.ggml.tokens"].contents() == ["a", "b"]
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in after.tensors)
    np.testing.assert_allclose(
        after.tensors[0].data, gguf.quants.dequantize(before.tensors[0].data, before.tensors[0].tensor_type)
    )
    np.testing.assert_allclose(after.tensors[0].data, weight, atol=0.05)


@pytest.mark.workload("arrivals", "long-prompts")
def test_a_group_run_marks_each_file_with_its_run_and_writes_a_manifest(tiny_gqa, tmp_path):
    argv = ["results", "--group", "foundations", "--only", "arrivals.json", "long_prompts.json", "--quick"]
    done = bench(*argv, "--without-peers", "--model", str(tiny_gqa), "--results", str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    manifest = json.loads((tmp_path / "runs" / "foundations.json").read_text())
    run = manifest["run"]
    assert run["group"] == "foundations" and run["id"].startswith("foundations-")
    from benchmarks import book_results

    jobs = [(job["file"], job["status"]) for job in manifest["jobs"]]
    assert jobs == [("arrivals.json", 0), ("long_prompts.json", 0)]
    assert manifest["commit"] and manifest["lscpu"] == book_results.lscpu()
    assert manifest["rates_before"]["bandwidth"]["bytes_per_s_best"] > 0 and "rates_after" in manifest
    for name in ("arrivals.json", "long_prompts.json"):
        assert json.loads((tmp_path / name).read_text())["run"] == run
    assert not list(tmp_path.glob("*.png"))  # a quick run's figures are not the book's


def test_every_job_of_the_results_command_is_a_command_its_workload_takes():
    from benchmarks import book_results
    from benchmarks.__main__ import workload_parser

    for jobs in book_results.groups().values():
        for job in jobs:
            parser, _ = workload_parser(job.workload)
            parser.parse_args(job.argv(Path("results"), Path("scratch"), False, False, None)[1:])


def test_a_job_at_a_lower_cpu_level_names_a_level_and_shows_it_in_its_command():
    from benchmarks import book_results

    job = book_results.Job("latency.json", "latency-cpu --variants fp32", cpu_level="avx2")
    assert job.shell_command == "ROSELLM_CPU_FEATURES=avx2 python -m benchmarks latency-cpu --variants fp32"
    masked = [job for jobs in book_results.groups().values() for job in jobs if job.cpu_level]
    if masked:  # chapter 18's latency at AVX2, in the trees that have it
        cpu_features = chapters.submodule("rosellm", "cpu_features")
        assert all(job.cpu_level in cpu_features.LEVELS for job in masked)


def test_a_group_of_one_kind_of_cpu_is_refused_on_another_and_skipped_from_a_full_run(monkeypatch, capsys):
    """avx2-cpu's files say they come from a CPU with AVX2 and no AVX-512: named on a CPU with AVX-512 its run
    stops before measuring anything; a run of every group passes over it and says so."""
    from benchmarks import book_results

    cpu = book_results.GROUP_CPUS["avx2-cpu"]
    assert cpu.fits({"sse4_2", "avx2", "fma"}) and not cpu.fits({"avx2", "avx512f"}) and not cpu.fits({"sse4_2"})
    avx512 = {"model_name": "a CPU with AVX-512", "flags": "sse4_2 avx2 avx512f avx512bw"}
    monkeypatch.setattr(book_results, "lscpu", lambda: avx512)
    ran = []
    monkeypatch.setattr(book_results, "run_group", lambda name, jobs, args: ran.append(name))
    monkeypatch.setattr(book_results, "install_peers", lambda jobs: None)
    with pytest.raises(SystemExit, match="avx2-cpu group measures a CPU with AVX2 and no AVX-512; this one is a CPU"):
        book_results.main(["--group", "avx2-cpu"])
    assert ran == []
    book_results.main([])
    held = [name for name, jobs in book_results.groups().items() if jobs]  # at a chapter's tag, fewer workloads
    assert ran == [name for name in held if name != "avx2-cpu"]
    assert "skipped: the avx2-cpu group" in capsys.readouterr().out
    monkeypatch.setattr(book_results, "lscpu", lambda: {"model_name": "AMD EPYC", "flags": "sse4_2 avx2 fma"})
    book_results.main(["--group", "avx2-cpu"])
    assert ran[-1] == ("avx2-cpu" if "avx2-cpu" in held else held[-1])


def test_a_result_measured_at_a_lower_cpu_level_says_so_in_its_command(monkeypatch):
    argv = ["benchmarks", "latency-cpu", "--quick", "--json", "out.json", "--figure", "out.png"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.delenv("ROSELLM_CPU_FEATURES", raising=False)
    assert harness.command_line() == "python -m benchmarks latency-cpu --quick"
    monkeypatch.setenv("ROSELLM_CPU_FEATURES", "avx2")
    assert harness.command_line() == "ROSELLM_CPU_FEATURES=avx2 python -m benchmarks latency-cpu --quick"
