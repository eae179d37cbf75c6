"""What the DESIGN.md §6 workloads (offline-cpu, latency-cpu, chapters, offline-gpu) share: the requests, the
machine's measured rates and the rooflines built from them, statistics, one subprocess per engine (so that
each engine's peak memory is its own), result files and the final table.

Rooflines. A decoder spends 2 FLOP per weight per token in its linear layers. With P the weights that every
generated token goes through (the decoder layers and the LM head; the embedding is a lookup, not a GEMM):

    compute roofline   = measured fp32 GEMM rate / (2 P)      tokens/s a machine could generate at best
    bandwidth roofline = measured memory bandwidth / (P bytes)  tokens/s at batch 1, where every step reads
                                                               every weight once

The attention's own FLOP and KV-cache reads come on top: both rooflines are upper bounds.
"""

import hashlib
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import machine as _machine
from .machine import machine_info

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "docs" / "figures"
SMOLLM2 = "SmolLM2-135M-Instruct (bundled GGUF, dequantized to fp32)"


class OtherLoad(_machine.OtherLoad):
    """`machine.OtherLoad` that also counts the CPU time of this process's finished children (the engine
    workers) as its own, so that only other people's work shows up as load."""

    @staticmethod
    def _sample():
        sample = _machine.OtherLoad._sample()
        if sample is None:
            return None
        times = os.times()
        return sample[0], sample[1], sample[2] + times.children_user + times.children_system


# --- requests -----------------------------------------------------------------------------------------


def random_requests(count: int, prompt_len: tuple[int, int], max_tokens: tuple[int, int], vocab_size: int,
                    seed: int) -> list[tuple[list[int], int]]:
    """`count` requests (prompt token ids, max_tokens): random ids, lengths uniform in the given ranges.

    The lowest ids are left out: they are the special tokens (end of text, chat markers) of most vocabularies.
    """
    rng = random.Random(seed)
    low = min(32, vocab_size // 8)
    requests = []
    for _ in range(count):
        prompt = [rng.randrange(low, vocab_size) for _ in range(rng.randint(*prompt_len))]
        requests.append((prompt, rng.randint(*max_tokens)))
    return requests


def model_config(model: str | None):
    """rosellm's `ModelConfig` of a model (None: SmolLM2), read without loading the weights."""
    from rosellm.config import ModelConfig
    from rosellm.loader import resolve_model_folder

    return ModelConfig.from_json(resolve_model_folder(model) / "config.json")


def parameter_counts(config) -> dict:
    """Weights of a Llama-family model, counted from its config. `roofline` is P of the module docstring."""
    hidden, heads, kv_heads, head_dim = (config.hidden_size, config.num_attention_heads,
                                         config.num_key_value_heads, config.head_dim)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o; k, v
    mlp = 3 * hidden * config.intermediate_size
    norms = 2 * hidden
    non_embedding = config.num_hidden_layers * (attention + mlp + norms) + hidden  # + the final norm
    embedding = config.vocab_size * hidden
    lm_head = config.vocab_size * hidden
    return {
        "non_embedding": non_embedding,
        "embedding": embedding,
        "lm_head": lm_head,
        "lm_head_tied_to_embedding": bool(config.tie_word_embeddings),
        "roofline": non_embedding + lm_head,
        "roofline_means": "non-embedding weights + LM head (the embedding is a lookup; a tied LM head counts "
                          "once, as the LM head)",
    }


def attention_flop_per_token(config, context: float) -> float:
    """FLOP of the attention itself (QK^T and PV) for one query token that sees `context` keys."""
    return 4.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * context


# --- the machine's rates --------------------------------------------------------------------------------


def measure_gemm(n: int = 2048, repeats: int = 5, dtype: str = "float32", device: str = "cpu") -> dict:
    """FLOP/s of one large square `torch.mm` (2 n^3 FLOP), best and median of `repeats` after a warm-up.

    Other work on the machine only slows a run down, so the best run is the estimate of what the machine can
    do; the median says how disturbed the measurement was."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(n, n, device=device).to(dt)
    b = torch.randn(n, n, device=device).to(dt)
    out = torch.empty(n, n, device=device, dtype=dt)
    torch.mm(a, b, out=out)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        sync(device)
        times.append(time.perf_counter() - start)
    flop = 2.0 * n**3
    return {"n": n, "dtype": dtype, "repeats": repeats,
            "flops_best": flop / min(times), "flops_median": flop / statistics.median(times)}


def measure_bandwidth(mib: int = 256, repeats: int = 5, device: str = "cpu") -> dict:
    """Bytes/s of copying a `mib` MiB fp32 tensor into another (each byte read once and written once)."""
    import torch

    numel = mib * (1 << 20) // 4
    src = torch.ones(numel, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    moved = 2.0 * numel * 4
    return {"mib": mib, "repeats": repeats,
            "bytes_per_s_best": moved / min(times), "bytes_per_s_median": moved / statistics.median(times)}


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def measure_rates(quick: bool, device: str = "cpu", dtype: str = "float32") -> dict:
    """The GEMM rate and the memory bandwidth, measured here and now (in this process)."""
    with OtherLoad() as other:
        gemm = measure_gemm(n=512 if quick else 2048, repeats=3 if quick else 5, dtype=dtype, device=device)
        bandwidth = measure_bandwidth(mib=32 if quick else 256, repeats=3 if quick else 5, device=device)
    return {"gemm": gemm, "bandwidth": bandwidth, "other_processes_cpu_share": other.share,
            "at": time.strftime("%H:%M:%S")}


def rooflines(rates: list[dict], params: dict, bytes_per_weight: int = 4) -> dict:
    """The rooflines from the best of several measurements of the rates (before and after the engines ran)."""
    gemm = max(r["gemm"]["flops_best"] for r in rates)
    bandwidth = max(r["bandwidth"]["bytes_per_s_best"] for r in rates)
    weight_bytes = params["roofline"] * bytes_per_weight
    return {
        "gemm_flops": gemm,
        "bandwidth_bytes_per_s": bandwidth,
        "flop_per_token": 2 * params["roofline"],
        "weight_bytes": weight_bytes,
        "compute_tokens_per_s": gemm / (2 * params["roofline"]),
        "bandwidth_tokens_per_s": bandwidth / weight_bytes,
        "measurements": rates,
    }


# --- statistics -----------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between order statistics."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median_p90(values: list[float], scale: float = 1.0, digits: int = 2) -> dict:
    values = [v * scale for v in values if v is not None]
    if not values:
        return {"median": None, "p90": None}
    return {"median": round(percentile(values, 50), digits), "p90": round(percentile(values, 90), digits)}


def latency_stats(run: dict, max_tokens: list[int]) -> dict:
    """TTFT and TPOT (milliseconds, median and p90) from a run's per-request times.

    run["first_token_s"][i]: seconds from the start (every request submitted) to request i's first token;
    run["last_token_s"][i]: to its last. TPOT = (last - first) / (tokens - 1): the pace at which its tokens
    came once the first was out."""
    ttft = run["first_token_s"]
    tpot = [(last - first) / (n - 1) for first, last, n in zip(ttft, run["last_token_s"], max_tokens) if n > 1]
    return {"ttft_ms": median_p90(ttft, 1000, 1), "tpot_ms": median_p90(tpot, 1000, 2)}


# --- one engine in its own process ----------------------------------------------------------------------


CACHE = Path(tempfile.gettempdir()) / "rosellm-bench-cache"


def run_worker(task: str, spec: dict, label: str, resume: bool = False, keep: bool = True) -> dict:
    """Run `benchmarks.worker` TASK in a fresh Python process and return its result.

    A fresh process per engine makes its peak memory its own and keeps one engine's allocator state (and
    thread pools) from slowing the next. The child's progress bars go to this terminal.

    Every finished engine's result is also kept in CACHE, keyed by the task and its exact spec: with
    `resume`, a run that was interrupted (a long offline-cpu on a shared machine) picks up the engines that
    had already finished instead of measuring them again. Only for the same code. `keep=False` (quick
    runs) leaves the cache alone."""
    key = hashlib.sha256(json.dumps([task, spec], sort_keys=True).encode()).hexdigest()[:20]
    cached = CACHE / f"{task}-{key}.json"
    if resume and cached.is_file():
        print(f"--- {label}: reusing the result of an interrupted run ({cached})", flush=True)
        return json.loads(cached.read_text()) | {"reused_from": str(cached)}
    result = run_worker_process(task, spec, label)
    if keep and "error" not in result:
        CACHE.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(result))
    return result


def run_worker_process(task: str, spec: dict, label: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="rosellm-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        print(f"--- {label}", flush=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        start = time.perf_counter()
        with OtherLoad() as other:
            done = subprocess.run([sys.executable, "-m", "benchmarks.worker", task, str(spec_path), str(out_path)],
                                  cwd=ROOT, env=env)
        if done.returncode != 0 or not out_path.is_file():
            return {"error": f"the {task} worker exited with status {done.returncode}",
                    "other_processes_cpu_share": other.share}
        result = json.loads(out_path.read_text())
    result["process_wall_s"] = round(time.perf_counter() - start, 1)
    result["other_processes_cpu_share"] = other.share
    return result


# --- output ---------------------------------------------------------------------------------------------


def describe_machine(device: str = "cpu", threads: int | None = None) -> dict:
    """machine.machine_info, after setting torch's thread count to what the engines will use."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    info = machine_info(device)
    try:
        import torch

        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available() and "gpu" not in info:
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # a description must never fail a run
        pass
    return info


def print_machine(machine: dict, rates: dict | None = None) -> None:
    line = (f"machine: {machine['cpu']}, {machine['cpu_cores']} cores ({machine.get('cpu_cores_usable')} usable), "
            f"torch {machine['torch']} with {machine['torch_threads']} threads, device {machine['device']}")
    if machine.get("gpu"):
        line += f", GPU {machine['gpu']}"
    print(line)
    if rates:
        gemm = rates["gemm"]
        print(f"measured: {gemm['dtype']} GEMM {gemm['flops_best'] / 1e9:.1f} GFLOP/s (n={gemm['n']}, best of "
              f"{rates['gemm']['repeats']}; median {rates['gemm']['flops_median'] / 1e9:.1f}), memory bandwidth "
              f"{rates['bandwidth']['bytes_per_s_best'] / 1e9:.1f} GB/s (copy of {rates['bandwidth']['mib']} MiB); "
              f"other processes used {share_text(rates['other_processes_cpu_share'])} of the CPU meanwhile")


def share_text(share: float | None) -> str:
    return "?" if share is None else f"{share:.0%}"


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    """A plain text table: columns are (key, heading); missing values print as '-'."""
    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:,.3g}" if abs(value) < 10 else f"{value:,.1f}"
        return str(value)

    cells = [[cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max([len(heading)] + [len(r[i]) for r in cells]) for i, (_, heading) in enumerate(columns)]
    print("  ".join(heading.rjust(w) if i else heading.ljust(w)
                    for i, ((_, heading), w) in enumerate(zip(columns, widths))))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))


def write_json(result: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def repo_path(path: Path) -> str:
    """A path relative to the repository when it is inside it (what result files record)."""
    try:
        return Path(path).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def finish_run(result: dict, other_share: float | None, started: float, json_path: Path, figures: list[Path],
               draw, report, wrong_engine: str) -> dict:
    """Stamp a measured run (other processes' CPU share, wall time, figures), write its JSON, draw its figures
    with `draw(result)`, print `report(result)`, and exit with an error if an engine's tokens were wrong."""
    result["other_processes_cpu_share"] = other_share
    result["machine"]["other_processes_cpu_share"] = other_share
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["figures"] = [repo_path(path) for path in figures]
    write_json(result, json_path)
    draw(result)
    report(result)
    print(f"wrote {json_path} and {', '.join(result['figures'])} ({result['wall_s']} s)")
    warn_if_loaded(other_share)
    if not result["correct"]:
        print(f"ERROR: {wrong_engine}", file=sys.stderr)
        raise SystemExit(1)
    return result


def warn_if_loaded(share: float | None) -> None:
    if share is not None and share > 0.05:
        print(f"warning: other processes used {share:.0%} of the CPU during the run; the timings are disturbed "
              f"(recorded in the result)")
