"""offline-cpu: throughput of offline generation on CPU, rosellm against the engines a reader would pick
instead.

64 requests of random prompt token ids, prompt lengths uniform in [32, 512], max_tokens uniform in [32, 256],
greedy, EOS ignored, seed 0, SmolLM2-135M in fp32 (`--dtype bfloat16`: every engine in bf16). The same requests, all
submitted at t = 0, go to rosellm's `LLMEngine` (the latest checkpoint, or the one `--checkpoint` names),
transformers `generate` (static batches of 16, left-padded: only each request's own max_tokens count as useful
output), transformers' continuous batching and, with `--peers vllm,llamacpp`, vLLM's CPU build and llama.cpp (see
`benchmarks.peers`). Each engine runs in a process of its own; transformers' greedy tokens for a sample of requests,
one request at a time, are the reference every engine is checked against (a peer before it is timed). The machine's
GEMM rate and memory bandwidth are measured before and after. latency-cpu and offline-gpu run through the same
engines and table. In bf16 the greedy tokens are compared, not required to be equal: rounding flips near ties
between tokens.

    python -m benchmarks offline-cpu [--checkpoint 11] [--peers vllm,llamacpp] [--dtype bfloat16] [--quick]
"""

import math
import operator
import textwrap

from . import harness, peers
from .harness import median_p90

NAME = "offline-cpu"
HELP = "64 random requests offline: rosellm's LLMEngine vs transformers (and --peers vllm,llamacpp)"
CHAPTER = 7  # the step engine (`LLMEngine`) appears; the latest checkpoint by default, any from 07 by --checkpoint

FULL = {
    "checkpoint": "latest",
    "requests": 64,
    "prompt_len": [32, 512],
    "max_tokens": [32, 256],
    "seed": 0,
    "repeats": 1,
    "dtype": "float32",  # or bfloat16: rosellm, transformers and vLLM all in bf16 (results/offline_cpu_bf16.json)
}
FULL |= {"static_batch": 16, "max_num_seqs": 64, "max_batch_tokens": 2048}  # the engines' limits
FULL |= {"check_requests": 4, "check_tokens": 16, "profile_every": 5}
FULL |= {"sweep": [1, 2, 4, 8, 16, 32, 64], "sweep_prompt_len": 128, "sweep_steps": 8}  # rosellm's decode sweep
QUICK = {"requests": 6, "prompt_len": [8, 40], "max_tokens": [4, 12], "static_batch": 4, "max_batch_tokens": 256}
QUICK |= {"check_requests": 2, "check_tokens": 4, "profile_every": 2}
QUICK |= {"sweep": [1, 2, 4], "sweep_prompt_len": 16, "sweep_steps": 3}
ENGINES = {  # rosellm's label names the checkpoint measured (`harness.rosellm_label`)
    "rosellm": "rosellm",
    "hf-generate": "transformers generate (static batches)",
    "hf-continuous": "transformers continuous batching",
}
NOTES = [
    "Useful output tokens: each request's own max_tokens (a static batch runs to its longest request).",
    "TTFT: from t = 0, when every request is submitted, to the request's first token; TPOT: (last - first) / "
    "(tokens - 1). A static batch returns its requests only when its longest is done ('returned_ms').",
    "share_of_roofline_output: useful output tokens/s / compute roofline; share_of_roofline_work: the dense FLOP "
    "the workload needs (every prompt and fed-back token through the decoder, the LM head once per output token) "
    "per second / measured GEMM rate.",
    "Peers: each in its own virtual environment on fp32 weights made from the same GGUF, checked against "
    "transformers' greedy tokens before it is timed; version, settings and load time in 'engines'.",
    "In bf16 or on quantized weights an engine is timed whatever its greedy tokens: its check is recorded "
    "(check.required false) and 'agreement_with_fp32' compares its tokens with the same engine's fp32 row.",
]
COLUMNS = {"label": "engine", "output_tokens_per_s": "output tok/s", "rosellm_ratio": "rosellm is x"}
COLUMNS |= {"share_of_roofline_output": "roofline share", "peak_rss_run_mib": "peak RSS MiB"}
COLUMNS |= {"check_passed": "check", "error": "error"}


def add_arguments(parser, engines: str = ",".join(ENGINES)) -> None:
    parser.add_argument("--engines", default=engines, help=f"of {', '.join(ENGINES)}")
    parser.add_argument("--peers", default="", help=f"also run these peers: {', '.join(peers.PEERS)}")


DTYPES = {"float32": "offline_cpu", "bfloat16": "offline_cpu_bf16"}  # -> the result's name


def run(args, s: dict) -> dict:
    if s["dtype"] not in DTYPES:
        raise SystemExit(f"--dtype {s['dtype']}: choose from {', '.join(DTYPES)}")
    return run_workload(args, s, NAME, DTYPES[s["dtype"]], plot, report, dtype=s["dtype"])


def run_workload(args, s: dict, workload: str, name: str, draw, show, finish=lambda body: body, **device) -> dict:
    """Install the peers, measure, and write the result and its figures (offline-cpu, latency-cpu, offline-gpu);
    `finish` turns the measured body into the workload's, `device` is offline-gpu's device, dtype and rates."""
    engines, chosen = [e for e in args.engines.split(",") if e], peers.named(args.peers)
    if set(engines) - set(ENGINES):
        raise SystemExit(f"unknown engines {sorted(set(engines) - set(ENGINES))}; choose from {', '.join(ENGINES)}")
    for peer in chosen:
        peers.install(peer)
    where = device.get("device", "cpu")
    result = harness.measured(args, workload, lambda: finish(measure(args, s, engines, chosen, **device)), where)
    json_path, figure = harness.output_paths(args, name)
    figures = [figure] + ([figure.with_name(figure.stem + "_batch_sweep.png")] if result["decode_sweep"] else [])
    wrong = "rosellm's greedy tokens differ from transformers' (see 'check')"
    return harness.write(result, json_path, figures, draw, show, wrong)


def kv_blocks(requests: list, block_size: int) -> int:
    return sum(math.ceil((len(p) + m) / block_size) for p, m in requests)


def measure(args, s: dict, engines: list, chosen: list, device="cpu", dtype="float32", rates=None, variants=()) -> dict:
    """Every engine on the same requests, the machine's rates measured before and after; rosellm once in each of
    `variants` (`benchmarks.variants`; none: once, in `dtype`), the first the row named "rosellm"."""
    rates = rates or (lambda: harness.measure_rates(args.quick, dtype=dtype))  # the GEMM rate in the dtype run
    before, config = rates(), harness.model_config(args.model)
    params, vocab = harness.parameter_counts(config), config.vocab_size
    requests = harness.random_requests(s["requests"], s["prompt_len"], s["max_tokens"], vocab, s["seed"])
    warmup = harness.random_requests(2, [8, 16], [4, 4], vocab, s["seed"] + 1000)
    sweep, longest = [b for b in s["sweep"] if b > 0], max(len(p) + m for p, m in requests)
    # a KV pool that holds every request at once (then the sweep's largest batch): throughput, not preemption
    b = max(sweep + [0])
    sweep_blocks = b * math.ceil((s["sweep_prompt_len"] + 2 * s["sweep_steps"] + b + 2) / 16)
    options = dict(max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_batch_tokens"], block_size=16)
    options |= dict(num_kv_blocks=max(kv_blocks(requests, 16) + s["max_num_seqs"], sweep_blocks))
    options |= dict(max_model_len=longest + 1)
    common = dict(model=args.model, threads=args.threads, requests=requests, warmup=warmup)
    common |= dict(device=device, dtype=dtype, repeats=s["repeats"])
    sample = list(range(min(s["check_requests"], len(requests))))
    hf = dict(batch_size=s["static_batch"], reference_sample=sample, reference_tokens=s["check_tokens"])
    hf["reference_only"] = "hf-generate" not in engines  # the reference is always made
    runs = {"hf-generate": harness.run_engine("hf-generate", common | hf, ENGINES["hf-generate"])}
    reference = runs["hf-generate"].get("reference", {})
    if "rosellm" in engines:
        point = harness.named_checkpoint(s["checkpoint"])
        extra = dict(module=point.module, profile_every=s["profile_every"])
        extra["sweep"] = sweep and dict(batch_sizes=sweep, prompt_len=s["sweep_prompt_len"], steps=s["sweep_steps"])
        for i, variant in enumerate(variants or [None]):
            key, label = "rosellm" if i == 0 else f"rosellm-{variant.name}", harness.rosellm_label(point)
            own = dict(dtype=dtype, engine_options=options, weights=dtype)
            if variant:
                own = dict(dtype=variant.dtype, engine_options=options | variant.engine_options(), weights=variant.name)
                label += f", {variant.label}"
            runs[key] = harness.run_engine("rosellm", common | extra | own, label) | dict(
                label=label,
                checkpoint=point.module,
                weights=own["weights"],
                exact=own["weights"] in ("fp32", "float32"),
            )
            runs[key] |= {"baseline": "rosellm"} if i else {}
    if "hf-continuous" in engines:
        page = 16 if args.quick else 256
        cb = dict(page_size=page, num_blocks=kv_blocks(requests, page) + s["max_num_seqs"], allow_block_sharing=False)
        cb |= dict(max_batch_tokens=s["max_batch_tokens"], max_requests_per_batch=s["max_num_seqs"])
        runs["hf-continuous"] = harness.run_engine(
            "hf-continuous", common | {"cb_options": cb}, ENGINES["hf-continuous"]
        )
    for peer in chosen:
        limits = {key: options[key] for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len")}
        spec = dict(threads=args.threads, requests=requests, warmup=warmup, reference=reference, options=limits)
        runs[peer.name] = peers.run_peer(peer, spec, args.model, dtype)
        runs[peer.name] |= dict(
            weights="gguf" if peer.weights == "file" else peer.dtype or dtype, exact=peer.exact(dtype)
        )
        runs[peer.name] |= {"baseline": peer.home} if peer.home else {}
    roof = harness.rooflines([before, rates()], params, 4 if dtype == "float32" else 2)
    if "hf-generate" not in engines:
        del runs["hf-generate"]
    for r in runs.values():
        r.setdefault("exact", dtype == "float32")
        r.setdefault("weights", dtype)
    work = workload_work(requests, config, params)
    rows = summarize(runs, requests, work, roof, reference)
    ours = runs.get("rosellm", {})
    for point in ours.get("decode_sweep") or []:
        point["share_of_roofline"] = round(point["tokens_per_s"] / roof["compute_tokens_per_s"], 4)
    same = {  # requests two engines answered alike, over all of them (not only the checked sample)
        f"rosellm vs {name}": dict(
            identical_requests=sum(map(operator.eq, ours["tokens"], r["tokens"])), requests=len(r["tokens"])
        )
        for name, r in runs.items()
        if name != "rosellm" and ours.get("tokens") and r.get("tokens")
    }
    for row in rows:  # a bf16 or quantized row against the same engine's fp32 row
        base = runs.get(runs[row["engine"]].get("baseline"), {})
        if runs[row["engine"]].get("tokens") and base.get("tokens"):
            row["agreement_with_fp32"] = harness.agreement(runs[row["engine"]]["tokens"], base["tokens"])
    named = dict(engines=engines, peers=[p.name for p in chosen], rosellm_engine_options=options, threads=args.threads)
    out = dict(settings=s | named, dtype=dtype, parameters=params, work=work, roofline=roof, engines=rows)
    out |= dict(agreement=same, notes=NOTES, check={row["engine"]: row["check"] for row in rows if "check" in row})
    out |= dict(decode_sweep=ours.get("decode_sweep") or [], profile=ours.get("profile"))
    ours_checked = out["check"].get("rosellm", {})
    return out | {"correct": "rosellm" not in runs or not runs["rosellm"]["exact"] or bool(ours_checked.get("passed"))}


def workload_work(requests: list, config, params: dict) -> dict:
    """Tokens and FLOP the workload needs, whatever the engine: every prompt token and every generated token but
    the last go through the decoder; the LM head runs once per generated token; attention (QK^T, PV) apart."""
    prompt_tokens, output_tokens = sum(len(p) for p, _ in requests), sum(m for _, m in requests)
    decoder_tokens = prompt_tokens + output_tokens - len(requests)
    per_key = 4.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    attention = sum(per_key * (len(p) * (len(p) + 1) / 2 + sum(len(p) + k for k in range(1, m))) for p, m in requests)
    dense = 2 * params["non_embedding"] * decoder_tokens + 2 * params["lm_head"] * output_tokens
    out = dict(requests=len(requests), prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    out |= dict(processed_tokens=prompt_tokens + output_tokens, decoder_tokens=decoder_tokens)
    return out | dict(dense_flop=dense, attention_flop=attention)


def summarize(runs: dict, requests: list, work: dict, roof: dict, reference: dict) -> list[dict]:
    """One row per engine: useful output tokens/s, latencies, memory, shares of the roofline, the greedy check
    and the ratio rosellm / engine. An engine that failed, or failed its check, keeps only its error."""
    rows, max_tokens = [], [m for _, m in requests]
    for name, r in runs.items():
        row = {"engine": name, "label": r.get("label") or ENGINES.get(name, name)}
        keys = ("checkpoint", "version", "settings", "environment", "load_s", "check", "weights", "compute_dtype")
        row |= {key: r[key] for key in keys if key in r}
        if r.get("tokens"):
            row["check"] = harness.check_against(reference, r["tokens"])
        if "check" in row:
            row["check"]["required"] = r.get("exact", True)
        row["check_passed"] = row.get("check", {}).get("passed") if r.get("exact", True) else None
        row["other_processes_cpu_share"] = r.get("other_processes_cpu_share")
        if "error" in r or not r.get("tokens"):
            rows.append(row | {"error": r.get("error", "no tokens")})
            continue
        wall, useful = r["wall_s"], sum(min(len(t), m) for t, m in zip(r["tokens"], max_tokens))
        times = zip(r["first_token_s"], r["last_token_s"], max_tokens)
        tpot = [(b - a) / (m - 1) for a, b, m in times if m > 1 and a is not None]
        memory = r.get("memory") or {}
        row |= dict(wall_s=round(wall, 2), useful_output_tokens=useful, output_tokens_per_s=round(useful / wall, 2))
        row |= dict(all_requests_complete=[len(t) for t in r["tokens"]] == max_tokens)
        row |= dict(ttft_ms=median_p90(r["first_token_s"], 1000, 1), tpot_ms=median_p90(tpot, 1000, 3))
        row |= dict(share_of_roofline_output=round(useful / wall / roof["compute_tokens_per_s"], 4))
        row |= dict(share_of_roofline_work=round(work["dense_flop"] / wall / roof["gemm_flops"], 4))
        row |= dict(memory=memory, peak_rss_run_mib=memory.get("peak_rss_run_mib"), steps=r.get("steps"))
        row |= dict(returned_ms=median_p90(r.get("returned_s") or [], 1000, 1))
        rows.append(row | {"padded_token_positions": r.get("padded_token_positions")})
    ours = next((row for row in rows if row["engine"] == "rosellm" and "error" not in row), None)
    for row in [row for row in rows if ours and "error" not in row]:
        row["rosellm_ratio"] = round(ours["output_tokens_per_s"] / row["output_tokens_per_s"], 2)
    return rows


def report(result: dict) -> None:
    print(f"\n{result['workload']}: compute roofline {result['roofline']['compute_tokens_per_s']:.0f} tokens/s")
    harness.print_table(result["engines"], COLUMNS)


def tick_label(label: str) -> str:
    """An engine's label on lines of at most 20 characters, what it is in parentheses on a line of its own."""
    name, _, detail = label.partition(" (")
    return "\n".join([textwrap.fill(name, 20)] + ([textwrap.fill("(" + detail, 22)] if detail else []))


def plot(result: dict, path, sweep_path=None) -> None:
    """Each engine's throughput (`path`); the decode sweep's share of the roofline (`sweep_path`)."""
    rows, roofline = [r for r in result["engines"] if "error" not in r], result["roofline"]["compute_tokens_per_s"]
    fig, ((ax,),) = harness.figure_axes(1, 1, (9, 4.4))
    names, speeds = [tick_label(r["label"]) for r in rows], [r["output_tokens_per_s"] for r in rows]
    bars = ax.bar(names, speeds, color=["tab:red" if r["engine"] == "rosellm" else "tab:gray" for r in rows])
    labels = [f"{r['output_tokens_per_s']:.1f} tok/s\n{r['share_of_roofline_output']:.0%} of roofline" for r in rows]
    ax.bar_label(bars, labels, fontsize=8)
    title = f"{result['workload']}: throughput (roofline {roofline:.0f} tok/s)"
    ax.set(ylabel="useful output tokens/s", ylim=(0, max(speeds + [1]) * 1.3), title=title)
    ax.tick_params(axis="x", labelsize=8)
    harness.save_figure(fig, path, result)
    if sweep_path:
        sizes = [p["batch_size"] for p in result["decode_sweep"]]
        fig, ((ax,),) = harness.figure_axes(1, 1, (7, 4.2))
        shares = [100 * p["share_of_roofline"] for p in result["decode_sweep"]]
        ax.plot(sizes, shares, "o-", color="tab:red", label="rosellm decode")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set(xlabel="sequences decoding together (batch size)", ylabel="% of the compute roofline", ylim=(0, 100))
        ax.set_title("decode: share of the GEMM roofline against batch size")
        ax.legend(fontsize=8)
        harness.save_figure(fig, sweep_path, result)
