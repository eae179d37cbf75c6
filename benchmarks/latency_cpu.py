"""latency-cpu (DESIGN.md §6): one request, a 128-token prompt, 256 output tokens, greedy, EOS ignored.

At batch 1 every decode step reads every weight once and does little arithmetic with it: memory bandwidth is
the limit, and the bandwidth roofline is (measured copy bandwidth) / (bytes of the weights a token goes
through). Each engine's decode tokens/s after the first token is set against it: rosellm, transformers
`generate` (whose tokens are the reference) and, with `--peers`, vLLM's CPU build and llama.cpp. rosellm and
transformers keep the fastest of `--repeats` runs.

    python -m benchmarks latency-cpu [--peers vllm,llamacpp] [--quick]
"""

import time

from . import harness, peers

NAME = "latency-cpu"
HELP = "DESIGN §6 latency-cpu: one request (128-token prompt, 256 tokens) at batch 1, rosellm vs transformers"
CHAPTER = 7  # measures chapter 07's step engine (`LLMEngine`)

FULL = {"prompt_len": 128, "max_tokens": 256, "repeats": 3, "seed": 0, "check_tokens": 16}
QUICK = {"prompt_len": 16, "max_tokens": 12, "repeats": 1, "check_tokens": 4}


def add_arguments(parser) -> None:
    harness.add_arguments(parser, FULL)
    parser.add_argument("--peers", default="", help=f"also run these peers: {', '.join(peers.PEERS)}")


def run(args) -> dict:
    s = harness.settings(args, FULL, QUICK)
    chosen_peers = peers.named(args.peers)
    for peer in chosen_peers:
        peers.install(peer)
    json_path, figure_path = harness.output_paths(args, "latency_cpu")
    started = time.perf_counter()
    with harness.OtherLoad() as other:
        result = measure(args, s, chosen_peers)
    return harness.finish(
        result,
        other,
        started,
        json_path,
        [figure_path],
        lambda r: plot(r, figure_path),
        report,
        "rosellm's greedy tokens differ from transformers'",
    )


def measure(args, s: dict, chosen_peers: list) -> dict:
    machine = harness.describe_machine("cpu", args.threads)
    before = harness.measure_rates(args.quick)
    harness.print_machine(machine, before)
    config = harness.model_config(args.model)
    params = harness.parameter_counts(config)
    requests = harness.random_requests(1, [s["prompt_len"]] * 2, [s["max_tokens"]] * 2, config.vocab_size, s["seed"])
    warmup = harness.random_requests(1, [8, 8], [4, 4], config.vocab_size, s["seed"] + 1000)
    common = {
        "model": args.model,
        "threads": args.threads,
        "requests": requests,
        "warmup": warmup,
        "repeats": s["repeats"],
    }
    # at batch 1 nothing is padded: transformers' timed run is itself the reference
    runs = {
        "hf-generate": harness.run_engine("hf-generate", common | {"batch_size": 1}, "transformers generate at batch 1")
    }
    reference = {"0": runs["hf-generate"]["tokens"][0][: s["check_tokens"]]} if "tokens" in runs["hf-generate"] else {}
    runs["rosellm"] = harness.run_engine(
        "rosellm", common | {"engine_options": {"max_num_seqs": 1}}, "rosellm (ch07) at batch 1"
    )
    for peer in chosen_peers:
        runs[peer.name] = peers.run_peer(
            peer,
            {
                "threads": args.threads,
                "requests": requests,
                "warmup": warmup,
                "reference": reference,
                "options": peers.options(peer, 1, max(s["prompt_len"], 256), s["prompt_len"] + s["max_tokens"]),
            },
            args.model,
        )
    roof = harness.rooflines([before, harness.measure_rates(args.quick)], params)
    labels = {"rosellm": "rosellm (ch07)", "hf-generate": "transformers generate"}
    engines = []
    for name, r in runs.items():
        row = {
            "engine": name,
            "label": r.get("label") or labels[name],
            **{key: r[key] for key in ("version", "settings", "environment", "load_s") if key in r},
            "check": r.get("check") or harness.check_against(reference, r.get("tokens") or [[]]),
            "other_processes_cpu_share": r.get("other_processes_cpu_share"),
        }
        if "error" in r:
            engines.append(row | {"error": r["error"]})
            continue
        first, last, n = r["first_token_s"][0], r["last_token_s"][0], s["max_tokens"]
        decode = (n - 1) / (last - first)
        engines.append(
            row
            | {
                "ttft_ms": round(first * 1000, 1),
                "decode_s": round(last - first, 3),
                "tpot_ms": round((last - first) / (n - 1) * 1000, 2),
                "decode_tokens_per_s": round(decode, 2),
                "end_to_end_tokens_per_s": round(n / last, 2),
                "share_of_bandwidth_roofline": round(decode / roof["bandwidth_tokens_per_s"], 4),
                "share_of_compute_roofline": round(decode / roof["compute_tokens_per_s"], 4),
                "repeat_walls_s": r.get("repeat_walls_s"),
                "memory": r.get("memory"),
                "peak_rss_run_mib": (r.get("memory") or {}).get("peak_rss_run_mib"),
            }
        )
    by = {e["engine"]: e for e in engines if "error" not in e}
    if "rosellm" in by:
        for e in by.values():
            e["rosellm_ratio"] = round(by["rosellm"]["decode_tokens_per_s"] / e["decode_tokens_per_s"], 2)
        if "hf-generate" in by:
            by["rosellm"]["decode_ratio_vs_transformers"] = by["hf-generate"]["rosellm_ratio"]
    kv_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    tokens = {name: r.get("tokens") for name, r in runs.items()}
    return harness.stamp(
        NAME,
        args,
        machine,
        s | {"greedy": True, "ignore_eos": True, "threads": args.threads, "peers": [p.name for p in chosen_peers]},
    ) | {
        "dtype": "float32",
        "parameters": params,
        "roofline": roof,
        "kv_cache_bytes_at_end": kv_bytes * (s["prompt_len"] + s["max_tokens"]),
        "engines": engines,
        "correct": bool(by.get("rosellm", {}).get("check", {}).get("passed")),
        "all_tokens_identical": tokens["rosellm"] is not None and tokens["rosellm"] == tokens["hf-generate"],
        "notes": [
            "decode tokens/s = (tokens - 1) / (last token's time - first token's): the first token is the "
            "prefill's; TTFT is its time.",
            "bandwidth roofline = measured copy bandwidth / (4 bytes x (non-embedding weights + LM head)); the "
            "KV cache read at each step (kv_cache_bytes_at_end at the last) comes on top.",
        ],
    }


def report(result: dict) -> None:
    roof = result["roofline"]
    print(f"\nlatency-cpu: bandwidth roofline {roof['bandwidth_tokens_per_s']:.0f} tokens/s")
    rows = [
        {
            "label": e["label"],
            "tps": e.get("decode_tokens_per_s", e.get("error")),
            "ratio": e.get("rosellm_ratio"),
            "ttft": e.get("ttft_ms"),
            "tpot": e.get("tpot_ms"),
            "share": e.get("share_of_bandwidth_roofline"),
            "check": "ok" if e["check"]["passed"] else "FAILED",
        }
        for e in result["engines"]
    ]
    harness.print_table(
        rows,
        [
            ("label", "engine"),
            ("tps", "decode tok/s"),
            ("ratio", "rosellm is x"),
            ("ttft", "TTFT ms"),
            ("tpot", "TPOT ms"),
            ("share", "bandwidth roofline"),
            ("check", "check"),
        ],
    )


def plot(result: dict, path) -> None:
    rows = [e for e in result["engines"] if "error" not in e]
    fig, ((left, right),) = harness.figure_axes(1, 2, (11, 4))
    names = [e["label"].replace(" (", "\n(") for e in rows]
    colors = ["tab:red" if e["engine"] == "rosellm" else "tab:gray" for e in rows]
    values = [e["decode_tokens_per_s"] for e in rows] + [result["roofline"]["bandwidth_tokens_per_s"]]
    bars = left.bar(names + ["bandwidth\nroofline"], values, color=colors + ["white"], edgecolor="black")
    left.bar_label(bars, [f"{v:.0f}" for v in values], fontsize=8)
    left.set(ylabel="decode tokens/s (batch 1)", title="decode speed, one request")
    right.bar(names, [e["ttft_ms"] for e in rows], color=colors, edgecolor="black")
    right.set(ylabel="milliseconds", title=f"time to first token ({result['settings']['prompt_len']}-token prompt)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelsize=7)
    harness.save_figure(fig, path, "latency-cpu: " + harness.caption(result))
