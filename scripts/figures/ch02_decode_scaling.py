"""Draw docs/figures/ch02_vs_ch01_decode.png: the cost of one decode step against the sequence length, for
chapter 01 (no cache) and chapter 02 (KV cache), from two results of the decode-scaling workload run with
the same settings:

    .venv/bin/python -m benchmarks decode-scaling --checkpoint chapters.ch01_naive_decode.rosellm \\
        --threads 1 --steps 16 --json benchmarks/results/ch02_decode_scaling_ch01.json --figure /tmp/ch01.png
    .venv/bin/python -m benchmarks decode-scaling --checkpoint chapters.ch02_kv_cache.rosellm \\
        --threads 1 --steps 16 --json benchmarks/results/ch02_decode_scaling_ch02.json --figure /tmp/ch02.png
    .venv/bin/python scripts/figures/ch02_decode_scaling.py

It also prints the speed-up at every measured length.
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "figures" / "ch02_vs_ch01_decode.png"


def load(tag: str) -> dict:
    return json.loads((RESULTS / f"ch02_decode_scaling_{tag}.json").read_text())


def main() -> None:
    naive, cached = load("ch01"), load("ch02")
    for key in ("lengths", "steps", "seed"):
        if naive["settings"][key] != cached["settings"][key]:
            sys.exit(f"the two results were measured with different {key}: rerun them with the same settings")
    if naive["machine"]["torch_threads"] != cached["machine"]["torch_threads"]:
        sys.exit("the two results used different numbers of torch threads")

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.3))
    styles = {"ch01": ("o-", "tab:red", "chapter 01: no cache"), "ch02": ("s-", "tab:blue", "chapter 02: KV cache")}
    for tag, result in (("ch01", naive), ("ch02", cached)):
        marker, color, label = styles[tag]
        points = result["points"]
        left.plot(
            [p["mean_context_len"] for p in points],
            [p["decode_ms_per_token"] for p in points],
            marker,
            color=color,
            label=f"{label}, decode step",
        )
    first = cached["points"]
    left.plot(
        [p["prompt_len"] for p in first],
        [p["first_token_ms"] for p in first],
        "x:",
        color="tab:blue",
        label="chapter 02: prefill of the whole prompt (first token)",
    )
    left.set(
        xlabel="tokens in the sequence",
        ylabel="milliseconds",
        title="cost of one generated token",
        xlim=(0, None),
        ylim=(0, None),
    )
    left.legend(fontsize=8)

    print(f"{'length':>6} {'ch01 ms':>8} {'ch02 ms':>8} {'speed-up':>8}")
    lengths, ratios = [], []
    for a, b in zip(naive["points"], cached["points"]):
        ratio = a["decode_ms_per_token"] / b["decode_ms_per_token"]
        lengths.append(a["prompt_len"])
        ratios.append(ratio)
        print(f"{a['prompt_len']:>6} {a['decode_ms_per_token']:>8.1f} {b['decode_ms_per_token']:>8.1f} {ratio:>7.1f}x")
    bars = right.bar([str(n) for n in lengths], ratios, color="tab:blue")
    for bar, ratio in zip(bars, ratios):
        right.annotate(
            f"{ratio:.1f}×",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            textcoords="offset points",
            xytext=(0, 3),
            ha="center",
            fontsize=9,
        )
    right.set(
        xlabel="prompt length (tokens)",
        ylabel="chapter 01 ms / chapter 02 ms",
        title="speed-up of a decode step",
        ylim=(0, max(ratios) * 1.15),
    )

    machine = cached["machine"]
    loads = ", ".join(f"{r['tag']} {r['machine']['other_processes_cpu_share']:.0%}" for r in (naive, cached))
    fig.suptitle(
        f"SmolLM2-135M {cached['dtype']} on {machine['cpu']}, {machine['torch_threads']} torch "
        f"thread(s), {cached['settings']['steps']} decode steps per length, best of "
        f"{cached['settings']['repeats']} (CPU used by other processes: {loads})",
        fontsize=9,
    )
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110)
    plt.close(fig)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
