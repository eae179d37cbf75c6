"""arrivals: requests that arrive over time, served by chapter 05's offline scheduler and by chapter 07's
continuous-batching engine, on the same KV pool.

Request i arrives at engine step `i * every` (a clock counted in steps, so both engines see the same arrival
pattern). Both run greedy with EOS ignored, so they produce the same tokens per request (checked) and the same
work; what differs is how many requests each keeps in flight. Times to first token are given in seconds and in
engine steps (steps do not depend on how busy the machine is). Chapter 05 admits a request only when its worst
case (prompt + max_tokens) fits; chapter 07 admits on the prompt alone and preempts when the pool runs out:
a preemption is seen through the public queues (running before a step, waiting after it).

    python -m benchmarks arrivals
"""

import statistics
import time

import chapters

from . import harness
from .paged_vs_padded import OfflineStepper

NAME = "arrivals"
HELP = "requests arriving over time: chapter 05's scheduler against chapter 07's on one KV pool"
CHAPTER = 7

FULL = {"requests": 24, "every": 2, "prompt_len": [16, 128], "max_tokens": [16, 96], "seed": 0}
FULL |= {"block_size": 16, "num_kv_blocks": 48, "max_batch": 32}  # one KV pool for both chapters
QUICK = {"requests": 6, "prompt_len": [4, 12], "max_tokens": [4, 8], "num_kv_blocks": 12, "block_size": 4}


def run(args, s: dict) -> dict:
    return harness.save(args, NAME, lambda: measure(args, s), "arrivals", plot)


class EngineStepper:
    """A chapter 07+ `LLMEngine` stepped like `OfflineStepper`; also tells which requests a step preempted
    (running before, waiting after)."""

    def __init__(self, module, engine):
        self.module, self.engine, self.preempted = module, engine, []

    def add(self, key: str, prompt: list[int], max_tokens: int) -> None:
        params = self.module.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(key, prompt, params)

    def step(self) -> list[tuple[str, list[int], bool]]:
        running = {seq.request_id for seq in self.engine.scheduler.running}
        outputs = self.engine.step()
        self.preempted = sorted(running & {seq.request_id for seq in self.engine.scheduler.waiting})
        return [(o.request_id, list(o.token_ids), o.finished) for o in outputs]

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()


def serve(stepper, requests: list, every: int) -> dict:
    """Run the arrival pattern to the end; times are wall-clock seconds from the first step."""
    arrived, first, done, tokens, produced = {}, {}, {}, {}, {}  # arrived, first: (seconds, step)
    batches, preemptions, recomputed = [], 0, 0
    step, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while len(done) < len(requests):
        for index, (prompt, max_tokens) in enumerate(requests):
            if index * every == step:
                stepper.add(str(index), prompt, max_tokens)
                arrived[str(index)] = (time.perf_counter() - start, step)
        advanced = stepper.step()
        now = time.perf_counter() - start
        for key in getattr(stepper, "preempted", []):  # its cached tokens are thrown away, to be recomputed
            preemptions += 1
            recomputed += len(requests[int(key)][0]) + len(produced.get(key, [])) - 1
        batches.append(len(advanced))
        for key, token_ids, finished in advanced:
            first.setdefault(key, (now, step))
            produced[key] = token_ids
            if finished:
                done[key], tokens[key] = now, token_ids
        step += 1
    cpu = time.process_time() - cpu_start
    ttft = [first[k][0] - arrived[k][0] for k in arrived]
    ttft_steps = [first[k][1] - arrived[k][1] for k in arrived]  # 0: prefilled on arrival
    wall, output = max(done.values()), sum(len(t) for t in tokens.values())
    out = dict(seconds=round(wall, 3), cpu_seconds=round(cpu, 3), steps=step, output_tokens=output)
    out |= dict(output_tokens_per_s=round(output / wall, 2), output_tokens_per_cpu_s=round(output / cpu, 2))
    out |= dict(mean_batch=round(statistics.fmean(n for n in batches if n), 2))
    out |= dict(ttft_median_s=round(statistics.median(ttft), 3), ttft_p90_s=round(harness.percentile(ttft, 90), 3))
    out |= dict(ttft_median_steps=statistics.median(ttft_steps), ttft_p90_steps=harness.percentile(ttft_steps, 90))
    out |= dict(ttft_max_steps=max(ttft_steps), preemptions=preemptions, recomputed_tokens=recomputed)
    latency = statistics.median([done[k] - arrived[k][0] for k in arrived])
    return out | dict(latency_median_s=round(latency, 3), tokens=tokens)


def measure(args, s: dict) -> dict:
    before, after = chapters.checkpoint(5), chapters.checkpoint(CHAPTER)
    ch05, ch07 = before.load(), after.load()
    pool = {"block_size": s["block_size"], "num_kv_blocks": s["num_kv_blocks"]}
    steppers = {
        before.name: OfflineStepper(ch05, ch05.LLM(args.model, max_batch_size=s["max_batch"], **pool)),
        after.name: EngineStepper(ch07, ch07.LLMEngine(args.model, max_num_seqs=s["max_batch"], **pool)),
    }
    vocab = steppers[before.name].llm.tokenizer.vocab_size
    requests = harness.random_requests(s["requests"], s["prompt_len"], s["max_tokens"], vocab, s["seed"])
    results = {name: serve(stepper, requests, s["every"]) for name, stepper in steppers.items()}
    old, new = (r.pop("tokens") for r in results.values())
    del results[before.name]["preemptions"], results[before.name]["recomputed_tokens"]
    a, b = results.values()
    for name, r in results.items():
        print(
            f"  {name}: {r['output_tokens_per_s']:.1f} tokens/s, {r['steps']} steps, mean batch {r['mean_batch']}, "
            f"TTFT median {r['ttft_median_steps']} steps"
        )
    return {
        "settings": s | {"threads": args.threads},
        "results": results,
        "correct": {k: len(v) for k, v in old.items()} == {k: len(v) for k, v in new.items()},
        "requests_with_identical_tokens": f"{sum(old[k] == new[k] for k in old)}/{len(old)}",
        "speedup_ch07_over_ch05": round(b["output_tokens_per_s"] / a["output_tokens_per_s"], 2),
        "speedup_ch07_over_ch05_cpu_time": round(b["output_tokens_per_cpu_s"] / a["output_tokens_per_cpu_s"], 2),
    }


def plot(result: dict, path) -> None:
    """Output tokens/s (left) and the time to first token in engine steps, median and p90 (right), per chapter."""
    runs, s = result["results"], result["settings"]
    names = [name[:4] + "\n" + name[5:].replace("_", " ") for name in runs]  # "ch05\npaged attention"
    colors = ["tab:gray", "tab:red"]
    fig, ((speed, ttft),) = harness.figure_axes(1, 2, (10, 4))
    bars = speed.bar(names, [r["output_tokens_per_s"] for r in runs.values()], color=colors)
    speed.bar_label(bars, [f"{r['output_tokens_per_s']:.1f}" for r in runs.values()], fontsize=9)
    speed.set(ylabel="output tokens/s", title="throughput")
    for offset, key, hatch in ((-0.2, "ttft_median_steps", ""), (0.2, "ttft_p90_steps", "//")):
        values = [r[key] for r in runs.values()]
        bars = ttft.bar([i + offset for i in range(len(runs))], values, 0.4, color=colors, hatch=hatch)
        ttft.bar_label(bars, [f"{v:.0f}" for v in values], fontsize=9)
    ttft.set_xticks(range(len(runs)), names)
    ttft.set(ylabel="engine steps", title="time to first token, in steps: median, p90 (hatched)")
    for ax in (speed, ttft):
        ax.tick_params(axis="x", labelsize=9)
        ax.margins(y=0.15)
    arriving = f"{s['requests']} requests, one every {s['every']} steps, a pool of {s['num_kv_blocks']} blocks; "
    harness.save_figure(fig, path, result, arriving)
