"""What the workloads share: settings, the requests, the machine and its measured rates, one process per
engine, the greedy check, statistics, result files and figures.

Rooflines. A decoder spends 2 FLOP per weight per token in its linear layers. With P the weights that every
generated token goes through (the decoder layers and the LM head; the embedding is a lookup, not a GEMM):

    compute roofline   = measured GEMM rate / (2 P)             tokens/s a machine could generate at best
    bandwidth roofline = measured memory bandwidth / (P bytes)  tokens/s at batch 1, where every step reads
                                                                every weight once

The attention's own FLOP and KV-cache reads come on top: both rooflines are upper bounds.
"""

import datetime
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FIGURES = ROOT / "docs" / "figures"
SMOLLM2 = "SmolLM2-135M-Instruct (bundled GGUF, dequantized to fp32)"


# --- settings: a workload's FULL defaults, what --quick changes (QUICK) ------------------------------------


def add_arguments(parser, full: dict) -> None:
    """An option per setting of `full` (a list takes values apart or comma-separated), plus the common ones."""
    for key, value in full.items():
        many = isinstance(value, list)
        option, kind = "--" + key.replace("_", "-"), str if many else type(value)
        parser.add_argument(option, type=kind, nargs="+" if many else None, help=f"default {value}")
    parser.add_argument("--model", default=None, help=".gguf file or Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="a tiny run that checks the harness, not the speed")
    parser.add_argument("--json", type=Path, default=None, help="result file")
    parser.add_argument("--figure", type=Path, default=None, help="figure")


def settings(args, full: dict, quick: dict) -> dict:
    """The workload's settings: what the command line set, else the --quick or the full default."""
    out = full | quick if args.quick else dict(full)
    for key, value in full.items():
        given = getattr(args, key)
        if given is not None and isinstance(value, list):
            out[key] = [type(value[0])(x) for part in given for x in part.split(",") if x]
        elif given is not None:
            out[key] = given
    return out


def output_paths(args, name: str, figure: str = "") -> tuple[Path, Path]:
    """The result file and figure: given, else results/NAME.json and figures/FIGURE.png (--quick: NAME_quick.*
    side by side, so that a quick run never overwrites the book's results)."""
    if args.quick:
        json_path = args.json or RESULTS / f"{name}_quick.json"
        return json_path, args.figure or json_path.with_suffix(".png")
    return args.json or RESULTS / f"{name}.json", args.figure or FIGURES / f"{figure or name}.png"


def command_line() -> str:
    """The command that reproduces this run, without its output paths (with the CPU level it was masked to)."""
    argv, paths = sys.argv[1:], ("--json", "--figure")
    kept = [arg for i, arg in enumerate(argv) if arg not in paths and (i == 0 or argv[i - 1] not in paths)]
    level = os.environ.get("ROSELLM_CPU_FEATURES")
    return (f"ROSELLM_CPU_FEATURES={level} " if level else "") + "python -m benchmarks " + " ".join(kept)


def named_checkpoint(text: str):
    """A checkpoint named on a command line: "latest", by chapter ("3", "ch03", ...) or by module ("rosellm",
    "chapters.ch03_batch_decode.rosellm")."""
    import chapters

    if text == "latest":
        return chapters.latest()
    return next((point for point in chapters.checkpoints() if text == point.module), None) or chapters.checkpoint(text)


def rosellm_label(point, short: bool = False) -> str:
    """How a checkpoint's engine is named in tables and figures: "rosellm (ch07, continuous batching)"."""
    tag = f"ch{point.number:02d}"
    return f"rosellm ({tag})" if short else f"rosellm ({tag}, {point.slug.replace('_', ' ')})"


# --- requests and model ----------------------------------------------------------------------------------


def random_requests(count: int, prompt_len: list, max_tokens: list, vocab_size: int, seed: int) -> list[tuple]:
    """`count` requests (prompt token ids, max_tokens), lengths uniform in the given ranges. The lowest ids,
    the special tokens of most vocabularies, are left out."""
    rng = random.Random(seed)
    low = min(32, vocab_size // 8)
    return [
        ([rng.randrange(low, vocab_size) for _ in range(rng.randint(*prompt_len))], rng.randint(*max_tokens))
        for _ in range(count)
    ]


def model_config(model: str | None):
    """rosellm's `ModelConfig` of a model (None: SmolLM2), read without loading the weights."""
    from chapters import submodule

    config = submodule("rosellm", "config")
    ModelConfig = config.ModelConfig
    loader = submodule("rosellm", "loader")
    resolve_model_folder = loader.resolve_model_folder

    return ModelConfig.from_json(resolve_model_folder(model) / "config.json")


def parameter_counts(config) -> dict:
    """Weights of a Llama-family model, counted from its config. `roofline` is P of the module docstring."""
    c = config
    attention = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    layer = attention + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size
    non_embedding = c.num_hidden_layers * layer + c.hidden_size  # + the final norm
    lm_head = c.vocab_size * c.hidden_size
    means = "non-embedding weights + LM head (the embedding is a lookup; a tied LM head counts once, as the LM head)"
    out = dict(non_embedding=non_embedding, embedding=lm_head, lm_head=lm_head, roofline=non_embedding + lm_head)
    return out | dict(lm_head_tied_to_embedding=bool(c.tie_word_embeddings), roofline_means=means)


# --- the machine -----------------------------------------------------------------------------------------


class OtherLoad:
    """The share of all CPUs' time that *other* processes used meanwhile (this one and its children are not
    others). Linux only; None elsewhere. A shared machine makes timings meaningless without saying so."""

    def __enter__(self):
        self.start, self.share = cpu_seconds(), None
        return self

    def __exit__(self, *exc):
        end = cpu_seconds()
        if self.start and end and end[0] > self.start[0]:
            total, busy, mine = (b - a for a, b in zip(self.start, end))
            self.share = round(max(busy - mine, 0.0) / total, 3)


def cpu_seconds() -> tuple[float, float, float] | None:
    """(every CPU's seconds, their busy seconds, the seconds of this process and its children) so far."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return None
    ticks, own = os.sysconf("SC_CLK_TCK"), os.times()
    mine = own.user + own.system + own.children_user + own.children_system
    return sum(fields) / ticks, (sum(fields) - fields[3] - fields[4]) / ticks, mine


def describe_machine(device: str = "cpu", threads: int | None = None) -> dict:
    """What a result was measured on, after setting torch's threads to what the engines will use."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    models = [
        line.split(":")[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line
    ]
    info = dict(cpu=(models or [platform.processor()])[0], cpu_cores=os.cpu_count(), device=device)
    info |= dict(cpu_flags=cpu_flags())
    info |= dict(cpu_cores_usable=len(os.sched_getaffinity(0)), platform=platform.platform(), torch=torch.__version__)
    info |= dict(python=platform.python_version(), torch_threads=torch.get_num_threads())
    info |= dict(load_average_1min=round(os.getloadavg()[0], 2), cuda_available=torch.cuda.is_available())
    return info | ({"gpu": torch.cuda.get_device_name(0)} if torch.cuda.is_available() else {})


CPU_FLAGS = {  # what /proc/cpuinfo (and lscpu) calls the vector and matrix extensions the kernels may use
    "avx2": "avx2",
    "avx512": "avx512f",
    "avx512_bf16": "avx512_bf16",
    "avx512_vnni": "avx512_vnni",
    "amx": "amx_tile",
}


def cpu_flags() -> dict[str, bool]:
    """Which of `CPU_FLAGS` the CPU has (all False where /proc/cpuinfo is not there)."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    return {name: flag in flags for name, flag in CPU_FLAGS.items()}


def measure_rates(quick: bool, device: str = "cpu", dtype: str = "float32", n: int = 0, mib: int = 0) -> dict:
    """The GEMM rate (one square `torch.mm`) and the memory bandwidth (a copy: each byte read and written), each
    the best and the median of a few runs after a warm-up one: other work only slows a run down."""
    import torch

    n, mib, repeats = n or (512 if quick else 2048), mib or (32 if quick else 256), 3 if quick else 5
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None

    def per_second(amount: float, fn) -> tuple[float, float]:
        times = []
        for _ in range(repeats + 1):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return amount / min(times[1:]), amount / statistics.median(times[1:])

    a = torch.randn(n, n, device=device).to(getattr(torch, dtype))  # (n, n)
    out = torch.empty_like(a)
    src = torch.ones(mib << 18, device=device)  # (mib MiB / 4 bytes,) fp32
    dst = torch.empty_like(src)
    with OtherLoad() as other:
        gemm = per_second(2.0 * n**3, lambda: torch.mm(a, a, out=out))
        copy = per_second(2.0 * src.numel() * 4, lambda: dst.copy_(src))
    gemm = dict(n=n, dtype=dtype, repeats=repeats, flops_best=gemm[0], flops_median=gemm[1])
    copy = dict(mib=mib, repeats=repeats, bytes_per_s_best=copy[0], bytes_per_s_median=copy[1])
    return dict(gemm=gemm, bandwidth=copy, other_processes_cpu_share=other.share, at=time.strftime("%H:%M:%S"))


def rooflines(rates: list[dict], params: dict, bytes_per_weight: int = 4) -> dict:
    """The rooflines from the best of the rates measured before and after the engines."""
    gemm = max(r["gemm"]["flops_best"] for r in rates)
    bandwidth = max(r["bandwidth"]["bytes_per_s_best"] for r in rates)
    weight, flop = params["roofline"] * bytes_per_weight, 2 * params["roofline"]
    out = dict(gemm_flops=gemm, bandwidth_bytes_per_s=bandwidth, flop_per_token=flop, weight_bytes=weight)
    out |= dict(compute_tokens_per_s=gemm / flop, bandwidth_tokens_per_s=bandwidth / weight)
    return out | {"measurements": rates}


# --- one engine in a process of its own --------------------------------------------------------------------


def run_process(argv: list[str], spec: dict, label: str, env: dict | None = None) -> dict:
    """Run `argv + [SPEC, OUT]` (the protocol of `benchmarks.engines` and of the peers' scripts: the spec in
    a JSON file, the result written to another) and return its result, or {"error": ...}. A fresh process
    per engine makes its peak memory its own and keeps one engine's threads and allocator from the next."""
    print(f"--- {label}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rosellm-bench-") as tmp, OtherLoad() as other:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        start = time.perf_counter()
        done = subprocess.run([*argv, str(spec_path), str(out_path)], cwd=ROOT, env=env)
        if done.returncode != 0 or not out_path.is_file():
            result = {"error": f"{label} exited with status {done.returncode}"}
        else:
            result = json.loads(out_path.read_text())
    result["process_wall_s"] = round(time.perf_counter() - start, 1)
    result["other_processes_cpu_share"] = other.share
    return result


def run_engine(task: str, spec: dict, label: str) -> dict:
    """One of `benchmarks.engines`' tasks, with this Python."""
    return run_process([sys.executable, "-m", "benchmarks.engines", task], spec, label, python_environment())


def python_environment() -> dict:
    """This process's environment, the repository first on the import path of the processes it starts."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def check_against(reference: dict, tokens: list | dict) -> dict:
    """Does an engine's greedy output start with transformers' one-at-a-time tokens on the checked sample?
    `reference` maps a request's index (a string) to its tokens; `tokens` is a list or the same kind of map."""
    mismatches = []
    for key, expected in reference.items():
        got = (tokens.get(key) if isinstance(tokens, dict) else tokens[int(key)]) or []
        got = got[: len(expected)]
        if got != expected:
            where = next((k for k, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            mismatches.append({"request": int(key), "first_difference_at": where})
    tokens_each = max((len(v) for v in reference.values()), default=0)
    passed = bool(reference) and not mismatches
    return dict(requests=len(reference), tokens_each=tokens_each, passed=passed, mismatches=mismatches)


def agreement(tokens: list[list[int]], baseline: list[list[int]], after: tuple = (1, 4, 16, 64)) -> dict:
    """How far an engine's greedy tokens follow a baseline's on the same requests: the share of generated
    tokens equal to the baseline's at the same position, the requests identical throughout, and, for each k
    in `after`, the share of requests whose first k tokens all equal the baseline's (whose first difference,
    if any, comes at token k + 1 or later; a request shorter than k counts when it is identical). Once two
    greedy runs differ, each continues its own text: later tokens rarely match, so the first difference is
    the measure that says most."""
    first, equal, total = [], 0, 0
    for got, want in zip(tokens, baseline):
        got, want = got or [], want or []
        equal += sum(a == b for a, b in zip(got, want))
        total += len(want)
        differ = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        first.append(differ if differ is not None or len(got) == len(want) else min(len(got), len(want)))
    n = len(first)
    shares = {str(k): round(sum(d is None or d >= k for d in first) / n, 4) if n else None for k in after}
    out = dict(requests=n, equal_token_share=round(equal / total, 4) if total else None)
    out |= dict(identical_requests=sum(d is None for d in first), first_difference_at=first)
    return out | dict(share_identical_for_first_k_tokens=shares)


# --- results: statistics, files, tables, figures -----------------------------------------------------------


def chapter_ranges(numbers: list[int]) -> str:
    """Chapter numbers as runs: [1, 2, 3, 6, 7, 8] -> "01-03, 06-08"; "none" when there are none."""
    runs = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a:02d}" if a == b else f"{a:02d}-{b:02d}" for a, b in runs) or "none"


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between order statistics."""
    if not values:
        return None
    ordered, position = sorted(values), (len(values) - 1) * q / 100
    low, high = int(position), min(int(position) + 1, len(values) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median_p90(values: list, scale: float = 1.0, digits: int = 2) -> dict:
    values = [v * scale for v in values if v is not None]
    if not values:
        return {"median": None, "p90": None}
    return {"median": round(percentile(values, 50), digits), "p90": round(percentile(values, 90), digits)}


def measured(args, workload: str, measure, device: str = "cpu") -> dict:
    """A result: the machine described (torch's threads set first), then `measure()`, whose settings come under
    "settings", under the head every result file starts with; the CPU other processes used and the wall time."""
    started, machine = time.perf_counter(), describe_machine(device, args.threads)
    with OtherLoad() as other:
        body = measure()
    head = dict(workload=workload, command=command_line(), date=datetime.date.today().isoformat(), quick=args.quick)
    if run := os.environ.get("BENCHMARKS_RUN"):  # one of the files of a group run (book_results.py)
        head["run"] = json.loads(run)
    head |= dict(model=args.model or SMOLLM2, machine=machine, settings=body.pop("settings"))
    result = head | body | {"correct": body.get("correct", True)}
    result["other_processes_cpu_share"] = machine["other_processes_cpu_share"] = other.share
    return result | {"wall_s": round(time.perf_counter() - started, 1)}


def portable(value):
    """`value` (a result, or any part of it) with this machine's paths rewritten wherever they appear: a path
    in the repository relative to it, one in the home folder from `~`, a temporary file by its name alone."""
    if isinstance(value, dict):
        return {key: portable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [portable(item) for item in value]
    if not isinstance(value, str):
        return value
    temporary = re.escape(str(Path(tempfile.gettempdir()).resolve()))
    value = re.sub(temporary + r"/(?:[^/\s:\"']+/)*", "", value.replace(f"{ROOT}/", ""))
    return value.replace(f"{Path.home()}/", "~/")


def write(result: dict, json_path: Path, figures: list[Path], plot, report, wrong: str) -> dict:
    """Write a result's JSON (with `portable` paths), draw its figures (`plot(result, *figures)`), print its
    report; exit with status 1 if an engine it vouches for gave wrong tokens (`wrong` says which)."""
    result["figures"] = [str(Path(path).resolve()) for path in figures]
    result |= portable(result)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, *figures)
    if report:
        report(result)
    print(f"wrote {', '.join([str(json_path), *result['figures']])} ({result['wall_s']} s)")
    other = result["other_processes_cpu_share"]
    if other and other > 0.05:
        print(f"warning: other processes used {other:.0%} of the CPU during the run; the timings are disturbed")
    if not result["correct"]:
        raise SystemExit(f"ERROR: {wrong}")  # status 1
    return result


def save(args, workload: str, measure, name: str, plot, figure: str = "", report=None, wrong: str = "") -> dict:
    """`measured(...)`, then `write(...)` to results/NAME.json and figures/FIGURE.png (see `output_paths`)."""
    result = measured(args, workload, measure)
    json_path, figure_path = output_paths(args, name, figure)
    return write(result, json_path, [figure_path], plot, report, wrong or f"{workload}: the engines' tokens disagree")


def print_table(rows: list[dict], columns: dict[str, str]) -> None:
    """A plain text table: `columns` maps a key of the rows to its heading; missing values print as '-'."""

    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:,.3g}" if abs(value) < 10 else f"{value:,.1f}"
        return "-" if value is None else str(value)

    cells = [[cell(row.get(key)) for key in columns] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(columns.values())]
    for line in [list(columns.values()), ["-" * w for w in widths], *cells]:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))))


def figure_axes(rows: int, cols: int, size: tuple[float, float]):
    """A matplotlib figure (Agg) with a grid of axes: (figure, axes[row][col])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=size, squeeze=False)


def save_figure(fig, path: Path, result: dict, prefix: str = "") -> None:
    """Save a figure under a caption that says what ran on which machine, and how busy it was."""
    import matplotlib.pyplot as plt

    m = result["machine"]
    other = m.get("other_processes_cpu_share")
    other = "?" if other is None else f"{other:.0%}"
    threads = f"{m['torch_threads']} torch thread" + ("s" if m["torch_threads"] != 1 else "")
    caption = f"{prefix}{result['model']}; {m['cpu']}, {threads}; other processes used {other} of the CPU"
    # on lines of even lengths that fit the figure (an 8-point character is about 4.5 points wide): never cut
    fits = int(fig.get_figwidth() * 72 / 4.5) - 4
    fig.suptitle(textwrap.fill(caption, math.ceil(len(caption) / math.ceil(len(caption) / fits)) + 2), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
