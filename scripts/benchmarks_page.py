"""Fill the generated parts of docs/benchmarks.md from the committed results in benchmarks/results/.

The page is written by hand; each block between

    <!-- results: NAME -->
    ...
    <!-- /results -->

is replaced by tables made from the result files, so that the numbers on the page are the numbers in the
files. NAME is one of: machine, offline-cpu, offline-cpu-profile, latency-cpu, chapters, offline-gpu.

    python scripts/benchmarks_page.py           # rewrite the blocks
    python scripts/benchmarks_page.py --check   # exit 1 if the page is not up to date with the results
"""

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.harness import chapter_ranges  # noqa: E402

PAGE = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- results: ([\w-]+) -->\n)(.*?)(<!-- /results -->)", re.DOTALL)
FILES = {
    "offline-cpu": "offline_cpu.json",
    "latency-cpu": "latency_cpu.json",
    "chapters": "chapters.json",
    "offline-gpu": "offline_gpu.json",
}


def load(workload: str) -> dict | None:
    path = RESULTS / FILES[workload]
    return json.loads(path.read_text()) if path.is_file() else None


def pct(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{100 * x:.{digits}f}%"


def num(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def table(headings: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(headings) - 1)
    marks = {"l": "---", "r": "--:", "c": ":-:"}
    lines = ["| " + " | ".join(headings) + " |", "| " + " | ".join(marks[a] for a in align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def figure_links(result: dict, alts: list[str]) -> str:
    out = []
    for path, alt in zip(result.get("figures", []), alts):
        if path.startswith("docs/"):
            out.append(f"![{alt}]({path.removeprefix('docs/')})")
    return "\n\n".join(out) + "\n" if out else ""


def missing(workload: str) -> str:
    if workload == "offline-gpu":
        return (
            "_Not measured: the machine these results come from has no GPU. On one with CUDA, run "
            "`python -m benchmarks offline-gpu` and then `python scripts/benchmarks_page.py`._\n"
        )
    return (
        f"_Not measured yet: run `python -m benchmarks {workload} --peers vllm,llamacpp` (or `make bench-peers`) "
        f"and then `python scripts/benchmarks_page.py`._\n"
    )


def run_line(result: dict) -> str:
    m = result["machine"]
    return (
        f"Measured on {result['date']} with `{result['command']}` ({result['wall_s'] / 60:.0f} minutes in all): "
        f"{m['cpu']}, {m['cpu_cores']} cores, torch {m['torch']} with {m['torch_threads']} thread"
        f"{'s' if m['torch_threads'] != 1 else ''}; other processes used "
        f"**{pct(result.get('other_processes_cpu_share'), 0)}** of the machine's CPU time meanwhile.\n"
    )


# --- blocks ---------------------------------------------------------------------------------------------


def block_machine() -> str:
    rows = []
    described = None
    for workload in FILES:
        result = load(workload)
        if result is None:
            continue
        described = described or result["machine"]
        roof = result["roofline"]
        gemm = ", ".join(f"{r['gemm']['flops_best'] / 1e9:.1f}" for r in roof["measurements"])
        bandwidth = ", ".join(f"{r['bandwidth']['bytes_per_s_best'] / 1e9:.1f}" for r in roof["measurements"])
        rows.append(
            [
                f"`{workload}`",
                result["date"],
                str(result["machine"]["torch_threads"]),
                f"{gemm} ({roof['measurements'][0]['gemm']['dtype']})",
                bandwidth,
                pct(result.get("other_processes_cpu_share"), 0),
            ]
        )
    if described is None:
        return "_No results yet._\n"
    m = described
    head = (
        f"**{m['cpu']}**, {m['cpu_cores']} cores ({m.get('cpu_cores_usable')} usable), {m['platform']}, "
        f"Python {m['python']}, torch {m['torch']}"
        + (f", GPU {m['gpu']}" if m.get("gpu") else ", no GPU")
        + ". Each run measures the machine again, before and after its engines (the better of the two makes its "
        "roofline):\n\n"
    )
    return head + table(
        [
            "workload",
            "date",
            "torch threads",
            "GEMM GFLOP/s (before, after)",
            "copy bandwidth GB/s (before, after)",
            "CPU used by other processes",
        ],
        rows,
        "lcrrrr",
    )


def engine_rows(result: dict) -> list[list[str]]:
    """One row per engine, peers included when the result has them; an engine that failed or failed its greedy
    check shows why, never a speed."""
    rows = []
    for e in result["engines"]:
        check = {True: "passed", False: "**FAILED**", None: "–"}[e.get("check_passed")]
        if "error" in e:
            rows.append([e["label"], f"not timed: {e['error']}"] + ["–"] * 6 + [check])
            continue
        ratio = "1 (itself)" if e["engine"] == "rosellm" else f"**{e['rosellm_ratio']:.2f}x**"
        ttft, tpot = e["ttft_ms"], e["tpot_ms"]
        rows.append(
            [
                e["label"],
                f"**{num(e['output_tokens_per_s'])}**",
                ratio,
                "–" if ttft["median"] is None else f"{num(ttft['median'] / 1000)} / {num(ttft['p90'] / 1000)}",
                f"{num(tpot['median'])} / {num(tpot['p90'])}",
                num(e.get("peak_rss_run_mib"), 0),
                pct(e["share_of_roofline_output"]),
                pct(e["share_of_roofline_work"]),
                check,
            ]
        )
    return rows


ENGINE_HEADINGS = [
    "engine",
    "useful output tokens/s",
    "rosellm is",
    "TTFT s (median / p90)",
    "TPOT ms (median / p90)",
    "peak RSS MiB",
    "roofline share: output tokens",
    "roofline share: all work",
    "greedy check",
]


def peer_lines(result: dict) -> str:
    """How each peer ran: its version, settings and load time (present only in runs with `--peers`)."""
    peers = [e for e in result["engines"] if "version" in e]
    if not peers:
        return ""
    lines = []
    for e in peers:
        settings = ", ".join(
            f"`{k}={v}`" for k, v in (e.get("settings") or {}).items() if k not in ("model", "system_info")
        )
        env = (e.get("environment") or {}) | {"python": ""}
        if env.get("LD_PRELOAD"):  # the libraries' names, not where this machine keeps them
            env["LD_PRELOAD"] = ":".join(Path(lib).name for lib in env["LD_PRELOAD"].split(":"))
        env = ", ".join(f"`{k}={v}`" for k, v in env.items() if k != "python")
        load = f"loaded in {num(e['load_s'])} s (not timed)" if e.get("load_s") is not None else "not loaded"
        lines.append(
            f"- **{e['label']}** ({e['engine']} {e['version']}), {load}; {settings}"
            + (f"; environment {env}" if env else "")
            + "\n"
        )
    weights = "fp32 weights made from the same GGUF"
    if any(e["engine"].endswith(("-bf16", "-q4_1")) for e in peers):
        weights += " (a bf16 row converts them to bf16; the Q4_1 row reads the bundled file itself)"
    return f"\nPeers, each in its own virtual environment on {weights}:\n\n" + "".join(lines)


def block_offline(workload: str) -> str:
    result = load(workload)
    if result is None:
        return missing(workload)
    roof, work, params = result["roofline"], result["work"], result["parameters"]
    s = result["settings"]
    out = [run_line(result), "\n"]
    out.append(
        f"Workload: {work['requests']} requests, {work['prompt_tokens']:,} prompt tokens and "
        f"{work['output_tokens']:,} useful output tokens; rosellm with `max_num_seqs={s.get('max_num_seqs')}`, "
        f"{s.get('max_batch_tokens')} tokens per step, a KV pool that holds every request at once; transformers "
        f"`generate` in static batches of {s.get('static_batch')}; transformers continuous batching with the "
        f"same limits{'; the peers with the same limits' if s.get('peers') else ''}.\n\n"
    )
    out.append(table(ENGINE_HEADINGS, engine_rows(result), "lrrrrrrrc") + peer_lines(result))
    bound = work["output_tokens"] * roof["flop_per_token"] / work["dense_flop"]
    out.append(
        f"\nCompute roofline: {roof['gemm_flops'] / 1e9:.1f} GFLOP/s / (2 × {params['roofline'] / 1e6:.1f} M "
        f"weights) = **{roof['compute_tokens_per_s']:.0f} tokens/s**. The workload needs "
        f"{work['dense_flop'] / 1e12:.2f} TFLOP of dense work (every prompt token through the decoder layers, "
        f"the LM head once per output token) plus {work['attention_flop'] / 1e12:.2f} TFLOP of attention; since "
        f"the prompts are {work['prompt_tokens'] / work['processed_tokens']:.0%} of the tokens processed, an "
        f"engine running at 100% of the GEMM rate would still reach only **{bound:.0%}** on the output-token "
        f"share.\n\n"
    )
    agree = result.get("agreement") or {}
    if agree:
        out.append(
            "Greedy tokens identical to rosellm's over every request (not only the checked sample): "
            + "; ".join(
                f"{k.removeprefix('rosellm vs ')}: {v['identical_requests']} of {v['requests']}"
                for k, v in agree.items()
            )
            + ".\n\n"
        )
    sweep = result.get("decode_sweep") or []
    if sweep:
        out.append(
            "Decode steps of rosellm alone, every sequence with a "
            f"{s.get('sweep_prompt_len', 128)}-token context (share of roofline against batch size):\n\n"
        )
        out.append(
            table(
                ["batch size"] + [str(p["batch_size"]) for p in sweep],
                [
                    ["decode tokens/s"] + [num(p["tokens_per_s"], 0) for p in sweep],
                    ["share of roofline"] + [pct(p["share_of_roofline"], 0) for p in sweep],
                ],
            )
        )
        out.append("\n")
    out.append(
        figure_links(
            result,
            [
                f"{workload}: useful output tokens/s of each engine",
                "rosellm's decode steps: share of the roofline against batch size",
            ],
        )
    )
    return "".join(out)


def block_profile() -> str:
    result = load("offline-cpu")
    if result is None or not result.get("profile"):
        return missing("offline-cpu")
    profile = result["profile"]
    parts = sorted(profile["parts"], key=lambda p: -p["seconds"])
    rows = [[f"`{p['part']}`", num(p["seconds"]), pct(p["share"]), num(p["ms_per_step"])] for p in parts]
    top = ", ".join(
        f"**{p['part']}** ({pct(p['share'], 0)}, {num(p['ms_per_step'], 0)} ms per step)" for p in parts[:3]
    )
    return (
        f"A second rosellm run of the same workload, `torch.profiler` recording one step in {profile['every']} "
        f"({profile['sampled_steps']} of its {profile['steps']} steps, {num(profile['sampled_s'])} s), each split by "
        f"the engine's labels. The three largest costs: {top}.\n\n"
        + table(["part", "seconds", "share of step time", "ms per step"], rows)
    )


def latency_check(e: dict) -> str:
    """An fp32 row's check against transformers; a bf16 or quantized row's greedy agreement with its engine's
    fp32 row (its check is recorded, not required: rounding flips near ties)."""
    if e["check"].get("required", True):
        return "passed" if e["check"]["passed"] else "**FAILED**"
    share = (e.get("agreement_with_fp32") or {}).get("equal_token_share")
    return "–" if share is None else f"{share:.0%} of tokens as fp32"


def block_latency() -> str:
    result = load("latency-cpu")
    if result is None:
        return missing("latency-cpu")
    roof, s = result["roofline"], result["settings"]
    ours = next((e for e in result["engines"] if e["engine"] == "rosellm" and "error" not in e), None)
    rows = []
    for e in result["engines"]:
        check = latency_check(e)
        if "error" in e:
            rows.append([e["label"], f"not timed: {e['error']}"] + ["–"] * 6 + [check])
            continue
        ratio = (
            "1 (itself)"
            if e is ours
            else f"**{ours['decode_tokens_per_s'] / e['decode_tokens_per_s']:.2f}x**"
            if ours
            else "–"
        )
        rows.append(
            [
                e["label"],
                f"**{num(e['decode_tokens_per_s'])}**",
                ratio,
                num(e["ttft_ms"], 0),
                num(e["tpot_ms"]),
                num(e.get("weight_mb_per_token", roof["weight_bytes"] / 1e6), 0),
                pct(e["share_of_bandwidth_roofline"]),
                num(e["peak_rss_run_mib"], 0),
                check,
            ]
        )
    return (
        run_line(result)
        + "\n"
        + f"One request, a {s['prompt_len']}-token prompt, {s['max_tokens']} output tokens; rosellm and transformers "
        f"keep the best of {s['repeats']} runs.\n\n"
        + table(
            [
                "engine",
                "decode tokens/s",
                "rosellm is",
                "TTFT ms",
                "TPOT ms",
                "MB of weights a token reads",
                "share of its bandwidth roofline",
                "peak RSS MiB",
                "greedy check",
            ],
            rows,
            "lrrrrrrrc",
        )
        + f"\nBandwidth roofline: {roof['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s / "
        f"{roof['weight_bytes'] / 1e6:.0f} MB of fp32 weights = **{roof['bandwidth_tokens_per_s']:.0f} tokens/s**; "
        "each row's share is of its own bound, from the bytes its weights' format reads "
        f"(the KV cache, {result['kv_cache_bytes_at_end'] / 1e6:.0f} MB at the last step, comes on top). All "
        f"{s['max_tokens']} tokens identical between rosellm and transformers: "
        f"{'yes' if result.get('all_tokens_identical') else 'no'}.\n"
        + peer_lines(result)
        + "\n"
        + figure_links(result, ["latency-cpu: decode tokens/s of each engine at batch 1, and the bandwidth roofline"])
    )


def block_chapters() -> str:
    result = load("chapters")
    if result is None:
        return missing("chapters")
    s, done = result["settings"], [r for r in result["chapters"] if "error" not in r]
    latest = max(r["chapter"] for r in done) if done else None

    def chapters_where(keep) -> str:
        return chapter_ranges([r["chapter"] for r in done if keep(r["options"])]).replace("-", "–")

    torch_backend = chapters_where(lambda options: options.get("attention_backend") == "torch")
    rows = []
    for r in result["chapters"]:
        anchor = f'<a id="ch{r["chapter"]:02d}"></a>'
        if "error" in r:
            rows.append([f"{anchor}{r['chapter']:02d}", f"failed: {r['error']}"] + ["–"] * 5)
            continue
        name = r["slug"][3:].replace("_", " ")
        options = ", ".join(f"`{k}={v}`" for k, v in r["options"].items()) or "one request at a time"
        rows.append(
            [
                f"{anchor}{r['chapter']:02d} · {name}",
                options,
                f"**{num(r['output_tokens_per_s'])}**",
                f"{r['speedup_vs_first']:.1f}x",
                num(r["wall_s"]),
                num(r["peak_rss_run_mib"], 0),
                pct(r["share_of_roofline_output"]),
                "passed" if r["check"]["passed"] and r["identical_to_latest"] else "**FAILED**",
            ]
        )
    return (
        run_line(result)
        + "\n"
        + f"{s['requests']} requests, prompts of {s['prompt_len'][0]}–{s['prompt_len'][1]} random tokens, "
        f"{s['max_tokens']} output tokens each, greedy; each checkpoint through its own `LLM.generate`. Chapters "
        f"{chapters_where(lambda options: not options)} serve one request at a time; chapters "
        f"{chapters_where(bool)} batch up to {s['batch']} requests"
        + (
            f" (chapters {torch_backend} with the PyTorch attention backend, which is what a CPU runs)"
            if torch_backend != "none"
            else ""
        )
        + ".\n\n"
        + table(
            [
                "chapter",
                "options",
                "output tokens/s",
                "vs chapter 01",
                "seconds",
                "peak RSS MiB",
                "roofline share",
                f"tokens = transformers and ch{latest:02d}" if latest else "tokens = transformers",
            ],
            rows,
            "llrrrrrc",
        )
        + "\n"
        + figure_links(result, ["output tokens/s of every chapter's checkpoint"])
    )


BLOCKS = {
    "machine": block_machine,
    "offline-cpu": lambda: block_offline("offline-cpu"),
    "offline-cpu-profile": block_profile,
    "latency-cpu": block_latency,
    "chapters": block_chapters,
    "offline-gpu": lambda: block_offline("offline-gpu"),
}


def render(page: str) -> str:
    def fill(match: re.Match) -> str:
        name = match.group(2)
        if name not in BLOCKS:
            raise SystemExit(f"unknown results block {name!r} in {PAGE} (known: {', '.join(BLOCKS)})")
        return match.group(1) + BLOCKS[name]() + match.group(4)

    return BLOCK.sub(fill, page)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that the page is up to date")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    new = render(page)
    if args.check:
        if new != page:
            print(f"{PAGE} is not up to date with {RESULTS}: run python scripts/benchmarks_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(new)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
