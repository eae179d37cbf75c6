"""long-prompts: long prompts arriving while others decode, and what chunked prefill does to latency.

Sixteen requests decode from the first step; long prompts arrive before fixed steps. Each configuration
(chunked prefill off, or on with a token budget) serves the same requests on a fresh engine. Reported per
configuration: the decoding requests' time per output token (p50, p90 and max of the gaps between two of
their tokens), the long prompts' time to first token, the run's output tokens/s, and every step's duration.

    python -m benchmarks long-prompts
"""

import time

import chapters

from . import harness

NAME = "long-prompts"
HELP = "long prompts arriving while 16 requests decode: decode latency and TTFT, chunked prefill on and off"
CHAPTER = 8

FULL = {"budgets": ["off", "256", "512"], "decoders": 16, "long_prompt": 1000, "long_at": [10, 30, 50]}
QUICK = {"budgets": ["off", "16"], "decoders": 3, "long_prompt": 40, "long_at": [3, 6]}


def run(args, s: dict) -> dict:
    return harness.save(args, NAME, lambda: measure(args, s), "long_prompts", plot, "ch08_long_prompts")


def requests(s: dict, vocab_size: int) -> list[tuple[int, str, list[int], int]]:
    """(arrival step, id, prompt, max_tokens): the decoders at step 1, lasting past the last long prompt's
    prefill, then the long prompts (8 tokens each)."""

    def token(i: int, j: int) -> int:
        return (i * 7919 + j * 104729) % (vocab_size - 10) + 5

    lasting = max(s["long_at"]) + 20
    decoders = [(1, f"d{i}", [token(i, j) for j in range(64)], lasting) for i in range(s["decoders"])]
    longs = [
        (at, f"long{k}", [token(100 + k, j) for j in range(s["long_prompt"])], 8) for k, at in enumerate(s["long_at"])
    ]
    return decoders + longs


def make_engine(package, model, budget: str):
    """Chunked prefill off, or on with a token budget (and at most as many sequences as tokens)."""
    if budget == "off":
        return package.LLMEngine(model, max_num_seqs=32, enable_chunked_prefill=False)
    return package.LLMEngine(model, max_num_seqs=min(32, int(budget)), max_num_batched_tokens=int(budget))


def serve(engine, package, budget: str, reqs) -> dict:
    """Run `reqs` to the end; time every step and every request's tokens."""
    params = {rid: package.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, rid, _, n in reqs}
    arrived, token_times, steps, step = {}, {}, [], 0
    start = time.perf_counter()
    while step < max(arrival for arrival, *_ in reqs) or engine.has_unfinished_requests():
        step += 1
        for arrival, rid, prompt, _ in reqs:
            if arrival == step:
                engine.add_request(rid, prompt, params[rid])
                arrived[rid] = time.perf_counter()
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps.append({"t": round(before - start, 4), "seconds": round(now - before, 4), "outputs": len(outputs)})
        for output in outputs:
            token_times.setdefault(output.request_id, []).append(now)
    elapsed = time.perf_counter() - start
    gaps = [b - a for rid, times in token_times.items() if rid.startswith("d") for a, b in zip(times, times[1:])]
    tpot = dict(p50=round(1000 * harness.percentile(gaps, 50), 1), p90=round(1000 * harness.percentile(gaps, 90), 1))
    tpot["max"] = round(1000 * max(gaps), 1)
    ttft = [round(token_times[rid][0] - arrived[rid], 3) for rid in arrived if rid.startswith("long")]
    out = dict(budget=budget, decode_tpot_ms=tpot, long_ttft_s=ttft)
    out |= dict(output_tokens_per_s=round(sum(len(t) for t in token_times.values()) / elapsed, 1))
    return out | dict(seconds=round(elapsed, 2), steps=steps)


def measure(args, s: dict) -> dict:
    point = chapters.checkpoint(CHAPTER)
    package = point.load()
    runs, reqs = [], None
    for budget in s["budgets"]:
        engine = make_engine(package, args.model, budget)
        reqs = reqs or requests(s, engine.model.config.vocab_size)
        runs.append(serve(engine, package, budget, reqs))
        del engine
    print(f"{'budget':>7} {'TPOT p50':>9} {'p90':>7} {'max':>7}  {'long TTFT s':<22} {'tok/s':>6}")
    for r in runs:
        tpot, ttft = r["decode_tpot_ms"], ", ".join(f"{t:.2f}" for t in r["long_ttft_s"])
        print(
            f"{r['budget']:>7} {tpot['p50']:9.1f} {tpot['p90']:7.1f} {tpot['max']:7.1f}  {ttft:<22} "
            f"{r['output_tokens_per_s']:6.1f}"
        )
    return {"settings": s, "checkpoint": point.module, "runs": runs}


def plot(result: dict, path) -> None:
    """Every step's duration over the run, one line per configuration."""
    fig, ((ax,),) = harness.figure_axes(1, 1, (8, 3.6))
    for r in result["runs"]:
        label = "chunked prefill off" if r["budget"] == "off" else f"chunked, budget {r['budget']}"
        times, ms = [s["t"] for s in r["steps"]], [1000 * s["seconds"] for s in r["steps"]]
        ax.step(times, ms, where="post", label=label, linewidth=1)  # each step drawn over the time it took
    title = f"{result['settings']['decoders']} requests decoding, long prompts arriving: every step"
    ax.set(xlabel="time since the first step (s)", ylabel="step duration (ms)", title=title)
    ax.legend(fontsize=8)
    harness.save_figure(fig, path, result)
