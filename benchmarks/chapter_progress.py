"""chapters: every chapter checkpoint on one small workload, so the book can show how each chapter moved the
needle.

8 requests of random prompt token ids (32-128 tokens), 32 output tokens each, greedy, EOS ignored, through
each checkpoint's public `LLM.generate` only (chapter 01 recomputes the whole prefix for every token: the
workload stays small for its sake). Batching chapters get a batch of 8 (chapter 06 with its PyTorch attention
backend, which is what runs on a CPU). Each checkpoint runs in a process of its own; its tokens must equal
transformers' on a sample (one request at a time) and the latest chapter's.

    python -m benchmarks chapters
"""

import chapters

from . import harness

NAME = "chapters"
HELP = "every chapter checkpoint on one small workload (tokens/s per chapter)"
CHAPTER = 7  # runs through the engines' processes, which drive chapter 07's step engine

FULL = {"requests": 8, "prompt_len": [32, 128], "max_tokens": 32, "batch": 8, "seed": 0}
FULL |= {"check_requests": 2, "check_tokens": 16}
QUICK = {"requests": 3, "prompt_len": [8, 24], "max_tokens": 6, "check_requests": 1, "check_tokens": 4}
COLUMNS = {"checkpoint": "checkpoint", "output_tokens_per_s": "output tok/s", "speedup_vs_first": "x ch01"}
COLUMNS |= {"share_of_roofline_output": "roofline share", "identical_to_latest": "= latest", "error": "error"}


def add_arguments(parser) -> None:
    parser.add_argument("--only", default=None, help="comma-separated chapter numbers to run (default: all)")


def checkpoint_options(point: chapters.Checkpoint, batch: int) -> dict:
    """What a checkpoint's `LLM` needs to batch `batch` requests on a CPU, from what it declares."""
    if "batched" not in point.capabilities:
        return {}  # one request at a time
    options = {"max_num_seqs" if "step_engine" in point.capabilities else "max_batch_size": batch}
    if "triton_kernels" in point.capabilities and "compiled" not in point.capabilities:
        options["attention_backend"] = "torch"  # from chapter 11 on, the CPU default ("cpu") is the fast one
    return options


def run(args, s: dict) -> dict:
    wrong = "a checkpoint's greedy tokens differ from transformers'"
    return harness.save(args, NAME, lambda: measure(args, s), "chapters", plot, "throughput_per_chapter", report, wrong)


def measure(args, s: dict) -> dict:
    before, config = harness.measure_rates(args.quick), harness.model_config(args.model)
    params, vocab = harness.parameter_counts(config), config.vocab_size
    requests = harness.random_requests(s["requests"], s["prompt_len"], [s["max_tokens"]] * 2, vocab, s["seed"])
    warmup = harness.random_requests(1, [8, 8], [2, 2], vocab, s["seed"] + 1000)
    wanted = {int(c) for c in args.only.split(",")} if args.only else None
    common = dict(model=args.model, threads=args.threads, requests=requests, warmup=warmup)
    sample = list(range(min(s["check_requests"], len(requests))))
    oracle = dict(reference_only=True, batch_size=1, reference_tokens=s["check_tokens"], reference_sample=sample)
    reference = harness.run_engine("hf-generate", common | oracle, "transformers reference").get("reference", {})
    rows, tokens = [], {}
    for point in [point for point in chapters.checkpoints() if not wanted or point.number in wanted]:
        options = checkpoint_options(point, s["batch"])
        label = f"chapter {point.number:02d} ({point.module}) {options or ''}"
        r = harness.run_engine("checkpoint", common | {"checkpoint": point.module, "options": options}, label)
        row = dict(chapter=point.number, checkpoint=point.module, options=options, error=r.get("error"))
        row["other_processes_cpu_share"] = r.get("other_processes_cpu_share")
        if "error" not in r:
            tokens[point.number], useful = r["tokens"], sum(min(len(t), s["max_tokens"]) for t in r["tokens"])
            row |= dict(slug=r["chapter"], wall_s=round(r["wall_s"], 2), output_tokens=useful, load_s=r["load_s"])
            row |= dict(output_tokens_per_s=round(useful / r["wall_s"], 2), memory=r["memory"])
            row |= dict(peak_rss_run_mib=r["memory"]["peak_rss_run_mib"])
            row |= dict(check=harness.check_against(reference, r["tokens"]))
        rows.append({key: value for key, value in row.items() if key != "error" or value})
    roof = harness.rooflines([before, harness.measure_rates(args.quick)], params)
    done = [row for row in rows if "error" not in row]
    for row in done:
        row["share_of_roofline_output"] = round(row["output_tokens_per_s"] / roof["compute_tokens_per_s"], 4)
        row["identical_to_latest"] = tokens[row["chapter"]] == tokens[max(tokens)]
        row["speedup_vs_first"] = round(row["output_tokens_per_s"] / done[0]["output_tokens_per_s"], 2)
    single = harness.chapter_ranges([row["chapter"] for row in rows if not row["options"]])
    batched = harness.chapter_ranges([row["chapter"] for row in rows if row["options"]])
    notes = [
        "tokens/s = all output tokens / wall time of one LLM.generate over all requests (model loaded and "
        f"warmed up before); chapters {single} serve one request at a time, {batched} batch up to `batch`."
    ]
    correct = bool(rows) and all(row.get("check", {}).get("passed") for row in rows)
    out = dict(settings=s | {"greedy": True, "ignore_eos": True, "threads": args.threads}, dtype="float32")
    return out | dict(parameters=params, roofline=roof, chapters=rows, correct=correct, notes=notes)


def report(result: dict) -> None:
    harness.print_table(result["chapters"], COLUMNS)


def plot(result: dict, path) -> None:
    rows, s = [r for r in result["chapters"] if "error" not in r], result["settings"]
    from matplotlib.ticker import FuncFormatter

    fig, ((ax,),) = harness.figure_axes(1, 1, (10, 4.6))
    # the chapter's tag, then its title a word a line: twelve labels side by side without overlapping
    names = [f"ch{r['chapter']:02d}\n" + "\n".join(r["slug"][3:].split("_")) for r in rows]
    bars = ax.bar(names, [r["output_tokens_per_s"] for r in rows], color="tab:red")
    ax.bar_label(bars, [f"{r['output_tokens_per_s']:.0f}" for r in rows], fontsize=9)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda value, _: f"{value:g}" if f"{value:.0e}"[0] in "25" else ""))
    title = f"throughput per chapter: {s['requests']} requests x {s['max_tokens']} tokens, batch {s['batch']}"
    ax.set(ylabel="output tokens/s (log scale)", title=title)
    ax.tick_params(axis="x", labelsize=9)
    harness.save_figure(fig, path, result)
