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

From chapter 18 on (a checkpoint that declares "integer_dot": `--checkpoint 18`) the kernels are those a layer of
each weight format can run, on layers made as the loader makes them from random weights (`nn.Linear`,
`quantized_linear.quantized_linear`) and prepared as the model runner prepares them (`pack_linears`,
`use_integer_dot`), at the CPU level the run is at:

  fp32 plain            `F.linear` on the fp32 weight as it is (what a quantized layer does with its dense copy)
  fp32 packed           oneDNN's GEMM on the weight reordered once (`packed_linear`'s copy)
  bf16 plain            `F.linear` on bf16 weights
  bf16 packed           oneDNN's GEMM on bf16 weights reordered once, where `packed_linear.can_pack` takes them
  Q4_1 integer dot      chapter 18's C kernel (`integer_dot_kernel.linear`) on the layer's 4-bit codes
  Q8_0 integer dot      the same on 8-bit codes
  Q4_1 int4pack         `_weight_int4pack_mm_for_cpu` on the layer's packed codes (bf16 activations)
  Q8_0 int4pack halves  the same on Q8_0's codes as two 4-bit halves, the inputs twice (bf16 activations)

A format's candidates on an activation dtype are its own kernels and the dense kernels of that dtype (a
quantized layer could multiply a dense copy either way). Beside them, "FORMAT choice": the layer's own forward,
which picks a kernel by the rows; each of its rows names the candidate it ran (`picked`, seen at the kernels'
entry points). `choice` then says, per format, activation dtype and row count, which candidate takes least time
for a whole step (`fastest`), which one the checkpoint picks and how many times the fastest's time it takes
(`pick_vs_fastest`), and the layer's own time (`choice_ms`). Kernels the checkpoint does not run at this level
are left out, and `absent` says why.

    python -m benchmarks quant-kernels [--checkpoint 13] [--rows 1,4,16] [--quick]
"""

import contextlib
import functools
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple
from unittest import mock

from chapters import submodule

from . import harness

NAME = "quant-kernels"
HELP = "chapter 13 on: ms per step of each linear kernel at 1-64 rows; from 18, which wins and which one is picked"
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


class Candidate(NamedTuple):
    """One of chapter 18's kernels: the layers it is measured on and how a layer's forward reaches it."""

    weights: str  # the format of the layers: fp32, bf16, Q4_1, Q8_0
    activation: str  # the activations' dtype
    entry: str  # the function a layer calls to run it (`entry_points`)


CANDIDATES = {
    "fp32 plain": Candidate("fp32", "float32", "F.linear"),
    "fp32 packed": Candidate("fp32", "float32", "oneDNN"),
    "bf16 plain": Candidate("bf16", "bfloat16", "F.linear"),
    "bf16 packed": Candidate("bf16", "bfloat16", "oneDNN"),
    "Q4_1 integer dot": Candidate("Q4_1", "float32", "integer dot"),
    "Q8_0 integer dot": Candidate("Q8_0", "float32", "integer dot"),
    "Q4_1 int4pack": Candidate("Q4_1", "bfloat16", "int4pack"),
    "Q8_0 int4pack halves": Candidate("Q8_0", "bfloat16", "int4pack"),
}
FORMATS = [  # (weights, activation dtype): the layers chapter 18 runs, each with its choice
    ("fp32", "float32"),
    ("Q4_1", "float32"),
    ("Q8_0", "float32"),
    ("bf16", "bfloat16"),
    ("Q4_1", "bfloat16"),
    ("Q8_0", "bfloat16"),
]
DENSE_WEIGHTS = {"float32": "fp32", "bfloat16": "bf16"}  # a quantized layer's dense copy, per activation dtype


def candidates(weights: str, activation: str) -> list[str]:
    """The kernels that can multiply a layer of `weights` on `activation`: its own and its dtype's dense ones."""
    formats = (weights, DENSE_WEIGHTS[activation])
    return [name for name, c in CANDIDATES.items() if c.activation == activation and c.weights in formats]


def choice_name(weights: str) -> str:
    """The name of a format's layer's own forward among the kernels (with its activation dtype, unique)."""
    return f"{weights} choice"


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
    spec = dict(module=point.module, integer_dot="integer_dot" in point.capabilities, threads=args.threads)
    spec |= dict(shapes=shapes(config))
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
    if spec["integer_dot"]:
        groups = kernel_groups(timed.get("absent", {}))
        out |= dict(groups=groups, absent=timed.get("absent", {}), choice=choices(rows, spec["shapes"], groups))
    else:
        out |= dict(crossover_rows=crossovers(per_step))
    out |= dict(errors=errors)
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


def kernel_groups(absent: dict) -> list[dict]:
    """Each format and activation dtype: the candidates measured (those in `absent` left out), its choice."""
    return [
        dict(weights=w, activation=a, kernels=[k for k in candidates(w, a) if k not in absent], choice=choice_name(w))
        for w, a in FORMATS
    ]


def choices(rows: list[dict], all_shapes: list[dict], groups: list[dict]) -> list[dict]:
    """Per group of `kernel_groups` and row count: the candidate that takes least time for a whole step, the one the
    layer's forward ran (one name where every shape agrees), its step's ms and how many times the fastest's that
    is, and the layer's own step time (`choice_ms`: the pick and the layer's code around it)."""
    counts = {shape["name"]: shape["per_step"] for shape in all_shapes}
    ms = {(r["kernel"], r["activation"], r["shape"], r["rows"]): r["ms_per_matrix"] * counts[r["shape"]] for r in rows}

    def step_ms(kernel_of: dict, activation: str, n: int) -> float | None:
        """ms of a step whose shapes run kernel_of[shape] (None: one of them was not measured)."""
        parts = [ms.get((kernel_of.get(shape), activation, shape, n)) for shape in counts]
        return None if None in parts else sum(parts)

    out = []
    for group in groups:
        activation, choice = group["activation"], group["choice"]
        ran = [r for r in rows if (r["kernel"], r["activation"]) == (choice, activation)]
        for n in sorted({r["rows"] for r in ran}):
            picked = {r["shape"]: r["picked"] for r in ran if r["rows"] == n}
            pick_ms = step_ms(picked, activation, n)
            if pick_ms is None:  # a kernel failed on a shape: `errors` says which
                continue
            timed = {k: step_ms(dict.fromkeys(counts, k), activation, n) for k in group["kernels"]}
            timed = {k: t for k, t in timed.items() if t is not None}
            fastest = min(timed, key=timed.get)
            entry = dict(weights=group["weights"], activation=activation, rows=n, fastest=fastest)
            entry |= dict(fastest_ms=round(timed[fastest], 3), pick=" + ".join(dict.fromkeys(picked.values())))
            entry |= dict(pick_ms=round(pick_ms, 3), pick_vs_fastest=round(pick_ms / timed[fastest], 3))
            out.append(entry | {"choice_ms": round(step_ms(dict.fromkeys(counts, choice), activation, n), 3)})
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


def time_formats(spec: dict) -> dict:
    """Chapter 18's candidates and each format's choice (see the module docstring), per shape and row count."""
    rows, errors, absent = [], [], {}
    for shape, (weights, activation) in itertools.product(spec["shapes"], FORMATS):
        copies = spec["copies"] if shape["per_step"] > 1 else 1
        try:
            layers = engine_layers(weights, activation, shape, copies, spec["module"])
            kernels = format_kernels(weights, activation, layers, spec["module"], absent)
            for (kernel, (prepared, multiply)), n in itertools.product(kernels.items(), spec["rows"]):
                ms = time_one(multiply, prepared, n, shape["in_features"], activation, spec["repeats"])
                row = dict(shape=shape["name"], kernel=kernel, weights=weights, activation=activation, rows=n)
                row |= dict(copies=copies, ms_per_matrix=round(ms, 4))
                if kernel == choice_name(weights):
                    row["picked"] = picked_kernel(layers[0], n, weights, activation, spec["module"])
                rows.append(row)
        except RuntimeError as error:
            errors.append(f"{weights} weights on {activation} ({shape['name']}): {error}")
    return {"rows": rows, "errors": errors, "absent": absent}


def format_kernels(weights: str, activation: str, layers: list, module: str, absent: dict) -> dict:
    """What to time on a format's layers: its own candidates and its choice, name -> (inputs, one per layer, and a
    function of (x, input)). A candidate the checkpoint does not run at this CPU level goes in `absent` instead."""
    kernels = {choice_name(weights): (layers, call_layer)}
    for name, candidate in CANDIDATES.items():
        if (candidate.weights, candidate.activation) == (weights, activation):
            try:
                kernels[name] = INPUTS[candidate.entry](layers, module)
            except Absent as reason:
                absent[name] = str(reason)
    return kernels


def engine_layers(weights: str, activation: str, shape: dict, copies: int, module: str) -> list:
    """`copies` layers of `shape` [out, in] holding random `weights`, for `activation` compute: made as the loader
    makes them and prepared as the model runner prepares a model (`pack_linears`, then `use_integer_dot`)."""
    import torch

    quantized_linear = submodule(module, "quantized_linear")
    out_features, in_features, dtype = shape["out_features"], shape["in_features"], getattr(torch, activation)
    if weights in DENSE_WEIGHTS.values():
        layers = [torch.nn.Linear(in_features, out_features, bias=False, dtype=dtype) for _ in range(copies)]
    else:
        made = (random_weight(weights, out_features, in_features, quantized_linear) for _ in range(copies))
        layers = [quantized_linear.quantized_linear(weight, None, dtype) for weight in made]
    net = torch.nn.ModuleList(layers)
    submodule(module, "packed_linear").pack_linears(net)
    quantized_linear.use_integer_dot(net)
    return list(net)


def random_weight(weights: str, out_features: int, in_features: int, quantized_linear):
    """A random `QuantizedWeight` [out, in] in GGUF's Q4_1 (codes 0..15, a scale and a minimum per 32 weights)
    or Q8_0 (int8 codes, a scale per 32), as the GGUF reader gives them."""
    import torch

    group = quantized_linear.GROUP
    blocks = (out_features, in_features // group)
    if weights == "Q4_1":
        codes = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8)
        return quantized_linear.QuantizedWeight(codes, torch.rand(blocks), torch.randn(blocks), 0, 4, group)
    codes = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    return quantized_linear.QuantizedWeight(codes, torch.rand(blocks), None, 0, 8, group)


class Absent(Exception):
    """A candidate the checkpoint does not run at this CPU level; the message says why."""


def plain_inputs(layers: list, module: str) -> tuple:
    """`F.linear` on each layer's weight as it is."""
    import torch

    return [layer.weight for layer in layers], torch.nn.functional.linear


def packed_inputs(layers: list, module: str) -> tuple:
    """oneDNN's GEMM on each layer's weight reordered once, as `packed_linear.pack_weight` reorders it."""
    import torch

    if not submodule(module, "packed_linear").can_pack(layers[0].weight):
        raise Absent(f"packed_linear.can_pack keeps {layers[0].weight.dtype} weights plain at this CPU level")
    return [torch.ops.mkldnn._reorder_linear_weight(layer.weight, None) for layer in layers], packed_multiply


def packed_multiply(x, packed):
    """x [rows, in] @ w.T -> [rows, out], w [out, in] reordered for oneDNN."""
    import torch

    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def integer_dot_inputs(layers: list, module: str) -> tuple:
    """Chapter 18's C kernel on each layer's codes in its layout (`use_integer_dot` made them)."""
    kernel = submodule(module, "quantized_linear").integer_dot_kernel
    library = kernel.kernel()
    if library is None:
        raise Absent("no C kernel is built at this CPU level")
    return layers, functools.partial(integer_dot_multiply, kernel, library)


def integer_dot_multiply(kernel, library, x, layer):
    """x [rows, in] fp32 @ w.T -> [rows, out]: 8-bit activations and integer dot products with the layer's codes."""
    return kernel.linear(x, layer.dot_codes, layer.dot_scales, layer.dot_minimums, None, library)


def int4pack_inputs(layers: list, module: str) -> tuple:
    """PyTorch's int4 kernel on each layer's packed codes (Q8_0's as two 4-bit halves: `Int8Linear`)."""
    quantized_linear = submodule(module, "quantized_linear")
    halves = isinstance(layers[0], quantized_linear.Int8Linear)
    return layers, functools.partial(int4pack_multiply, quantized_linear.GROUP, halves)


def int4pack_multiply(group: int, halves: bool, x, layer):
    """x [rows, in] bf16 @ w.T -> [rows, out]; with `halves`, the inputs twice, [x, x], meet both halves."""
    import torch

    x = torch.cat([x, x], dim=-1) if halves else x  # [rows, in], or [rows, 2 * in]
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, group, layer.scale_and_zero)


INPUTS = {  # a candidate's entry -> its inputs and function
    "F.linear": plain_inputs,
    "oneDNN": packed_inputs,
    "integer dot": integer_dot_inputs,
    "int4pack": int4pack_inputs,
}


def call_layer(x, layer):
    """The layer's own forward: the kernel it picks for x's rows."""
    return layer(x)


def entry_points(module: str) -> dict:
    """Where a layer calls each candidate's kernel from Python: entry -> (object, attribute)."""
    import torch

    return {
        "F.linear": (torch.nn.functional, "linear"),
        "oneDNN": (torch.ops.mkldnn, "_linear_pointwise"),
        "integer dot": (submodule(module, "quantized_linear").integer_dot_kernel, "linear"),
        "int4pack": (torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
    }


def picked_kernel(layer, rows: int, weights: str, activation: str, module: str) -> str:
    """The candidate a layer's forward runs at `rows`: the one whose entry point a call goes through, watched."""
    import torch

    x = torch.randn(rows, layer.in_features).to(getattr(torch, activation))  # [rows, in]
    with contextlib.ExitStack() as stack:
        watched = {
            entry: stack.enter_context(mock.patch.object(owner, name, wraps=getattr(owner, name)))
            for entry, (owner, name) in entry_points(module).items()
        }
        layer(x)
    reached = [entry for entry, spy in watched.items() if spy.called]
    picked = [name for name in candidates(weights, activation) if CANDIDATES[name].entry in reached]
    if len(reached) != 1 or len(picked) != 1:
        raise RuntimeError(f"the layer's forward at {rows} rows reached {reached or 'none of the kernels'}")
    return picked[0]


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
        timed = time_formats(spec) if spec["integer_dot"] else time_kernels(spec)
        result = timed | {"attention": time_attention(spec), "cpu_level": cpu_level(spec["module"])}
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
    if "crossover_rows" in result:
        print(f"crossover rows (dense faster from): {result['crossover_rows']}")
    else:
        print(f"\nthe fastest kernel and the checkpoint's pick, at CPU level {result['cpu_level']['level']}")
        choice_columns = {"weights": "weights", "activation": "activations", "rows": "rows", "fastest": "fastest"}
        choice_columns |= {"fastest_ms": "ms", "pick": "picked", "pick_ms": "its ms", "pick_vs_fastest": "x fastest"}
        harness.print_table(result["choice"], choice_columns)
    print("\ndecode attention: ms for every layer of a step")
    attention_columns = {"way": "way", "dtype": "dtype", "batch": "sequences", "keys": "keys"}
    harness.print_table(result["attention"], attention_columns | {"ms_per_step": "ms", "gb_per_s": "GB/s"})


def panels(result: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    """The figure's panels: a title and its lines (kernel, activation dtype). Chapter 18's: one per format and
    activation dtype, its candidates and its choice; chapter 13's: one per activation dtype."""
    if "groups" in result:
        return [
            (
                f"{g['weights']} weights, {g['activation']} activations",
                [(k, g["activation"]) for k in [*g["kernels"], g["choice"]]],
            )
            for g in result["groups"]
        ]
    return [
        (f"{a} activations", [(k, a) for k, kinds in KERNELS.items() if a in kinds]) for a in ("float32", "bfloat16")
    ]


def plot(result: dict, path) -> None:
    """A step's matrix time against rows, a panel per `panels` (the layers' own choice dashed)."""
    shown = panels(result)
    columns = min(len(shown), 3)
    grid_rows = -(-len(shown) // columns)
    fig, axes = harness.figure_axes(grid_rows, columns, (5.5 * columns, 4 * grid_rows))
    for ax, (title, lines) in zip([ax for row in axes for ax in row], shown):
        for kernel, activation in lines:
            points = [p for p in result["per_step"] if p["kernel"] == kernel and p["activation"] == activation]
            if points:
                style = dict(marker="x", linestyle="--", color="black") if kernel.endswith(" choice") else {}
                ax.plot([p["rows"] for p in points], [p["ms"] for p in points], **{"marker": "o"} | style, label=kernel)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set(xlabel="rows (tokens in the step)", ylabel="ms per step (all matrices)", title=title)
        ax.legend(fontsize=8)
    harness.save_figure(fig, path, result)


if __name__ == "__main__":
    main(*sys.argv[1:])
