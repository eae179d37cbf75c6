"""Long prompts arriving while others decode: what chunked prefill does to latency (chapter 08).

Sixteen requests decode; long prompts arrive at fixed steps. Each configuration (chunked prefill off, or
on at a few token budgets) runs the same requests on the same engine settings. Reported per configuration:
the decoding requests' time per output token (p50, p90, max: the gap between two of their tokens), the
long requests' time to first token, the whole run's output tokens/s, and every step's duration (figure).
"""

import argparse
import datetime
import json
import time
from pathlib import Path

from .machine import OtherLoad, command_line, machine_info

NAME = "long-prompts"
CHAPTER = 8
HELP = "long prompts arriving while 16 requests decode: decode latency and TTFT, chunked prefill on and off"
RESULTS = Path(__file__).resolve().parent / "results"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="None: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--budgets", default="off,256,512", help="'off' (chunked prefill off) and token budgets")
    parser.add_argument("--decoders", type=int, default=16, help="requests decoding from the first step")
    parser.add_argument("--long-prompt", type=int, default=1000, help="tokens in each long prompt")
    parser.add_argument("--long-at", default="10,30,50", help="the steps before which a long prompt arrives")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny run to check the workload (written only where --json and --figure say)")
    parser.add_argument("--json", type=Path, help=f"default: {RESULTS / 'long_prompts.json'} (not with --quick)")
    parser.add_argument("--figure", type=Path, help="default: docs/figures/ch08_long_prompts.png (not with --quick)")


def requests(args, vocab_size: int) -> list[tuple[int, str, list[int], int]]:
    """(arrival step, id, prompt, max_tokens): the decoders at step 1, then the long prompts."""
    long_at = [int(s) for s in args.long_at.split(",")]
    last = max(long_at) + 20  # the decoders outlive the last long prompt's prefill
    token = lambda i, j: (i * 7919 + j * 104729) % (vocab_size - 10) + 5  # noqa: E731
    decoders = [(1, f"d{i}", [token(i, j) for j in range(64)], last) for i in range(args.decoders)]
    longs = [(step, f"long{k}", [token(100 + k, j) for j in range(args.long_prompt)], 8)
             for k, step in enumerate(long_at)]
    return decoders + longs


def make_engine(package, model, budget: str):
    """Chunked prefill off, or on with a token budget (and at most as many sequences as tokens)."""
    if budget == "off":
        return package.LLMEngine(model, max_num_seqs=32, enable_chunked_prefill=False)
    return package.LLMEngine(model, max_num_seqs=min(32, int(budget)), max_num_batched_tokens=int(budget))


def serve(engine, package, budget: str, reqs) -> dict:
    """Run `reqs` on a fresh engine; time every step and every token."""
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
        steps.append({"t": round(before - start, 4), "seconds": round(now - before, 4),
                      "outputs": len(outputs)})  # requests that got a token
        for output in outputs:
            token_times.setdefault(output.request_id, []).append(now)
    elapsed = time.perf_counter() - start
    gaps = [b - a for rid, times in token_times.items() if rid.startswith("d") for a, b in zip(times, times[1:])]
    ttft = [token_times[rid][0] - arrived[rid] for rid in arrived if rid.startswith("long")]
    return {
        "budget": budget,
        "decode_tpot_ms": {q: round(1000 * quantile(gaps, q), 1) for q in ("p50", "p90", "max")},
        "long_ttft_s": [round(t, 3) for t in ttft],
        "output_tokens_per_s": round(sum(len(t) for t in token_times.values()) / elapsed, 1),
        "seconds": round(elapsed, 2),
        "steps": steps,
    }


def quantile(values: list[float], name: str) -> float:
    ordered = sorted(values)
    if name == "max":
        return ordered[-1]
    return ordered[min(len(ordered) - 1, int({"p50": 0.5, "p90": 0.9}[name] * len(ordered)))]


def run(args) -> dict:
    import chapters
    import torch

    torch.set_num_threads(args.threads)
    package = chapters.latest().load()
    if args.quick:
        args.decoders, args.long_prompt, args.long_at, args.budgets = 3, 40, "3,6", "off,16"
    runs, reqs = [], None
    with OtherLoad() as other:
        for budget in args.budgets.split(","):
            engine = make_engine(package, args.model, budget)
            reqs = reqs or requests(args, engine.model.config.vocab_size)
            runs.append(serve(engine, package, budget, reqs))
    result = {
        "workload": NAME,
        "command": command_line(),
        "date": datetime.date.today().isoformat(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "figure")},
        "machine": {**machine_info(), "other_processes_cpu_share": other.share},
        "runs": runs,
    }
    print(f"{'budget':>7} {'TPOT p50':>9} {'p90':>7} {'max':>7}  {'long TTFT s':<22} {'tok/s':>6}")
    for r in runs:
        tpot = r["decode_tpot_ms"]
        print(f"{r['budget']:>7} {tpot['p50']:9.1f} {tpot['p90']:7.1f} {tpot['max']:7.1f}  "
              f"{', '.join(f'{t:.2f}' for t in r['long_ttft_s']):<22} {r['output_tokens_per_s']:6.1f}")
    print(f"other processes used {other.share} of the CPU")
    json_path = args.json or (None if args.quick else RESULTS / "long_prompts.json")
    figure = args.figure or (None if args.quick else Path("docs/figures/ch08_long_prompts.png"))
    if json_path:
        json_path.write_text(json.dumps(result, indent=1) + "\n")
    if figure:
        plot(result, figure)
    return result


def plot(result: dict, path: Path) -> None:
    """Every step's duration over the run, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for r in result["runs"]:
        label = "chunked prefill off" if r["budget"] == "off" else f"chunked, budget {r['budget']}"
        ax.plot([s["t"] for s in r["steps"]], [1000 * s["seconds"] for s in r["steps"]], label=label, linewidth=1)
    ax.set(xlabel="time since the first step (s)", ylabel="step duration (ms)",
           title="16 requests decoding, long prompts arriving: every step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
