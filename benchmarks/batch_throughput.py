"""batch-throughput: output tokens per second against batch size (chapter 03's batched engine, or any
checkpoint whose `LLM` takes `max_batch_size`).

For each batch size b, b requests with random prompts of the same length (no row is padded) generate
`--max-tokens` tokens each, greedily with EOS ignored, in one `generate` call: one prefill of b prompts, then
decode steps of b tokens. The same prompts with `max_tokens=1` time the prefill alone; the difference gives
the decode steps by themselves. Whole passes over all batch sizes are repeated and the fastest run of each
kept: other work on the machine only adds time.

With `--padding` it times nothing and counts instead what padding costs chapter 03's `BatchedKVCache`, which
pads every row of a forward to the longest: at every forward of a mixed batch (paged-vs-padded's: 16 random
prompts of 16-512 tokens, 64 greedy tokens each), how many slots of the merged key/value tensors hold
padding. The count is taken inside the engine, by wrapping the checkpoint's `BatchedKVCache` from outside (the
frozen code is not edited), and again by replaying the scheduler's policy on the lengths alone; the two must
agree. The replay also counts the offline workload's requests (offline-cpu's 64, in batches of 32), which leave
and join at different steps. The counts depend on the lengths alone, not on the machine.

    python -m benchmarks batch-throughput
    python -m benchmarks batch-throughput --padding      # results/ch03_padding.json
"""

import contextlib
import importlib
import statistics
from collections import deque
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

# --padding: the mixed batch (paged-vs-padded's defaults) and the offline workload (offline-cpu's requests)
MIXED = {"requests": 16, "prompt_len": [16, 512], "max_tokens": 64, "seed": 0}
MIXED_QUICK = {"requests": 3, "prompt_len": [4, 24], "max_tokens": 4, "seed": 0}
OFFLINE = {"requests": 64, "prompt_len": [32, 512], "max_tokens": [32, 256], "seed": 0, "max_batch_size": 32}


def add_arguments(parser) -> None:
    parser.add_argument("--padding", action="store_true", help="count the padding of a mixed batch, time nothing")


def run(args, s: dict) -> dict:
    point = harness.named_checkpoint(s["checkpoint"])
    module = point.load()
    tag = f"ch{module.__chapter__[:2]}"
    if args.padding:
        count_it = partial(count_padding, args, point.module, module, tag)
        json_path, _ = harness.output_paths(args, f"{tag}_padding")
        return harness.write(harness.measured(args, NAME, count_it), json_path, [], no_figure, None, REPLAY_WRONG)
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


# --- --padding: slots of the merged key/value tensors that hold padding -------------------------------------

REPLAY_WRONG = "the replay of the scheduler disagrees with what the engine merged"


def count_padding(args, name: str, module, tag: str) -> dict:
    """The mixed batch counted in the engine and by replay, the offline workload by replay."""
    mixed = MIXED_QUICK if args.quick else MIXED
    llm = module.LLM(model=args.model, max_batch_size=mixed["requests"])
    vocab = llm.tokenizer.vocab_size
    requests = harness.random_requests(
        mixed["requests"], mixed["prompt_len"], [mixed["max_tokens"]] * 2, vocab, mixed["seed"]
    )
    prompts = [prompt for prompt, _ in requests]
    with merges_counted(module) as merged:
        params = module.SamplingParams(temperature=0.0, max_tokens=mixed["max_tokens"], ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
    lens = [len(prompt) for prompt in prompts]
    replayed = replay_offline_scheduler(lens, [mixed["max_tokens"]] * len(lens), mixed["requests"])
    agree = replayed == merged
    offline = harness.random_requests(
        OFFLINE["requests"], OFFLINE["prompt_len"], OFFLINE["max_tokens"], vocab, OFFLINE["seed"]
    )
    offline_forwards = replay_offline_scheduler(
        [len(p) for p, _ in offline], [m for _, m in offline], OFFLINE["max_batch_size"]
    )
    print(f"mixed batch: {padding_summary(merged)['kv_padding_share_mean_per_forward']:.1%} of the merged KV slots")
    mixed_batch = {"prompt_lens": lens, "shortest_prompt": min(lens), "longest_prompt": max(lens)}
    mixed_batch |= {"prompt_tokens": sum(lens), "replay_matches_engine": agree} | padding_summary(merged)
    mixed_batch["rows_at_first_decode"] = next(f["rows"] for f in merged if f["kind"] == "decode")
    padding = {"mixed_batch": mixed_batch, "offline_workload_replayed": padding_summary(offline_forwards)}
    record = checkpoint_record(name, module, llm) | {"tag": tag, "correct": agree}
    return record | {"settings": {"mixed_batch": mixed, "offline_workload": OFFLINE}, "padding": padding}


@contextlib.contextmanager
def merges_counted(module):
    """While active, every forward of the checkpoint's engine appends {kind, new, rows} to the yielded list:
    tokens fed per row, and tokens per row of layer 0's merged keys (the longest row sets their length)."""
    engine_module = importlib.import_module(module.__name__ + ".engine")
    original, merged = engine_module.BatchedKVCache, []

    class CountingBatchedKVCache(original):
        def update(self, layer, k, v):
            keys, values = super().update(layer, k, v)  # keys: [batch, kv_heads, longest, head_dim]
            if layer == 0:  # every layer merges the same rows
                rows = [cache.length + n for cache, n in zip(self.caches, self.new_lens)]  # stored, not advanced
                assert keys.shape[2] == max(rows), (keys.shape, rows)
                kind = "prefill" if max(self.new_lens) > 1 else "decode"
                merged.append({"kind": kind, "new": list(self.new_lens), "rows": rows})
            return keys, values

    engine_module.BatchedKVCache = CountingBatchedKVCache
    try:
        yield merged
    finally:
        engine_module.BatchedKVCache = original


def replay_offline_scheduler(prompt_lens: list[int], max_tokens: list[int], max_batch_size: int) -> list[dict]:
    """Chapter 03's `OfflineScheduler` on lengths alone (EOS ignored: every request makes its max_tokens): the
    forwards in the engine's order, as `merges_counted` records them. A step prefills the joining requests in one
    forward, then decodes the ones already running in another; finished ones leave, waiting ones join next step."""
    waiting, running, forwards = deque(range(len(prompt_lens))), [], []
    stored, made = [0] * len(prompt_lens), [0] * len(prompt_lens)
    while waiting or running:
        decoding, joining = list(running), []
        while waiting and len(running) < max_batch_size:
            joining.append(waiting.popleft())
            running.append(joining[-1])
        for kind, group in (("prefill", joining), ("decode", decoding)):
            new = [prompt_lens[r] if kind == "prefill" else 1 for r in group]
            for r, n in zip(group, new):
                stored[r], made[r] = stored[r] + n, made[r] + 1
            if group:
                forwards.append({"kind": kind, "new": new, "rows": [stored[r] for r in group]})
        running = [r for r in running if made[r] < max_tokens[r]]
    return forwards


def padding_summary(forwards: list[dict]) -> dict:
    """Shares of padding in the merged key/value tensors of `forwards`, and in their [batch, width] inputs."""

    def padded(rows: list[int]) -> tuple[int, int]:  # (padding slots, all slots): every row padded to the longest
        return len(rows) * max(rows) - sum(rows), len(rows) * max(rows)

    kv = [padded(f["rows"]) for f in forwards]
    decode = [padded(f["rows"]) for f in forwards if f["kind"] == "decode"]
    prefill_inputs = [padded(f["new"]) for f in forwards if f["kind"] == "prefill"]
    share = lambda pairs: round(sum(p for p, _ in pairs) / sum(t for _, t in pairs), 4)  # noqa: E731
    return {
        "forwards": len(forwards),
        "kv_padding_share_mean_per_forward": round(statistics.fmean(p / t for p, t in kv), 4),
        "kv_padding_share_of_all_slots": share(kv),
        "kv_padding_share_decode_forwards": share(decode),
        "kv_slots_merged": sum(t for _, t in kv),
        "kv_slots_padding": sum(p for p, _ in kv),
        "prefill_input_padding_share": share(prefill_inputs),
        "prefill_input_slots": sum(t for _, t in prefill_inputs),
        "prefill_input_padding": sum(p for p, _ in prefill_inputs),
    }


def no_figure(result: dict) -> None:
    """The padding count draws no figure."""
