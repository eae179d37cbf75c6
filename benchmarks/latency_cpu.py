"""latency-cpu: one request, a 128-token prompt, 256 output tokens, greedy, EOS ignored.

At batch 1 every decode step reads every weight once and does little arithmetic with it: memory bandwidth is
the limit, and the bandwidth roofline is (measured copy bandwidth) / (bytes of the weights a token goes
through). Each engine's decode tokens/s after the first token is set against it: rosellm, transformers
`generate` and, with `--peers`, vLLM's CPU build and llama.cpp. The engines run as offline-cpu runs them (one
request is a workload of one, rosellm from the checkpoint `--checkpoint` names, the latest by default);
rosellm and transformers keep the fastest of `--repeats` runs.

    python -m benchmarks latency-cpu [--checkpoint 11] [--peers vllm,llamacpp] [--quick]
"""

from functools import partial

from . import harness, offline_cpu

NAME = "latency-cpu"
HELP = "one request (128-token prompt, 256 tokens) at batch 1: rosellm's LLMEngine vs transformers"
CHAPTER = 7  # the step engine (`LLMEngine`) appears; the latest checkpoint by default, any from 07 by --checkpoint

FULL = {"checkpoint": "latest", "prompt_len": 128, "max_tokens": 256, "repeats": 3, "seed": 0, "check_tokens": 16}
QUICK = {"prompt_len": 16, "max_tokens": 12, "repeats": 1, "check_tokens": 4}
COLUMNS = {"label": "engine", "decode_tokens_per_s": "decode tok/s", "rosellm_ratio": "rosellm is x"}
COLUMNS |= {"ttft_ms": "TTFT ms", "share_of_bandwidth_roofline": "bandwidth roofline", "check_passed": "check"}
COLUMNS |= {"error": "error"}


def add_arguments(parser) -> None:
    offline_cpu.add_arguments(parser, engines="rosellm,hf-generate")


def run(args, s: dict) -> dict:
    n, p = s["max_tokens"], s["prompt_len"]
    one = offline_cpu.FULL | {"requests": 1, "prompt_len": [p, p], "max_tokens": [n, n], "static_batch": 1}
    one |= {"max_num_seqs": 1, "max_batch_tokens": max(p, 256), "check_requests": 1, "sweep": [0]}
    one |= {"profile_every": 0, "check_tokens": s["check_tokens"], "seed": s["seed"], "repeats": s["repeats"]}
    one |= {"checkpoint": s["checkpoint"]}
    return offline_cpu.run_workload(
        args, one, NAME, "latency_cpu", plot, report, partial(at_batch_1, s=s, model=args.model)
    )


def at_batch_1(body: dict, s: dict, model: str | None) -> dict:
    """offline-cpu's rows of one request, read as decode speed: decode tokens/s = (tokens - 1) / (last token's
    time - first token's), the first being the prefill's; TTFT is its time."""
    point = harness.named_checkpoint(s["checkpoint"])
    labels = {"rosellm": harness.rosellm_label(point, short=True), "hf-generate": "transformers generate"}
    rows, roofline = [e for e in body["engines"] if "error" not in e], body["roofline"]["bandwidth_tokens_per_s"]
    for e in body["engines"]:
        e["label"] = labels.get(e["engine"], e["label"])
    for e in rows:
        e["ttft_ms"], e["tpot_ms"] = e["ttft_ms"]["median"], e["tpot_ms"]["median"]
        e["decode_tokens_per_s"] = round(1000 / e["tpot_ms"], 2)
        e["share_of_bandwidth_roofline"] = round(e["decode_tokens_per_s"] / roofline, 4)
    ours = next((e for e in rows if e["engine"] == "rosellm"), None)
    for e in rows if ours else []:
        e["rosellm_ratio"] = round(ours["decode_tokens_per_s"] / e["decode_tokens_per_s"], 2)
        if e["engine"] == "hf-generate":
            ours["decode_ratio_vs_transformers"] = e["rosellm_ratio"]
    c, tokens = harness.model_config(model), s["prompt_len"] + s["max_tokens"]
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 * tokens
    identical = body["agreement"].get("rosellm vs hf-generate", {}).get("identical_requests") == 1
    notes = [
        "bandwidth roofline = measured copy bandwidth / (4 bytes x (non-embedding weights + LM head)); the KV "
        "cache read at each step (kv_cache_bytes_at_end at the last) comes on top."
    ]
    extra = dict(kv_cache_bytes_at_end=kv_bytes, all_tokens_identical=identical, notes=notes)
    return body | {"settings": body["settings"] | s} | extra


def report(result: dict) -> None:
    print(f"\nlatency-cpu: bandwidth roofline {result['roofline']['bandwidth_tokens_per_s']:.0f} tokens/s")
    harness.print_table(result["engines"], COLUMNS)


def plot(result: dict, path) -> None:
    rows = [e for e in result["engines"] if "error" not in e]
    fig, ((ax,),) = harness.figure_axes(1, 1, (8, 4))
    values = [e["decode_tokens_per_s"] for e in rows] + [result["roofline"]["bandwidth_tokens_per_s"]]
    names = [offline_cpu.tick_label(e["label"]) for e in rows] + ["bandwidth\nroofline"]
    colors = ["tab:red" if e["engine"] == "rosellm" else "tab:gray" for e in rows] + ["white"]
    ax.bar_label(ax.bar(names, values, color=colors, edgecolor="black"), [f"{v:.0f}" for v in values], fontsize=8)
    ax.set(ylabel="decode tokens/s (batch 1)", title="latency-cpu: decode speed, one request")
    ax.tick_params(axis="x", labelsize=8)
    harness.save_figure(fig, path, result)
