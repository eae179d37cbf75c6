"""decode-scaling: how the cost of one decode step grows with the length of the sequence.

For each prompt length n, a prompt of n random token ids is generated from twice, greedily with EOS ignored:
once with `max_tokens=1` (the first token: one forward over the prompt) and once with `max_tokens=1+k`. The
difference divided by k is the cost of one decode step at a context of about n tokens. Only the public `LLM`
API is used, so the same workload measures every chapter's checkpoint (by default this chapter's):

    python -m benchmarks decode-scaling --checkpoint chapters.ch01_naive_decode.rosellm
"""

import statistics
from functools import partial

from . import harness
from .engines import timed_generate

NAME = "decode-scaling"
HELP = "milliseconds per decode step against sequence length, for one chapter checkpoint"
CHAPTER = 2

FULL = {"checkpoint": str(CHAPTER), "lengths": [16, 64, 128, 256, 384, 512], "steps": 4, "repeats": 3, "seed": 0}
FULL |= {"total_tokens": 96}  # one whole generation from the shortest prompt, to check that the steps add up
QUICK = {"lengths": [8, 16], "steps": 2, "repeats": 1, "total_tokens": 8}


def run(args, s: dict) -> dict:
    point = harness.named_checkpoint(s["checkpoint"])
    module = point.load()
    tag = f"ch{module.__chapter__[:2]}"
    return harness.save(args, NAME, partial(measure, args, s, point.module, module, tag), f"decode_scaling_{tag}", plot)


def measure(args, s: dict, name: str, module, tag: str) -> dict:
    llm = module.LLM(model=args.model)
    lengths, steps, total, vocab = s["lengths"], s["steps"], s["total_tokens"], llm.tokenizer.vocab_size
    prompts = {n: harness.random_requests(1, [n, n], [1, 1], vocab, s["seed"] + n)[0][0] for n in lengths}
    generate = partial(timed_generate, module, llm)
    generate([prompts[lengths[0]]], 2)  # warm-up: first calls are slower
    calls = {}
    for n in lengths:  # the first token alone, then with the decode steps
        calls["first", n] = partial(generate, [prompts[n]], 1)
        calls["full", n] = partial(generate, [prompts[n]], 1 + steps)
    if total:
        calls["whole"] = partial(generate, [prompts[lengths[0]]], total)
    best = {key: min(times) for key, times in timed_passes(calls, s["repeats"], name)[0].items()}
    points = []
    for n in lengths:
        decode_ms = (best["full", n] - best["first", n]) / steps * 1000
        point = dict(prompt_len=n, mean_context_len=n + (steps + 1) / 2)  # step j sees n + j tokens
        point |= dict(first_token_ms=round(best["first", n] * 1000, 2), decode_ms_per_token=round(decode_ms, 2))
        points.append(point | {"decode_tokens_per_s": round(1000 / decode_ms, 2)})
        print(f"  prompt {n:>5}: first token {point['first_token_ms']:.0f} ms, decode step {decode_ms:.1f} ms")
    xs, ys = [p["mean_context_len"] for p in points], [p["decode_ms_per_token"] for p in points]
    slope = statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else 0.0
    intercept = statistics.fmean(ys) - slope * statistics.fmean(xs)
    whole = None
    if total:  # the fitted steps added up, against one measured generation
        n = lengths[0]
        steps_s = sum(intercept + slope * (n + i) for i in range(1, total)) / 1000
        predicted = round(points[0]["first_token_ms"] / 1000 + steps_s, 2)
        whole = dict(prompt_len=n, max_tokens=total, measured_s=round(best["whole"], 2), predicted_from_fit_s=predicted)
    fit = {"intercept_ms": round(intercept, 2), "slope_ms_per_token": round(slope, 4)}
    out = checkpoint_record(name, module, llm) | dict(points=points, fit=fit, whole_generation=whole)
    return out | {"settings": s | {"greedy": True, "ignore_eos": True}, "tag": tag}


def plot(result: dict, path) -> None:
    points, fit, whole = result["points"], result["fit"], result["whole_generation"]
    fig, ((cost,), (speed,), (total,)) = harness.figure_axes(3, 1, (7.5, 11))
    lengths = [p["mean_context_len"] for p in points]
    cost.plot(lengths, [p["decode_ms_per_token"] for p in points], "o", label="decode step (measured)")
    cost.plot([p["prompt_len"] for p in points], [p["first_token_ms"] for p in points], "x", label="first token")
    a, b = fit["intercept_ms"], fit["slope_ms_per_token"]
    cost.plot(
        [0, max(lengths)], [a, a + b * max(lengths)], "--", color="gray", label=f"fit: {a:.0f} ms + {b:.2f} ms × length"
    )
    cost.set(xlabel="tokens in the sequence", ylabel="milliseconds per generated token", title="cost of one step")
    cost.legend(fontsize=8)
    speed.plot(lengths, [p["decode_tokens_per_s"] for p in points], "o-")
    speed.set(xlabel="tokens in the sequence", ylabel="generated tokens per second", title="decode speed")
    # adding up the fitted steps: the time to generate N tokens grows like N²
    start = points[0]["prompt_len"]
    seconds, curve = points[0]["first_token_ms"] / 1000, []
    for n in range(1, max(p["prompt_len"] for p in points) - start + 2):
        curve.append((n, seconds))
        seconds += (a + b * (start + n)) / 1000
    total.plot(*zip(*curve), "--", color="gray", label="sum of the fitted step costs")
    if whole:
        total.plot([whole["max_tokens"]], [whole["measured_s"]], "o", label="measured")
    total.set(xlabel=f"tokens generated from a {start}-token prompt", ylabel="seconds")
    total.set_title("time to generate N tokens")
    total.legend(fontsize=8)
    for ax in (cost, speed, total):
        ax.set(xlim=(0, None), ylim=(0, None))
    harness.save_figure(fig, path, result, f"{result['checkpoint']}, {result['dtype']}: ")


# --- timing a checkpoint's `LLM.generate` in passes (also chapter 03's and 05's workloads) --------------------


def timed_passes(calls: dict, repeats: int, label: str) -> tuple[dict, dict]:
    """Every call of `calls` (key -> a function that returns (seconds, outputs), like `timed_generate`) in
    `repeats` whole passes, the calls interleaved: a burst of other work spoils one pass, not one call, and the
    fastest of each call's runs discards it. Returns (key -> the seconds of each pass, key -> the last outputs)."""
    times, outputs = {key: [] for key in calls}, {}
    for repeat in range(repeats):
        print(f"{label}: pass {repeat + 1} of {repeats}", flush=True)
        for key, call in calls.items():
            seconds, outputs[key] = call()
            times[key].append(seconds)
    return times, outputs


def dtype_of(llm) -> str:
    """The dtype of a checkpoint's `LLM`'s weights: "float32", ..."""
    return str(next(llm.model.parameters()).dtype).removeprefix("torch.")


def checkpoint_record(name: str, module, llm) -> dict:
    """Which checkpoint a chapter workload measured, and in which dtype."""
    return {"checkpoint": name, "chapter": module.__chapter__, "dtype": dtype_of(llm)}
