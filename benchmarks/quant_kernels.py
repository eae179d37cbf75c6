"""quant-kernels: the CPU matrix kernels chapter 13 chooses between, at the row counts a step feeds them.

For each of SmolLM2's matrix shapes, as the engine runs them (fused QKV, O, fused gate-up, down, the LM head),
`copies` distinct copies of the weights (30, one per layer: each call reads its weights from memory, not from
the cache; the LM head, larger than any cache, once), x [rows, in_features] at each of `rows`:

  fp32 dense     fp32 weights packed once for oneDNN, chapter 11's `packed_linear` (the checkpoint's own)
  bf16 dense     `F.linear` on bf16 weights
  int8pack       `torch.ops.aten._weight_int8pack_mm`: int8 codes, a scale per output channel
  int4pack       `torch.ops.aten._weight_int4pack_mm_for_cpu`: int4 codes in groups of 32, a scale and a
                 minimum per group
each with fp32 activations and with bf16 ones (the dense kernels in their own dtype only). Times are the median
of `repeats` passes over the copies (milliseconds), after one unmeasured pass.

Beside them, the decode attention of the "cpu" backend, both ways it can run: the tensor algebra compiled by
Inductor (`compiled_decode_attention`) and the C kernel (`kernel_decode_attention`), in fp32 and bf16, for
batches of `attention_batches` sequences whose lengths are drawn uniformly from `attention_context` (seed 0),
SmolLM2's heads, blocks of 16 in shuffled order, a pool per layer: ms for all the layers of one step, and the
keys and values read per second. A step's time at a row count is
the sum over a decoder layer's shapes times the layers, plus the LM head. A kernel's crossover is the smallest
measured row count at which the dense kernel of its activation dtype takes less time for a step: below it, the
kernel is the faster one. The machine description lists the CPU's vector and matrix extensions (`cpu_flags`);
`cpu_level`, the level the checkpoint's C kernels ran at (ROSELLM_CPU_FEATURES masks it) and PyTorch's own.

    python -m benchmarks quant-kernels [--checkpoint 13] [--rows 1,4,16] [--quick]
"""

import functools
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

from chapters import submodule

from . import harness

NAME = "quant-kernels"
HELP = "chapter 13: ms per layer of dense fp32/bf16, int8pack and int4pack matmuls at 1-64 rows"
CHAPTER = 13

FULL = {"checkpoint": "13", "rows": [1, 2, 4, 8, 16, 32, 64], "copies": 30, "repeats": 5}
FULL |= {"attention_batches": [1, 16, 64], "attention_context": [128, 640]}
QUICK = {"rows": [1, 4], "copies": 2, "repeats": 2, "attention_batches": [1, 4], "attention_context": [8, 40]}
ATTENTION = ("compiled", "C kernel")  # decode attention's two ways
BLOCK_SIZE = 16
GROUP = 32  # int4pack's group size
KERNELS = {  # name -> (activation dtypes, the dense kernel of each activation dtype it is compared with)
    "fp32 dense": ["float32"],
    "bf16 dense": ["bfloat16"],
    "int8pack": ["bfloat16", "float32"],
    "int4pack": ["bfloat16", "float32"],
}
DENSE = {"float32": "fp32 dense", "bfloat16": "bf16 dense"}


def run(args, s: dict) -> dict:
    wrong = "a kernel failed (see 'errors')"
    return harness.save(
        args, NAME, lambda: measure(args, s), "quant_kernels", plot, "ch13_quant_kernels", report, wrong
    )


def shapes(config) -> list[dict]:
    """The matrices a step multiplies: (name, out_features, in_features, how many a step multiplies)."""
    c, h = config, config.hidden_size
    q, kv, layers = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.num_hidden_layers
    found = [("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * c.intermediate_size, h)]
    found.append(("down", h, c.intermediate_size))
    found = [dict(name=name, out_features=out, in_features=inp, per_step=layers) for name, out, inp in found]
    return found + [dict(name="lm_head", out_features=c.vocab_size, in_features=h, per_step=1)]


def measure(args, s: dict) -> dict:
    point = harness.named_checkpoint(s["checkpoint"])
    if point.number < CHAPTER:
        raise SystemExit(f"quant-kernels times chapter {CHAPTER}'s kernels on; --checkpoint: chapter {point.number}")
    config = harness.model_config(args.model)
    spec = dict(module=point.module, threads=args.threads, shapes=shapes(config))
    spec |= dict(rows=s["rows"], copies=s["copies"], repeats=s["repeats"])
    spec |= dict(batches=s["attention_batches"], context=s["attention_context"], heads=attention_shape(config))
    argv = [sys.executable, "-m", "benchmarks.quant_kernels"]
    timed = harness.run_process(argv, spec, "quant kernels", harness.python_environment())
    rows = timed.get("rows", [])
    per_step = step_times(rows, spec["shapes"])
    out = dict(settings=s, checkpoint=point.module, cpu_level=timed.get("cpu_level"), shapes=spec["shapes"])
    out |= dict(rows=rows, per_step=per_step)
    out |= dict(attention_shape=spec["heads"], attention=timed.get("attention", []))
    errors = timed.get("errors", []) + ([timed["error"]] if "error" in timed else [])
    out |= dict(crossover_rows=crossovers(per_step), errors=errors)
    return out | {"correct": bool(rows) and not out["errors"]}


def attention_shape(config) -> dict:
    c = config
    return dict(
        heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim, layers=c.num_hidden_layers
    )


def step_times(rows: list[dict], all_shapes: list[dict]) -> list[dict]:
    """ms of every matrix a step multiplies, per kernel, activation dtype and row count."""
    counts, totals = {shape["name"]: shape["per_step"] for shape in all_shapes}, {}
    for r in rows:
        key = (r["kernel"], r["activation"], r["rows"])
        totals[key] = totals.get(key, 0.0) + r["ms_per_matrix"] * counts[r["shape"]]
    return [dict(kernel=k, activation=a, rows=n, ms=round(ms, 3)) for (k, a, n), ms in totals.items()]


def crossovers(per_step: list[dict]) -> dict:
    """Per kernel and activation dtype: the smallest row count at which its activation dtype's dense kernel
    takes less time for a step (None: never, at the rows measured)."""
    ms = {(p["kernel"], p["activation"], p["rows"]): p["ms"] for p in per_step}
    out = {}
    for kernel, activation, rows in sorted(ms, key=lambda key: key[2]):
        dense = ms.get((DENSE[activation], activation, rows))
        name = f"{kernel} ({activation})"
        if kernel != DENSE[activation] and dense is not None:
            out.setdefault(name, None)
            if out[name] is None and dense < ms[kernel, activation, rows]:
                out[name] = rows
    return out


# --- in a process of its own: python -m benchmarks.quant_kernels SPEC OUT ---------------------------------------


def prepare(kernel: str, activation: str, weights: list, module: str) -> list:
    """The kernel's weights, one per copy of the fp32 `weights` [out, in], and a function of (x, prepared)."""
    import torch

    packed_linear = submodule(module, "packed_linear")
    dtype = getattr(torch, activation)
    if kernel == "fp32 dense":
        for w in weights:
            packed_linear.pack_weight(w)
        return weights, lambda x, w: packed_linear.packed_linear(x, w, None)
    if kernel == "bf16 dense":
        return [w.to(torch.bfloat16) for w in weights], lambda x, w: torch.nn.functional.linear(x, w)
    if kernel == "int8pack":
        prepared = [
            (torch.randint(-127, 128, w.shape, dtype=torch.int8), torch.rand(w.shape[0], dtype=dtype)) for w in weights
        ]
        return prepared, lambda x, p: torch.ops.aten._weight_int8pack_mm(x, p[0], p[1])
    codes = [torch.randint(0, 16, w.shape, dtype=torch.int32) for w in weights]  # [out, in]
    packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(c, 2) for c in codes]
    scales = [torch.rand(w.shape[1] // GROUP, w.shape[0], 2, dtype=dtype) for w in weights]  # [in/32, out, 2]
    return list(zip(packed, scales)), lambda x, p: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p[0], GROUP, p[1])


def time_kernels(spec: dict) -> dict:
    import torch

    rows, errors = [], []
    for shape in spec["shapes"]:
        copies = spec["copies"] if shape["per_step"] > 1 else 1
        weights = [torch.randn(shape["out_features"], shape["in_features"]) for _ in range(copies)]  # [out, in]
        for kernel, activations in KERNELS.items():
            for activation in activations:
                try:
                    prepared, multiply = prepare(kernel, activation, weights, spec["module"])
                    for n in spec["rows"]:
                        ms = time_one(multiply, prepared, n, shape["in_features"], activation, spec["repeats"])
                        row = dict(shape=shape["name"], kernel=kernel, activation=activation, rows=n, copies=copies)
                        rows.append(row | {"ms_per_matrix": round(ms, 4)})
                except RuntimeError as error:  # a kernel this build of torch lacks for this CPU
                    errors.append(f"{kernel} ({activation}) on {shape['name']}: {error}")
    return {"rows": rows, "errors": errors}


def time_one(multiply, prepared: list, rows: int, in_features: int, activation: str, repeats: int) -> float:
    """ms per matrix: the median of `repeats` passes over every copy, after one unmeasured pass."""
    import torch

    x = torch.randn(rows, in_features).to(getattr(torch, activation))  # [rows, in]
    return ms_per_item(lambda p: multiply(x, p), prepared, repeats)


def ms_per_item(call, items: list, repeats: int) -> float:
    """The median of `repeats` passes of `call` over every item, after one unmeasured pass, per item."""
    passes = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        for item in items:
            call(item)
        passes.append(time.perf_counter() - start)
    return 1000 * statistics.median(passes[1:]) / len(items)


def time_attention(spec: dict) -> list[dict]:
    """Decode attention at each batch, compiled and by the C kernel, in fp32 and bf16: ms per step."""
    import torch

    cpu_attention = submodule(spec["module"], "cpu_attention")
    ways = {"compiled": cpu_attention.compiled_decode_attention, "C kernel": cpu_attention.kernel_decode_attention}
    h, rows = spec["heads"], []
    for name, batch in itertools.product(("float32", "bfloat16"), spec["batches"]):
        dtype, draw = getattr(torch, name), random.Random(batch)
        lens = [draw.randint(*spec["context"]) for _ in range(batch)]
        counts = [-(-n // BLOCK_SIZE) for n in lens]
        order = torch.randperm(sum(counts), generator=torch.Generator().manual_seed(0))
        tables = torch.zeros(batch, max(counts), dtype=torch.long)  # [batch, blocks]: shuffled, none shared
        for b, (start, n) in enumerate(zip(itertools.accumulate(counts, initial=0), counts)):
            tables[b, :n] = order[start : start + n]
        shape = (sum(counts), BLOCK_SIZE, h["kv_heads"], h["head_dim"])  # one layer's pool
        pools = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(h["layers"])]
        query = torch.randn(batch, h["heads"], h["head_dim"]).to(dtype)  # [batch, heads, head_dim]
        seq_lens = torch.tensor(lens)
        read = 2 * sum(lens) * h["kv_heads"] * h["head_dim"] * query.element_size() * h["layers"]  # bytes a step
        for way, attend in ways.items():
            call = functools.partial(attend_layer, attend, query, tables, seq_lens)
            step_ms = h["layers"] * ms_per_item(call, pools, spec["repeats"])
            row = dict(way=way, dtype=name, batch=batch, keys=sum(lens), ms_per_step=round(step_ms, 3))
            rows.append(row | {"gb_per_s": round(read / step_ms / 1e6, 2)})
    return rows


def attend_layer(attend, query, tables, seq_lens, pool: tuple):
    return attend(query, *pool, tables, seq_lens)


def cpu_level(module: str) -> dict:
    """The CPU level the checkpoint's C kernels run at (ROSELLM_CPU_FEATURES's, `masked`, else the CPU's own,
    `native`) and the one PyTorch's own kernels run at (`torch`: the variable does not mask them)."""
    import torch

    features = submodule(module, "cpu_features")
    level = dict(level=features.level(), native=features.native_level(), masked=features.masked())
    return level | {"torch": torch.backends.cpu.get_cpu_capability()}


def main(spec_path: str, out_path: str) -> None:
    import torch

    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    with torch.inference_mode():
        result = time_kernels(spec) | {"attention": time_attention(spec), "cpu_level": cpu_level(spec["module"])}
    Path(out_path).write_text(json.dumps(result))


# --- the result ------------------------------------------------------------------------------------------------


def report(result: dict) -> None:
    steps = result["per_step"]
    table = {}
    for p in steps:
        table.setdefault(p["rows"], {"rows": p["rows"]})[f"{p['kernel']} ({p['activation']})"] = p["ms"]
    columns = {"rows": "rows"} | {
        name: name for name in dict.fromkeys(f"{p['kernel']} ({p['activation']})" for p in steps)
    }
    print("\nquant-kernels: ms for every matrix of a step")
    harness.print_table(list(table.values()), columns)
    print(f"crossover rows (dense faster from): {result['crossover_rows']}")
    print("\ndecode attention: ms for every layer of a step")
    attention_columns = {"way": "way", "dtype": "dtype", "batch": "sequences", "keys": "keys"}
    harness.print_table(result["attention"], attention_columns | {"ms_per_step": "ms", "gb_per_s": "GB/s"})


def plot(result: dict, path) -> None:
    """A step's matrix time against rows, with fp32 activations (left) and bf16 ones (right)."""
    fig, ((left, right),) = harness.figure_axes(1, 2, (11, 4))
    for ax, activation in ((left, "float32"), (right, "bfloat16")):
        for kernel in KERNELS:
            points = [p for p in result["per_step"] if p["kernel"] == kernel and p["activation"] == activation]
            if points:
                ax.plot([p["rows"] for p in points], [p["ms"] for p in points], "o-", label=kernel)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(
            xlabel="rows (tokens in the step)", ylabel="ms per step (all matrices)", title=f"{activation} activations"
        )
        ax.legend(fontsize=8)
    harness.save_figure(fig, path, result)


if __name__ == "__main__":
    main(*sys.argv[1:])
