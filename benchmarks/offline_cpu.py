"""offline-cpu (DESIGN.md §6): throughput of offline generation on CPU, rosellm against the engines a reader
would pick instead.

64 requests of random prompt token ids, prompt lengths uniform in [32, 512], max_tokens uniform in [32, 256],
greedy, EOS ignored, seed 0, SmolLM2-135M in fp32. The same requests, all submitted at t = 0, go to rosellm's
`LLMEngine`, transformers `generate` (static batches of 16, left-padded: only each request's own max_tokens
count as useful output), transformers' continuous batching and, with `--peers vllm,llamacpp`, vLLM's CPU build
and llama.cpp (see `benchmarks.peers`). Each engine runs in a process of its own; transformers' greedy
tokens for a sample of requests, one request at a time, are the reference every engine is checked against
(a peer before it is timed). The machine's GEMM rate and memory bandwidth are measured before and after.

    python -m benchmarks offline-cpu [--peers vllm,llamacpp] [--quick]
"""

import math
import time

from . import harness, peers
from .harness import median_p90

NAME = "offline-cpu"
HELP = "DESIGN §6 offline-cpu: 64 random requests, rosellm vs transformers (and --peers vllm,llamacpp)"
CHAPTER = 7  # measures chapter 07's step engine (`LLMEngine`)

FULL = {
    "requests": 64,
    "prompt_len": [32, 512],
    "max_tokens": [32, 256],
    "seed": 0,
    "static_batch": 16,
    "max_num_seqs": 64,
    "max_batch_tokens": 2048,
    "check_requests": 4,
    "check_tokens": 16,
    "sweep": [1, 2, 4, 8, 16, 32, 64],
    "sweep_prompt_len": 128,
    "sweep_steps": 8,
    "profile_requests": 8,
}
QUICK = {
    "requests": 6,
    "prompt_len": [8, 40],
    "max_tokens": [4, 12],
    "static_batch": 4,
    "max_batch_tokens": 256,
    "check_requests": 2,
    "check_tokens": 4,
    "sweep": [1, 2, 4],
    "sweep_prompt_len": 16,
    "sweep_steps": 3,
    "profile_requests": 3,
}
ENGINES = {
    "rosellm": "rosellm (ch07, continuous batching)",
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
    "Peers: each in its own virtual environment on fp32 weights made from the same GGUF; checked against "
    "transformers' greedy tokens before it is timed; version, settings and load time in 'engines'.",
]


def add_arguments(parser) -> None:
    harness.add_arguments(parser, FULL)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"of {', '.join(ENGINES)}")
    parser.add_argument("--peers", default="", help=f"also run these peers: {', '.join(peers.PEERS)}")


def run(args) -> dict:
    s = harness.settings(args, FULL, QUICK)
    engines, chosen_peers = [e for e in args.engines.split(",") if e], peers.named(args.peers)
    if set(engines) - set(ENGINES):
        raise SystemExit(f"unknown engines {sorted(set(engines) - set(ENGINES))}; choose from {', '.join(ENGINES)}")
    for peer in chosen_peers:
        peers.install(peer)
    json_path, figure_path = harness.output_paths(args, "offline_cpu")
    sweep_path = figure_path.with_name(figure_path.stem + "_batch_sweep.png")
    started = time.perf_counter()
    with harness.OtherLoad() as other:
        result = measure(args, s, engines, chosen_peers)
    figures = [figure_path] + ([sweep_path] if result["decode_sweep"] else [])
    return harness.finish(
        result,
        other,
        started,
        json_path,
        figures,
        lambda r: plot(r, figure_path, sweep_path),
        report,
        "rosellm's greedy tokens differ from transformers' (see 'check')",
    )


def kv_blocks(requests: list, block_size: int) -> int:
    return sum(math.ceil((len(p) + m) / block_size) for p, m in requests)


def measure(
    args,
    s: dict,
    engines: list[str],
    chosen_peers: list,
    device: str = "cpu",
    dtype: str = "float32",
    rates=None,
    workload: str = NAME,
) -> dict:
    """Every engine on the same requests; offline-gpu calls it too, with its own device, dtype and rates."""
    rates = rates or (lambda: harness.measure_rates(args.quick))
    machine = harness.describe_machine(device, args.threads)
    before = rates()
    harness.print_machine(machine, before)
    config = harness.model_config(args.model)
    params = harness.parameter_counts(config)
    requests = harness.random_requests(s["requests"], s["prompt_len"], s["max_tokens"], config.vocab_size, s["seed"])
    warmup = harness.random_requests(2, [8, 16], [4, 4], config.vocab_size, s["seed"] + 1000)
    work = workload_work(requests, config, params)
    sweep = [b for b in s["sweep"] if b > 0]
    # a pool that holds every request (and the sweep's largest batch) at once: throughput, not preemption
    room = (
        kv_blocks(requests, 16)
        + s["max_num_seqs"]
        + max(sweep or [0]) * math.ceil((s["sweep_prompt_len"] + 2 * s["sweep_steps"] + max(sweep or [0]) + 2) / 16 + 1)
    )
    longest = max(len(p) + m for p, m in requests)
    common = {
        "model": args.model,
        "threads": args.threads,
        "requests": requests,
        "warmup": warmup,
        "device": device,
        "dtype": dtype,
    }
    runs = {
        "hf-generate": harness.run_engine(
            "hf-generate",
            common
            | {
                "batch_size": s["static_batch"],
                "reference_sample": list(range(min(s["check_requests"], len(requests)))),
                "reference_tokens": s["check_tokens"],
                "reference_only": "hf-generate" not in engines,
            },
            ENGINES["hf-generate"],
        )
    }
    reference = runs["hf-generate"].get("reference", {})
    options = {
        "max_num_seqs": s["max_num_seqs"],
        "max_num_batched_tokens": s["max_batch_tokens"],
        "block_size": 16,
        "num_kv_blocks": room,
        "max_model_len": longest + 1,
    }
    if "rosellm" in engines:
        runs["rosellm"] = harness.run_engine(
            "rosellm",
            common
            | {
                "engine_options": options,
                "profile_requests": requests[: s["profile_requests"]],
                "sweep": sweep
                and {"batch_sizes": sweep, "prompt_len": s["sweep_prompt_len"], "steps": s["sweep_steps"]},
            },
            ENGINES["rosellm"],
        )
    if "hf-continuous" in engines:
        page = 16 if args.quick else 256  # its KV pool, like rosellm's, holds every request at once
        runs["hf-continuous"] = harness.run_engine(
            "hf-continuous",
            common
            | {
                "cb_options": {
                    "page_size": page,
                    "num_blocks": kv_blocks(requests, page) + s["max_num_seqs"],
                    "max_batch_tokens": s["max_batch_tokens"],
                    "max_requests_per_batch": s["max_num_seqs"],
                    "allow_block_sharing": False,
                }
            },
            ENGINES["hf-continuous"],
        )
    for peer in chosen_peers:
        runs[peer.name] = peers.run_peer(
            peer,
            {
                "threads": args.threads,
                "requests": requests,
                "warmup": warmup,
                "reference": reference,
                "options": peers.options(peer, s["max_num_seqs"], s["max_batch_tokens"], longest),
            },
            args.model,
        )
    roof = harness.rooflines([before, rates()], params, 4 if dtype == "float32" else 2)
    if "hf-generate" not in engines:
        del runs["hf-generate"]
    summaries = summarize(runs, requests, work, roof, reference)
    for point in runs.get("rosellm", {}).get("decode_sweep") or []:
        point["share_of_roofline"] = round(point["tokens_per_s"] / roof["compute_tokens_per_s"], 4)
    rosellm = runs.get("rosellm", {})
    return harness.stamp(
        workload,
        args,
        machine,
        s
        | {
            "engines": engines,
            "peers": [p.name for p in chosen_peers],
            "rosellm_engine_options": options,
            "threads": args.threads,
        },
    ) | {
        "dtype": dtype,
        "parameters": params,
        "work": work,
        "roofline": roof,
        "engines": summaries,
        "check": {e["engine"]: e["check"] for e in summaries if "check" in e},
        "correct": "rosellm" not in runs or bool(rosellm.get("tokens") and check_of(rosellm, reference)["passed"]),
        "agreement": {
            f"rosellm vs {name}": {
                "identical_requests": sum(a == b for a, b in zip(rosellm["tokens"], r["tokens"])),
                "requests": len(requests),
            }
            for name, r in runs.items()
            if name != "rosellm" and r.get("tokens") and rosellm.get("tokens")
        },
        "decode_sweep": rosellm.get("decode_sweep") or [],
        "profile": rosellm.get("profile"),
        "targets": targets_met(summaries),
        "notes": NOTES,
    }


def check_of(run: dict, reference: dict) -> dict:
    return run.get("check") or harness.check_against(reference, run["tokens"])


def workload_work(requests: list, config, params: dict) -> dict:
    """Tokens and FLOP the workload needs, whatever the engine: every prompt token and every generated token but
    the last go through the decoder; the LM head runs once per generated token; attention (QK^T, PV) apart."""
    prompt_tokens, output_tokens = sum(len(p) for p, _ in requests), sum(m for _, m in requests)
    decoder_tokens = prompt_tokens + output_tokens - len(requests)
    per_key = 4.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    attention = sum(per_key * (len(p) * (len(p) + 1) / 2 + sum(len(p) + k for k in range(1, m))) for p, m in requests)
    return {
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "processed_tokens": prompt_tokens + output_tokens,
        "decoder_tokens": decoder_tokens,
        "dense_flop": 2 * params["non_embedding"] * decoder_tokens + 2 * params["lm_head"] * output_tokens,
        "attention_flop": attention,
    }


def summarize(runs: dict, requests: list, work: dict, roof: dict, reference: dict) -> list[dict]:
    """One row per engine: useful output tokens/s, latencies, memory, shares of the roofline, the greedy check
    and the ratio rosellm / engine. An engine that failed (or failed its check) keeps only its error."""
    rows = []
    max_tokens = [m for _, m in requests]
    for name, r in runs.items():
        row = {
            "engine": name,
            "label": r.get("label") or ENGINES.get(name, name),
            **{key: r[key] for key in ("version", "settings", "environment", "load_s") if key in r},
            "other_processes_cpu_share": r.get("other_processes_cpu_share"),
        }
        if r.get("tokens"):
            row["check"] = check_of(r, reference)
        elif "check" in r:
            row["check"] = r["check"]
        row["check_passed"] = row["check"]["passed"] if "check" in row else None
        if "error" in r or not r.get("tokens"):
            rows.append(row | {"error": r.get("error", "no tokens")})
            continue
        useful = sum(min(len(t), m) for t, m in zip(r["tokens"], max_tokens))
        last = r["last_token_s"]
        tpot = [(b - a) / (m - 1) for a, b, m in zip(r["first_token_s"], last, max_tokens) if m > 1 and a is not None]
        rows.append(
            row
            | {
                "wall_s": round(r["wall_s"], 2),
                "useful_output_tokens": useful,
                "all_requests_complete": [len(t) for t in r["tokens"]] == max_tokens,
                "output_tokens_per_s": round(useful / r["wall_s"], 2),
                "processed_tokens_per_s": round(work["processed_tokens"] / r["wall_s"], 2),
                "ttft_ms": median_p90(r["first_token_s"], 1000, 1),
                "tpot_ms": median_p90(tpot, 1000, 2),
                "share_of_roofline_output": round(useful / r["wall_s"] / roof["compute_tokens_per_s"], 4),
                "share_of_roofline_work": round(work["dense_flop"] / r["wall_s"] / roof["gemm_flops"], 4),
                "share_of_roofline_work_with_attention": round(
                    (work["dense_flop"] + work["attention_flop"]) / r["wall_s"] / roof["gemm_flops"], 4
                ),
                "memory": r.get("memory"),
                "peak_rss_run_mib": (r.get("memory") or {}).get("peak_rss_run_mib"),
                **(
                    {
                        "returned_ms": median_p90(r["returned_s"], 1000, 1),
                        "padded_token_positions": r["padded_token_positions"],
                    }
                    if "returned_s" in r
                    else {}
                ),
                **({"steps": r["steps"]} if "steps" in r else {}),
            }
        )
    ours = next((row for row in rows if row["engine"] == "rosellm" and "error" not in row), None)
    for row in rows:
        if ours and "error" not in row:
            row["rosellm_ratio"] = round(ours["output_tokens_per_s"] / row["output_tokens_per_s"], 2)
    return rows


def targets_met(rows: list[dict]) -> dict:
    by = {row["engine"]: row for row in rows if "error" not in row}
    if "rosellm" not in by:
        return {}
    tps = {name: row["output_tokens_per_s"] for name, row in by.items()}
    out = {
        "share_of_roofline_output >= 0.6": by["rosellm"]["share_of_roofline_output"] >= 0.6,
        "share_of_roofline_work >= 0.6": by["rosellm"]["share_of_roofline_work"] >= 0.6,
    }
    if "hf-generate" in tps:
        out["4x transformers generate"] = tps["rosellm"] >= 4 * tps["hf-generate"]
    if "hf-continuous" in tps:
        out["beats transformers continuous batching"] = tps["rosellm"] > tps["hf-continuous"]
    if "vllm" in tps:
        out["beats vLLM (CPU build)"] = tps["rosellm"] > tps["vllm"]
    return out


def report(result: dict) -> None:
    roof, work = result["roofline"], result["work"]
    print(
        f"\n{result['workload']}: {work['requests']} requests, {work['output_tokens']} useful output tokens, "
        f"{work['prompt_tokens']} prompt tokens; compute roofline {roof['compute_tokens_per_s']:.0f} tokens/s"
    )
    rows = [
        {
            "label": r["label"],
            "tps": r.get("output_tokens_per_s", r.get("error")),
            "ratio": r.get("rosellm_ratio"),
            "ttft": r.get("ttft_ms", {}).get("median"),
            "tpot": r.get("tpot_ms", {}).get("median"),
            "mem": r.get("peak_rss_run_mib"),
            "share": r.get("share_of_roofline_output"),
            "check": {True: "ok", False: "FAILED", None: "-"}[r["check_passed"]],
        }
        for r in result["engines"]
    ]
    harness.print_table(
        rows,
        [
            ("label", "engine"),
            ("tps", "output tok/s"),
            ("ratio", "rosellm is x"),
            ("ttft", "TTFT ms median"),
            ("tpot", "TPOT ms median"),
            ("mem", "peak RSS MiB"),
            ("share", "roofline share"),
            ("check", "check"),
        ],
    )
    if result["decode_sweep"]:
        print(
            "decode sweep (rosellm): "
            + ", ".join(f"b={p['batch_size']}: {p['tokens_per_s']:.0f} tok/s" for p in result["decode_sweep"])
        )
    if result.get("profile"):
        print(
            "profile (share of step time): "
            + ", ".join(f"{p['part']} {p['share']:.0%}" for p in result["profile"]["parts"])
        )
    for name, met in result["targets"].items():
        print(f"target {name}: {'met' if met else 'NOT met'}")


def plot(result: dict, path, sweep_path) -> None:
    """Throughput and latency of each engine (`path`); the decode sweep's share of the roofline (`sweep_path`)."""
    rows = [r for r in result["engines"] if "error" not in r]
    fig, ((left, right),) = harness.figure_axes(1, 2, (12, 4.4))
    names = [r["label"].replace(" (", "\n(") for r in rows]
    colors = ["tab:red" if r["engine"] == "rosellm" else "tab:gray" for r in rows]
    bars = left.bar(names, [r["output_tokens_per_s"] for r in rows], color=colors)
    left.bar_label(
        bars,
        [f"{r['output_tokens_per_s']:.1f} tok/s\n{r['share_of_roofline_output']:.0%} of roofline" for r in rows],
        fontsize=8,
    )
    left.set(
        ylabel="useful output tokens/s",
        ylim=(0, max([r["output_tokens_per_s"] for r in rows] + [1]) * 1.3),
        title=f"{result['workload']}: throughput (roofline {result['roofline']['compute_tokens_per_s']:.0f} tok/s)",
    )
    left.tick_params(axis="x", labelsize=7)
    for offset, key, label, scale in (
        (-0.19, "ttft_ms", "time to first token", 1),
        (0.19, "tpot_ms", "time per output token x 100", 100),
    ):
        med = [(r[key]["median"] or 0) * scale / 1000 for r in rows]
        p90 = [(r[key]["p90"] or 0) * scale / 1000 for r in rows]
        right.bar([i + offset for i in range(len(rows))], med, 0.38, label=f"{label} (median)")
        right.errorbar(
            [i + offset for i in range(len(rows))],
            med,
            yerr=[[0] * len(med), [max(p - m, 0) for p, m in zip(p90, med)]],
            fmt="none",
            ecolor="black",
            capsize=3,
        )
    right.set_xticks(range(len(rows)), names, fontsize=7)
    right.set(ylabel="seconds (whisker: p90)", title="latency, every request submitted at t=0 (lower is better)")
    right.legend(fontsize=8)
    harness.save_figure(fig, path, harness.caption(result))
    sweep = result["decode_sweep"]
    if sweep:
        fig, ((ax,),) = harness.figure_axes(1, 1, (7, 4.2))
        sizes = [p["batch_size"] for p in sweep]
        ax.plot(sizes, [100 * p["share_of_roofline"] for p in sweep], "o-", color="tab:red", label="rosellm decode")
        ax.axhline(60, ls="--", color="gray", label="60%")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set(
            xlabel="sequences decoding together (batch size)",
            ylabel="% of the compute roofline",
            ylim=(0, 100),
            title="decode: share of the GEMM roofline against batch size",
        )
        ax.legend(fontsize=8)
        harness.save_figure(fig, sweep_path, harness.caption(result))
