"""Chapter 06's kernels compiled for real GPUs (sm_80 and sm_90) on a machine without one.

The interpreter tests prove the kernels compute the right thing; these prove a GPU could run them: every
configuration the launchers can choose compiles to PTX and a cubin, fits the architecture's shared memory,
and is compiled with the warps and stages its launcher asked for. `benchmarks.kernel_compile` does the
compiling, in a process of its own: this folder's conftest sets TRITON_INTERPRET=1, under which `triton.jit`
makes interpreted functions that cannot be compiled, while the script imports the kernels without it.
Each checkpoint is compiled once per test session (Triton's own cache, outside the repository, makes a
second session fast).
"""

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from chapters import submodule

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "benchmarks" / "results" / "kernel_compile.json"
KERNELS = {"store_kv_kernel", "decode_split_kernel", "decode_merge_kernel", "prefill_kernel"}
# Maximum shared memory per thread block (opted into with cudaFuncSetAttribute): 163 KiB on compute
# capability 8.0 (A100), 227 KiB on 9.0 (H100). Source: CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability", row "Maximum amount of shared memory per thread block".
SHARED_MEMORY_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}
# The facts that depend only on the kernels and the pinned Triton (PTX and cubin sizes also hold the path
# of the kernel's source file, for line information, so they differ by a few bytes between checkouts).
DETERMINISTIC = (
    "kernel",
    "arch",
    "dtype",
    "head_dim",
    "constexprs",
    "intended",
    "num_warps",
    "num_stages",
    "shared_bytes",
    "registers",
    "stack_bytes",
)


@functools.cache
def compile_facts(checkpoint_name: str) -> list[dict]:
    """The rows `python -m benchmarks.kernel_compile` writes for this checkpoint, run without TRITON_INTERPRET."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel_compile.json"
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.kernel_compile", "--checkpoint", checkpoint_name, "--json", str(path)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-4000:]  # a kernel the GPU compiler rejects fails here
        return json.loads(path.read_text())["rows"]


def test_every_kernel_compiles_to_ptx_and_cubin_for_both_architectures(checkpoint):
    rows = compile_facts(checkpoint.__name__)
    assert {(row["kernel"], row["arch"]) for row in rows} == {(k, a) for k in KERNELS for a in SHARED_MEMORY_LIMIT}
    for row in rows:
        assert row["ptx_bytes"] > 0 and row["cubin_bytes"] > 0, row


def test_launchers_reach_every_branch(checkpoint):
    """The enumerated shapes make each launcher choose each of its tile sizes at least once."""
    chosen = {}
    for row in compile_facts(checkpoint.__name__):
        for name, value in row["constexprs"].items():
            chosen.setdefault((row["kernel"], name), set()).add(value)
    max_splits = submodule(checkpoint, "kernels.decode_attention").MAX_SPLITS
    assert chosen[("decode_merge_kernel", "BLOCK_S")] == {2**i for i in range(max_splits.bit_length())}
    assert chosen[("decode_split_kernel", "BLOCK_G")] == {16, 128}  # a GQA group padded to 16, or wider
    assert chosen[("prefill_kernel", "BLOCK_M")] == {64, 128}  # BLOCK_M, or a GQA group wider than it
    for kernel in KERNELS:
        assert chosen[(kernel, "BLOCK_D")] == {64, 128}
    assert chosen[("prefill_kernel", "DOT_PRECISION")] == {"tf32", "ieee"}  # 16-bit inputs, or float32
    assert {row["dtype"] for row in compile_facts(checkpoint.__name__)} == {"bfloat16", "float16", "float32"}


def test_shared_memory_fits_the_architecture(checkpoint):
    for row in compile_facts(checkpoint.__name__):
        assert 0 <= row["shared_bytes"] <= SHARED_MEMORY_LIMIT[row["arch"]], row


def test_warps_and_stages_are_what_the_launcher_chose(checkpoint):
    for row in compile_facts(checkpoint.__name__):
        assert (row["num_warps"], row["num_stages"]) == (row["intended"]["num_warps"], row["intended"]["num_stages"])


def test_committed_compile_facts_are_current():
    """benchmarks/results/kernel_compile.json (the table of the chapter page) is what the compiler says now."""

    def facts(rows):
        return [{name: row[name] for name in DETERMINISTIC} for row in rows]

    committed = json.loads(COMMITTED.read_text())
    assert committed["checkpoint"] == "rosellm"
    assert facts(committed["rows"]) == facts(compile_facts("rosellm")), (
        "the kernels changed: regenerate with python -m benchmarks.kernel_compile"
    )
