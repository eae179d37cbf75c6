"""kernel-compile: chapter 06's Triton kernels compiled for real GPUs, on a machine that has none.

Triton's interpreter runs the kernels on a CPU, but it accepts code that a real compile rejects and says
nothing of the shared memory, registers or pipelining a GPU would give them. Triton can compile for a GPU it
cannot see. This script calls each launcher (`store_kv`, `paged_decode_attention`, `paged_prefill_attention`)
on small CPU tensors of representative shapes with the kernels replaced by recorders, compiles every distinct
launch it recorded for sm_80 (A100) and sm_90 (H100) to PTX and to a cubin (ptxas ships with Triton), and
writes what the compiler reports. Compile facts are deterministic, so any machine can produce them:

    python -m benchmarks.kernel_compile              # writes benchmarks/results/kernel_compile.json
    python -m benchmarks.kernel_compile --checkpoint chapters.ch06_triton_kernels.rosellm --json ch06.json

Registers and spills come from `cuobjdump --dump-resource-usage` on the cubin (Triton's own `n_regs` needs
the cubin loaded on a GPU). The kernels must be real `triton.jit` functions, not interpreted ones, so
TRITON_INTERPRET must be unset when they are imported: `main` unsets it before importing them.
"""

import argparse
import contextlib
import importlib
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from unittest import mock

from chapters import submodule

ROOT = Path(__file__).resolve().parent.parent
ARCHS = (80, 90)  # compute capabilities: sm_80 (A100), sm_90 (H100)
DTYPES = ("bfloat16", "float16", "float32")  # 16-bit: what a GPU serves in; float32: the IEEE dot precision
SHAPES = (  # (query heads, KV heads, head_dim); GQA groups 3, 4 and 128 reach every branch of the launchers
    (9, 3, 64),  # SmolLM2-135M
    (32, 8, 128),  # Llama-3-8B
    (128, 1, 64),  # a GQA group wider than a prefill tile
)
CONTEXTS = (1, 300, 1000, 2000, 4096)  # a decode step's longest sequence: 1, 2, 4, 8 and 16 splits
KERNEL_MODULES = ("store_kv", "decode_attention", "prefill_attention")
BLOCK_SIZE = 16  # tokens per KV block: a runtime argument of the kernels, it changes no compiled code


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running it."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


@contextlib.contextmanager
def recording(checkpoint, launches: list):
    """Replace every kernel of the checkpoint's kernel modules by a Recorder appending to `launches`."""
    from triton.runtime.jit import KernelInterface

    with contextlib.ExitStack() as stack:
        for name in KERNEL_MODULES:
            module = submodule(checkpoint, f"kernels.{name}")
            for attr, value in vars(module).copy().items():
                if isinstance(value, KernelInterface):
                    stack.enter_context(mock.patch.object(module, attr, Recorder(value, launches)))
        yield


def recorded_launches(
    checkpoint, dtype_name: str, num_heads: int, num_kv_heads: int, head_dim: int, context: int
) -> list:
    """(kernel, args, kwargs) of each launch the three launchers make on CPU tensors: storing and attending
    a prefill of two short prompts, and a decode step whose longest sequence has `context` tokens."""
    import torch

    dtype = getattr(torch, dtype_name)
    kernels = submodule(checkpoint, "kernels")
    build = submodule(checkpoint, "attention_metadata").AttentionMetadata.build
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)  # two sequences of two blocks each
    prefill = build([5, 20], [5, 20], tables, BLOCK_SIZE, torch.device("cpu"))
    decode = build([1, 1], [6, 21], tables, BLOCK_SIZE, torch.device("cpu"))
    key_cache = torch.zeros(4, BLOCK_SIZE, num_kv_heads, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    query = torch.zeros(25, num_heads, head_dim, dtype=dtype)
    new_kv = torch.zeros(25, num_kv_heads, head_dim, dtype=dtype)
    launches = []
    with recording(checkpoint, launches):
        kernels.store_kv(new_kv, new_kv, key_cache, value_cache, prefill.slot_mapping)
        kernels.paged_prefill_attention(
            query,
            key_cache,
            value_cache,
            prefill.query_start_loc,
            prefill.seq_lens,
            prefill.block_tables,
            prefill.max_query_len,
        )
        kernels.paged_decode_attention(query[:2], key_cache, value_cache, decode.seq_lens, decode.block_tables, context)
    return launches


def compile_source(kernel, args: tuple, kwargs: dict):
    """(ASTSource, options) of one recorded launch: each argument typed and specialized by the function
    Triton's own launcher uses (16-aligned pointers and multiples of 16 marked divisible, the integer 1
    made a constant); keyword arguments that are kernel parameters are constexprs, the others options."""
    from triton.backends.compiler import BaseBackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, native_specialize_impl

    if not isinstance(kernel, JITFunction):
        raise TypeError(
            f"{kernel.__name__} is not compiled but interpreted: it was imported while TRITON_INTERPRET was set"
        )
    signature, constexprs, attrs = {}, {}, {}
    for index, (name, value) in enumerate(zip(kernel.arg_names, args)):
        kind, specialization = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = specialization
        elif specialization:
            attrs[(index,)] = BaseBackend.parse_attr(specialization)
    options = {}
    for name, value in kwargs.items():
        if name in kernel.arg_names:
            signature[name], constexprs[name] = "constexpr", value
        else:
            options[name] = value
    return ASTSource(kernel, signature, constexprs, attrs), options


def resource_usage(cubin: bytes) -> dict:
    """Registers per thread and stack bytes (spills) of the cubin's kernel, as cuobjdump reads them."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", file.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage = dict(re.findall(r"(REG|STACK):(\d+)", report))
    return {"registers": int(usage["REG"]), "stack_bytes": int(usage["STACK"])}


def compile_facts(checkpoint_name: str = "rosellm") -> list[dict]:
    """One row per configuration a launcher chose (kernel, dtype, constexprs, warps, stages) and architecture:
    what the compiler reports for it. A configuration is compiled with the arguments of the first shape that
    chose it (other shapes differ only in how Triton specializes integers: divisible by 16, or equal to 1)."""
    import triton
    from triton.backends.compiler import GPUTarget

    checkpoint = importlib.import_module(checkpoint_name)
    chosen = {}  # configuration -> (dtype, head_dim, kernel, args, kwargs)
    for dtype in DTYPES:
        for num_heads, num_kv_heads, head_dim in SHAPES:
            for context in CONTEXTS:
                for kernel, args, kwargs in recorded_launches(
                    checkpoint, dtype, num_heads, num_kv_heads, head_dim, context
                ):
                    configuration = (kernel.__name__, dtype, tuple(sorted(kwargs.items())))
                    chosen.setdefault(configuration, (dtype, head_dim, kernel, args, kwargs))
    rows = []
    for dtype, head_dim, kernel, args, kwargs in chosen.values():
        source, options = compile_source(kernel, args, kwargs)
        if not {"num_warps", "num_stages"} <= options.keys():
            raise ValueError(f"the launcher of {kernel.__name__} must choose its num_warps and num_stages")
        for arch in ARCHS:
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
            rows.append(
                {
                    "kernel": kernel.__name__,
                    "arch": f"sm_{arch}",
                    "dtype": dtype,
                    "head_dim": head_dim,
                    "constexprs": {name: value for name, value in kwargs.items() if name in kernel.arg_names},
                    "intended": {name: options[name] for name in ("num_warps", "num_stages")},
                    "num_warps": compiled.metadata.num_warps,
                    "num_stages": compiled.metadata.num_stages,
                    "shared_bytes": compiled.metadata.shared,
                    **resource_usage(compiled.asm["cubin"]),
                    "ptx_bytes": len(compiled.asm["ptx"]),
                    "cubin_bytes": len(compiled.asm["cubin"]),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--checkpoint", default="rosellm", help="the package whose kernels to compile")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "kernel_compile.json")
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # read by triton.jit when the kernel modules are imported
    import triton

    rows = compile_facts(args.checkpoint)
    result = {"benchmark": "kernel-compile", "checkpoint": args.checkpoint, "triton": triton.__version__, "rows": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(rows)} compiled kernels, written to {args.json}")


if __name__ == "__main__":
    main()
