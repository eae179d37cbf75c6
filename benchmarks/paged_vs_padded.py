"""paged-vs-padded: chapter 05's paged KV pool against chapter 03's padded, per-request caches.

Three measurements on SmolLM2-135M (fp32, CPU), all in one run:

(a) KV memory use. The mixed batch (16 random prompts of lengths uniform in [16, 512], 64 greedy tokens each,
    `ignore_eos`) runs through both checkpoints. At every step we record how many KV slots hold live tokens
    (the sum of the sequence lengths) and how many were allocated: for chapter 03 the merged tensor that
    `BatchedKVCache` pads to the longest row (and, beside it, the per-request contiguous caches sized for
    prompt + max_tokens), for chapter 05 the blocks handed out by the block manager × block_size (and the
    transient copy its PyTorch attention gathers). The frozen checkpoints are not edited: their methods are
    wrapped at run time, and unwrapped afterwards.
(b) Throughput. The same requests (32 random prompts, lengths uniform in [16, 128], max_tokens uniform in
    [8, 32], greedy, `ignore_eos`) through both checkpoints at max_batch_size 8 and 32, interleaved, the
    fastest of `--repeats` runs kept: useful output tokens per second of wall time, prefill included.
(c) Requests per KV budget. How many of (a)'s requests are admitted at once into a fixed budget of KV
    memory (256 MiB): computed for contiguous caches sized for max_model_len or for prompt + max_tokens,
    and for blocks of 16 under chapter 05's reservation rule, then checked by running chapter 05 with
    `kv_cache_memory` = the budget and counting the running sequences at every step.

    python -m benchmarks paged-vs-padded --threads 1

writes benchmarks/results/paged_vs_padded.json and docs/figures/paged_vs_padded.png. On a shared machine
use one thread: two OpenMP threads on two busy cores mostly wait for each other.
"""

import contextlib
import datetime
import gc
import json
import random
import statistics
import time
from pathlib import Path

import chapters

from .machine import command_line, machine_info, measure_watched

NAME = "paged-vs-padded"
HELP = "chapter 05's paged KV pool vs chapter 03's padded caches: KV memory use, throughput, requests per budget"
CHAPTER = 5
ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help=".gguf file or Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--parts", default="a,b,c", help="which measurements to run, comma-separated")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--max-model-len", type=int, default=1024, help="for both checkpoints")
    parser.add_argument("--block-size", type=int, default=16)
    # (a)
    parser.add_argument("--mixed-prompts", type=int, default=16, help="(a) number of prompts, one batch")
    parser.add_argument("--mixed-lengths", type=int_list, default=[16, 512], help="(a) prompt lengths: min,max")
    parser.add_argument("--mixed-max-tokens", type=int, default=64, help="(a) tokens generated per prompt")
    # (b)
    parser.add_argument("--batches", type=int_list, default=[8, 32], help="(b) max_batch_size values")
    parser.add_argument("--throughput-requests", type=int, default=32, help="(b) number of requests")
    parser.add_argument("--throughput-lengths", type=int_list, default=[16, 128], help="(b) prompt lengths: min,max")
    parser.add_argument("--throughput-max-tokens", type=int_list, default=[8, 32],
                        help="(b) max_tokens: min,max (uniform per request)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="(b) keep the fastest of this many runs (other work on the machine only adds time)")
    # (c)
    parser.add_argument("--budget-mib", type=int, default=256, help="(c) KV memory budget in MiB")
    parser.add_argument("--budget-requests", type=int, default=16,
                        help="(c) requests of (a)'s kind offered to the budget (the first ones are (a)'s)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "paged_vs_padded.json")
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "paged_vs_padded.png")


# --- wrapping the checkpoints' methods from the outside -------------------------------------------------


@contextlib.contextmanager
def wrapped(cls, name: str, make_wrapper):
    """Replace `cls.name` by `make_wrapper(original)` for the duration of the block."""
    original = cls.__dict__[name]
    setattr(cls, name, make_wrapper(original))
    try:
        yield
    finally:
        setattr(cls, name, original)


def random_prompts(rng: random.Random, vocab: int, count: int, lengths: list[int]) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def summarize(steps: list[dict], live: str, allocated: str) -> dict:
    shares = [step[live] / step[allocated] for step in steps]
    return {
        "mean_share_over_steps": round(statistics.fmean(shares), 4),
        "share_of_summed_slots": round(sum(s[live] for s in steps) / sum(s[allocated] for s in steps), 4),
        "min_share": round(min(shares), 4),
        "peak_allocated_slots": max(step[allocated] for step in steps),
        "per_step_share": [round(share, 4) for share in shares],
    }


# --- (a) KV memory use --------------------------------------------------------------------------------


def kv_use_ch03(ch03, llm, prompts, params) -> tuple[dict, list]:
    """Per step: live tokens, the slots of the padded merged tensor, the slots of the per-request caches."""
    steps = []

    def wrap_step(step):
        def recording_step(self):
            steps.append({"live": 0, "padded": 0, "contiguous": 0, "forwards": 0})
            return step(self)
        return recording_step

    def wrap_forward(forward):
        def recording_forward(self, token_lists, caches):
            # After this forward, row b holds cache.length + len(token_lists[b]) tokens; BatchedKVCache pads
            # every row of the merged tensor to the longest of them.
            lens = [cache.length + len(tokens) for cache, tokens in zip(caches, token_lists)]
            step = steps[-1]
            step["live"] += sum(lens)
            step["padded"] += len(lens) * max(lens)
            step["contiguous"] += sum(cache.capacity for cache in caches)
            step["forwards"] += 1
            return forward(self, token_lists, caches)
        return recording_forward

    with wrapped(ch03.scheduler.OfflineScheduler, "step", wrap_step), \
            wrapped(ch03.engine.InferenceEngine, "forward", wrap_forward):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return {"steps": len(steps), "wall_s": round(elapsed, 1),
            "padded_merged_cache": summarize(steps, "live", "padded"),
            "contiguous_caches": summarize(steps, "live", "contiguous"),
            "forwards_per_step_max": max(s["forwards"] for s in steps)}, outputs


def kv_use_ch05(ch05, llm, prompts, params) -> tuple[dict, list]:
    """Per step: live tokens, the slots of the blocks in use, the slots gathered by the reference attention."""
    steps = []
    manager = llm.block_manager
    block_size = manager.block_size

    def wrap_forward(forward):
        def recording_forward(self, token_lists, seq_lens, block_tables):
            in_tables = int((block_tables >= 0).sum())  # no block is shared in chapter 05
            in_use = manager.num_total_blocks - manager.num_free_blocks
            assert in_tables == in_use, (in_tables, in_use)
            needed = -(-max(seq_lens) // block_size)  # gather_kv reads this many blocks per sequence
            steps.append({"live": sum(seq_lens), "pool": in_use * block_size,
                          "gathered": len(seq_lens) * needed * block_size})
            return forward(self, token_lists, seq_lens, block_tables)
        return recording_forward

    with wrapped(ch05.engine.InferenceEngine, "forward", wrap_forward):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return {"steps": len(steps), "wall_s": round(elapsed, 1), "block_size": block_size,
            "pool_blocks_in_use": summarize(steps, "live", "pool"),
            "reference_attention_gather": summarize(steps, "live", "gathered")}, outputs


def measure_kv_use(args, ch03, ch05, llm03, llm05, vocab) -> dict:
    rng = random.Random(args.seed)
    prompts = random_prompts(rng, vocab, args.mixed_prompts, args.mixed_lengths)
    print(f"(a) KV memory use: {len(prompts)} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} "
          f"tokens, {args.mixed_max_tokens} tokens each", flush=True)
    result03, out03 = kv_use_ch03(ch03, llm03, prompts, ch03.SamplingParams(
        temperature=0.0, max_tokens=args.mixed_max_tokens, ignore_eos=True))
    result05, out05 = kv_use_ch05(ch05, llm05, prompts, ch05.SamplingParams(
        temperature=0.0, max_tokens=args.mixed_max_tokens, ignore_eos=True))
    same = sum(a.token_ids == b.token_ids for a, b in zip(out03, out05))
    for name, part in [("ch03 padded merged cache", result03["padded_merged_cache"]),
                       ("ch03 contiguous per-request caches", result03["contiguous_caches"]),
                       ("ch05 blocks in use", result05["pool_blocks_in_use"]),
                       ("ch05 reference attention's gather", result05["reference_attention_gather"])]:
        print(f"    {name:<36} live share {part['mean_share_over_steps']:.1%} (mean over steps), "
              f"min {part['min_share']:.1%}, peak {part['peak_allocated_slots']} slots")
    print(f"    same greedy tokens in {same} of {len(prompts)} requests", flush=True)
    return {"prompts": len(prompts), "prompt_lens": [len(p) for p in prompts],
            "max_tokens": args.mixed_max_tokens, "ch03": result03, "ch05": result05,
            "same_tokens": f"{same}/{len(prompts)}"}


# --- (b) throughput --------------------------------------------------------------------------------


def measure_throughput(args, engines: dict, vocab: int) -> dict:
    rng = random.Random(args.seed + 1)
    prompts = random_prompts(rng, vocab, args.throughput_requests, args.throughput_lengths)
    max_tokens = [rng.randint(*args.throughput_max_tokens) for _ in prompts]
    print(f"(b) throughput: {len(prompts)} requests, prompts {min(map(len, prompts))}..{max(map(len, prompts))} "
          f"tokens, max_tokens {min(max_tokens)}..{max(max_tokens)}, best of {args.repeats}", flush=True)
    times: dict[tuple[str, int], list[float]] = {key: [] for key in engines}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for repeat in range(args.repeats):
        for batch in args.batches:  # interleaved: a burst of other work spoils one run, not one configuration
            for chapter in ("ch03", "ch05"):
                module, llm = engines[chapter, batch]
                params = [module.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - start
                times[chapter, batch].append(elapsed)
                tokens[chapter, batch] = [o.token_ids for o in outputs]
                print(f"    pass {repeat + 1}: {chapter} batch {batch:>2}: {elapsed:6.1f} s", flush=True)
    useful = sum(max_tokens)
    rows = []
    for batch in args.batches:
        row = {"max_batch_size": batch}
        for chapter in ("ch03", "ch05"):
            best = min(times[chapter, batch])
            row[chapter] = {"best_s": round(best, 2), "all_s": [round(t, 2) for t in times[chapter, batch]],
                            "output_tokens_per_s": round(useful / best, 2)}
        row["ch05_over_ch03"] = round(row["ch05"]["output_tokens_per_s"] / row["ch03"]["output_tokens_per_s"], 3)
        row["same_tokens"] = "{}/{}".format(
            sum(a == b for a, b in zip(tokens["ch03", batch], tokens["ch05", batch])), len(prompts))
        rows.append(row)
        print(f"    batch {batch:>2}: ch03 {row['ch03']['output_tokens_per_s']:7.1f} tok/s, "
              f"ch05 {row['ch05']['output_tokens_per_s']:7.1f} tok/s, ch05/ch03 = {row['ch05_over_ch03']:.2f} "
              f"(same tokens in {row['same_tokens']} requests)", flush=True)
    return {"requests": len(prompts), "prompt_lens": [len(p) for p in prompts], "max_tokens": max_tokens,
            "output_tokens": useful, "rows": rows}


# --- (c) requests per budget ---------------------------------------------------------------------------


def first_come_first_served(costs: list[int], capacity: int) -> int:
    """How many requests, taken in order, fit together into `capacity` (the scheduler stops at the first
    one that does not fit)."""
    used = 0
    for count, cost in enumerate(costs):
        if used + cost > capacity:
            return count
        used += cost
    return len(costs)


def simulate_ch05(kv_tokens: list[int], max_tokens: int, num_blocks: int, block_size: int,
                  max_batch_size: int) -> list[int]:
    """Chapter 05's admission, replayed in plain Python: running sequences per step.

    A request is admitted when its reservation (blocks for prompt + max_tokens - 1 slots) fits beside the
    reservations of the running ones; with ignore_eos it runs exactly max_tokens steps, then frees them."""
    waiting = list(kv_tokens)
    running: list[list[int]] = []  # [blocks reserved, steps left]
    per_step = []
    while waiting or running:
        reserved = sum(r[0] for r in running)
        while waiting and len(running) < max_batch_size and reserved + -(-waiting[0] // block_size) <= num_blocks:
            running.append([-(-waiting.pop(0) // block_size), max_tokens])
            reserved += running[-1][0]
        per_step.append(len(running))
        for r in running:
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    return per_step


def measure_budget(args, ch05, common: dict) -> dict:
    budget = args.budget_mib * MIB
    llm = ch05.LLM(**common, block_size=args.block_size, max_batch_size=args.budget_requests,
                   kv_cache_memory=budget)
    bytes_per_token, vocab = llm.engine.bytes_per_token(), llm.tokenizer.vocab_size
    rng = random.Random(args.seed)  # the same generator as (a): its prompts come first
    prompts = random_prompts(rng, vocab, args.budget_requests, args.mixed_lengths)
    slots = budget // bytes_per_token
    block_size, max_tokens, max_len = args.block_size, args.mixed_max_tokens, args.max_model_len
    num_blocks = budget // (block_size * bytes_per_token)
    kv_tokens = [min(len(p) + max_tokens, max_len) - 1 for p in prompts]  # the last token is never cached
    computed = {
        "contiguous_for_max_model_len": slots // max_len,
        "contiguous_for_prompt_plus_max_tokens": first_come_first_served(kv_tokens, slots),
        "blocks_reserving_prompt_plus_max_tokens": first_come_first_served(
            [-(-n // block_size) for n in kv_tokens], num_blocks),
        # For comparison: what admitting on the prompt alone (chapter 07, which preempts when blocks run
        # out later) would let in at first.
        "blocks_reserving_prompt_only": first_come_first_served(
            [-(-len(p) // block_size) for p in prompts], num_blocks),
    }
    simulated = simulate_ch05(kv_tokens, max_tokens, num_blocks, block_size, max_batch_size=len(prompts))
    print(f"(c) a budget of {args.budget_mib} MiB = {slots} token slots of {bytes_per_token} B = {num_blocks} "
          f"blocks of {block_size}; {len(prompts)} requests offered", flush=True)
    for name, count in computed.items():
        print(f"    {name:<42} {count:>3} requests at once")

    assert llm.block_manager.num_total_blocks == num_blocks, llm.block_manager.num_total_blocks
    running, blocks_in_use = [], []

    def wrap_advance(advance):
        def recording_advance(self, sessions):
            running.append(len(sessions))
            blocks_in_use.append(self.block_manager.num_total_blocks - self.block_manager.num_free_blocks)
            return advance(self, sessions)
        return recording_advance

    params = ch05.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with wrapped(ch05.scheduler.OfflineScheduler, "_advance", wrap_advance):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    assert llm.block_manager.num_free_blocks == num_blocks  # every block came back
    print(f"    measured (chapter 05 with kv_cache_memory={args.budget_mib} MiB): peak {max(running)} running "
          f"sequences (simulated: {max(simulated)}), peak {max(blocks_in_use)} of {num_blocks} blocks in use; "
          f"{elapsed:.1f} s", flush=True)
    return {"budget_mib": args.budget_mib, "bytes_per_token": bytes_per_token, "token_slots": slots,
            "block_size": block_size, "num_blocks": num_blocks, "max_model_len": max_len,
            "max_tokens": max_tokens, "requests_offered": len(prompts), "prompt_lens": [len(p) for p in prompts],
            "computed": computed, "simulated_running_per_step": simulated,
            "measured_running_per_step": running, "measured_peak_running": max(running),
            "measured_peak_blocks_in_use": max(blocks_in_use), "wall_s": round(elapsed, 1),
            "dtype": str(next(llm.model.parameters()).dtype).removeprefix("torch.")}


# --- the run ----------------------------------------------------------------------------------------


def run(args) -> dict:
    result = measure_watched(args, measure)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.figure)
    print(f"wrote {args.json} and {args.figure} ({result['wall_s']} s)")
    return result


def measure(args) -> dict:
    wall_start = time.perf_counter()
    machine = machine_info(args.device)  # before we load the machine ourselves
    parts = set(args.parts.split(","))
    padded, paged = chapters.checkpoint(3), chapters.checkpoint(5)
    ch03, ch05 = padded.load(), paged.load()
    common = {"model": args.model, "device": args.device, "max_model_len": args.max_model_len}
    result = {"workload": "paged-vs-padded", "command": command_line(),
              "date": datetime.date.today().isoformat(), "checkpoints": [padded.module, paged.module],
              "model": args.model or "SmolLM2-135M-Instruct (bundled GGUF, dequantized)",
              "settings": {k: v for k, v in vars(args).items() if k not in ("json", "figure", "run")},
              "machine": machine}

    if parts & {"a", "b"}:
        batches = sorted(set(args.batches) | ({max(args.mixed_prompts, max(args.batches))} if "a" in parts else set()))
        engines = {}
        for batch in batches:
            engines["ch03", batch] = (ch03, ch03.LLM(**common, max_batch_size=batch))
            engines["ch05", batch] = (ch05, ch05.LLM(**common, max_batch_size=batch, block_size=args.block_size))
        any_llm = engines["ch05", batches[0]][1]
        vocab = any_llm.tokenizer.vocab_size
        result["dtype"] = str(next(any_llm.model.parameters()).dtype).removeprefix("torch.")
        for module, llm in engines.values():  # warm-up: first calls are slower
            llm.generate([[1, 2, 3]], module.SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        if "a" in parts:
            biggest = max(batches)  # room for the whole mixed batch at once in both chapters
            result["kv_use"] = measure_kv_use(args, ch03, ch05, engines["ch03", biggest][1],
                                              engines["ch05", biggest][1], vocab)
        if "b" in parts:
            result["throughput"] = measure_throughput(
                args, {key: value for key, value in engines.items() if key[1] in args.batches}, vocab)
        del engines, any_llm
        gc.collect()

    if "c" in parts:
        result["budget"] = measure_budget(args, ch05, common)
        result.setdefault("dtype", result["budget"].pop("dtype"))

    result["wall_s"] = round(time.perf_counter() - wall_start, 1)
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [key for key in ("kv_use", "throughput", "budget") if key in result]
    # One panel under the other, so that the figure stays readable at the width of a page.
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 4.2 * len(panels)), squeeze=False)
    for ax, key in zip(axes[:, 0], panels):
        if key == "kv_use":
            kv = result["kv_use"]
            curves = [("ch03: padded merged cache", kv["ch03"]["padded_merged_cache"], "#e6550d"),
                      ("ch03: contiguous caches (prompt + max_tokens)", kv["ch03"]["contiguous_caches"], "#fdae6b"),
                      ("ch05: blocks in use × block_size", kv["ch05"]["pool_blocks_in_use"], "#3182bd")]
            for label, part, color in curves:
                shares = [100 * s for s in part["per_step_share"]]
                ax.plot(range(1, len(shares) + 1), shares, color=color,
                        label=f"{label}: {100 * part['mean_share_over_steps']:.0f} %")
            ax.set(xlabel="step", ylabel="% of allocated KV slots holding live tokens", ylim=(0, 105),
                   title=f"(a) KV memory use, {kv['prompts']} prompts × {kv['max_tokens']} tokens")
            ax.legend(fontsize=7, loc="lower right")
        elif key == "throughput":
            rows = result["throughput"]["rows"]
            xs = range(len(rows))
            width = 0.38
            for offset, chapter, color in [(-width / 2, "ch03", "#e6550d"), (width / 2, "ch05", "#3182bd")]:
                values = [row[chapter]["output_tokens_per_s"] for row in rows]
                bars = ax.bar([x + offset for x in xs], values, width, color=color,
                              label={"ch03": "ch03 (padded)", "ch05": "ch05 (paged, PyTorch reference)"}[chapter])
                ax.bar_label(bars, fmt="%.1f", fontsize=7)
            ax.set_xticks(list(xs), [f"max_batch_size {row['max_batch_size']}" for row in rows])
            ax.set(ylabel="output tokens / s (best run)",
                   title=f"(b) throughput, {result['throughput']['requests']} requests")
            ax.legend(fontsize=7)
        else:
            budget = result["budget"]
            labels = {"contiguous_for_max_model_len": f"contiguous,\nmax_model_len\n({budget['max_model_len']})",
                      "contiguous_for_prompt_plus_max_tokens": "contiguous,\nprompt +\nmax_tokens",
                      "blocks_reserving_prompt_plus_max_tokens": f"blocks of {budget['block_size']},\nreserving\n"
                                                                 "prompt + max_tokens"}
            names = list(labels)
            values = [budget["computed"][name] for name in names]
            colors = ["#fdae6b", "#fdae6b", "#3182bd"]
            bars = ax.bar(range(len(names)), values, color=colors)
            ax.bar_label(bars, fontsize=8)
            ax.axhline(budget["measured_peak_running"], color="black", linestyle="--", linewidth=1,
                       label=f"ch05 run: peak {budget['measured_peak_running']} running")
            ax.set_xticks(range(len(names)), [labels[n] for n in names], fontsize=7)
            ax.set(ylabel="requests admitted at once",
                   ylim=(0, budget["requests_offered"] + 2),
                   title=f"(c) {budget['budget_mib']} MiB of KV: {budget['requests_offered']} requests offered")
            ax.legend(fontsize=7)
    machine = result["machine"]
    other = machine.get("other_processes_cpu_share")
    fig.suptitle(f"chapter 03 vs chapter 05, SmolLM2-135M {result.get('dtype', '')} on {machine['device']}:\n"
                 f"{machine['cpu']}, torch threads: {machine['torch_threads']}"
                 + (f", other processes used {other:.0%} of the CPU" if other is not None else ""), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
