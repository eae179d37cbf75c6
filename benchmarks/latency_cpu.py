"""latency-cpu (DESIGN.md §6): one request, a 128-token prompt, 256 output tokens, greedy, EOS ignored.

At batch 1 every decode step reads every weight once and does little arithmetic with it, so memory
bandwidth is the limit: the bandwidth roofline is (measured copy bandwidth) / (bytes of the weights a token
goes through). rosellm's decode tokens/s (after the first token) is set against it and against transformers
`generate` at batch 1 on the same request. Each engine runs in a process of its own, the fastest of
`--repeats` runs is kept.

    python -m benchmarks latency-cpu
"""

import datetime
import time
from pathlib import Path

from . import harness
from .machine import command_line
from .offline_cpu import check_against, output_paths

NAME = "latency-cpu"
HELP = "DESIGN §6 latency-cpu: one request (128-token prompt, 256 tokens), rosellm vs transformers at batch 1"
CHAPTER = 7  # measures chapter 07's step engine (`LLMEngine`)


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help=".gguf file or Hugging Face folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="keep the fastest of this many runs per engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--resume", action="store_true",
                        help="reuse the engines that an interrupted run with the same settings had finished")
    parser.add_argument("--quick", action="store_true", help="a short request, one repeat: checks the harness")
    parser.add_argument("--json", type=Path, default=None,
                        help="result file (default: benchmarks/results/latency_cpu.json; --quick: "
                             "latency_cpu_quick.json)")
    parser.add_argument("--figure", type=Path, default=None,
                        help="figure (default: docs/figures/latency_cpu.png; --quick: next to the JSON)")


def run(args) -> dict:
    if args.quick:
        args.prompt_len = 16 if args.prompt_len == 128 else args.prompt_len
        args.max_tokens = 12 if args.max_tokens == 256 else args.max_tokens
        args.repeats = 1 if args.repeats == 3 else args.repeats
        args.check_tokens = 4 if args.check_tokens == 16 else args.check_tokens
    json_path, figure_path = output_paths(args, "latency_cpu")
    started = time.perf_counter()
    with harness.OtherLoad() as whole:
        result = measure(args)
    return harness.finish_run(result, whole.share, started, json_path, [figure_path],
                              lambda r: plot(r, figure_path), report,
                              "rosellm's greedy tokens differ from transformers'")


def decode_stats(run: dict, max_tokens: int) -> dict:
    first, last = run["first_token_s"][0], run["last_token_s"][0]
    decode_s = last - first
    return {"ttft_ms": round(first * 1000, 1), "decode_s": round(decode_s, 3),
            "tpot_ms": round(decode_s / (max_tokens - 1) * 1000, 2),
            "decode_tokens_per_s": round((max_tokens - 1) / decode_s, 2),
            "end_to_end_tokens_per_s": round(max_tokens / last, 2)}


def measure(args) -> dict:
    machine = harness.describe_machine("cpu", args.threads)
    rates = [harness.measure_rates(args.quick)]
    harness.print_machine(machine, rates[0])
    config = harness.model_config(args.model)
    params = harness.parameter_counts(config)
    [request] = harness.random_requests(1, (args.prompt_len, args.prompt_len), (args.max_tokens, args.max_tokens),
                                        config.vocab_size, args.seed)
    warmup = harness.random_requests(1, (8, 8), (4, 4), config.vocab_size, args.seed + 1000)
    print(f"workload: one request, {args.prompt_len}-token prompt, {args.max_tokens} output tokens, greedy")
    common = {"model": args.model, "threads": args.threads, "requests": [request], "warmup": warmup,
              "repeats": args.repeats}
    runs = {
        "rosellm": harness.run_worker("rosellm", common | {"engine_options": {"max_num_seqs": 1}},
                                      "rosellm (ch07) at batch 1", args.resume, not args.quick),
        # at batch 1 without padding, transformers' timed run is itself the oracle of the check
        "hf-generate": harness.run_worker("hf-generate", common | {"batch_size": 1},
                                          "transformers generate at batch 1", args.resume, not args.quick),
    }
    rates.append(harness.measure_rates(args.quick))
    roof = harness.rooflines(rates, params)
    reference = {"0": runs["hf-generate"]["tokens"][0][: args.check_tokens]} if "tokens" in runs["hf-generate"] else {}
    engines = []
    for name, run in runs.items():
        if "error" in run:
            engines.append({"engine": name, "error": run["error"]})
            continue
        stats = decode_stats(run, args.max_tokens)
        engines.append({
            "engine": name,
            "label": {"rosellm": "rosellm (ch07)", "hf-generate": "transformers generate"}[name],
            **stats,
            "share_of_bandwidth_roofline": round(stats["decode_tokens_per_s"] / roof["bandwidth_tokens_per_s"], 4),
            "share_of_compute_roofline": round(stats["decode_tokens_per_s"] / roof["compute_tokens_per_s"], 4),
            "repeat_walls_s": run.get("repeat_walls_s"),
            "peak_rss_run_mib": run["memory"]["peak_rss_run_mib"],
            "memory": run["memory"],
            "check": check_against(reference, run["tokens"]),
            "other_processes_cpu_share": run.get("other_processes_cpu_share"),
        })
    by = {e["engine"]: e for e in engines if "error" not in e}
    if "rosellm" in by and "hf-generate" in by:
        by["rosellm"]["decode_ratio_vs_transformers"] = round(
            by["rosellm"]["decode_tokens_per_s"] / by["hf-generate"]["decode_tokens_per_s"], 2)
    full_agreement = None
    if all("tokens" in r for r in runs.values()):
        full_agreement = runs["rosellm"]["tokens"][0] == runs["hf-generate"]["tokens"][0]
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    return {
        "workload": "latency-cpu",
        "command": command_line(),
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "model": args.model or harness.SMOLLM2,
        "dtype": "float32",
        "machine": machine,
        "settings": {"prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats,
                     "seed": args.seed, "greedy": True, "ignore_eos": True, "threads": args.threads,
                     "check_tokens": args.check_tokens},
        "parameters": params,
        "roofline": roof,
        "kv_cache_bytes_at_end": kv_bytes * (args.prompt_len + args.max_tokens),
        "engines": engines,
        "correct": bool(by.get("rosellm", {}).get("check", {}).get("passed")),
        "all_tokens_identical": full_agreement,
        "notes": [
            "decode tokens/s = (tokens - 1) / (time of the last token - time of the first): the first token is the "
            "prefill's; TTFT is that first token's time.",
            "bandwidth roofline = measured copy bandwidth / (4 bytes x (non-embedding weights + LM head)); reading "
            "the KV cache (kv_cache_bytes_at_end at the last step) comes on top, so the roofline is an upper bound.",
        ],
    }


def report(result: dict) -> None:
    roof = result["roofline"]
    print()
    print(f"latency-cpu: {result['settings']['prompt_len']}-token prompt, {result['settings']['max_tokens']} tokens; "
          f"bandwidth {roof['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s / {roof['weight_bytes'] / 1e6:.0f} MB of weights "
          f"= {roof['bandwidth_tokens_per_s']:.0f} tokens/s roofline")
    rows = []
    for e in result["engines"]:
        if "error" in e:
            rows.append({"label": e["engine"], "tps": e["error"]})
            continue
        rows.append({"label": e["label"], "tps": e["decode_tokens_per_s"],
                     "ratio": e.get("decode_ratio_vs_transformers"),
                     "ttft": e["ttft_ms"], "tpot": e["tpot_ms"], "share": f"{e['share_of_bandwidth_roofline']:.1%}",
                     "mem": e["peak_rss_run_mib"], "check": "ok" if e["check"]["passed"] else "FAILED",
                     "load": harness.share_text(e.get("other_processes_cpu_share"))})
    harness.print_table(rows, [("label", "engine"), ("tps", "decode tok/s"), ("ratio", "vs transformers"),
                               ("ttft", "TTFT ms"), ("tpot", "TPOT ms"), ("share", "bandwidth roofline"),
                               ("mem", "peak RSS MiB"), ("check", "check"), ("load", "other load")])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [e for e in result["engines"] if "error" not in e]
    roof = result["roofline"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [e["label"] for e in engines] + ["bandwidth roofline"]
    values = [e["decode_tokens_per_s"] for e in engines] + [roof["bandwidth_tokens_per_s"]]
    colors = ["tab:red" if e["engine"] == "rosellm" else "tab:gray" for e in engines] + ["white"]
    bars = left.bar(names, values, color=colors, edgecolor="black")
    for bar, value in zip(bars, values):
        left.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                      va="bottom", fontsize=8)
    left.set(ylabel="decode tokens/s (batch 1)", title="decode speed, one request")
    left.tick_params(axis="x", labelsize=8)
    right.bar([e["label"] for e in engines], [e["ttft_ms"] for e in engines], color=colors[:-1], edgecolor="black")
    right.set(ylabel="milliseconds", title=f"time to first token ({result['settings']['prompt_len']}-token prompt)")
    right.tick_params(axis="x", labelsize=8)
    machine = result["machine"]
    fig.suptitle(f"latency-cpu: {result['model']}; {machine['cpu']}, {machine['torch_threads']} threads; "
                 f"other processes {harness.share_text(result.get('other_processes_cpu_share'))} of the CPU",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
