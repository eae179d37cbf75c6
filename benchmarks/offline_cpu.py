"""offline-cpu (DESIGN.md §6): throughput of offline generation on CPU, rosellm against transformers.

64 requests of random prompt token ids, prompt lengths uniform in [32, 512], max_tokens uniform in
[32, 256], greedy, EOS ignored, seed 0, SmolLM2-135M in fp32. The same requests go to:

- rosellm's `LLMEngine` (chapter 07's continuous batching), every request submitted at t=0;
- transformers `generate` in static batches of 16, left-padded, in request order: a batch runs until its
  longest request is done, and only each request's own max_tokens count as useful output;
- transformers' continuous batching (the manager behind `generate_batch`), each request with its own
  max_new_tokens.

Each engine runs in a process of its own (its peak memory is its own). transformers' greedy tokens for a
sample of requests, generated one request at a time, are the oracle every engine is checked against. The
machine's fp32 GEMM rate and memory bandwidth are measured in this process before and after the engines;
the compute roofline is GEMM rate / (2 x (non-embedding weights + LM head)) tokens/s.

    python -m benchmarks offline-cpu            # the full workload (many minutes on 2 cores)
    python -m benchmarks offline-cpu --quick    # a smoke test
"""

import datetime
import time
import math
from pathlib import Path

from . import harness
from .machine import command_line

NAME = "offline-cpu"
HELP = "DESIGN §6 offline-cpu: 64 random requests, rosellm vs transformers generate and continuous batching"
CHAPTER = 7  # measures chapter 07's step engine (`LLMEngine`)

ENGINES = ("rosellm", "hf-generate", "hf-continuous")
LABELS = {"rosellm": "rosellm (ch07, continuous batching)",
          "hf-generate": "transformers generate (static batches)",
          "hf-continuous": "transformers continuous batching"}


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help=".gguf file or Hugging Face folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--static-batch", type=int, default=16, help="batch size of transformers generate")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="rosellm's and transformers' continuous "
                        "batching: most sequences in one step")
    parser.add_argument("--max-batch-tokens", type=int, default=2048,
                        help="most tokens in one step, for both continuous-batching engines")
    parser.add_argument("--check-requests", type=int, default=4,
                        help="requests whose greedy tokens are checked against transformers one at a time")
    parser.add_argument("--check-tokens", type=int, default=16, help="tokens checked per request")
    parser.add_argument("--sweep", type=int_list, default=[1, 2, 4, 8, 16, 32, 64],
                        help="batch sizes of the decode sweep (share of roofline against batch size)")
    parser.add_argument("--sweep-prompt-len", type=int, default=128)
    parser.add_argument("--sweep-steps", type=int, default=8)
    parser.add_argument("--no-profile", dest="profile", action="store_false",
                        help="skip the second, profiled rosellm run (where the time of a step goes)")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"which engines to run ({', '.join(ENGINES)})")
    parser.add_argument("--threads", type=int, default=None, help="torch threads in every engine (default: torch's)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the engines that an interrupted run with the same settings had finished")
    parser.add_argument("--quick", action="store_true",
                        help="a small workload (a few short requests, small sweep): checks the harness, not the speed")
    parser.add_argument("--json", type=Path, default=None,
                        help="result file (default: benchmarks/results/offline_cpu.json; --quick: "
                             "offline_cpu_quick.json)")
    parser.add_argument("--figure", type=Path, default=None,
                        help="figure (default: docs/figures/offline_cpu.png; --quick: next to the JSON)")


def apply_quick(args) -> None:
    """--quick shrinks everything that the user did not set."""
    if not args.quick:
        return
    defaults = {"requests": 64, "prompt_len": [32, 512], "max_tokens": [32, 256], "static_batch": 16,
                "check_requests": 4, "check_tokens": 16, "sweep": [1, 2, 4, 8, 16, 32, 64],
                "sweep_prompt_len": 128, "sweep_steps": 8, "max_batch_tokens": 2048}
    small = {"requests": 6, "prompt_len": [8, 40], "max_tokens": [4, 12], "static_batch": 4,
             "check_requests": 2, "check_tokens": 4, "sweep": [1, 2, 4], "sweep_prompt_len": 16, "sweep_steps": 3,
             "max_batch_tokens": 256}
    for key, value in small.items():
        if getattr(args, key) == defaults[key]:
            setattr(args, key, value)


def output_paths(args, name: str) -> tuple[Path, Path]:
    suffix = "_quick" if args.quick else ""
    json_path = args.json or harness.RESULTS / f"{name}{suffix}.json"
    figure = args.figure or (json_path.with_suffix(".png") if args.quick else harness.FIGURES / f"{name}.png")
    return json_path, figure


# --- the work that the workload asks for -------------------------------------------------------------------


def workload_work(requests: list, config, params: dict) -> dict:
    """Tokens and FLOP that the workload needs, whatever the engine (padding and recomputation not counted).

    Every prompt token goes through the decoder layers once; so does every generated token but the last
    (it is fed back to produce the next); the LM head runs once per generated token."""
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(m for _, m in requests)
    decoder_tokens = prompt_tokens + output_tokens - len(requests)
    dense = 2 * params["non_embedding"] * decoder_tokens + 2 * params["lm_head"] * output_tokens
    attention = 0.0
    for prompt, m in requests:
        n = len(prompt)
        attention += harness.attention_flop_per_token(config, 1) * (n * (n + 1) / 2)  # prefill, causal
        attention += sum(harness.attention_flop_per_token(config, n + k) for k in range(1, m))  # decode
    return {"requests": len(requests), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "processed_tokens": prompt_tokens + output_tokens, "decoder_tokens": decoder_tokens,
            "dense_flop": dense, "attention_flop": attention}


def sweep_blocks(args, block_size: int) -> int:
    """KV blocks the decode sweep's largest batch needs (see worker.decode_sweep's max_tokens)."""
    if not args.sweep:
        return 0
    b = max(args.sweep)
    return b * math.ceil((args.sweep_prompt_len + 2 * args.sweep_steps + b + 2) / block_size) + b


def kv_blocks_needed(requests: list, block_size: int) -> int:
    return sum(math.ceil((len(p) + m) / block_size) for p, m in requests)


# --- checks ---------------------------------------------------------------------------------------------


def check_against(reference: dict, tokens: list) -> dict:
    """Does an engine's greedy output start with transformers' one-at-a-time tokens, on the checked sample?"""
    mismatches = []
    for key, expected in reference.items():
        got = (tokens[int(key)] or [])[: len(expected)]
        if got != expected:
            where = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            mismatches.append({"request": int(key), "first_difference_at": where})
    return {"requests": len(reference), "tokens_each": max((len(v) for v in reference.values()), default=0),
            "passed": bool(reference) and not mismatches, "mismatches": mismatches}


def agreement(a: list, b: list) -> dict:
    """How many requests two engines answered with identical tokens (all of them, not only the sample)."""
    same = sum(1 for x, y in zip(a, b) if x == y)
    return {"identical_requests": same, "requests": len(a)}


def summarize_engine(name: str, run: dict, requests: list, work: dict, roof: dict) -> dict:
    """Useful output tokens/s, latencies, memory and shares of the roofline of one engine's run."""
    if "error" in run:
        return {"engine": name, "label": LABELS.get(name, name), "error": run["error"],
                "other_processes_cpu_share": run.get("other_processes_cpu_share")}
    max_tokens = [m for _, m in requests]
    produced = [len(t) if t is not None else 0 for t in run["tokens"]]
    useful = sum(min(n, m) for n, m in zip(produced, max_tokens))  # never more than asked for
    wall = run["wall_s"]
    tokens_per_s = useful / wall
    summary = {
        "engine": name,
        "label": LABELS.get(name, name),
        "wall_s": round(wall, 2),
        "useful_output_tokens": useful,
        "all_requests_complete": produced == max_tokens,
        "output_tokens_per_s": round(tokens_per_s, 2),
        "processed_tokens_per_s": round(work["processed_tokens"] / wall, 2),
        **harness.latency_stats(run, max_tokens),
        # useful output tokens/s against GEMM rate / (2 P): the target's measure
        "share_of_roofline_output": round(tokens_per_s / roof["compute_tokens_per_s"], 4),
        # the whole work (prompt + output tokens: dense FLOP of the decoder and LM head) against the GEMM rate
        "share_of_roofline_work": round(work["dense_flop"] / wall / roof["gemm_flops"], 4),
        "share_of_roofline_work_with_attention": round(
            (work["dense_flop"] + work["attention_flop"]) / wall / roof["gemm_flops"], 4),
        "memory": run.get("memory"),
        "peak_rss_run_mib": (run.get("memory") or {}).get("peak_rss_run_mib"),
        "load_s": run.get("load_s"),
        "other_processes_cpu_share": run.get("other_processes_cpu_share"),
        "measured_in_an_earlier_interrupted_run": bool(run.get("reused_from")),
    }
    if name == "hf-generate":
        summary["padded_token_positions"] = run.get("padded_token_positions")
        summary["returned_ms"] = harness.median_p90(run["returned_s"], 1000, 1)
    if "steps" in run:
        summary["steps"] = run["steps"]
    return summary


# --- the workload ---------------------------------------------------------------------------------------



def summarize_runs(runs: dict, reference_only: bool, requests: list, work: dict, roof: dict) -> tuple[list, dict]:
    """Each engine's summary, with its speed ratio to rosellm and its check against transformers' reference
    (kept by the hf-generate run; not an engine of its own when it ran `reference_only`)."""
    reference = runs["hf-generate"].get("reference", {})
    summaries, checks = [], {}
    for name, r in runs.items():
        if name == "hf-generate" and reference_only:
            continue
        summaries.append(summarize_engine(name, r, requests, work, roof))
        if "tokens" in r:
            checks[name] = check_against(reference, r["tokens"])
    rosellm = next((s for s in summaries if s["engine"] == "rosellm" and "error" not in s), None)
    for s in summaries:
        if rosellm and "error" not in s:
            s["rosellm_ratio"] = round(rosellm["output_tokens_per_s"] / s["output_tokens_per_s"], 2)
        s["check_passed"] = checks.get(s["engine"], {}).get("passed")
    return summaries, checks

def run(args) -> dict:
    apply_quick(args)
    json_path, figure_path = output_paths(args, "offline_cpu")
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise SystemExit(f"unknown engines {sorted(unknown)}; choose from {ENGINES}")
    started = time.perf_counter()
    with harness.OtherLoad() as whole:
        result = measure(args, engines)
    figures = [figure_path] + ([sweep_figure_path(figure_path)] if result["decode_sweep"] else [])
    return harness.finish_run(result, whole.share, started, json_path, figures, lambda r: plot(r, figure_path),
                              report, "rosellm's greedy tokens differ from transformers' (see 'check'): the "
                              "numbers above measure a wrong engine")


def measure(args, engines: list[str]) -> dict:
    machine = harness.describe_machine("cpu", args.threads)
    rates = [harness.measure_rates(args.quick)]
    harness.print_machine(machine, rates[0])
    config = harness.model_config(args.model)
    params = harness.parameter_counts(config)
    requests = harness.random_requests(args.requests, tuple(args.prompt_len), tuple(args.max_tokens),
                                       config.vocab_size, args.seed)
    warmup = harness.random_requests(2, (8, 16), (4, 4), config.vocab_size, args.seed + 1000)
    work = workload_work(requests, config, params)
    print(f"workload: {len(requests)} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens "
          f"({work['prompt_tokens']} in all), max_tokens {args.max_tokens[0]}-{args.max_tokens[1]} "
          f"({work['output_tokens']} in all), greedy, EOS ignored, seed {args.seed}")
    block_size = 16
    # Room for every request at once in both continuous-batching engines: throughput, not preemption, is measured.
    blocks = kv_blocks_needed(requests, block_size) + args.max_num_seqs
    page = 256 if not args.quick else 16
    hf_blocks = kv_blocks_needed(requests, page) + args.max_num_seqs
    common = {"model": args.model, "threads": args.threads, "requests": requests, "warmup": warmup}
    sample = list(range(min(args.check_requests, len(requests))))
    specs = {
        "rosellm": common | {
            "engine_options": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_batch_tokens,
                               "block_size": block_size, "num_kv_blocks": max(blocks, sweep_blocks(args, block_size))}},
        "hf-generate": common | {"batch_size": args.static_batch, "reference_sample": sample,
                                 "reference_tokens": args.check_tokens},
        "hf-continuous": common | {"cb_options": {
            "page_size": page, "num_blocks": hf_blocks, "max_batch_tokens": args.max_batch_tokens,
            "max_requests_per_batch": args.max_num_seqs, "allow_block_sharing": False}},
    }
    if "hf-generate" not in engines:  # the oracle still has to run
        specs["hf-generate"]["reference_only"], engines = True, engines + ["hf-generate"]
    runs = {}
    for name in ENGINES:
        if name in engines:
            runs[name] = harness.run_worker(name, specs[name], LABELS[name], args.resume, not args.quick)
        if name == "rosellm" and name in engines and "error" not in runs[name]:
            # the decode sweep and the profiled run, each in a process of its own (its own peak memory, and
            # a shorter run to lose if the machine's other users kill it)
            extra = {key: specs["rosellm"][key] for key in ("model", "threads", "warmup", "engine_options")}
            if args.sweep:
                sweep = harness.run_worker("rosellm", extra | {"sweep": {
                    "batch_sizes": args.sweep, "prompt_len": args.sweep_prompt_len, "decode_steps": args.sweep_steps}},
                                           "rosellm: decode steps against batch size", args.resume, not args.quick)
                runs[name]["decode_sweep"] = sweep.get("decode_sweep")
            if args.profile:
                profile = harness.run_worker("rosellm", extra | {"profile_requests": requests},
                                             "rosellm: the same workload again, every part of a step timed",
                                             args.resume, not args.quick)
                runs[name]["profile"] = profile.get("profile")
    rates.append(harness.measure_rates(args.quick))
    roof = harness.rooflines(rates, params)

    summaries, checks = summarize_runs(runs, specs["hf-generate"].get("reference_only"), requests, work, roof)
    agree = {}
    if "rosellm" in runs and "tokens" in runs["rosellm"]:
        for name, r in runs.items():
            if name != "rosellm" and r.get("tokens"):
                agree[f"rosellm vs {name}"] = agreement(runs["rosellm"]["tokens"], r["tokens"])

    sweep = runs.get("rosellm", {}).get("decode_sweep") or []
    for point in sweep:
        point["share_of_roofline"] = round(point["tokens_per_s"] / roof["compute_tokens_per_s"], 4)
    targets = targets_met(summaries)
    return {
        "workload": "offline-cpu",
        "command": command_line(),
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "model": args.model or harness.SMOLLM2,
        "dtype": "float32",
        "machine": machine,
        "settings": {"requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "seed": args.seed, "greedy": True, "ignore_eos": True, "static_batch": args.static_batch,
                     "max_num_seqs": args.max_num_seqs, "max_batch_tokens": args.max_batch_tokens,
                     "rosellm_engine_options": specs["rosellm"]["engine_options"],
                     "transformers_cb_options": specs["hf-continuous"]["cb_options"],
                     "check_requests": len(sample), "check_tokens": args.check_tokens, "sweep": args.sweep,
                     "sweep_prompt_len": args.sweep_prompt_len, "sweep_steps": args.sweep_steps,
                     "threads": args.threads, "engines": engines},
        "parameters": params,
        "work": work,
        "roofline": roof,
        "engines": summaries,
        "check": checks,
        "correct": bool(checks.get("rosellm", {}).get("passed")) if "rosellm" in runs else True,
        "agreement": agree,
        "decode_sweep": sweep,
        "profile": runs.get("rosellm", {}).get("profile"),
        "targets": targets,
        "notes": NOTES,
    }


NOTES = [
    "Useful output tokens: each request's own max_tokens. A static batch of transformers generate runs until its "
    "longest request is done; the tokens its shorter requests generate past their max_tokens are not counted.",
    "TTFT: from the moment every request is submitted (t=0) to the request's first token. TPOT: (last token - first "
    "token) / (tokens - 1). For static batches the first token is the batch's first token, the last is the step "
    "that produced the request's own last useful token (the request is only returned with the whole batch: "
    "'returned_ms').",
    "transformers continuous batching is driven through its manager (init/continuous_batching_context_manager, "
    "the engine behind generate_batch) because generate_batch takes one max_new_tokens for all requests; every "
    "request gets its own max_new_tokens here, EOS disabled, greedy.",
    "share_of_roofline_output: useful output tokens/s / compute roofline. share_of_roofline_work: the dense FLOP the "
    "workload needs (every prompt and fed-back token through the decoder, the LM head once per output token) per "
    "second / measured GEMM rate; _with_attention adds the attention's own FLOP (QK^T, PV).",
    "Peak memory: the resident-set high-water mark of the engine's own process during the timed run (reset after "
    "loading and warm-up), model included.",
]


def targets_met(summaries: list[dict]) -> dict:
    by = {s["engine"]: s for s in summaries if "error" not in s}
    rosellm = by.get("rosellm")
    if not rosellm:
        return {}
    out = {"share_of_roofline_output >= 0.6": rosellm["share_of_roofline_output"] >= 0.6,
           "share_of_roofline_work >= 0.6": rosellm["share_of_roofline_work"] >= 0.6}
    if "hf-generate" in by:
        out["4x transformers generate"] = rosellm["output_tokens_per_s"] >= 4 * by["hf-generate"]["output_tokens_per_s"]
    if "hf-continuous" in by:
        out["beats transformers continuous batching"] = (
            rosellm["output_tokens_per_s"] > by["hf-continuous"]["output_tokens_per_s"])
    return out


# --- output ---------------------------------------------------------------------------------------------


def report(result: dict) -> None:
    roof = result["roofline"]
    print()
    work = result["work"]
    print(f"{result['workload']}: {work['requests']} requests, {work['output_tokens']} useful output tokens, "
          f"{work['prompt_tokens']} prompt tokens; {result['model']}")
    print(f"roofline: GEMM {roof['gemm_flops'] / 1e9:.1f} GFLOP/s / (2 x {result['parameters']['roofline'] / 1e6:.1f}"
          f" M weights) = {roof['compute_tokens_per_s']:.0f} tokens/s; bandwidth "
          f"{roof['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    rows = []
    for s in result["engines"]:
        if "error" in s:
            rows.append({"label": s["label"], "tps": s["error"]})
            continue
        rows.append({
            "label": s["label"], "tps": s["output_tokens_per_s"], "ratio": s.get("rosellm_ratio"),
            "ttft": f"{s['ttft_ms']['median']:.0f} / {s['ttft_ms']['p90']:.0f}",
            "tpot": f"{s['tpot_ms']['median']:.1f} / {s['tpot_ms']['p90']:.1f}",
            "mem": s.get("peak_rss_run_mib"), "share": f"{s['share_of_roofline_output']:.1%}",
            "work": f"{s['share_of_roofline_work']:.1%}",
            "check": {True: "ok", False: "FAILED", None: "-"}[s.get("check_passed")],
            "load": harness.share_text(s.get("other_processes_cpu_share")),
        })
    harness.print_table(rows, [("label", "engine"), ("tps", "output tok/s"), ("ratio", "rosellm is x"),
                               ("ttft", "TTFT ms med/p90"), ("tpot", "TPOT ms med/p90"), ("mem", "peak RSS MiB"),
                               ("share", "roofline (output)"), ("work", "roofline (work)"),
                               ("check", "check"), ("load", "other load")])
    if result["decode_sweep"]:
        print("decode sweep (rosellm): " + ", ".join(
            f"b={p['batch_size']}: {p['tokens_per_s']:.0f} tok/s ({p['share_of_roofline']:.0%})"
            for p in result["decode_sweep"]))
    if result.get("profile"):
        parts = sorted(result["profile"]["parts"], key=lambda p: -p["seconds"])
        print("profile of a rosellm run (share of step time): " + ", ".join(
            f"{p['part']} {p['share']:.0%}" for p in parts if p["share"] is not None))
    for name, value in result["targets"].items():
        print(f"target {name}: {'met' if value else 'NOT met'}")


def sweep_figure_path(path: Path) -> Path:
    return path.with_name(path.stem + "_batch_sweep" + path.suffix)


def plot(result: dict, path: Path) -> None:
    """Two figures: throughput and latency of each engine (`path`), and the decode sweep's share of the
    roofline against batch size (`..._batch_sweep.png` beside it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [s for s in result["engines"] if "error" not in s]
    roof = result["roofline"]
    machine = result["machine"]
    where = (f"{result['model']}; {machine['cpu']}, {machine['torch_threads']} torch threads; other processes used "
             f"{harness.share_text(result.get('other_processes_cpu_share'))} of the CPU")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    names = [s["label"].replace(" (", "\n(") for s in engines]
    colors = ["tab:red" if s["engine"] == "rosellm" else "tab:gray" for s in engines]
    bars = left.bar(names, [s["output_tokens_per_s"] for s in engines], color=colors)
    for bar, s in zip(bars, engines):
        left.annotate(f"{s['output_tokens_per_s']:.1f} tok/s\n{s['share_of_roofline_output']:.0%} of roofline",
                      (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    left.set(ylabel="useful output tokens/s",
             title=f"{result['workload']}: throughput (roofline {roof['compute_tokens_per_s']:.0f} tok/s)")
    left.set_ylim(0, max([s["output_tokens_per_s"] for s in engines] + [1]) * 1.3)
    left.tick_params(axis="x", labelsize=8)
    x = list(range(len(engines)))
    width = 0.38
    for offset, key, label in ((-width / 2, "ttft_ms", "time to first token"),
                               (width / 2, "tpot_ms", "time per output token x 100")):
        scale = 100 if key == "tpot_ms" else 1
        med = [s[key]["median"] * scale / 1000 for s in engines]
        p90 = [s[key]["p90"] * scale / 1000 for s in engines]
        right.bar([i + offset for i in x], med, width, label=f"{label} (median)")
        right.errorbar([i + offset for i in x], med, yerr=[[0] * len(med), [p - m for p, m in zip(p90, med)]],
                       fmt="none", ecolor="black", capsize=3)
    right.set_xticks(x, names, fontsize=8)
    right.set(ylabel="seconds (whisker: p90)", title="latency, every request submitted at t=0 (lower is better)")
    right.legend(fontsize=8)
    fig.suptitle(where, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

    sweep = result.get("decode_sweep") or []
    if not sweep:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([p["batch_size"] for p in sweep], [100 * p["share_of_roofline"] for p in sweep], "o-", color="tab:red",
            label="rosellm decode steps")
    for p in sweep:
        ax.annotate(f"{p['tokens_per_s']:.0f} tok/s", (p["batch_size"], 100 * p["share_of_roofline"]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.axhline(60, ls="--", color="gray", label="60%")
    ax.set_xscale("log", base=2)
    ax.set_xticks([p["batch_size"] for p in sweep], [str(p["batch_size"]) for p in sweep])
    ax.set(xlabel="sequences decoding together (batch size)", ylabel="% of the compute roofline",
           title=f"decode: share of the GEMM roofline ({roof['compute_tokens_per_s']:.0f} tok/s) against batch size",
           ylim=(0, 100))
    ax.legend(fontsize=8)
    fig.text(0.5, 0.01, where, ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(sweep_figure_path(path), dpi=110)
    plt.close(fig)
