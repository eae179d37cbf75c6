"""batch-throughput: output tokens per second against batch size, and the padding a padded batch carries.

Two measurements of chapter 03's batched engine (or any checkpoint whose `LLM` takes `max_batch_size`):

1. **Throughput.** For each batch size b, b requests with random prompts of the same length (so that no
   row is padded) generate `--max-tokens` tokens each, greedily with `ignore_eos=True`, in one
   `generate` call: one prefill of b prompts, then decode steps of b tokens. Output tokens per second
   is b × max_tokens over the wall time. The same b prompts are also run with `max_tokens=1` (the
   prefill alone); the difference gives the decode rate by itself. Whole passes over all batch sizes
   are repeated and the fastest run of each kept: other work on the machine only adds time.

2. **Padding waste.** A batch of prompts of mixed lengths (uniform in `--mixed-len`) generates
   `--mixed-tokens` tokens each. Chapter 03 merges every row's cache into one zero-padded tensor per
   layer and forward; we count, at every forward, how many of its key/value slots hold padding. The
   count is taken twice: by wrapping the checkpoint's `BatchedKVCache` from outside (the frozen code is
   not edited), and by replaying the scheduler's policy on the lengths alone (`simulate_offline`); the two
   must agree. The replay also gives the waste on the design's offline workload (requests with
   different output lengths that leave and join), without running the model.

    python -m benchmarks batch-throughput
"""

import contextlib
import datetime
import importlib
import json
import random
import statistics
import time
from collections import deque
from pathlib import Path

from . import named_checkpoint
from .machine import command_line, machine_info, measure_watched

NAME = "batch-throughput"
HELP = "output tokens/s against batch size, and the padded share of the merged KV cache (chapter 03)"
CHAPTER = 3
ROOT = Path(__file__).resolve().parent.parent


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def add_arguments(parser) -> None:
    parser.add_argument("--checkpoint", default="3",
                        help="chapter (3, ch03, ...) or module of a checkpoint whose LLM takes max_batch_size "
                             "(default: chapter 03)")
    parser.add_argument("--model", default=None, help=".gguf file or Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 2, 4, 8, 16, 32],
                        help="batch sizes to measure, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens in every prompt of part 1")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request in part 1")
    parser.add_argument("--repeats", type=int, default=3, help="keep the fastest of this many passes")
    parser.add_argument("--mixed-requests", type=int, default=16, help="requests in the mixed-length batch")
    parser.add_argument("--mixed-len", type=int, nargs=2, default=[16, 512], metavar=("MIN", "MAX"),
                        help="prompt lengths of the mixed batch, uniform in [MIN, MAX]")
    parser.add_argument("--mixed-tokens", type=int, default=64, help="tokens per request in the mixed batch")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", type=Path, default=None,
                        help="result file (default: benchmarks/results/batch_throughput_chNN.json)")
    parser.add_argument("--figure", type=Path, default=None,
                        help="plot (default: docs/figures/chNN_batch_throughput.png)")


# --- padding: counted from the lengths alone ------------------------------------------------------------


def padded_slots(row_lengths: list[int]) -> tuple[int, int]:
    """(padding slots, all slots) of one merged tensor whose rows hold `row_lengths` tokens each: every
    row is padded to the longest."""
    return len(row_lengths) * max(row_lengths) - sum(row_lengths), len(row_lengths) * max(row_lengths)


def simulate_offline(prompt_lens: list[int], max_tokens: list[int], max_batch_size: int) -> list[dict]:
    """Replay chapter 03's `OfflineScheduler` on lengths only (greedy, EOS ignored, so every request
    generates exactly its max_tokens). Returns one record per forward, in the order the engine runs
    them: `kind` ("prefill" or "decode"), `step`, `new` (tokens each row feeds in) and `rows` (the
    tokens each row's cache holds once they are written: what the merged tensor holds per row).

    Each step first prefills the requests that join (up to max_batch_size running), in one forward,
    then decodes the ones that were already running, in another; a finished request leaves at the end
    of the step, and a waiting one takes its place at the next.
    """
    waiting = deque(range(len(prompt_lens)))
    running: list[int] = []
    cached = [0] * len(prompt_lens)  # tokens in each request's cache
    produced = [0] * len(prompt_lens)  # tokens generated so far
    forwards, step = [], 0
    while waiting or running:
        decoding = list(running)
        joining = []
        while waiting and len(running) < max_batch_size:
            joining.append(waiting.popleft())
            running.append(joining[-1])
        for kind, group in (("prefill", joining), ("decode", decoding)):
            if not group:
                continue
            new = [prompt_lens[r] if kind == "prefill" else 1 for r in group]
            for r, n in zip(group, new):
                cached[r] += n
                produced[r] += 1
            forwards.append({"kind": kind, "step": step, "new": new, "rows": [cached[r] for r in group]})
        running = [r for r in running if produced[r] < max_tokens[r]]
        step += 1
    return forwards


def padding_summary(forwards: list[dict]) -> dict:
    """Shares of padding over the merged KV tensors (and over the input tokens) of a list of forwards."""
    kv = [padded_slots(f["rows"]) for f in forwards]
    tokens = [padded_slots(f["new"]) for f in forwards]
    prefill_tokens = [padded_slots(f["new"]) for f in forwards if f["kind"] == "prefill"]
    decode = [padded_slots(f["rows"]) for f in forwards if f["kind"] == "decode"]
    return {
        "forwards": len(forwards),
        # the headline: the share of padding in each forward's merged tensors, averaged over forwards
        "kv_padding_share_mean_per_forward": round(statistics.fmean(p / t for p, t in kv), 4),
        # the same weighted by size: padding slots over all slots ever allocated for the merge
        "kv_padding_share_of_all_slots": round(sum(p for p, _ in kv) / sum(t for _, t in kv), 4),
        "kv_padding_share_decode_forwards": round(sum(p for p, _ in decode) / sum(t for _, t in decode), 4)
        if decode else None,
        "kv_slots_merged": sum(t for _, t in kv),
        "kv_slots_padding": sum(p for p, _ in kv),
        # input padding: positions of the [batch, width] inputs that are padding, over all forwards and
        # over the prefill forwards alone (a decode forward feeds one real token per row: none there)
        "input_padding_share": round(sum(p for p, _ in tokens) / sum(t for _, t in tokens), 4),
        "input_padding_share_prefill": round(sum(p for p, _ in prefill_tokens) / sum(t for _, t in prefill_tokens), 4)
        if prefill_tokens else None,
    }


# --- padding: counted inside the engine ----------------------------------------------------------------


@contextlib.contextmanager
def count_merges(checkpoint: str):
    """While active, every forward of the checkpoint's engine appends a record to the yielded list:
    `new` (tokens per row) and `rows` / `padded` (the row lengths and the padded length of layer 0's
    merged key tensor). Wraps `BatchedKVCache` in the engine module from outside; restores it after."""
    engine_module = importlib.import_module(checkpoint + ".engine")
    original = engine_module.BatchedKVCache
    records: list[dict] = []

    class CountingBatchedKVCache(original):
        def update(self, layer, k, v):
            keys, values = super().update(layer, k, v)
            if layer == 0:  # every layer merges the same lengths
                # the caches have stored this step's tokens but not yet advanced: length + new per row
                rows = [cache.length + n for cache, n in zip(self.caches, self.new_lens)]
                records.append({"new": list(self.new_lens), "rows": rows, "padded": keys.shape[2],
                                "kind": "prefill" if max(self.new_lens) > 1 else "decode"})
            return keys, values

    engine_module.BatchedKVCache = CountingBatchedKVCache
    try:
        yield records
    finally:
        engine_module.BatchedKVCache = original


# --- the run --------------------------------------------------------------------------------------------


def timed_generate(engine, llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) for one greedy `generate` of exactly `max_tokens`
    tokens for every prompt. With one torch thread on a busy machine, the CPU time is the steadier
    number: time spent waiting for a core does not count."""
    params = engine.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    assert all(len(o.token_ids) == max_tokens for o in outputs), "a request stopped early"
    return elapsed, cpu


def run(args) -> dict:
    result = measure_watched(args, measure)
    json_path = args.json or ROOT / "benchmarks" / "results" / f"batch_throughput_{result['tag']}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    figure_path = args.figure or ROOT / "docs" / "figures" / f"{result['tag']}_batch_throughput.png"
    plot(result, figure_path)
    print(f"wrote {json_path} and {figure_path} ({result['wall_s']} s)")
    return result


def measure(args) -> dict:
    wall_start = time.perf_counter()
    machine = machine_info(args.device)  # before we load the machine ourselves
    args.checkpoint = named_checkpoint(args.checkpoint).module
    engine = importlib.import_module(args.checkpoint)
    chapter = engine.__chapter__
    tag = f"ch{chapter[:2]}"
    # One LLM whose limit is the largest batch: each point submits exactly b requests, so the batch is b.
    largest = max(args.batch_sizes + [args.mixed_requests])
    start = time.perf_counter()
    llm = engine.LLM(model=args.model, device=args.device, max_batch_size=largest)
    load_s = time.perf_counter() - start

    rng = random.Random(args.seed)
    vocab = llm.tokenizer.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(max(args.batch_sizes))]
    timed_generate(engine, llm, prompts[:2], 2)  # warm-up: first calls are slower

    print(f"{args.checkpoint} (chapter {chapter}): {args.prompt_len}-token prompts, {args.max_tokens} tokens "
          f"each, best of {args.repeats}")
    firsts = {b: [] for b in args.batch_sizes}  # (wall, cpu) of each run
    fulls = {b: [] for b in args.batch_sizes}
    for repeat in range(args.repeats):
        print(f"pass {repeat + 1} of {args.repeats} ...", flush=True)
        for b in args.batch_sizes:
            firsts[b].append(timed_generate(engine, llm, prompts[:b], 1))
            fulls[b].append(timed_generate(engine, llm, prompts[:b], args.max_tokens))

    print(f"{'batch':>5} {'prefill s':>9} {'total s':>8} {'output tok/s':>12} {'decode tok/s':>12} "
          f"{'ms/step':>8} {'tok/CPU-s':>9}")
    points = []
    steps = args.max_tokens - 1  # decode steps of b tokens after the prefill
    for b in args.batch_sizes:
        first_s, full_s = min(w for w, _ in firsts[b]), min(w for w, _ in fulls[b])
        first_cpu, full_cpu = min(c for _, c in firsts[b]), min(c for _, c in fulls[b])
        decode_s = full_s - first_s
        point = {
            "batch_size": b,
            "requests": b,
            "output_tokens": b * args.max_tokens,
            "prefill_s": round(first_s, 3),
            "total_s": round(full_s, 3),
            "output_tokens_per_s": round(b * args.max_tokens / full_s, 2),
            "decode_tokens_per_s": round(b * steps / decode_s, 2),
            "decode_ms_per_step": round(decode_s / steps * 1000, 2),
            # the same from this process's CPU time (fastest of the repeats)
            "total_cpu_s": round(full_cpu, 3),
            "output_tokens_per_cpu_s": round(b * args.max_tokens / full_cpu, 2),
            "decode_ms_per_step_cpu": round((full_cpu - first_cpu) / steps * 1000, 2),
        }
        points.append(point)
        print(f"{b:>5} {first_s:>9.2f} {full_s:>8.2f} {point['output_tokens_per_s']:>12.1f} "
              f"{point['decode_tokens_per_s']:>12.1f} {point['decode_ms_per_step']:>8.1f} "
              f"{point['output_tokens_per_cpu_s']:>9.1f}")
    base = points[0]["output_tokens_per_s"]
    for point in points:
        point["speedup_over_first"] = round(point["output_tokens_per_s"] / base, 2)

    padding = measure_padding(args, engine, llm, vocab)

    result = {
        "workload": "batch-throughput",
        "tag": tag,
        "command": command_line(),
        "date": datetime.date.today().isoformat(),
        "checkpoint": args.checkpoint,
        "chapter": chapter,
        "model": args.model or "SmolLM2-135M-Instruct (bundled GGUF, dequantized)",
        "dtype": str(next(llm.model.parameters()).dtype).removeprefix("torch."),
        "settings": {"batch_sizes": args.batch_sizes, "prompt_len": args.prompt_len,
                     "max_tokens": args.max_tokens, "repeats": args.repeats, "seed": args.seed,
                     "greedy": True, "ignore_eos": True, "max_batch_size": largest},
        "machine": machine,
        "load_s": round(load_s, 2),
        "points": points,
        "padding": padding,
    }
    result["wall_s"] = round(time.perf_counter() - wall_start, 1)
    return result


def measure_padding(args, engine, llm, vocab: int) -> dict | None:
    """Part 2: run the mixed-length batch once with the merges counted; check against the replay."""
    if "padded_batch" not in named_checkpoint(args.checkpoint).capabilities:
        print("this checkpoint merges no padded caches: padding not measured")
        return None
    rng = random.Random(args.seed)  # its own stream: the lengths do not depend on part 1's settings
    lens = [rng.randint(*args.mixed_len) for _ in range(args.mixed_requests)]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lens]
    with count_merges(args.checkpoint) as records:
        seconds, _ = timed_generate(engine, llm, prompts, args.mixed_tokens)
    for record in records:  # the padded tensor is exactly as long as the longest row
        assert record["padded"] == max(record["rows"]), record
    replay = simulate_offline(lens, [args.mixed_tokens] * len(lens), llm.scheduler.max_batch_size)
    measured = [{"kind": r["kind"], "new": r["new"], "rows": r["rows"]} for r in records]
    same = [{k: f[k] for k in ("kind", "new", "rows")} for f in replay] == measured
    assert same, "the replay of the scheduler disagrees with what the engine merged"
    summary = padding_summary(records)
    per_forward = [round(padded_slots(r["rows"])[0] / padded_slots(r["rows"])[1], 4) for r in records]
    print(f"mixed batch: {len(lens)} prompts of {min(lens)}..{max(lens)} tokens (mean "
          f"{statistics.fmean(lens):.0f}), {args.mixed_tokens} tokens each, {seconds:.1f} s: "
          f"{summary['kv_padding_share_mean_per_forward']:.1%} of the merged KV slots are padding "
          f"(mean over {summary['forwards']} forwards; {summary['kv_padding_share_of_all_slots']:.1%} of "
          f"all slots); {summary['input_padding_share_prefill']:.1%} of the prefill's input positions are padding")

    # The design's offline workload (64 requests, prompts in [32, 512], outputs in [32, 256]), by replay
    # only: here requests leave at different times and waiting ones join a running batch.
    offline_rng = random.Random(0)
    offline_prompts = [offline_rng.randint(32, 512) for _ in range(64)]
    offline_tokens = [offline_rng.randint(32, 256) for _ in range(64)]
    offline = {
        "requests": 64, "prompt_len": [32, 512], "max_tokens": [32, 256], "seed": 0,
        "max_batch_size": 32,
        **padding_summary(simulate_offline(offline_prompts, offline_tokens, 32)),
    }
    print(f"offline workload (replayed, batch 32): {offline['kv_padding_share_mean_per_forward']:.1%} of the "
          f"merged KV slots are padding (mean over {offline['forwards']} forwards)")
    return {
        "mixed_batch": {
            "requests": len(lens), "prompt_len_range": args.mixed_len, "prompt_lens": lens,
            "max_tokens": args.mixed_tokens, "seconds": round(seconds, 2),
            "output_tokens_per_s": round(len(lens) * args.mixed_tokens / seconds, 2),
            "replay_matches_engine": same,
            **summary,
            "per_forward_kv_padding_share": per_forward,
            "per_forward_kind": [r["kind"] for r in records],
            # what one merged tensor holds: each row's tokens at the first decode forward
            "rows_at_first_decode": next(r["rows"] for r in records if r["kind"] == "decode"),
        },
        "offline_workload_replayed": offline,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    sizes = [p["batch_size"] for p in points]
    padding = result.get("padding")
    fig, axes = plt.subplots(1, 2 if padding else 1, figsize=(12 if padding else 6.5, 4.2), squeeze=False)
    left = axes[0, 0]
    left.plot(sizes, [p["output_tokens_per_s"] for p in points], "o-", label="output tokens/s (prefill included)")
    left.plot(sizes, [p["decode_tokens_per_s"] for p in points], "s--", label="decode tokens/s (decode steps only)")
    base = points[0]["output_tokens_per_s"]
    left.plot(sizes, [base * b / sizes[0] for b in sizes], ":", color="gray", label="linear in the batch size")
    for p in points:
        left.annotate(f"{p['output_tokens_per_s']:.0f}", (p["batch_size"], p["output_tokens_per_s"]),
                      textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    left.set_xscale("log", base=2)
    left.set_xticks(sizes, [str(b) for b in sizes])
    top = max(max(p["decode_tokens_per_s"] for p in points), max(p["output_tokens_per_s"] for p in points))
    settings = result["settings"]
    left.set(xlabel="batch size (requests decoded together)", ylabel="tokens per second",
             title=f"{settings['prompt_len']}-token prompts, {settings['max_tokens']} tokens each",
             ylim=(0, top * 1.25))
    left.legend(fontsize=8, loc="upper left")
    if padding:
        mixed = padding["mixed_batch"]
        right = axes[0, 1]
        rows = mixed["rows_at_first_decode"]
        longest = max(rows)
        index = range(len(rows))
        right.barh(index, rows, color="tab:blue", label="cached tokens")
        right.barh(index, [longest - n for n in rows], left=rows, color="#dddddd", hatch="///",
                   edgecolor="#999999", label="padding")
        right.invert_yaxis()
        share = 1 - sum(rows) / (len(rows) * longest)
        right.set(xlabel=f"slots of the merged tensor [{len(rows)}, kv_heads, {longest}, head_dim]",
                  ylabel="request (row)", xlim=(0, longest * 1.32),
                  title=f"merged cache at the first decode step of {mixed['requests']} mixed prompts:\n"
                        f"{share:.0%} padding (mean over all {mixed['forwards']} forwards: "
                        f"{mixed['kv_padding_share_mean_per_forward']:.0%})")
        right.title.set_fontsize(10)
        right.legend(fontsize=8, loc="center right")
    machine = result["machine"]
    fig.suptitle(f"{result['checkpoint']} (chapter {result['chapter']}), {result['dtype']} on "
                 f"{machine['device']}: {machine['cpu']}, torch threads: {machine['torch_threads']}, "
                 f"CPU used by other processes: {machine.get('other_processes_cpu_share') or 0:.0%}", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
