"""arrivals: requests that arrive over time, served by chapter 05's offline scheduler and by chapter 07's
continuous-batching engine, on the same KV pool.

Request i arrives at engine step `i * every` (a clock counted in steps, so both engines see the same
arrival pattern). Both run greedy with EOS ignored, so they produce the same number of tokens per request
(checked) and the same amount of work; what differs is how many requests each keeps in flight. Times to
first token are given in seconds and in engine steps: the steps do not depend on how busy the machine is.
The report also counts the requests whose tokens are identical in both runs (greedy, so they should be,
up to float ties between batch shapes). Chapter 05 admits a request only when its worst case
(prompt + max_tokens) fits; chapter 07 admits on the prompt alone and preempts when the pool runs out.

    python -m benchmarks arrivals
"""

import datetime
import json
import math
import random
import statistics
import time
from pathlib import Path

import chapters

from .machine import OtherLoad, command_line, machine_info

NAME = "arrivals"
HELP = "requests arriving over time: chapter 05's scheduler against chapter 07's on one KV pool"
CHAPTER = 7
ROOT = Path(__file__).resolve().parent.parent


def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None, help=".gguf file or Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--every", type=int, default=2, help="a new request every this many steps")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=48, help="the pool both chapters get")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's; 1 is steadier on a busy machine)")
    parser.add_argument("--quick", action="store_true", help="a tiny workload, to check the harness")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "arrivals.json")


def workload(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [
        ([rng.randrange(3, vocab_size) for _ in range(rng.randint(*args.prompt_len))], rng.randint(*args.max_tokens))
        for _ in range(args.requests)
    ]


class Chapter05:
    """Drives chapter 05's `OfflineScheduler` one step at a time."""

    def __init__(self, args):
        self.package = chapters.checkpoint(5).load()
        self.llm = self.package.LLM(args.model, max_batch_size=args.max_batch, block_size=args.block_size,
                                    num_kv_blocks=args.num_kv_blocks)
        self.sessions = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = self.package.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.sessions[request_id] = self.llm.add_request(prompt, params)

    def step(self) -> list[tuple[str, list[int], bool]]:
        """(request id, tokens so far, finished) of each request that advanced."""
        ids = {id(session): request_id for request_id, session in self.sessions.items()}
        return [(ids[id(session)], session.output.token_ids, session.finished)
                for session, _ in self.llm.scheduler.step()]

    def busy(self) -> bool:
        return self.llm.scheduler.has_unfinished_requests()


class Chapter07:
    """Drives chapter 07's `LLMEngine`."""

    def __init__(self, args):
        self.package = chapters.checkpoint(7).load()
        self.engine = self.package.LLMEngine(args.model, max_num_seqs=args.max_batch, block_size=args.block_size,
                                             num_kv_blocks=args.num_kv_blocks)
        self.preemptions = self.recomputed_tokens = 0
        schedule = self.engine.scheduler.schedule

        def counting_schedule():  # how often the pool ran out, and how many cached tokens were thrown away
            plan = schedule()
            self.preemptions += len(plan.preempted)
            self.recomputed_tokens += sum(seq.num_tokens - 1 for seq in plan.preempted)
            return plan

        self.engine.scheduler.schedule = counting_schedule

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = self.package.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(request_id, prompt, params)

    def step(self) -> list[tuple[str, list[int], bool]]:
        return [(o.request_id, o.token_ids, o.finished) for o in self.engine.step()]

    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()


def serve(runner, requests, every: int) -> dict:
    """Run the arrival pattern to the end; times are wall-clock seconds from the first step."""
    arrivals, first_token, finished_at, tokens = {}, {}, {}, {}
    arrival_step, first_token_step = {}, {}
    batch_sizes = []
    step, start, cpu_start = 0, time.perf_counter(), time.process_time()
    while len(finished_at) < len(requests):
        for index, (prompt, max_tokens) in enumerate(requests):
            if index * every == step:
                runner.add(str(index), prompt, max_tokens)
                arrivals[str(index)] = time.perf_counter() - start
                arrival_step[str(index)] = step
        advanced = runner.step()
        now = time.perf_counter() - start
        batch_sizes.append(len(advanced))
        for request_id, token_ids, done in advanced:
            first_token.setdefault(request_id, now)
            first_token_step.setdefault(request_id, step)
            if done:
                finished_at[request_id] = now
                tokens[request_id] = list(token_ids)
        step += 1
    cpu_seconds = time.process_time() - cpu_start
    ttft = [first_token[r] - arrivals[r] for r in arrivals]
    ttft_steps = [first_token_step[r] - arrival_step[r] for r in arrivals]  # 0: prefilled on arrival
    latency = [finished_at[r] - arrivals[r] for r in arrivals]
    elapsed = max(finished_at.values())
    output_tokens = sum(len(t) for t in tokens.values())
    return {
        "seconds": round(elapsed, 3),
        "cpu_seconds": round(cpu_seconds, 3),  # this process only: what other work on the machine cannot add
        "steps": step,
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / elapsed, 2),
        "output_tokens_per_cpu_s": round(output_tokens / cpu_seconds, 2),
        "mean_batch": round(statistics.fmean(n for n in batch_sizes if n), 2),  # steps that ran something
        "ttft_median_s": round(statistics.median(ttft), 3),
        "ttft_p90_s": round(percentile(ttft, 90), 3),
        "ttft_median_steps": statistics.median(ttft_steps),
        "ttft_p90_steps": percentile(ttft_steps, 90),
        "ttft_max_steps": max(ttft_steps),
        "latency_median_s": round(statistics.median(latency), 3),
        "tokens": tokens,
    }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least q % of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def run(args) -> dict:
    if args.quick:
        args.requests, args.prompt_len, args.max_tokens, args.num_kv_blocks = 6, [4, 12], [4, 8], 12
        args.block_size = 4
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    runners = {"ch05_paged_attention": Chapter05(args), "ch07_continuous_batching": Chapter07(args)}
    vocab = runners["ch05_paged_attention"].llm.model.config.vocab_size
    requests = workload(args, vocab)
    results = {}
    with OtherLoad() as other:
        for name, runner in runners.items():
            results[name] = serve(runner, requests, args.every)
    results["ch07_continuous_batching"]["preemptions"] = runners["ch07_continuous_batching"].preemptions
    results["ch07_continuous_batching"]["recomputed_tokens"] = runners["ch07_continuous_batching"].recomputed_tokens
    first, second = results.values()
    counts = [{r: len(t) for r, t in result["tokens"].items()} for result in (first, second)]
    assert counts[0] == counts[1], "the two chapters produced different amounts of work"
    same = sum(first["tokens"][r] == second["tokens"][r] for r in first["tokens"])
    total = len(first["tokens"])
    for result in results.values():
        result.pop("tokens")
    report = {
        "workload": "arrivals",
        "command": command_line(),
        "date": datetime.date.today().isoformat(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "run", "workload")},
        "machine": {**machine_info(), "other_processes_cpu_share": other.share},
        "results": results,
        "requests_with_identical_tokens": f"{same}/{total}",
        "speedup_ch07_over_ch05": round(second["output_tokens_per_s"] / first["output_tokens_per_s"], 2),
        "speedup_ch07_over_ch05_cpu_time": round(second["output_tokens_per_cpu_s"] / first["output_tokens_per_cpu_s"], 2),
    }
    print(f"{'chapter':26} {'tok/s':>7} {'tok/cpu-s':>9} {'seconds':>8} {'steps':>6} {'batch':>6} "
          f"{'TTFT med':>9} {'TTFT p90':>9} {'in steps':>9}")
    for name, r in results.items():
        print(f"{name:26} {r['output_tokens_per_s']:7.1f} {r['output_tokens_per_cpu_s']:9.1f} {r['seconds']:8.1f} "
              f"{r['steps']:6d} {r['mean_batch']:6.1f} {r['ttft_median_s']:9.2f} {r['ttft_p90_s']:9.2f} "
              f"{r['ttft_median_steps']:>4g} /{r['ttft_p90_steps']:>3g}")
    print(f"chapter 07 / chapter 05 throughput: {report['speedup_ch07_over_ch05']}x wall-clock, "
          f"{report['speedup_ch07_over_ch05_cpu_time']}x per CPU-second; "
          f"identical tokens: {same}/{total} requests; other processes used "
          f"{other.share} of the CPUs")
    ch07 = results["ch07_continuous_batching"]
    print(f"chapter 07 preempted {ch07['preemptions']} times, recomputing {ch07['recomputed_tokens']} tokens")
    if not args.quick:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return report
