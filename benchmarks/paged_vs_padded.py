"""paged-vs-padded: chapter 05's paged KV pool against chapter 03's padded, per-request caches, through the
checkpoints' public API only (one step at a time, see `OfflineStepper`):

(a) KV memory use: a mixed batch (16 random prompts of 16-512 tokens, 64 greedy tokens each, EOS ignored); after
    every step but the last, the live KV slots against chapter 03's merged cache padded to the longest row and
    its contiguous caches sized for prompt + max_tokens, and chapter 05's blocks in use.
(b) Throughput: 32 random prompts (16-128 tokens, 8-32 new tokens) at max_batch_size 8 and 32, interleaved,
    the fastest of `--repeats` runs: useful output tokens per second, prefill included.
(c) Requests per KV budget: how many of (a)'s requests fit at once in 256 MiB, computed for contiguous caches
    and for blocks of 16 reserving prompt + max_tokens (chapter 05's rule), then measured on chapter 05.

    python -m benchmarks paged-vs-padded --threads 1
"""

import statistics
from functools import partial

import chapters

from . import harness
from .decode_scaling import dtype_of, timed_passes
from .engines import timed_generate

NAME = "paged-vs-padded"
HELP = "chapter 05's paged KV pool vs chapter 03's padded caches: KV memory use, throughput, requests per budget"
CHAPTER = 5

FULL = {"max_model_len": 1024, "block_size": 16, "seed": 0, "budget_mib": 256}
FULL |= {"mixed_prompts": 16, "mixed_lengths": [16, 512], "mixed_max_tokens": 64}  # (a), and (c)'s requests
FULL |= {"batches": [8, 32], "throughput_requests": 32, "throughput_lengths": [16, 128], "repeats": 2}  # (b)
FULL |= {"throughput_max_tokens": [8, 32]}
QUICK = {"max_model_len": 256, "block_size": 4, "budget_mib": 1, "mixed_prompts": 3, "mixed_lengths": [4, 24]}
QUICK |= {"mixed_max_tokens": 4, "batches": [2], "throughput_requests": 3, "throughput_lengths": [4, 16]}
QUICK |= {"throughput_max_tokens": [2, 4], "repeats": 1}


def run(args, s: dict) -> dict:
    return harness.save(args, NAME, lambda: measure(args, s), "paged_vs_padded", plot)


class OfflineStepper:
    """A chapter 03-05 `LLM` stepped through its offline scheduler, one step at a time: a step returns (key,
    token ids so far, finished) for each request that got a token. (Chapter 07's workloads step its engine.)"""

    def __init__(self, module, llm):
        self.module, self.llm, self.sessions = module, llm, {}

    def add(self, key: str, prompt: list[int], max_tokens: int) -> None:
        params = self.module.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.sessions[key] = self.llm.add_request(prompt, params)

    def step(self) -> list[tuple[str, list[int], bool]]:
        keys = {id(session): key for key, session in self.sessions.items()}
        return [
            (keys[id(session)], list(session.output.token_ids), session.finished)
            for session, _ in self.llm.scheduler.step()
        ]

    def busy(self) -> bool:
        return self.llm.scheduler.has_unfinished_requests()


def measure(args, s: dict) -> dict:
    ch03, ch05 = chapters.checkpoint(3).load(), chapters.checkpoint(5).load()

    def make(module, batch: int, **extra):
        paged = {"block_size": s["block_size"]} if module is ch05 else {}
        return module.LLM(args.model, max_model_len=s["max_model_len"], max_batch_size=batch, **paged, **extra)

    mixed_tokens, vocab = [s["mixed_max_tokens"]] * 2, make(ch05, 1).tokenizer.vocab_size
    mixed = harness.random_requests(s["mixed_prompts"], s["mixed_lengths"], mixed_tokens, vocab, s["seed"])
    print(f"(a) KV memory use: {len(mixed)} prompts, {s['mixed_max_tokens']} tokens each", flush=True)
    steps03, tokens03 = kv_use(OfflineStepper(ch03, make(ch03, len(mixed))), mixed, s["block_size"])
    steps05, tokens05 = kv_use(OfflineStepper(ch05, make(ch05, len(mixed))), mixed, s["block_size"])
    kv = dict(prompts=len(mixed), prompt_lens=[len(p) for p, _ in mixed], max_tokens=s["mixed_max_tokens"])
    kv["ch03"] = dict(steps=len(steps03), padded_merged_cache=share(steps03, "padded"))
    kv["ch03"]["contiguous_caches"] = share(steps03, "contiguous")
    kv["ch05"] = dict(steps=len(steps05), block_size=s["block_size"], pool_blocks_in_use=share(steps05, "pool"))
    kv["ch05"]["reference_attention_gather"] = share(steps05, "gathered")
    kv["same_tokens"] = f"{sum(tokens03[k] == tokens05[k] for k in tokens03)}/{len(mixed)}"
    llms = {
        (name, b): (module, make(module, b)) for b in s["batches"] for name, module in (("ch03", ch03), ("ch05", ch05))
    }
    out = dict(settings=s | {"threads": args.threads}, checkpoints=[chapters.checkpoint(n).module for n in (3, 5)])
    out |= dict(dtype=dtype_of(next(iter(llms.values()))[1]), kv_use=kv, throughput=throughput(s, llms, vocab))
    budget_llm = make(ch05, len(mixed), kv_cache_memory=s["budget_mib"] << 20)
    return out | {"budget": budget(s, ch05, budget_llm, mixed)}


def kv_use(stepper, requests: list, block_size: int) -> tuple[list[dict], dict]:
    """Per step (but the last): live slots, and the slots of each way of holding them."""
    for i, (prompt, max_tokens) in enumerate(requests):
        stepper.add(str(i), prompt, max_tokens)
    steps, tokens, manager = [], {}, getattr(stepper.llm, "block_manager", None)
    while stepper.busy():
        advanced = stepper.step()
        stored = [len(requests[int(k)][0]) + len(t) - 1 for k, t, _ in advanced]  # the newest is not stored yet
        tokens.update({k: t for k, t, _ in advanced})
        if advanced and not any(done for *_, done in advanced):
            reserved = sum(len(requests[int(k)][0]) + requests[int(k)][1] - 1 for k, *_ in advanced)
            gathered = len(stored) * -(-max(stored) // block_size) * block_size
            step = dict(live=sum(stored), padded=len(stored) * max(stored), contiguous=reserved, gathered=gathered)
            if manager:
                step["pool"] = (manager.num_total_blocks - manager.num_free_blocks) * block_size
            steps.append(step)
    return steps, tokens


def share(steps: list[dict], allocated: str) -> dict:
    """How much of what `allocated` holds is live, step by step and over the run."""
    shares = [step["live"] / step[allocated] for step in steps]
    out = dict(mean_share_over_steps=round(statistics.fmean(shares), 4), min_share=round(min(shares), 4))
    out |= dict(share_of_summed_slots=round(sum(s["live"] for s in steps) / sum(s[allocated] for s in steps), 4))
    return out | dict(
        peak_allocated_slots=max(s[allocated] for s in steps), per_step_share=[round(x, 4) for x in shares]
    )


def throughput(s: dict, llms: dict, vocab: int) -> dict:
    """(b): the same requests through every (chapter, max_batch_size), interleaved, the fastest run of each."""
    lengths, max_tokens = s["throughput_lengths"], s["throughput_max_tokens"]
    requests = harness.random_requests(s["throughput_requests"], lengths, max_tokens, vocab, s["seed"] + 1)
    prompts, max_tokens = [p for p, _ in requests], [m for _, m in requests]
    calls = {key: partial(timed_generate, module, llm, prompts, max_tokens) for key, (module, llm) in llms.items()}
    times, outputs = timed_passes(calls, s["repeats"], f"(b) throughput, {len(prompts)} requests")
    rows = []
    for b in s["batches"]:
        row = {"max_batch_size": b}
        for name in ("ch03", "ch05"):
            best, tokens = min(times[name, b]), sum(max_tokens)
            row[name] = dict(best_s=round(best, 2), all_s=[round(t, 2) for t in times[name, b]])
            row[name]["output_tokens_per_s"] = round(tokens / best, 2)
        row["ch05_over_ch03"] = round(row["ch05"]["output_tokens_per_s"] / row["ch03"]["output_tokens_per_s"], 3)
        same = sum(a.token_ids == c.token_ids for a, c in zip(outputs["ch03", b], outputs["ch05", b]))
        rows.append(row | {"same_tokens": f"{same}/{len(prompts)}"})
    out = dict(requests=len(prompts), prompt_lens=[len(p) for p in prompts], max_tokens=max_tokens)
    return out | dict(output_tokens=sum(max_tokens), rows=rows)


def budget(s: dict, ch05, llm, mixed: list) -> dict:
    """(c): how many of (a)'s requests fit at once in the KV budget `llm` was given, computed and measured."""
    bs, blocks, per_token = s["block_size"], llm.block_manager.num_total_blocks, llm.engine.bytes_per_token()
    slots = (s["budget_mib"] << 20) // per_token
    needs = [min(len(p) + m, s["max_model_len"]) - 1 for p, m in mixed]  # the last token is never cached

    def fitting(costs: list[int], capacity: int) -> int:
        """How many requests, taken in order, fit together (admission stops at the first that does not)."""
        return next((k for k in range(len(costs)) if sum(costs[: k + 1]) > capacity), len(costs))

    computed = dict(contiguous_for_max_model_len=slots // s["max_model_len"])
    computed["contiguous_for_prompt_plus_max_tokens"] = fitting(needs, slots)
    computed["blocks_reserving_prompt_plus_max_tokens"] = fitting([-(-n // bs) for n in needs], blocks)
    computed["blocks_reserving_prompt_only"] = fitting([-(-len(p) // bs) for p, _ in mixed], blocks)
    stepper, running, in_use = OfflineStepper(ch05, llm), [], []
    for i, (prompt, m) in enumerate(mixed):
        stepper.add(str(i), prompt, m)
    while stepper.busy():
        running.append(len(stepper.step()))
        in_use.append(blocks - llm.block_manager.num_free_blocks)
    print(f"(c) {s['budget_mib']} MiB: computed {computed}; measured peak {max(running)} running", flush=True)
    out = dict(budget_mib=s["budget_mib"], bytes_per_token=per_token, token_slots=slots, block_size=bs)
    out |= dict(num_blocks=blocks, max_model_len=s["max_model_len"], max_tokens=s["mixed_max_tokens"])
    out |= dict(requests_offered=len(mixed), computed=computed, measured_running_per_step=running)
    return out | dict(measured_peak_running=max(running), measured_peak_blocks_in_use=max(in_use))


def plot(result: dict, path) -> None:
    kv, rows, fits = result["kv_use"], result["throughput"]["rows"], result["budget"]
    fig, ((use,), (speed,), (fit,)) = harness.figure_axes(3, 1, (7.5, 12.6))
    for label, part, color in (
        ("ch03: padded merged cache", kv["ch03"]["padded_merged_cache"], "#e6550d"),
        ("ch03: contiguous caches", kv["ch03"]["contiguous_caches"], "#fdae6b"),
        ("ch05: blocks in use × block_size", kv["ch05"]["pool_blocks_in_use"], "#3182bd"),
    ):
        label += f": {100 * part['mean_share_over_steps']:.0f} %"
        use.plot([100 * x for x in part["per_step_share"]], color=color, label=label)
    use.set(xlabel="step", ylabel="% of allocated KV slots holding live tokens", ylim=(0, 105))
    use.set_title(f"(a) KV memory use, {kv['prompts']} prompts × {kv['max_tokens']} tokens")
    use.legend(fontsize=7, loc="lower right")
    for offset, name, color in ((-0.19, "ch03", "#e6550d"), (0.19, "ch05", "#3182bd")):
        speeds = [r[name]["output_tokens_per_s"] for r in rows]
        bars = speed.bar([i + offset for i in range(len(rows))], speeds, 0.38, color=color, label=name)
        speed.bar_label(bars, fmt="%.1f", fontsize=7)
    speed.set_xticks(range(len(rows)), [f"max_batch_size {r['max_batch_size']}" for r in rows])
    speed.set(ylabel="output tokens / s (best run)")
    speed.set_title(f"(b) throughput, {result['throughput']['requests']} requests")
    speed.legend(fontsize=7)
    counts = list(fits["computed"].values())[:3]  # contiguous for max_model_len, for prompt + max_tokens; blocks
    names = ["contiguous,\nmax_model_len", "contiguous,\nprompt + max_tokens", "blocks, reserving\nprompt + max_tokens"]
    fit.bar_label(fit.bar(names, counts, color=["#fdae6b", "#fdae6b", "#3182bd"]), fontsize=8)
    peak = fits["measured_peak_running"]
    fit.axhline(peak, color="black", ls="--", lw=1, label=f"ch05 run: peak {peak} running")
    fit.set(ylabel="requests admitted at once", ylim=(0, fits["requests_offered"] + 2))
    fit.set_title(f"(c) {fits['budget_mib']} MiB of KV: {fits['requests_offered']} requests offered")
    fit.legend(fontsize=7)
    harness.save_figure(fig, path, result, "chapter 03 vs chapter 05: ")
