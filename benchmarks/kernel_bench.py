"""kernel-bench: paged decode attention on a GPU, chapter 06's Triton kernel against two baselines.

For each batch size and context length, on the same random data (Llama-3-8B's attention shape by
default: 32 query heads, 8 KV heads, head_dim 128, bf16, KV blocks of 16 tokens in shuffled order):

  triton          `kernels.paged_decode_attention`, the number of splits it picks itself
  triton-1split   the same kernel forced to one split (no split-K): what split-K buys
  torch-ref       `paged_attention.paged_attention`, chapter 05's PyTorch reference (gathers the
                  blocks into a padded copy, repeats KV heads, masked SDPA)
  sdpa-dense      `F.scaled_dot_product_attention` on keys and values already laid out contiguously
                  (no paging at all: the cost a contiguous cache would pay, a floor to compare with)

The kernels are chapter 06's checkpoint's (`--checkpoint` names another). Times are medians of
`triton.testing.do_bench` (milliseconds). The bandwidth column is the keys and values the Triton kernel must
read, divided by its time. Needs a CUDA device:

    python -m benchmarks.kernel_bench                      # the full table, about a minute
    python -m benchmarks.kernel_bench --batches 1,64 --contexts 1024,8192
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import chapters

from .harness import describe_machine

HELP = "paged decode attention: Triton kernel vs PyTorch reference vs dense SDPA (needs CUDA)"
CHAPTER = 6
ROOT = Path(__file__).resolve().parent.parent
METHODS = ("triton", "triton-1split", "torch-ref", "sdpa-dense")


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def add_arguments(parser) -> None:
    default = chapters.checkpoint(CHAPTER).module
    parser.add_argument("--checkpoint", default=default, help=f"the package whose kernels to time (default {default})")
    parser.add_argument("--batches", type=int_list, default=[1, 4, 16, 64, 256])
    parser.add_argument("--contexts", type=int_list, default=[128, 512, 2048, 8192])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "kernel_bench.json")


def make_data(batch: int, context: int, args, device):
    """A paged pool holding `batch` sequences of `context` tokens in shuffled blocks, their metadata,
    one query token per sequence, and the same keys and values laid out densely."""
    import torch

    AttentionMetadata = chapters.submodule(args.checkpoint, "attention_metadata").AttentionMetadata
    dtype = getattr(torch, args.dtype)
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    key_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    value_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen, device=device)
    tables = order.view(batch, blocks_per_seq).to(torch.int32)
    metadata = AttentionMetadata.build([1] * batch, [context] * batch, tables.cpu(), args.block_size, device)
    query = torch.randn(batch, args.num_heads, args.head_dim, generator=gen, device=device, dtype=dtype)
    return query, key_cache, value_cache, metadata


def dense_kv(cache, metadata, context: int):
    """[batch, kv_heads, context, head_dim]: a sequence's keys (or values) contiguous, as SDPA wants them."""
    tables = metadata.block_tables.long()
    return cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()


def measure_one(batch: int, context: int, args, device, timer) -> dict:
    import torch
    import torch.nn.functional as F

    kernels = chapters.submodule(args.checkpoint, "kernels")
    paged_attention = chapters.submodule(args.checkpoint, "paged_attention")
    query, key_cache, value_cache, metadata = make_data(batch, context, args, device)
    seq_lens, tables = metadata.seq_lens, metadata.block_tables
    splits = kernels.choose_num_splits(context)
    row = {"batch": batch, "context": context, "num_splits": splits}
    runs = {
        "triton": lambda: kernels.paged_decode_attention(query, key_cache, value_cache, seq_lens, tables, context),
        "triton-1split": lambda: kernels.paged_decode_attention(
            query, key_cache, value_cache, seq_lens, tables, context, num_splits=1
        ),
        "torch-ref": lambda: paged_attention.paged_attention(query, key_cache, value_cache, metadata),
    }
    try:
        keys, values = dense_kv(key_cache, metadata, context), dense_kv(value_cache, metadata, context)
        q4 = query[:, :, None]  # [batch, heads, 1, head_dim]
        runs["sdpa-dense"] = lambda: F.scaled_dot_product_attention(q4, keys, values, enable_gqa=True)[:, :, 0]
    except torch.OutOfMemoryError:
        row["sdpa-dense"] = None
    outputs = {}
    for name, fn in runs.items():
        try:
            outputs[name] = fn()
            row[name] = timer(fn)
        except torch.OutOfMemoryError:  # the reference's padded, head-repeated copies are large
            row[name] = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "torch-ref" in outputs:
        row["max_abs_diff_vs_ref"] = float((outputs["triton"].float() - outputs["torch-ref"].float()).abs().max())
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * key_cache.element_size()
    row["triton_gb_per_s"] = kv_bytes / (row["triton"] * 1e-3) / 1e9
    return row


def cell(value, spec: str) -> str:
    return "OOM" if value is None else format(value, spec)


def print_header() -> None:
    print(
        f"{'batch':>6} {'context':>8} {'splits':>6} "
        + " ".join(f"{m:>14}" for m in METHODS)
        + f" {'triton GB/s':>12} {'max |diff|':>11}"
    )


def print_row(row: dict) -> None:
    line = f"{row['batch']:>6} {row['context']:>8} {row['num_splits']:>6} "
    line += " ".join(f"{cell(row.get(m), '.3f'):>14}" for m in METHODS)
    diff = row.get("max_abs_diff_vs_ref")
    print(line + f" {row['triton_gb_per_s']:>12.0f} {'-' if diff is None else format(diff, '.1e'):>11}", flush=True)


def run(args) -> dict:
    import torch

    if not torch.cuda.is_available():
        sys.exit(
            "kernel_bench measures GPU kernels and needs a CUDA device; none was found. "
            "(On a CPU, Triton's interpreter runs the kernels correctly but its timings mean nothing.)"
        )
    import triton

    device = torch.device("cuda")

    def timer(fn) -> float:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    print(
        f"ms per decode attention call, {args.num_heads} query / {args.num_kv_heads} KV heads, head_dim "
        f"{args.head_dim}, {args.dtype}, block size {args.block_size}, on {torch.cuda.get_device_name()}"
    )
    print_header()
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            rows.append(measure_one(batch, context, args, device, timer))
            print_row(rows[-1])
    result = {
        "benchmark": "kernel-bench",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": describe_machine("cuda"),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "run"},
        "unit": "milliseconds (median of triton.testing.do_bench)",
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernel_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
