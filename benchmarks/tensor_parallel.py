"""tensor-parallel: what chapter 12's split costs here, and what it buys at scale (modelled).

Measured, on this machine (gloo over loopback, one torch thread per rank):
  all-reduce    one all-reduce of [tokens, hidden] fp32 between 2 and between 3 processes: microseconds
  engine        the same requests through `LLMEngine` with `tensor_parallel_size` 1 and N: output tokens/s,
                time rank 0 spends in all-reduces (per step, per layer, per token); tokens must be equal
Modelled, from the shapes alone (`tensor_parallel.RankShapes`) and stated bandwidths: the weights and KV
bytes per rank and the communication per token for SmolLM2, a Llama-2-7B and a Llama-3-70B shape, a
batch-1 decode step's time and a 2048-token prefill step's all-reduces on GPUs joined by NVLink or by PCIe.

    python -m benchmarks tensor-parallel [--quick]
"""

import dataclasses
import importlib
import statistics
import sys
import time
from pathlib import Path

import chapters
from chapters import submodule

from . import harness

NAME = "tensor-parallel"
HELP = "chapter 12: gloo all-reduce cost, engine with 1 and N ranks, modelled costs at scale"
CHAPTER = 12

FULL = {"sizes": [1, 3], "requests": 16, "prompt_len": [32, 128], "max_tokens": [32, 64], "seed": 0}
FULL |= {"message_tokens": [1, 16, 64, 256, 1024], "repeats": 200, "enforce_eager": 0}
QUICK = {"sizes": [1, 2], "requests": 3, "prompt_len": [8, 16], "max_tokens": [4, 8], "message_tokens": [1, 16]}
QUICK |= {"repeats": 5, "enforce_eager": 1}

# Model shapes for the modelled table (Hugging Face config fields); bf16 on GPUs, as served
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30)
SMOLLM2 |= dict(num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
LLAMA_2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32)
LLAMA_2_7B |= dict(num_attention_heads=32, num_key_value_heads=32, tie_word_embeddings=False)
LLAMA_3_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80)
LLAMA_3_70B |= dict(num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)
GPU = dict(  # stated assumptions of the model, not measurements
    name="H100 SXM 80 GB",
    memory_gb=80,
    hbm_gb_per_s=3350,  # datasheet memory bandwidth
    nvlink_gb_per_s=450,  # NVLink 4, per direction
    pcie_gb_per_s=25,  # PCIe 4.0 x16, about 25 of its 32 GB/s achieved
    all_reduce_latency_us=10,  # a small all-reduce's fixed cost on NCCL
)
PREFILL_TOKENS = 2048  # a prefill step's tokens, where the bandwidth of the link matters


def run(args, s: dict) -> dict:
    wrong = "tensor_parallel_size N gave other tokens than 1"
    return harness.save(
        args, NAME, lambda: measure(args, s), "tensor_parallel", plot, "ch12_tensor_parallel", report, wrong
    )


def measure(args, s: dict) -> dict:
    config = harness.model_config(args.model)
    spec = dict(hidden=config.hidden_size, tokens=s["message_tokens"], repeats=s["repeats"])
    all_reduce = [
        dict(ranks=size, **harness.run_process(task("all-reduce", size), spec, f"all-reduce, {size} ranks"))
        for size in sorted({max(2, size) for size in s["sizes"]})
    ]
    requests = harness.random_requests(s["requests"], s["prompt_len"], s["max_tokens"], config.vocab_size, s["seed"])
    warmup = harness.random_requests(2, [8, 16], [4, 4], config.vocab_size, s["seed"] + 1000)
    engines = []
    for size in s["sizes"]:
        spec = dict(model=args.model, threads=args.threads, requests=requests, warmup=warmup, size=size)
        spec["module"] = chapters.checkpoint(CHAPTER).module
        spec["enforce_eager"] = bool(s["enforce_eager"])
        engines.append(dict(ranks=size, **harness.run_process(task("engine", 1), spec, f"rosellm, {size} ranks")))
    expected = engines[0].get("tokens")
    for e in engines:
        e["same_tokens"] = e.pop("tokens", None) == expected
    correct = expected is not None and all(e["same_tokens"] for e in engines)
    out = {"settings": s, "checkpoint": chapters.checkpoint(CHAPTER).module, "all_reduce": all_reduce}
    return out | {"engines": engines, "modelled": modelled(), "correct": correct}


def task(name: str, ranks: int) -> list[str]:
    return [sys.executable, "-m", "benchmarks.tensor_parallel", name, str(ranks)]


def modelled() -> dict:
    """Per model and rank count: bytes per rank, and a batch-1 decode step: reading the rank's weights from
    HBM, then 2 all-reduces per layer (ring: each rank sends and receives 2 (N-1)/N of the message)."""
    package = chapters.checkpoint(CHAPTER).module
    ModelConfig = submodule(package, "config").ModelConfig
    tensor_parallel = submodule(package, "tensor_parallel")
    RankShapes, check_shardable = tensor_parallel.RankShapes, tensor_parallel.check_shardable

    models = [("SmolLM2-135M (fp32)", SMOLLM2, 4), ("Llama-2-7B shape (bf16)", LLAMA_2_7B, 2)]
    models.append(("Llama-3-70B shape (bf16)", LLAMA_3_70B, 2))
    rows = []
    for label, fields, itemsize in models:
        config = ModelConfig.from_dict(fields)
        for size in (1, 2, 3, 4, 8):
            try:
                check_shardable(config, size)
            except ValueError:
                continue
            shapes = RankShapes.of(config, size, itemsize)
            weights_ms = shapes.weight_bytes / GPU["hbm_gb_per_s"] / 1e6
            row = dict(model=label, ranks=size, weight_gb_per_rank=round(shapes.weight_bytes / 1e9, 3))
            row |= dict(kv_kb_per_token_per_rank=round(shapes.kv_bytes_per_token / 1e3, 2))
            row |= dict(all_reduce_bytes_per_token=shapes.all_reduce_bytes_per_token)
            row |= dict(
                fits_one_gpu=shapes.weight_bytes < 0.9 * GPU["memory_gb"] * 1e9, weights_ms=round(weights_ms, 3)
            )
            for link in ("nvlink", "pcie"):
                comm_ms = communication_ms(config, size, itemsize, GPU[f"{link}_gb_per_s"])
                row[f"{link}_comm_ms"] = round(comm_ms, 3)
                row[f"{link}_tokens_per_s"] = round(1000 / (weights_ms + comm_ms), 1)
                prefill_ms = communication_ms(config, size, itemsize, GPU[f"{link}_gb_per_s"], PREFILL_TOKENS)
                row[f"{link}_prefill_comm_ms"] = round(prefill_ms, 2)
            rows.append(row)
    return {"gpu": GPU, "batch": 1, "prefill_tokens": PREFILL_TOKENS, "rows": rows}


def communication_ms(config, size: int, itemsize: int, gb_per_s: float, tokens: int = 1) -> float:
    """A step's all-reduces: 2 per layer, each of [tokens, hidden], a fixed cost plus a ring's bytes."""
    if size == 1:
        return 0.0
    message = tokens * config.hidden_size * itemsize
    per_all_reduce_s = GPU["all_reduce_latency_us"] * 1e-6 + 2 * (size - 1) / size * message / (gb_per_s * 1e9)
    return 2 * config.num_hidden_layers * per_all_reduce_s * 1000


# --- the processes --------------------------------------------------------------------------------------


def all_reduce_rank(rank: int, size: int, address: str, spec: dict, out: str) -> None:
    """One rank of the all-reduce timing: `repeats` all-reduces per message size; rank 0 writes medians."""
    import json

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=size)
    rows = []
    for tokens in spec["tokens"]:
        x = torch.randn(tokens, spec["hidden"])
        times = []
        for _ in range(spec["repeats"] + 5):  # 5 to warm up
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        rows.append(dict(tokens=tokens, bytes=x.numel() * 4, median_us=round(statistics.median(times[5:]) * 1e6, 1)))
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows}))
    dist.destroy_process_group()


def time_engine(spec: dict) -> dict:
    """The requests through the checkpoint `spec["module"]`'s `LLMEngine` with `size` ranks; rank 0's all-reduce
    time, from its counters."""
    import torch

    package = importlib.import_module(spec["module"])
    tensor_parallel = submodule(spec["module"], "tensor_parallel")

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    options = dict(tensor_parallel_size=spec["size"], enforce_eager=spec["enforce_eager"])
    engine = package.LLMEngine(spec["model"], max_num_seqs=len(spec["requests"]), **options)
    try:
        finish(package, engine, spec["warmup"])
        tensor_parallel.comm_stats = tensor_parallel.CommStats()
        start = time.perf_counter()
        tokens, steps = finish(package, engine, spec["requests"])
        wall = time.perf_counter() - start
        comm = dataclasses.asdict(tensor_parallel.comm_stats)
    finally:
        engine.close()
    layers = engine.model.config.num_hidden_layers
    forwarded = comm["bytes"] // (2 * layers * engine.model.config.hidden_size * 4) if comm["calls"] else None
    result = dict(wall_s=round(wall, 3), steps=steps, output_tokens_per_s=round(sum(map(len, tokens)) / wall, 2))
    result |= dict(tokens=tokens, all_reduce=comm, all_reduce_share=round(comm["seconds"] / wall, 3))
    if comm["calls"]:
        result |= dict(all_reduce_ms_per_step=round(comm["seconds"] / steps * 1e3, 2), forwarded_tokens=forwarded)
        result |= dict(all_reduce_us_per_call=round(comm["seconds"] / comm["calls"] * 1e6, 1))
        result |= dict(all_reduce_us_per_token=round(comm["seconds"] / forwarded * 1e6, 1))
    return result


def finish(package, engine, requests: list) -> tuple[list[list[int]], int]:
    """Submit every request at once, step until all finish: (tokens of each, steps taken)."""
    for index, (prompt, max_tokens) in enumerate(requests):
        params = package.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(str(index), prompt, params)
    tokens, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        tokens |= {out.request_id: out.token_ids for out in engine.step() if out.finished}
    return [tokens[str(index)] for index in range(len(requests))], steps


def report(result: dict) -> None:
    harness.print_table(result["all_reduce"][0]["rows"], {"tokens": "tokens", "bytes": "bytes", "median_us": "µs"})
    columns = {"ranks": "ranks", "output_tokens_per_s": "output tok/s", "all_reduce_share": "all-reduce share"}
    harness.print_table(result["engines"], columns | {"same_tokens": "same tokens"})


def plot(result: dict, path) -> None:
    """Measured all-reduce time against message size (left); modelled batch-1 step time against ranks (right)."""
    fig, axes = harness.figure_axes(1, 2, (11, 3.8))
    left, right = axes[0]
    for run in result["all_reduce"]:
        rows = run["rows"]
        left.loglog([r["bytes"] for r in rows], [r["median_us"] for r in rows], "o-", label=f"{run['ranks']} ranks")
    left.set(xlabel="bytes per all-reduce", ylabel="µs (median)", title="gloo all-reduce here (measured)")
    left.legend(fontsize=8)
    rows = result["modelled"]["rows"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        right.plot([r["ranks"] for r in mine], [r["weights_ms"] + r["nvlink_comm_ms"] for r in mine], "o-", label=model)
    right.set(xlabel="ranks", ylabel="ms per decode step", yscale="log", title="batch-1 step on NVLink (modelled)")
    right.legend(fontsize=7)
    harness.save_figure(fig, path, result)


def main(name: str, ranks: str, spec_path: str, out_path: str) -> None:
    import json

    spec = json.loads(Path(spec_path).read_text())
    if name == "engine":
        Path(out_path).write_text(json.dumps(time_engine(spec)))
        return
    import torch.multiprocessing

    from .serve import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    torch.multiprocessing.spawn(all_reduce_rank, args=(int(ranks), address, spec, out_path), nprocs=int(ranks))


if __name__ == "__main__":
    main(*sys.argv[1:])
