"""cpu-ablation: chapter 11's speed-ups one at a time, on offline-cpu's requests.

The same requests (offline-cpu's distribution: prompts of 32-512 tokens, 32-256 new tokens, greedy, EOS
ignored) through four engines, each in a process of its own:
  ch10                 chapter 10's checkpoint (attention "torch")
  + fused, packed      chapter 11's checkpoint, `enforce_eager=True, attention_backend="torch"`: QKV and
                       gate-up fused, every projection on oneDNN-packed weights
  + in-place decode    the same with `attention_backend="cpu"`: decode rows read the pool in place (compiled)
  + compiled layers    chapter 11's defaults: the decoder layers compiled too
Every run's greedy tokens must equal the first's; the first and last are profiled (`torch.profiler` with the
engine's labels) on one step in `profile_every` of a second run.

    python -m benchmarks cpu-ablation [--quick]
"""

import textwrap

import chapters

from . import harness

NAME = "cpu-ablation"
HELP = "chapter 11's speed-ups one at a time on offline-cpu's requests (output tok/s and profiles)"
CHAPTER = 11

FULL = {"requests": 64, "prompt_len": [32, 512], "max_tokens": [32, 256], "seed": 0, "profile_every": 5}
FULL |= {"max_num_seqs": 64, "max_batch_tokens": 2048}
QUICK = {"requests": 5, "prompt_len": [8, 40], "max_tokens": [4, 12], "profile_every": 2, "max_batch_tokens": 256}
STEPS = [  # (what the step adds, its chapter: the one before this or this one, engine options)
    ("", CHAPTER - 1, {}),
    ("+ fused, packed GEMMs", CHAPTER, {"enforce_eager": True, "attention_backend": "torch"}),
    ("+ in-place decode attention", CHAPTER, {"enforce_eager": True, "attention_backend": "cpu"}),
    ("+ compiled layers", CHAPTER, {}),
]


def columns(result: dict) -> dict:
    first = result["steps"][0]["label"]
    return {
        "label": "step",
        "output_tokens_per_s": "output tok/s",
        "speedup": f"x {first}",
        "same_tokens": "same tokens",
    }


def step_label(index: int, text: str, point) -> str:
    """A step's label, its chapter's tag from the checkpoint: the first is the tag alone, the last (the
    chapter whole) ends with it."""
    tag = f"ch{point.number:02d}"
    return f"{text} ({tag})" if index == len(STEPS) - 1 else text or tag


def run(args, s: dict) -> dict:
    wrong = f"an ablation step's greedy tokens differ from chapter {CHAPTER - 1:02d}'s"
    return harness.save(args, NAME, lambda: measure(args, s), "cpu_ablation", plot, "ch11_ablation", report, wrong)


def measure(args, s: dict) -> dict:
    vocab = harness.model_config(args.model).vocab_size
    requests = harness.random_requests(s["requests"], s["prompt_len"], s["max_tokens"], vocab, s["seed"])
    warmup = harness.random_requests(2, [8, 16], [4, 4], vocab, s["seed"] + 1000)
    longest = max(len(p) + m for p, m in requests)
    options = dict(max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_batch_tokens"], block_size=16)
    options |= dict(max_model_len=longest + 1, num_kv_blocks=sum(-(-(len(p) + m) // 16) for p, m in requests) + 64)
    rows, first_tokens = [], None
    for index, (text, chapter, extra) in enumerate(STEPS):
        point = chapters.checkpoint(chapter)
        label = step_label(index, text, point)
        spec = dict(model=args.model, threads=args.threads, requests=requests, warmup=warmup, module=point.module)
        spec["engine_options"] = options | extra
        if index in (0, len(STEPS) - 1):
            spec["profile_every"] = s["profile_every"]
        r = harness.run_engine("rosellm", spec, label)
        row = dict(label=label, checkpoint=point.module, options=extra, error=r.get("error"))
        if r.get("tokens"):
            useful = sum(len(t) for t in r["tokens"])
            row |= dict(wall_s=round(r["wall_s"], 2), output_tokens_per_s=round(useful / r["wall_s"], 2))
            row |= dict(load_s=r.get("load_s"), profile=r.get("profile"))
            first_tokens = first_tokens or r["tokens"]
            row["same_tokens"] = r["tokens"] == first_tokens
        rows.append(row)
    base = rows[0].get("output_tokens_per_s")
    for row in rows:
        if base and row.get("output_tokens_per_s"):
            row["speedup"] = round(row["output_tokens_per_s"] / base, 2)
    correct = all(row.get("same_tokens") for row in rows)
    return {"settings": s, "engine_options": options, "steps": rows, "correct": correct}


def report(result: dict) -> None:
    harness.print_table(result["steps"], columns(result))


def plot(result: dict, path) -> None:
    """Output tokens/s per step (left); where a step's time goes, before and after (right)."""
    fig, axes = harness.figure_axes(1, 2, (11, 3.8))
    left, right = axes[0]
    rows = [r for r in result["steps"] if r.get("output_tokens_per_s")]
    bars = left.bar(range(len(rows)), [r["output_tokens_per_s"] for r in rows], color="tab:red")
    left.bar_label(bars, [f"{r['output_tokens_per_s']:.0f}\n{r['speedup']:.2f}x" for r in rows], fontsize=8)
    left.set_xticks(range(len(rows)), [textwrap.fill(r["label"], 18) for r in rows], fontsize=7)
    left.set(ylabel="output tokens/s", ylim=(0, max(r["output_tokens_per_s"] for r in rows) * 1.3))
    left.set_title("offline-cpu requests, one step at a time", fontsize=9)
    profiled = [r for r in rows if r.get("profile")]
    parts = ["gemm", "attention", "other_model", "lm_head"]
    for i, r in enumerate(profiled):
        ms = {p["part"]: p["ms_per_step"] for p in r["profile"]["parts"]}
        bottom = 0.0
        for part, color in zip(parts, ["tab:blue", "tab:orange", "tab:green", "tab:purple"]):
            right.bar(i, ms[part], bottom=bottom, color=color, label=part if i == 0 else None)
            bottom += ms[part]
    right.set_xticks(range(len(profiled)), [r["label"] for r in profiled], fontsize=7)
    right.set(ylabel="ms per step (profiled run)")
    right.set_title("where a step's time goes", fontsize=9)
    right.legend(fontsize=7)
    harness.save_figure(fig, path, result)
