"""latency-cpu: one request, a 128-token prompt, 256 output tokens, greedy, EOS ignored.

At batch 1 every decode step reads every weight once and does little arithmetic with it: memory bandwidth is
the limit, and the bandwidth roofline is (measured copy bandwidth) / (bytes of the weights a token goes
through). Each engine's decode tokens/s after the first token is set against it: rosellm, transformers
`generate` and, with `--peers`, vLLM's CPU build and llama.cpp. The engines run as offline-cpu runs them (one
request is a workload of one, rosellm from the checkpoint `--checkpoint` names, the latest by default);
rosellm and transformers keep the fastest of `--repeats` runs.

From chapter 13 rosellm runs once per weight format `--variants` names (`benchmarks.variants`: fp32, bf16,
int8, int4, gguf; all by default, fp32 alone on earlier checkpoints), and the peers have variants of their own
(vllm-bf16, llamacpp-q4_1: the bundled GGUF as it is). Each row states the bytes of weights a token reads
(`weight_bytes_per_token`) and its bandwidth roofline from them. The fp32 rows are checked against transformers;
the others record their agreement with the same engine's fp32 row (`agreement_with_fp32`) instead.

    python -m benchmarks latency-cpu [--checkpoint 11] [--variants fp32,int4] [--peers vllm,llamacpp] [--quick]
"""

from functools import partial
from pathlib import Path

from . import harness, offline_cpu, variants

NAME = "latency-cpu"
HELP = "one request (128-token prompt, 256 tokens) at batch 1: rosellm's LLMEngine vs transformers"
CHAPTER = 7  # the step engine (`LLMEngine`) appears; the latest checkpoint by default, any from 07 by --checkpoint

FULL = {"checkpoint": "latest", "prompt_len": 128, "max_tokens": 256, "repeats": 3, "seed": 0, "check_tokens": 16}
FULL |= {"variants": "all"}
QUICK = {"prompt_len": 16, "max_tokens": 12, "repeats": 1, "check_tokens": 4}
COLUMNS = {"label": "engine", "decode_tokens_per_s": "decode tok/s", "tpot_ms": "ms/token"}
COLUMNS |= {"weight_mb_per_token": "weights MB/token", "rosellm_ratio": "rosellm is x", "ttft_ms": "TTFT ms"}
COLUMNS |= {"share_of_bandwidth_roofline": "bandwidth roofline", "check_passed": "check"}
COLUMNS |= {"same_tokens_as_fp32": "same as fp32"}
COLUMNS |= {"error": "error"}


def add_arguments(parser) -> None:
    offline_cpu.add_arguments(parser, engines="rosellm,hf-generate")


def run(args, s: dict) -> dict:
    n, p = s["max_tokens"], s["prompt_len"]
    one = offline_cpu.FULL | {"requests": 1, "prompt_len": [p, p], "max_tokens": [n, n], "static_batch": 1}
    one |= {"max_num_seqs": 1, "max_batch_tokens": max(p, 256), "check_requests": 1, "sweep": [0]}
    one |= {"profile_every": 0, "check_tokens": s["check_tokens"], "seed": s["seed"], "repeats": s["repeats"]}
    one |= {"checkpoint": s["checkpoint"]}
    chosen = variants.chosen(s["variants"], harness.named_checkpoint(s["checkpoint"]))
    finish = partial(at_batch_1, s=s, model=args.model)
    return offline_cpu.run_workload(args, one, NAME, "latency_cpu", plot, report, finish, variants=chosen)


def at_batch_1(body: dict, s: dict, model: str | None) -> dict:
    """offline-cpu's rows of one request, read as decode speed: decode tokens/s = (tokens - 1) / (last token's
    time - first token's), the first being the prefill's; TTFT is its time. Each row's bandwidth roofline is
    the measured bandwidth over the bytes of weights its tokens read."""
    point, c = harness.named_checkpoint(s["checkpoint"]), harness.model_config(model)
    short = harness.rosellm_label(point, short=True)
    labels = {"rosellm": short, "hf-generate": "transformers generate"}
    labels |= {f"rosellm-{v.name}": f"{short} {v.label}" for v in variants.VARIANTS.values()}
    if len([e for e in body["engines"] if e["engine"].startswith("rosellm")]) > 1:
        labels["rosellm"] = f"{short} fp32"
    rows, bandwidth = [e for e in body["engines"] if "error" not in e], body["roofline"]["bandwidth_bytes_per_s"]
    for e in body["engines"]:
        e["label"] = labels.get(e["engine"], e["label"])
    for e in rows:
        form = e["weights"]
        if "compute_dtype" in e:  # rosellm's rows
            exact = e["engine"] == "rosellm-gguf-exact"  # the dense fp32 copy: chapter 18's oracle
            form = variants.read_format(form, e["compute_dtype"], "integer_dot" in point.capabilities and not exact)
        e["weight_bytes_per_token"] = variants.bytes_per_token(form, c, gguf_file(model))
        e["weight_mb_per_token"] = round(e["weight_bytes_per_token"] / 1e6, 1)
        e["bandwidth_roofline_tokens_per_s"] = round(bandwidth / e["weight_bytes_per_token"], 2)
        e["same_tokens_as_fp32"] = (e.get("agreement_with_fp32") or {}).get("equal_token_share")
    for e in rows:
        e["ttft_ms"], e["tpot_ms"] = e["ttft_ms"]["median"], e["tpot_ms"]["median"]
        e["decode_tokens_per_s"] = round(1000 / e["tpot_ms"], 2)
        e["share_of_bandwidth_roofline"] = round(e["decode_tokens_per_s"] / e["bandwidth_roofline_tokens_per_s"], 4)
    ours = next((e for e in rows if e["engine"] == "rosellm"), None)
    for e in rows if ours else []:
        e["rosellm_ratio"] = round(ours["decode_tokens_per_s"] / e["decode_tokens_per_s"], 2)
        if e["engine"] == "hf-generate":
            ours["decode_ratio_vs_transformers"] = e["rosellm_ratio"]
    tokens = s["prompt_len"] + s["max_tokens"]
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4 * tokens
    identical = body["agreement"].get("rosellm vs hf-generate", {}).get("identical_requests") == 1
    notes = [
        "bandwidth roofline = measured copy bandwidth / (4 bytes x (non-embedding weights + LM head)); the KV "
        "cache read at each step (kv_cache_bytes_at_end at the last) comes on top.",
        "Each row's bandwidth_roofline_tokens_per_s uses its own weight_bytes_per_token: " + variants.BYTES,
    ]
    extra = dict(kv_cache_bytes_at_end=kv_bytes, all_tokens_identical=identical, notes=notes)
    return body | {"settings": body["settings"] | s} | extra


def gguf_file(model: str | None):
    """The GGUF whose tensors the "gguf" rows read: the model, when it is one, else the bundled SmolLM2."""
    from chapters import submodule

    loader = submodule("rosellm", "loader")

    return Path(model) if model and str(model).endswith(".gguf") else loader.model_source(None)


def report(result: dict) -> None:
    print(f"\nlatency-cpu: bandwidth roofline {result['roofline']['bandwidth_tokens_per_s']:.0f} tokens/s")
    harness.print_table(result["engines"], COLUMNS)


def plot(result: dict, path) -> None:
    """Decode tokens/s of each row beside its bandwidth roofline (left); ms/token against the MB of weights a
    token reads, with the line the measured bandwidth draws (right)."""
    rows = [e for e in result["engines"] if "error" not in e]
    fig, ((left, right),) = harness.figure_axes(1, 2, (13, 5.4))
    names = [offline_cpu.tick_label(e["label"]) for e in rows]
    colors = ["tab:red" if e["engine"].startswith("rosellm") else "tab:gray" for e in rows]
    values = [e["decode_tokens_per_s"] for e in rows]
    bars = left.bar(names, values, color=colors, edgecolor="black")
    left.bar_label(bars, [f"{v:.0f}" for v in values], fontsize=7)
    left.plot(names, [e["bandwidth_roofline_tokens_per_s"] for e in rows], "_", color="black", ms=18, label="roofline")
    left.set(ylabel="decode tokens/s (batch 1)", title="latency-cpu: decode speed, one request")
    left.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=6)
    left.legend(fontsize=7)
    megabytes = [e["weight_bytes_per_token"] / 1e6 for e in rows]
    right.scatter(megabytes, [e["tpot_ms"] for e in rows], c=colors, edgecolors="black", zorder=3)
    for mb, e in zip(megabytes, rows):
        right.annotate(e["label"], (mb, e["tpot_ms"]), fontsize=6, xytext=(4, 2), textcoords="offset points")
    bandwidth = result["roofline"]["bandwidth_bytes_per_s"]
    line = [0, max(megabytes + [1]) * 1.1]
    right.plot(line, [mb * 1e6 / bandwidth * 1000 for mb in line], "--", color="black", label="bandwidth bound")
    right.set(xlabel="MB of weights read per token", ylabel="ms per token", title="time against bytes per token")
    right.set_xlim(left=0)
    right.set_ylim(bottom=0)
    right.legend(fontsize=7)
    if any("weight_mb_per_token" in e and e["engine"] != "rosellm" for e in rows):  # rows of several formats
        result = result | {"model": "SmolLM2-135M-Instruct (bundled GGUF; each row's weights as its label says)"}
    harness.save_figure(fig, path, result)
