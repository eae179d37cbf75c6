"""torch.compile happens a bounded number of times, never once per batch shape; `enforce_eager` turns it off;
without a C compiler, `enforce_eager` runs every CPU backend."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

pytestmark = [pytest.mark.requires("compiled"), pytest.mark.cpu_features]


def compiled_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def serve_batches(llm, checkpoint, sizes, prompt_len, seed):
    """Batches of `sizes` requests with prompts of ragged lengths around prompt_len: new token counts per step,
    batch sizes and table widths all change from step to step."""
    for size in sizes:
        prompts = [[(seed + 7 * i + j) % 300 + 3 for j in range(prompt_len + 5 * i)] for i in range(size)]
        params = [checkpoint.SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True) for i in range(size)]
        llm.generate(prompts, params, use_tqdm=False)


def test_the_engine_compiles_at_start_and_never_again(checkpoint, tiny_model_dirs):
    torch._dynamo.reset()  # count this engine's compilations from zero
    start = compiled_graphs()
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), block_size=4, max_num_batched_tokens=64)
    at_start = compiled_graphs() - start
    # Chapter 11: the two halves of a decoder layer for one token and for any number (sizes 0 and 1 are
    # specialized, the others symbolic); the decode kernel for batch and table width each 1 or more. From
    # chapter 13: the whole step, for one token and for any number; the decode kernel is C, not a graph. From
    # chapter 18: the one-token step twice, for the rows it attends inside itself and for more.
    assert 2 <= at_start <= 8, at_start
    serve_batches(llm, checkpoint, [1, 2, 5], prompt_len=3, seed=0)
    serve_batches(llm, checkpoint, [3, 7, 4, 6, 1], prompt_len=9, seed=50)
    assert compiled_graphs() - start == at_start  # batch sizes, token counts, table widths: no new graph


def test_enforce_eager_compiles_nothing(checkpoint, tiny_model_dirs, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.compile called under enforce_eager")

    monkeypatch.setattr(torch, "compile", refuse)
    monkeypatch.setattr(torch.nn.Module, "compile", refuse)
    llm = checkpoint.LLM(str(tiny_model_dirs["gqa"]), enforce_eager=True)
    runner = llm.llm_engine.model_runner
    assert runner.attention_backend.name == "torch"
    start = compiled_graphs()
    llm.generate([[5, 6, 7], [8, 9]], checkpoint.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert compiled_graphs() == start


def test_enforce_eager_is_checked(checkpoint, tiny_model_dirs):
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        checkpoint.LLM(str(tiny_model_dirs["gqa"]), enforce_eager="yes")


# Run in a process of its own, with no compiler to be found and torch.compile refused: each CPU backend
# generates under enforce_eager; the tokens of each, as JSON.
WITHOUT_A_COMPILER = """
import json, sys, torch
import {package} as rosellm

def refuse(*args, **kwargs):
    raise AssertionError("torch.compile called without a C compiler")

torch.compile = torch.nn.Module.compile = refuse
params = rosellm.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
prompts = [[5, 6, 7], [8, 9], list(range(3, 40))]
tokens = {{}}
for backend in ("reference", "torch", "cpu"):
    llm = rosellm.LLM(sys.argv[1], enforce_eager=True, attention_backend=backend, block_size=4)
    tokens[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
print(json.dumps(tokens))
"""


def test_enforce_eager_runs_every_cpu_backend_without_a_c_compiler(checkpoint, tiny_model_dirs, tmp_path):
    """CC and CXX name a compiler that does not exist (torch.compile's and any kernel's cache empty): with
    enforce_eager, "reference", "torch" and "cpu" all generate, the same tokens, compiling nothing."""
    nowhere = str(tmp_path / "no-such-compiler")
    env = os.environ | {
        "CC": nowhere,
        "CXX": nowhere,
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "ROSELLM_CACHE": str(tmp_path / "cache"),
    }
    code = WITHOUT_A_COMPILER.format(package=checkpoint.__name__)
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_model_dirs["gqa"])],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = json.loads(done.stdout.splitlines()[-1])
    assert tokens["cpu"] == tokens["torch"] == tokens["reference"] and len(tokens["cpu"][2]) == 6
