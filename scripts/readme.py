"""Fill the generated parts of README.md: the chapter list and the numbers of "How fast".

The README is written by hand; each block between

    <!-- readme: NAME -->
    ...
    <!-- /readme -->

is replaced by Markdown made from the checkpoints (`chapters`: `scripts/chapter_list.py`) or from the
committed results in benchmarks/results/ (`how-fast`: offline_cpu.json and cpu_ablation.json), so that
the README lists every chapter and quotes the numbers of the files.

    python scripts/readme.py           # rewrite the blocks
    python scripts/readme.py --check   # exit 1 if the README is not up to date
"""

import argparse
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

chapter_list = importlib.import_module("chapter_list")  # scripts/chapter_list.py
chapters = importlib.import_module("chapters")  # the repository's, not an installed copy

README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
BUSY_SHARE = 0.10  # as scripts/docs_results.py: above this share of the CPU used by others, a run was under load


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def chapters_block() -> str:
    return chapter_list.chapter_table(ROOT, chapters.checkpoints(), "docs/chapters", learns=False)


def how_fast_block() -> str:
    offline, ablation = load("offline_cpu.json"), load("cpu_ablation.json")
    s, machine, busy = offline["settings"], offline["machine"], offline["other_processes_cpu_share"]
    done = sorted((e for e in offline["engines"] if "error" not in e), key=lambda e: -e["output_tokens_per_s"])
    ours = next(e for e in done if e["engine"] == "rosellm")
    agreement = {pair.removeprefix("rosellm vs "): a for pair, a in offline["agreement"].items()}
    headings = ["engine", "output tokens/s", "rosellm makes, of its throughput", "of the GEMM rate"]
    rows = ["| " + " | ".join(headings + ["greedy tokens as rosellm's"]) + " |"]
    rows.append("| --- | ---: | ---: | ---: | ---: |")
    for e in done:
        ratio = ours["output_tokens_per_s"] / e["output_tokens_per_s"]
        same = agreement.get(e["engine"])
        rows.append(
            f"| {e['label']} | {e['output_tokens_per_s']:.1f} | "
            + ("–" if e is ours else f"{ratio:.3g}×" + (" (level within one percent)" if abs(ratio - 1) < 0.01 else ""))
            + f" | {100 * e['share_of_roofline_work']:.0f} % | "
            + ("–" if same is None else f"{same['identical_requests']} of {same['requests']} requests")
            + " |"
        )
    checked = all(offline["check"][e["engine"]]["passed"] for e in done)
    first, last = ablation["steps"][0], ablation["steps"][-1]
    return (
        f"On a {machine['cpu_cores']}-core CPU ({machine['cpu']}, fp32, SmolLM2-135M-Instruct, {s['requests']} "
        f"requests with prompts of {s['prompt_len'][0]}–{s['prompt_len'][1]} tokens and {s['max_tokens'][0]}–"
        f"{s['max_tokens'][1]} output tokens), one run of offline-cpu with the peers (`{offline['command']}`) "
        f"on {offline['date']} measured, in "
        f"useful output tokens/s ({'a busy' if busy > BUSY_SHARE else 'an idle'} machine: other processes used "
        f"{100 * busy:.0f} % of the CPU meanwhile):\n\n"
        + "\n".join(rows)
        + "\n\nEvery engine ran the same fp32 weights and "
        + ("passed" if checked else "**not every engine passed**")
        + " a check against transformers' greedy tokens before it was timed. Chapter 11 (packed GEMMs, "
        f"attention reading the KV pool in place, compiled layers) made rosellm {last['speedup']:.1f}× faster "
        f"than chapter 10 within its own ablation run ({first['output_tokens_per_s']:.1f} → "
        f"{last['output_tokens_per_s']:.1f} tokens/s). Runs on this machine differ from one to the next (the same "
        f"engine made {last['output_tokens_per_s']:.1f} tokens/s in that run and {ours['output_tokens_per_s']:.1f} "
        "in the peers' run), which is why every comparison is made within one run.\n"
    )


def batch_one_block() -> str:
    latency = load("latency_cpu.json")
    s, busy, machine = latency["settings"], latency["other_processes_cpu_share"], latency["machine"]
    flags = ", ".join(name.replace("_", "-").upper() for name, has in machine.get("cpu_flags", {}).items() if has)
    done = sorted((e for e in latency["engines"] if "error" not in e), key=lambda e: e["tpot_ms"])
    rows = ["| engine | ms per token | MB of weights a token reads | greedy tokens |", "| --- | ---: | ---: | --- |"]
    for e in done:
        if e["check"].get("required", True):
            check = "as transformers'" if e["check"]["passed"] else "**differ from transformers'**"
        else:
            check = f"{e['agreement_with_fp32']['equal_token_share']:.0%} as its fp32 row's"
        rows.append(f"| {e['label']} | {e['tpot_ms']:.1f} | {e['weight_mb_per_token']:.0f} | {check} |")
    return (
        f"At batch 1 (one request, a {s['prompt_len']}-token prompt, {s['max_tokens']} output tokens), one run of "
        f"latency-cpu with the peers (`{latency['command']}`) on {latency['date']}, on a {machine['cpu_cores']}-core "
        f"{machine['cpu']} ({flags}; {'busy' if busy > BUSY_SHARE else 'idle'}: other processes used "
        f"{100 * busy:.0f} % of the CPU):\n\n"
        + "\n".join(rows)
        + "\n\nThe quantized rows run the bundled file's own 4-bit tensors (`--quantization gguf`) or quantize at "
        "load (`int8`, `int4`); chapter 13 explains what they trade.\n"
    )


BLOCKS = {"chapters": chapters_block, "how-fast": how_fast_block, "batch-one": batch_one_block}


def filled(text: str) -> str:
    """The README with every generated block made afresh."""
    out, rest = [], text
    while (start := rest.find("<!-- readme: ")) >= 0:
        head_end = rest.index("-->", start) + len("-->")
        name = rest[start + len("<!-- readme: ") : head_end - len("-->")].strip()
        if name not in BLOCKS:
            raise ValueError(f"README.md: unknown block {name!r}; known: {', '.join(BLOCKS)}")
        end = rest.index("<!-- /readme -->", head_end)
        out.append(rest[:head_end] + "\n" + BLOCKS[name]() + "<!-- /readme -->")
        rest = rest[end + len("<!-- /readme -->") :]
    return "".join(out) + rest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is not up to date")
    args = parser.parse_args()
    text = README.read_text()
    new = filled(text)
    if args.check:
        if new != text:
            print("README.md is not up to date: run python scripts/readme.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
