"""decode-scaling: how the cost of one decode step grows with the length of the sequence.

For each prompt length n, a prompt of n random token ids is generated from twice, greedily and with
`ignore_eos=True`: once with `max_tokens=1` (the first token: one forward over the prompt) and once with
`max_tokens=1+k`. The difference divided by k is the cost of one decode step at a context of about n
tokens. Only the public `LLM` API is used, so the same workload measures every chapter's checkpoint:

    python -m benchmarks decode-scaling --checkpoint chapters.ch01_naive_decode.rosellm
"""

import datetime
import importlib
import json
import random
import statistics
import time
from pathlib import Path

from . import named_checkpoint
from .machine import command_line, machine_info, measure_watched

NAME = "decode-scaling"
HELP = "milliseconds per decode step against sequence length, for one chapter checkpoint"
CHAPTER = 2
ROOT = Path(__file__).resolve().parent.parent


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def add_arguments(parser) -> None:
    parser.add_argument("--checkpoint", default="rosellm",
                        help="chapter (2, ch02, ...) or module of a checkpoint (default: rosellm, the latest "
                             "chapter), e.g. chapters.ch01_naive_decode.rosellm")
    parser.add_argument("--model", default=None, help=".gguf file or Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lengths", type=int_list, default=[16, 64, 128, 256, 384, 512],
                        help="prompt lengths to measure at, comma-separated")
    parser.add_argument("--steps", type=int, default=4, help="decode steps timed at each length")
    parser.add_argument("--repeats", type=int, default=3,
                        help="keep the fastest of this many runs (other work on the machine only adds time)")
    parser.add_argument("--total-tokens", type=int, default=96,
                        help="also time one whole generation of this many tokens from the shortest "
                             "prompt, to check the per-step numbers add up (0: skip)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", type=Path, default=None,
                        help="result file (default: benchmarks/results/decode_scaling_chNN.json)")
    parser.add_argument("--figure", type=Path, default=None,
                        help="plot (default: docs/figures/decode_scaling_chNN.png)")


def timed_generate(engine, llm, prompt: list[int], max_tokens: int) -> float:
    """Seconds for one greedy `generate` of exactly `max_tokens` tokens."""
    params = engine.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    [output] = llm.generate([prompt], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert len(output.token_ids) == max_tokens, (len(output.token_ids), max_tokens)
    return elapsed


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of y = a + b x."""
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


def run(args) -> dict:
    result = measure_watched(args, measure)
    json_path = args.json or ROOT / "benchmarks" / "results" / f"decode_scaling_{result['tag']}.json"
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    figure_path = args.figure or ROOT / "docs" / "figures" / f"decode_scaling_{result['tag']}.png"
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
    start = time.perf_counter()
    llm = engine.LLM(model=args.model, device=args.device)
    load_s = time.perf_counter() - start

    rng = random.Random(args.seed)
    vocab = llm.tokenizer.vocab_size
    prompts = {n: [rng.randrange(vocab) for _ in range(n)] for n in args.lengths}
    timed_generate(engine, llm, prompts[args.lengths[0]], 2)  # warm-up: first calls are slower

    print(f"{args.checkpoint} (chapter {chapter}), {args.steps} decode steps per length, "
          f"best of {args.repeats}")
    # Whole passes over all lengths, repeated: a burst of other work on the machine then spoils one pass
    # (which the minimum discards), not every repeat of one length.
    firsts = {n: [] for n in args.lengths}
    fulls = {n: [] for n in args.lengths}
    wholes = []
    for repeat in range(args.repeats):
        print(f"pass {repeat + 1} of {args.repeats} ...", flush=True)
        for n in args.lengths:
            firsts[n].append(timed_generate(engine, llm, prompts[n], 1))
            fulls[n].append(timed_generate(engine, llm, prompts[n], 1 + args.steps))
        if args.total_tokens:
            wholes.append(timed_generate(engine, llm, prompts[args.lengths[0]], args.total_tokens))

    print(f"{'prompt':>7} {'first token ms':>15} {'decode ms/token':>16} {'tokens/s':>9}")
    points = []
    for n in args.lengths:
        first_s, full_s = min(firsts[n]), min(fulls[n])
        decode_ms = (full_s - first_s) / args.steps * 1000
        points.append({
            "prompt_len": n,
            # decode step j (1..k) runs with n + j tokens in the sequence
            "mean_context_len": n + (args.steps + 1) / 2,
            "first_token_ms": round(first_s * 1000, 2),
            "decode_ms_per_token": round(decode_ms, 2),
            "decode_tokens_per_s": round(1000 / decode_ms, 2),
        })
        print(f"{n:>7} {first_s * 1000:>15.1f} {decode_ms:>16.1f} {1000 / decode_ms:>9.1f}")

    intercept, slope = fit_line([p["mean_context_len"] for p in points],
                                [p["decode_ms_per_token"] for p in points])
    print(f"fit: decode ms/token = {intercept:.1f} + {slope:.3f} * sequence length")

    whole = None
    if args.total_tokens:
        n, total, measured = args.lengths[0], args.total_tokens, min(wholes)
        # the first token, then total-1 decode steps with n+1 .. n+total-1 tokens in the sequence
        predicted = points[0]["first_token_ms"] / 1000 + sum(
            intercept + slope * (n + i) for i in range(1, total)) / 1000
        whole = {"prompt_len": n, "max_tokens": total, "measured_s": round(measured, 2),
                 "predicted_from_fit_s": round(predicted, 2)}
        print(f"whole generation of {total} tokens from a {n}-token prompt: {measured:.1f} s "
              f"(the fit predicts {predicted:.1f} s)")

    result = {
        "workload": "decode-scaling",
        "tag": tag,
        "command": command_line(),
        "date": datetime.date.today().isoformat(),
        "checkpoint": args.checkpoint,
        "chapter": chapter,
        "model": args.model or "SmolLM2-135M-Instruct (bundled GGUF, dequantized)",
        "dtype": str(next(llm.model.parameters()).dtype).removeprefix("torch."),
        "settings": {"lengths": args.lengths, "steps": args.steps, "repeats": args.repeats,
                     "seed": args.seed, "greedy": True, "ignore_eos": True},
        "machine": machine,
        "load_s": round(load_s, 2),
        "points": points,
        "fit": {"intercept_ms": round(intercept, 2), "slope_ms_per_token": round(slope, 4)},
        "whole_generation": whole,
    }
    result["wall_s"] = round(time.perf_counter() - wall_start, 1)
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    lengths = [p["mean_context_len"] for p in points]
    fit = result["fit"]
    # One panel under the other, so that the figure stays readable at the width of a page.
    fig, (left, middle, right) = plt.subplots(3, 1, figsize=(7.5, 11))
    left.plot(lengths, [p["decode_ms_per_token"] for p in points], "o", label="decode step (measured)")
    left.plot([p["prompt_len"] for p in points], [p["first_token_ms"] for p in points], "x",
              label="first token (measured)")
    ends = [0, max(lengths)]
    left.plot(ends, [fit["intercept_ms"] + fit["slope_ms_per_token"] * x for x in ends], "--", color="gray",
              label=f"fit: {fit['intercept_ms']:.0f} ms + {fit['slope_ms_per_token']:.2f} ms × length")
    left.set(xlabel="tokens in the sequence", ylabel="milliseconds per generated token",
             title="cost of one step", xlim=(0, None), ylim=(0, None))
    left.legend(fontsize=8)
    middle.plot(lengths, [p["decode_tokens_per_s"] for p in points], "o-")
    middle.set(xlabel="tokens in the sequence", ylabel="generated tokens per second",
               title="decode speed", xlim=(0, None), ylim=(0, None))
    # Adding up the steps: the time to generate N tokens grows like N².
    whole = result.get("whole_generation")
    prompt_len = whole["prompt_len"] if whole else points[0]["prompt_len"]
    horizon = max(p["prompt_len"] for p in points) - prompt_len
    total_s, curve = points[0]["first_token_ms"] / 1000, [(1, points[0]["first_token_ms"] / 1000)]
    for n in range(1, horizon):
        total_s += (fit["intercept_ms"] + fit["slope_ms_per_token"] * (prompt_len + n)) / 1000
        curve.append((n + 1, total_s))
    right.plot(*zip(*curve), "--", color="gray", label="sum of the fitted step costs")
    if whole:
        right.plot([whole["max_tokens"]], [whole["measured_s"]], "o", label="measured")
    right.set(xlabel=f"tokens generated from a {prompt_len}-token prompt", ylabel="seconds",
              title="time to generate N tokens", xlim=(0, None), ylim=(0, None))
    right.legend(fontsize=8)
    machine = result["machine"]
    fig.suptitle(f"{result['checkpoint']} (chapter {result['chapter']}), {result['dtype']} on "
                 f"{machine['device']}: {machine['cpu']}, {machine['torch_threads']} threads", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
