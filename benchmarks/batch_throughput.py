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

from . import harness, named_checkpoint

NAME = "batch-throughput"
HELP = "output tokens/s against batch size (chapter 03)"
CHAPTER = 3

FULL = {
    "checkpoint": "3",
    "batch_sizes": [1, 2, 4, 8, 16, 32],
    "prompt_len": 64,
    "max_tokens": 64,
    "repeats": 3,
    "seed": 0,
}
QUICK = {"batch_sizes": [1, 2], "prompt_len": 8, "max_tokens": 4, "repeats": 1}


def add_arguments(parser) -> None:
    harness.add_arguments(parser, FULL)


def run(args) -> dict:
    s = harness.settings(args, FULL, QUICK)
    point = named_checkpoint(s["checkpoint"])
    module = point.load()
    tag = f"ch{module.__chapter__[:2]}"
    return harness.chapter_run(
        args,
        NAME,
        lambda: measure(args, s, point.module, module) | {"tag": tag},
        f"batch_throughput_{tag}",
        f"{tag}_batch_throughput",
        plot,
    )


def measure(args, s: dict, name: str, module) -> dict:
    llm = module.LLM(model=args.model, max_batch_size=max(s["batch_sizes"]))
    n, largest = s["prompt_len"], max(s["batch_sizes"])
    prompts = [p for p, _ in harness.random_requests(largest, [n, n], [1, 1], llm.tokenizer.vocab_size, s["seed"])]
    harness.timed_generate(module, llm, prompts[:2], 2)  # warm-up: first calls are slower
    firsts, fulls = {b: [] for b in s["batch_sizes"]}, {b: [] for b in s["batch_sizes"]}
    for repeat in range(s["repeats"]):
        print(f"{name}: pass {repeat + 1} of {s['repeats']}", flush=True)
        for b in s["batch_sizes"]:
            firsts[b].append(harness.timed_generate(module, llm, prompts[:b], 1)[0])
            fulls[b].append(harness.timed_generate(module, llm, prompts[:b], s["max_tokens"])[0])
    points, steps = [], s["max_tokens"] - 1  # decode steps of b tokens after the prefill
    for b in s["batch_sizes"]:
        first, full = min(firsts[b]), min(fulls[b])
        point = dict(batch_size=b, requests=b, output_tokens=b * s["max_tokens"], prefill_s=round(first, 3))
        point |= dict(total_s=round(full, 3), output_tokens_per_s=round(b * s["max_tokens"] / full, 2))
        point |= dict(decode_tokens_per_s=round(b * steps / (full - first), 2))
        points.append(point | {"decode_ms_per_step": round((full - first) / steps * 1000, 2)})
        print(f"  batch {b:>3}: {points[-1]['output_tokens_per_s']:.1f} output tokens/s", flush=True)
    for p in points:
        p["speedup_over_first"] = round(p["output_tokens_per_s"] / points[0]["output_tokens_per_s"], 2)
    settings = s | {"greedy": True, "ignore_eos": True, "max_batch_size": largest}
    return harness.checkpoint_record(name, module, llm) | {"points": points, "settings": settings}


def plot(result: dict, path) -> None:
    points = result["points"]
    fig, ((ax,),) = harness.figure_axes(1, 1, (7.5, 4.2))
    sizes = [p["batch_size"] for p in points]
    ax.plot(sizes, [p["output_tokens_per_s"] for p in points], "o-", label="output tokens/s (prefill included)")
    ax.plot(sizes, [p["decode_tokens_per_s"] for p in points], "s--", label="decode tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set(
        xlabel="batch size",
        ylabel="tokens per second",
        ylim=(0, None),
        title=f"{result['checkpoint']}: {result['settings']['prompt_len']}-token prompts, "
        f"{result['settings']['max_tokens']} tokens each",
    )
    ax.legend(fontsize=8)
    harness.save_figure(fig, path, harness.caption(result))
