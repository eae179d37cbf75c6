"""chapters (DESIGN.md §6): every chapter checkpoint on one small workload, so the book can show how each
chapter moved the needle.

8 requests of random prompt token ids (32-128 tokens), 32 output tokens each, greedy, EOS ignored, through
each checkpoint's public `LLM.generate` only (chapter 01 recomputes the whole prefix for every token: this
workload stays small for its sake). Batching chapters get a batch of 8 (chapter 06 with its PyTorch
attention backend, which is what runs on a CPU). Each checkpoint runs in a process of its own; every
checkpoint's tokens must equal transformers' on a sample (one request at a time) and chapter 07's.

    python -m benchmarks chapters
"""

import datetime
import time
from pathlib import Path

import chapters

from . import harness
from .machine import command_line
from .offline_cpu import check_against, output_paths

NAME = "chapters"
HELP = "DESIGN §6 chapters: every chapter checkpoint on one small workload (tokens/s per chapter)"
CHAPTER = 7  # runs through the harness's workers, which drive chapter 07's step engine


def checkpoint_options(point: chapters.Checkpoint, batch: int) -> dict:
    """What a checkpoint's `LLM` needs to batch `batch` requests on a CPU, from what it declares."""
    if "batched" not in point.capabilities:
        return {}  # one request at a time
    options = {"max_num_seqs" if "step_engine" in point.capabilities else "max_batch_size": batch}
    if "triton_kernels" in point.capabilities:
        options["attention_backend"] = "torch"
    return options


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help=".gguf file or Hugging Face folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="batch size of the batching chapters")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", default=None, help="comma-separated chapter numbers to run (default: all)")
    parser.add_argument("--check-requests", type=int, default=2)
    parser.add_argument("--check-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--resume", action="store_true",
                        help="reuse the engines that an interrupted run with the same settings had finished")
    parser.add_argument("--quick", action="store_true", help="a tiny workload: checks the harness")
    parser.add_argument("--json", type=Path, default=None,
                        help="result file (default: benchmarks/results/chapters.json; --quick: chapters_quick.json)")
    parser.add_argument("--figure", type=Path, default=None,
                        help="figure (default: docs/figures/throughput_per_chapter.png; --quick: next to the JSON)")


def run(args) -> dict:
    if args.quick:
        args.requests = 3 if args.requests == 8 else args.requests
        args.prompt_len = [8, 24] if args.prompt_len == [32, 128] else args.prompt_len
        args.max_tokens = 6 if args.max_tokens == 32 else args.max_tokens
        args.check_requests = 1 if args.check_requests == 2 else args.check_requests
        args.check_tokens = 4 if args.check_tokens == 16 else args.check_tokens
    json_path, _ = output_paths(args, "chapters")
    figure_path = args.figure or (json_path.with_suffix(".png") if args.quick
                                  else harness.FIGURES / "throughput_per_chapter.png")
    started = time.perf_counter()
    with harness.OtherLoad() as whole:
        result = measure(args)
    return harness.finish_run(result, whole.share, started, json_path, [figure_path],
                              lambda r: plot(r, figure_path), report,
                              "a checkpoint's greedy tokens differ from transformers'")


def measure(args) -> dict:
    machine = harness.describe_machine("cpu", args.threads)
    rates = [harness.measure_rates(args.quick)]
    harness.print_machine(machine, rates[0])
    config = harness.model_config(args.model)
    params = harness.parameter_counts(config)
    requests = harness.random_requests(args.requests, tuple(args.prompt_len), (args.max_tokens, args.max_tokens),
                                       config.vocab_size, args.seed)
    warmup = harness.random_requests(1, (8, 8), (2, 2), config.vocab_size, args.seed + 1000)
    wanted = {int(c) for c in args.only.split(",")} if args.only else None
    chosen = [point for point in chapters.checkpoints() if wanted is None or point.number in wanted]
    names = ", ".join(f"ch{point.number:02d}" for point in chosen)
    print(f"workload: {len(requests)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, "
          f"{args.max_tokens} tokens each, greedy; checkpoints: {names}")
    sample = list(range(min(args.check_requests, len(requests))))
    oracle = harness.run_worker("hf-generate", {"model": args.model, "threads": args.threads, "requests": requests,
                                                "reference_only": True, "batch_size": 1, "reference_sample": sample,
                                                "reference_tokens": args.check_tokens},
                                "transformers reference (one request at a time)", args.resume, not args.quick)
    reference = oracle.get("reference", {})
    rows, tokens = [], {}
    for point in chosen:
        n, module, options = point.number, point.module, checkpoint_options(point, args.batch)
        run = harness.run_worker("checkpoint", {"checkpoint": module, "model": args.model, "threads": args.threads,
                                                "options": options, "requests": requests, "warmup": warmup},
                                 f"chapter {n:02d} ({module}) {options or ''}", args.resume, not args.quick)
        row = {"chapter": n, "checkpoint": module, "options": options,
               "other_processes_cpu_share": run.get("other_processes_cpu_share")}
        if "error" in run:
            rows.append(row | {"error": run["error"]})
            continue
        useful = sum(min(len(t), args.max_tokens) for t in run["tokens"])
        tokens[n] = run["tokens"]
        row.update(
            slug=run["chapter"], wall_s=round(run["wall_s"], 2), output_tokens=useful,
            output_tokens_per_s=round(useful / run["wall_s"], 2), load_s=run.get("load_s"),
            peak_rss_run_mib=run["memory"]["peak_rss_run_mib"], memory=run["memory"],
            check=check_against(reference, run["tokens"]))
        rows.append(row)
    rates.append(harness.measure_rates(args.quick))
    roof = harness.rooflines(rates, params)
    latest = max(tokens) if tokens else None
    for row in rows:
        if "output_tokens_per_s" in row:
            row["share_of_roofline_output"] = round(row["output_tokens_per_s"] / roof["compute_tokens_per_s"], 4)
            row["identical_to_latest"] = tokens[row["chapter"]] == tokens[latest]
    first = next((r for r in rows if "output_tokens_per_s" in r), None)
    if first:
        for row in rows:
            if "output_tokens_per_s" in row:
                row["speedup_vs_first"] = round(row["output_tokens_per_s"] / first["output_tokens_per_s"], 2)
    correct = bool(rows) and all(r.get("check", {}).get("passed") for r in rows)
    return {
        "workload": "chapters",
        "command": command_line(),
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "model": args.model or harness.SMOLLM2,
        "dtype": "float32",
        "machine": machine,
        "settings": {"requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "batch": args.batch, "seed": args.seed, "greedy": True, "ignore_eos": True,
                     "threads": args.threads, "check_requests": len(sample), "check_tokens": args.check_tokens},
        "parameters": params,
        "roofline": roof,
        "chapters": rows,
        "correct": correct,
        "notes": ["tokens/s = all output tokens / wall time of one LLM.generate over all requests (model loaded "
                  "and warmed up before); chapters 01-02 serve one request at a time, 03-07 batch up to `batch`.",
                  "share_of_roofline_output: output tokens/s / (GEMM rate / (2 x (non-embedding weights + LM head)))."],
    }


def report(result: dict) -> None:
    print()
    print(f"chapters: {result['settings']['requests']} requests x {result['settings']['max_tokens']} tokens; "
          f"compute roofline {result['roofline']['compute_tokens_per_s']:.0f} tokens/s")
    rows = []
    for r in result["chapters"]:
        if "error" in r:
            rows.append({"ch": f"ch{r['chapter']:02d}", "tps": r["error"]})
            continue
        rows.append({"ch": f"ch{r['chapter']:02d} {r['slug'][3:]}", "tps": r["output_tokens_per_s"],
                     "x": r.get("speedup_vs_first"), "wall": r["wall_s"], "mem": r["peak_rss_run_mib"],
                     "share": f"{r['share_of_roofline_output']:.1%}",
                     "check": "ok" if r["check"]["passed"] else "FAILED",
                     "same": "yes" if r["identical_to_latest"] else "no",
                     "load": harness.share_text(r.get("other_processes_cpu_share"))})
    harness.print_table(rows, [("ch", "chapter"), ("tps", "output tok/s"), ("x", "x ch01"), ("wall", "seconds"),
                               ("mem", "peak RSS MiB"), ("share", "roofline"), ("check", "check"),
                               ("same", "= latest"), ("load", "other load")])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["chapters"] if "output_tokens_per_s" in r]
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [f"ch{r['chapter']:02d}\n{r['slug'][3:].replace('_', ' ')}" for r in rows]
    bars = ax.bar(names, [r["output_tokens_per_s"] for r in rows], color="tab:red")
    for bar, r in zip(bars, rows):
        ax.annotate(f"{r['output_tokens_per_s']:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set(ylabel="output tokens/s (log scale)",
           title=f"throughput per chapter: {result['settings']['requests']} requests x "
                 f"{result['settings']['max_tokens']} tokens, batch {result['settings']['batch']}")
    ax.tick_params(axis="x", labelsize=8)
    machine = result["machine"]
    fig.text(0.5, 0.01, f"{result['model']}; {machine['cpu']}, {machine['torch_threads']} threads; other processes "
             f"{harness.share_text(result.get('other_processes_cpu_share'))} of the CPU", ha="center", fontsize=8)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
