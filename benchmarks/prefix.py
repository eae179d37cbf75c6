"""prefix: requests sharing a long system prompt, and multi-turn chats, with prefix caching on and off.

Two scenarios, each served on a fresh engine with `enable_prefix_caching` on, then off:
- shared: every request is the same system prompt followed by its own question; the first one is served
  alone (the system prompt seen before), then all the others are queued at once;
- chats: a few conversations of several turns; each turn resends the whole history (the earlier prompts and
  answers) plus a new message, and a turn is sent when the previous one has answered.
Reported per run: prompt tokens computed (and found in the cache), the hit rate, time to first token
(median, p90), output tokens/s and the run's seconds. Greedy tokens must be equal with caching on and off.

    python -m benchmarks prefix
"""

import time

import chapters

from . import harness

NAME = "prefix"
HELP = "a shared system prompt and multi-turn chats: prompt tokens computed, TTFT and tok/s, prefix caching on/off"
CHAPTER = 9

FULL = {"requests": 64, "system": 400, "question": [20, 60], "max_tokens": 32, "chats": 8, "turns": 4, "message": 30}
QUICK = {"requests": 4, "system": 24, "question": [3, 6], "max_tokens": 4, "chats": 2, "turns": 2, "message": 20}


def run(args, s: dict) -> dict:
    return harness.save(args, NAME, lambda: measure(args, s), "prefix", plot, "ch09_prefix")


def tokens(seed: int, length: int, vocab_size: int) -> list[int]:
    """Deterministic token ids that look like no other prompt's."""
    return [(seed * 7919 + j * 104729) % (vocab_size - 10) + 5 for j in range(length)]


def serve(engine, package, batches, max_tokens: int) -> dict:
    """Each batch of prompts is queued once the batch before it has finished; `batches(previous_answers)`
    yields the next batch from the answers so far. Times every request's first token."""
    params = package.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    answers, ttft, prompt_tokens, cached, generated = {}, [], 0, 0, 0
    start = time.perf_counter()
    for batch in batches(answers):
        queued = {engine.add_request(None, prompt, params): (time.perf_counter(), prompt) for prompt in batch}
        first_seen = set()
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id not in first_seen:
                    first_seen.add(output.request_id)
                    ttft.append(time.perf_counter() - queued[output.request_id][0])
                if output.finished:
                    prompt = queued[output.request_id][1]
                    answers[tuple(prompt)] = output.token_ids
                    prompt_tokens += len(prompt)
                    cached += output.num_cached_tokens
                    generated += len(output.token_ids)
    seconds = time.perf_counter() - start
    return {
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "computed_prompt_tokens": prompt_tokens - cached,
        "hit_rate": round(cached / prompt_tokens, 3),
        "ttft_s": harness.median_p90(ttft, digits=3),
        "output_tokens_per_s": round(generated / seconds, 1),
        "seconds": round(seconds, 2),
        "answers": {" ".join(map(str, k)): v for k, v in answers.items()},
    }


def shared_batches(s: dict, vocab_size: int):
    system = tokens(0, s["system"], vocab_size)
    low, high = s["question"]
    questions = [tokens(1 + i, low + (i * 7) % (high - low + 1), vocab_size) for i in range(s["requests"])]
    prompts = [system + q for q in questions]
    return lambda answers: [prompts[:1], prompts[1:]]


def chat_batches(s: dict, vocab_size: int):
    """Turn t of every chat: the history so far (prompts and answers) plus message t."""

    def turns(answers):
        histories = [[] for _ in range(s["chats"])]
        for turn in range(s["turns"]):
            prompts = [h + tokens(1000 + 100 * c + turn, s["message"], vocab_size) for c, h in enumerate(histories)]
            yield prompts
            histories = [p + answers[tuple(p)] for p in prompts]

    return turns


def measure(args, s: dict) -> dict:
    point = chapters.checkpoint(CHAPTER)
    package = point.load()
    runs = []
    for scenario in ("shared", "chats"):
        for caching in (True, False):
            engine = package.LLMEngine(args.model, enable_prefix_caching=caching)
            vocab = engine.model.config.vocab_size
            batches = shared_batches(s, vocab) if scenario == "shared" else chat_batches(s, vocab)
            runs.append({"scenario": scenario, "caching": caching} | serve(engine, package, batches, s["max_tokens"]))
            del engine
    correct = all(runs[i]["answers"] == runs[i + 1]["answers"] for i in (0, 2))
    columns = {"scenario": "scenario", "caching": "caching", "computed_prompt_tokens": "prompt computed"}
    harness.print_table(runs, columns | {"hit_rate": "hit rate", "output_tokens_per_s": "tok/s", "seconds": "s"})
    for r in runs:
        del r["answers"]
    return {"settings": s, "checkpoint": point.module, "runs": runs, "correct": correct}


def plot(result: dict, path) -> None:
    """Prompt tokens computed, median TTFT and output tok/s, caching on and off, per scenario."""
    fig, axes = harness.figure_axes(1, 3, (11, 3.4))
    runs = result["runs"]
    scenarios = ["shared", "chats"]
    for ax, key, label in zip(
        axes[0],
        ["computed_prompt_tokens", "ttft", "output_tokens_per_s"],
        ["prompt tokens computed", "time to first token, median (s)", "output tokens/s"],
    ):
        for offset, caching in ((-0.2, True), (0.2, False)):
            values = []
            for scenario in scenarios:
                [r] = [r for r in runs if r["scenario"] == scenario and r["caching"] == caching]
                values.append(r["ttft_s"]["median"] if key == "ttft" else r[key])
            ax.bar([i + offset for i in range(2)], values, width=0.4, label=f"caching {'on' if caching else 'off'}")
        ax.set_xticks(range(2), ["shared system prompt", "multi-turn chats"], fontsize=8)
        ax.set_title(label, fontsize=9)
    axes[0][0].legend(fontsize=8)
    harness.save_figure(fig, path, result)
