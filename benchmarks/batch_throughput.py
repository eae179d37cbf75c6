"""batch-throughput: output tokens per second against batch size (chapter 03's batched engine, or any
checkpoint whose `LLM` takes `max_batch_size`).

For each batch size b, b requests with random prompts of the same length (no row is padded) generate
`--max-tokens` tokens each, greedily with EOS ignored, in one `generate` call: one prefill of b prompts, then
decode steps of b tokens. The same prompts with `max_tokens=1` time the prefill alone; the difference gives
the decode steps by themselves. Whole passes over all batch sizes are repeated and the fastest run of each
kept: other work on the machine only adds time. (What padding costs a mixed batch is counted in chapter
03's notebook.)

    python -m benchmarks batch-throughput
"""

from functools import partial

from . import harness
from .decode_scaling import checkpoint_record, timed_passes
from .engines import timed_generate

NAME = "batch-throughput"
HELP = "output tokens/s against batch size (chapter 03)"
CHAPTER = 3

FULL = {
    "checkpoint": str(CHAPTER),
    "batch_sizes": [1, 2, 4, 8, 16, 32],
    "prompt_len": 64,
    "max_tokens": 64,
    "repeats": 3,
}
FULL |= {"seed": 0}
QUICK = {"batch_sizes": [1, 2], "prompt_len": 8, "max_tokens": 4, "repeats": 1}


def run(args, s: dict) -> dict:
    point = harness.named_checkpoint(s["checkpoint"])
    module = point.load()
    tag = f"ch{module.__chapter__[:2]}"
    measure_it = partial(measure, args, s, point.module, module, tag)
    return harness.save(args, NAME, measure_it, f"batch_throughput_{tag}", plot, f"{tag}_batch_throughput")


def measure(args, s: dict, name: str, module, tag: str) -> dict:
    sizes, n, largest, m = s["batch_sizes"], s["prompt_len"], max(s["batch_sizes"]), s["max_tokens"]
    llm = module.LLM(model=args.model, max_batch_size=largest)
    prompts = [p for p, _ in harness.random_requests(largest, [n, n], [1, 1], llm.tokenizer.vocab_size, s["seed"])]
    generate = partial(timed_generate, module, llm)
    generate(prompts[:2], 2)  # warm-up: first calls are slower
    calls = {}
    for b in sizes:  # the prefill alone, then with the decode steps
        calls["first", b] = partial(generate, prompts[:b], 1)
        calls["full", b] = partial(generate, prompts[:b], m)
    best = {key: min(times) for key, times in timed_passes(calls, s["repeats"], name)[0].items()}
    points, steps = [], m - 1  # decode steps of b tokens after the prefill
    for b in sizes:
        first, full = best["first", b], best["full", b]
        decode = full - first
        point = dict(batch_size=b, requests=b, output_tokens=b * m, prefill_s=round(first, 3), total_s=round(full, 3))
        point |= dict(output_tokens_per_s=round(b * m / full, 2), decode_tokens_per_s=round(b * steps / decode, 2))
        points.append(point | {"decode_ms_per_step": round(decode / steps * 1000, 2)})
        print(f"  batch {b:>3}: {points[-1]['output_tokens_per_s']:.1f} output tokens/s", flush=True)
    for p in points:
        p["speedup_over_first"] = round(p["output_tokens_per_s"] / points[0]["output_tokens_per_s"], 2)
    settings = s | {"greedy": True, "ignore_eos": True, "max_batch_size": largest}
    return checkpoint_record(name, module, llm) | {"points": points, "settings": settings, "tag": tag}


def plot(result: dict, path) -> None:
    points = result["points"]
    fig, ((ax,),) = harness.figure_axes(1, 1, (7.5, 4.2))
    sizes = [p["batch_size"] for p in points]
    ax.plot(sizes, [p["output_tokens_per_s"] for p in points], "o-", label="output tokens/s (prefill included)")
    ax.plot(sizes, [p["decode_tokens_per_s"] for p in points], "s--", label="decode tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    s = result["settings"]
    ax.set(xlabel="batch size", ylabel="tokens per second", ylim=(0, None))
    ax.set_title(f"{result['checkpoint']}: {s['prompt_len']}-token prompts, {s['max_tokens']} tokens each")
    ax.legend(fontsize=8)
    harness.save_figure(fig, path, result)
