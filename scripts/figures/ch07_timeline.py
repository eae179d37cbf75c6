"""Chapter 07's timeline figure, drawn from a real run of the step-level engine.

Six requests arrive over time on a tiny random model with a KV pool too small for all of them: the plot
shows, step by step, which request waits, prefills, decodes or was just preempted, and the blocks in use.

    .venv/bin/python scripts/figures/ch07_timeline.py   ->  docs/figures/ch07_timeline.png
"""

import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rosellm import LLMEngine, SamplingParams  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

# (arrival step, prompt length, max_tokens)
REQUESTS = [(1, 6, 14), (1, 9, 10), (2, 4, 12), (4, 12, 6), (6, 3, 9), (9, 7, 8)]
COLORS = {"waiting": "#d9d9d9", "prefill": "#e6550d", "decode": "#3182bd", "preempted": "#000000"}


def run() -> tuple[list[dict], list[int], int]:
    folder = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny", "gqa")
    engine = LLMEngine(str(folder), max_num_seqs=4, block_size=4, num_kv_blocks=12, watermark=0.0)
    states, used, step = [], [], 0
    while step < max(r[0] for r in REQUESTS) or engine.has_unfinished_requests():
        step += 1
        for index, (arrival, prompt_len, max_tokens) in enumerate(REQUESTS):
            if arrival == step:
                prompt = [(index * 31 + j * 7) % 300 + 3 for j in range(prompt_len)]
                engine.add_request(
                    f"r{index}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                )
        schedule = engine.scheduler.schedule
        plan_box = {}

        def recording_schedule(schedule=schedule, plan_box=plan_box):
            plan_box["plan"] = schedule()
            return plan_box["plan"]

        engine.scheduler.schedule = recording_schedule
        engine.step()
        engine.scheduler.schedule = schedule
        plan = plan_box["plan"]
        prefilled = {seq.request_id for seq in plan.scheduled[len(plan.scheduled) - plan.num_prefills :]}
        state = {seq.request_id: "waiting" for seq in engine.scheduler.waiting}
        state.update({seq.request_id: "preempted" for seq in plan.preempted})
        for seq in plan.scheduled:
            state[seq.request_id] = "prefill" if seq.request_id in prefilled else "decode"
        states.append(state)
        used.append(engine.block_manager.num_total_blocks - engine.block_manager.num_free_blocks)
    return states, used, engine.block_manager.num_total_blocks


def main() -> None:
    states, used, total = run()
    names = [f"r{i}" for i in range(len(REQUESTS))]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 5.2), sharex=True, height_ratios=[3, 1.3])
    for row, name in enumerate(names):
        for step, state in enumerate(states, start=1):
            if name in state:
                top.barh(row, 1, left=step - 0.5, color=COLORS[state[name]], edgecolor="white", linewidth=0.5)
    top.set_yticks(range(len(names)), [f"{n} (P={p}, out={m})" for n, (_, p, m) in zip(names, REQUESTS)])
    top.invert_yaxis()
    top.set_title("Continuous batching: 6 requests, max_num_seqs=4, 12 KV blocks of 4 slots")
    top.legend(handles=[Patch(color=c, label=s) for s, c in COLORS.items()], loc="lower left", ncols=2, fontsize=8)
    steps = range(1, len(used) + 1)
    bottom.step(steps, used, where="mid", color="#3182bd")
    bottom.axhline(total, color="grey", linestyle="--", linewidth=0.8)
    bottom.set_ylim(0, total + 1)
    bottom.set_ylabel("blocks used")
    bottom.set_xlabel("engine step")
    fig.tight_layout()
    out = ROOT / "docs" / "figures" / "ch07_timeline.png"
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    for step, state in enumerate(states, start=1):
        print(step, used[step - 1], state)


if __name__ == "__main__":
    main()
