"""mkdocs hook: the measured tables of the chapter pages, generated from the committed result files.

A line of its own in a page

    <!-- measured: run FILE.json -->                           when, how and on what FILE was measured
    <!-- measured: decode-scaling FILE.json -->                one checkpoint's cost per token against length
    <!-- measured: decode-scaling-pair OLD.json NEW.json -->   two checkpoints' cost per token, side by side
    <!-- measured: batch-throughput FILE.json -->              throughput against batch size
    <!-- measured: arrivals FILE.json -->                      chapter 05 against chapter 07 on arriving requests
    <!-- measured: long-prompts FILE.json -->                  decode latency and long prompts' TTFT, chunking off / on
    <!-- measured: prefix FILE.json -->                        prompt tokens computed, TTFT, tok/s: caching on / off
    <!-- measured: serve FILE.json -->                         the server under Poisson arrivals: latency, goodput
    <!-- measured: cpu-ablation FILE.json -->                  chapter 11's speed-ups one at a time, profiles
    <!-- measured: cpu-peers OFFLINE.json LATENCY.json -->      rosellm against its peers: offline and batch 1
    <!-- measured: tensor-parallel FILE.json -->               chapter 12: all-reduce and engine costs measured here
    <!-- measured: tensor-parallel-model FILE.json -->         chapter 12: bytes and step times modelled at scale
    <!-- measured: chapter-row NN -->                          chapter NN's row of the `chapters` workload
    <!-- measured: batch-one FILE.json -->                     chapter 13: every weight format and peer at batch 1
    <!-- measured: quant-kernels FILE.json -->                 chapter 13: the linear kernels at 1 to 64 rows
    <!-- measured: decode-attention FILE.json -->              chapter 13: decode attention, compiled and in C
    <!-- measured: kernel-choice FILE.json -->                 chapter 18: per format and rows, the fastest kernel
                                                               and the one the checkpoint picks, at one CPU level
    <!-- measured: perplexity FILE.json -->                    chapter 13: perplexity and greedy agreement per format
    <!-- measured: speculative FILE.json -->                   chapter 14: speculation's speed, acceptance, tokens
    <!-- measured: structured FILE.json -->                    chapter 15: the grammar's cost per step, compiling

is replaced by Markdown made from `benchmarks/results/`, so that a page quotes the numbers of the files,
with the machine and the load other processes put on it while they were measured. A missing file fails the
build, but for `speculative` and `structured`, whose blocks say how to measure them until their files are committed.

One value of a result file, anywhere in a sentence:

    <!-- value: FILE.json dotted.path.0.key FORMAT -->

is replaced by that value written with the Python format spec FORMAT (`.1f`, `.0%`, `,d`; left out: as it
is). Numbers in the path index lists (`-1`: the last item). A missing file or key fails the build, naming
both. A marker written between backticks (`` `<!-- value: ... -->` ``) is left as it is, so that a page can
show the syntax.

A section (the text under one heading) compares only numbers of one run: a group of `python -m benchmarks
results` (its files carry the run's id), or for a file measured on its own, its day and CPU. A section that
quotes files of two runs fails the build, unless it holds the line

    <!-- runs: labelled -->

and then each value in it is followed by its run's letter (<sup>A</sup>, <sup>B</sup>, ...) and the section
ends with what each letter is (the files, the day, the CPU). A block names its run in its own last line.
"""

import json
import re
from pathlib import Path

from mkdocs.exceptions import PluginError

MARKER = re.compile(r"^<!--\s*measured:\s*([\w-]+)((?:\s+[\w.-]+)*)\s*-->[ \t]*$", re.MULTILINE)
VALUE = re.compile(r"(?<!`)<!--\s*value:\s*([\w./-]+\.json)\s+([\w.-]+)(?:\s+(\S+?))?\s*-->(?!`)")
BUSY_SHARE = 0.10  # above this share of the CPU used by other processes, a run is flagged as measured under load


def on_page_markdown(markdown: str, page, config, files) -> str:
    results = Path(config.config_file_path).parent / "benchmarks" / "results"
    try:
        markdown = "".join(one_run_per_section(section, results) for section in sections(markdown))
    except ValueError as error:
        raise PluginError(f"{page.file.src_path}: {error}") from None

    def expand(match: re.Match) -> str:
        kind, args = match.group(1), match.group(2).split()
        if kind not in BLOCKS:
            raise PluginError(f"{page.file.src_path}: unknown results block {kind!r}")
        return BLOCKS[kind](results, *args)

    def value(match: re.Match) -> str:
        name, path, spec = match.groups()
        try:
            return format(lookup(load(results, name), path, f"benchmarks/results/{name}"), spec or "")
        except (KeyError, ValueError, PluginError) as error:
            raise PluginError(f"{page.file.src_path}: {match.group(0)}: {error.args[0]}") from None

    return VALUE.sub(value, MARKER.sub(expand, markdown))


# --- runs: one per section -------------------------------------------------------------------------------

LABELLED = re.compile(r"^<!--\s*runs:\s*labelled\s*-->[ \t]*\n?", re.MULTILINE)
HEADING = re.compile(r"^#{1,6} ")
BLOCK_FILES = {"chapter-row": lambda args: ["chapters.json"]}  # blocks that name no file read this one


def sections(markdown: str) -> list[str]:
    """`markdown` cut before each heading (not one inside a code fence); joined, they give it back."""
    parts, fenced = [""], False
    for line in markdown.splitlines(keepends=True):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and HEADING.match(line) and parts[-1]:
            parts.append("")
        parts[-1] += line
    return parts


def run_of(result: dict) -> tuple[str, str]:
    """(id, words) of the run that measured `result`: its group run of `python -m benchmarks results`, else the
    day and CPU it was measured on by itself."""
    cpu, date = result.get("machine", {}).get("cpu", "an unrecorded CPU"), result.get("date", "an unrecorded day")
    run = result.get("run")
    if run:
        return run["id"], f"the {run['group']} run of {date}, on {cpu}"
    return f"{date} {cpu}", f"{date}, on {cpu}"


def quoted_files(section: str) -> list[str]:
    """The result files a section's markers quote, in order, each once (a missing file is the marker's error)."""
    names = []
    for match in MARKER.finditer(section):
        kind, args = match.group(1), match.group(2).split()
        names += BLOCK_FILES.get(kind, lambda args: [a for a in args if a.endswith(".json")])(args)
    names += [m.group(1) for m in VALUE.finditer(section)]
    return list(dict.fromkeys(names))


def one_run_per_section(section: str, results: Path) -> str:
    """`section` as it is when its numbers come from one run (a `runs: labelled` line dropped); labelled (see
    the module docstring) when it says so; ValueError naming the runs otherwise."""
    runs: dict[str, tuple[str, list[str]]] = {}  # id -> (words, files)
    files = [name for name in quoted_files(section) if (results / name).is_file()]
    for name in files:
        run_id, words = run_of(json.loads((results / name).read_text()))
        runs.setdefault(run_id, (words, []))[1].append(name)
    if len(runs) <= 1:
        return LABELLED.sub("", section)
    if not LABELLED.search(section):
        title = section.splitlines()[0].lstrip("# ").strip() if HEADING.match(section) else "(the page's top)"
        found = "; ".join(f"{', '.join(names)} ({words})" for words, names in runs.values())
        raise ValueError(
            f"the section {title!r} quotes numbers of {len(runs)} runs: {found}. Measure them in one run "
            "(python -m benchmarks results), or add <!-- runs: labelled --> to label each number with its run"
        )
    letters = {name: chr(ord("A") + i) for i, (_, names) in enumerate(runs.values()) for name in names}

    def labelled(match: re.Match) -> str:
        letter = letters.get(match.group(1))
        return match.group(0) + (f"<sup>{letter}</sup>" if letter else "")

    legend = "; ".join(f"<sup>{letters[names[0]]}</sup> {', '.join(names)}: {words}" for words, names in runs.values())
    body = VALUE.sub(labelled, LABELLED.sub("", section)).rstrip("\n")
    return f"{body}\n\n*Runs: {legend}.*\n\n"


def lookup(result, path: str, name: str = "the result file"):
    """The value at a dotted path of result file `name` (`engines.0.output_tokens_per_s`: numbers index lists)."""
    found = result
    for i, key in enumerate(path.split(".")):
        where = ".".join(path.split(".")[:i]) or "the top level"
        if isinstance(found, list) and re.fullmatch(r"-?\d+", key) and -len(found) <= int(key) < len(found):
            found = found[int(key)]
        elif isinstance(found, dict) and key in found:
            found = found[key]
        else:
            raise KeyError(f"{name} has no key {key!r} at {where} (the path {path!r})")
    return found


def load(results: Path, name: str) -> dict:
    path = results / name
    if not path.is_file():
        raise PluginError(f"no result file benchmarks/results/{name}")
    return json.loads(path.read_text())


def table(headings: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headings) + " |", "| --- " + "| ---: " * (len(headings) - 1) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows]) + "\n"


def load_words(share: float | None) -> str:
    if share is None:
        return "the load of other processes was not recorded"
    words = f"other processes used {100 * share:.0f} % of the CPU meanwhile"
    return (
        f"**{words}** (a busy machine: slower, noisier timings)" if share > BUSY_SHARE else words + " (an idle machine)"
    )


def run_line(result: dict) -> str:
    m = result["machine"]
    threads = m["torch_threads"]
    share = m.get("other_processes_cpu_share", result.get("other_processes_cpu_share"))
    flags = [name.replace("_", "-").upper() for name, has in m.get("cpu_flags", {}).items() if has]
    return (
        f"*Measured on {result['date']} with `{result['command']}`: {m['cpu']} ({m['cpu_cores']} cores"
        + (f"; {', '.join(flags)}" if flags else "")
        + "), "
        f"torch {m['torch']} with {threads} thread{'s' if threads != 1 else ''}, "
        f"{result.get('dtype', 'float32')}; {load_words(share)}.*\n"
    )


# --- blocks ---------------------------------------------------------------------------------------------


def block_run(results: Path, name: str) -> str:
    return run_line(load(results, name))


def block_decode_scaling(results: Path, name: str) -> str:
    result = load(results, name)
    rows = [
        [
            str(p["prompt_len"]),
            f"{p['first_token_ms']:.0f}",
            f"{p['decode_ms_per_token']:.0f}",
            f"{p['decode_tokens_per_s']:.1f}",
        ]
        for p in result["points"]
    ]
    fit, whole = result["fit"], result["whole_generation"]
    return (
        table(["prompt tokens", "first token (ms)", "decode step (ms)", "decode tokens/s"], rows)
        + "\n"
        + f"Fit: a step costs **{fit['intercept_ms']:.0f} ms + {fit['slope_ms_per_token']:.2f} ms per token** in the "
        f"sequence. One whole generation of {whole['max_tokens']} tokens from a {whole['prompt_len']}-token prompt "
        f"took **{whole['measured_s']:.1f} s** (the fit predicts {whole['predicted_from_fit_s']:.1f} s).\n\n"
        + run_line(result)
    )


def block_decode_scaling_pair(results: Path, old_name: str, new_name: str) -> str:
    old, new = load(results, old_name), load(results, new_name)
    label_old, label_new = (f"chapter {r['chapter'][:2]}" for r in (old, new))
    rows = []
    for a, b in zip(old["points"], new["points"]):
        rows.append(
            [
                str(a["prompt_len"]),
                f"{a['decode_ms_per_token']:,.0f}",
                f"{b['decode_ms_per_token']:,.0f}",
                f"{a['decode_ms_per_token'] / b['decode_ms_per_token']:.1f}×",
                f"{b['first_token_ms']:,.0f}",
            ]
        )
    wholes = (
        f"One whole generation of {new['whole_generation']['max_tokens']} tokens from a "
        f"{new['whole_generation']['prompt_len']}-token prompt took {old['whole_generation']['measured_s']:.1f} s "
        f"on {label_old} and {new['whole_generation']['measured_s']:.1f} s on {label_new}.\n\n"
    )
    return (
        table(
            [
                "tokens in the prompt",
                f"{label_old}: ms per token",
                f"{label_new}: ms per token",
                "speed-up",
                f"{label_new}: prefill of the prompt, ms",
            ],
            rows,
        )
        + "\n"
        + wholes
        + f"{label_old.capitalize()}: "
        + run_line(old)
        + "\n"
        + f"{label_new.capitalize()}: "
        + run_line(new)
    )


def block_batch_throughput(results: Path, name: str) -> str:
    result = load(results, name)
    base = result["points"][0]["output_tokens_per_s"]
    rows = [
        [
            str(p["batch_size"]),
            f"{p['output_tokens_per_s']:.1f}",
            f"{p['decode_tokens_per_s']:.1f}",
            f"{p['decode_ms_per_step']:.0f}",
            f"{p['prefill_s']:.2f}",
            f"{p['output_tokens_per_s'] / base:.1f}×",
        ]
        for p in result["points"]
    ]
    return (
        table(
            [
                "batch size",
                "output tokens/s",
                "decode tokens/s",
                "ms per decode step",
                "prefill of the batch, s",
                "vs batch 1",
            ],
            rows,
        )
        + "\n"
        + run_line(result)
    )


def block_arrivals(results: Path, name: str) -> str:
    result = load(results, name)
    old, new = result["results"]["ch05_paged_attention"], result["results"]["ch07_continuous_batching"]

    def row(label: str, show) -> list[str]:
        return [label, show(old), show(new)]

    rows = [
        row("output tokens", lambda r: str(r["output_tokens"])),
        row("engine steps", lambda r: str(r["steps"])),
        row("mean batch (sequences per step)", lambda r: f"{r['mean_batch']:.1f}"),
        row("output tokens / s (wall clock)", lambda r: f"{r['output_tokens_per_s']:.1f}"),
        row("output tokens / CPU-second", lambda r: f"{r['output_tokens_per_cpu_s']:.1f}"),
        row("TTFT median / p90, seconds", lambda r: f"{r['ttft_median_s']:.1f} / {r['ttft_p90_s']:.1f}"),
        row(
            "TTFT median / p90 / max, steps",
            lambda r: f"{r['ttft_median_steps']:.0f} / {r['ttft_p90_steps']} / {r['ttft_max_steps']}",
        ),
        ["preemptions (tokens recomputed)", "none possible", f"{new['preemptions']} ({new['recomputed_tokens']})"],
        ["requests with identical tokens", result["requests_with_identical_tokens"].replace("/", " / "), ""],
    ]
    return (
        table(["", "chapter 05 (reserve prompt + max_tokens)", "chapter 07 (admit on the prompt, preempt)"], rows)
        + "\n"
        + run_line(result)
    )


def block_long_prompts(results: Path, name: str) -> str:
    result = load(results, name)
    s = result["settings"]
    model = Path(result["model"]).name if "/" in result["model"] else result["model"]
    arrivals = [str(step) for step in s["long_at"]]
    plural = "s" if len(arrivals) > 1 else ""
    when = ", ".join(arrivals[:-1]) + " and " + arrivals[-1] if plural else arrivals[0]
    ms = lambda v: f"{v:.0f}" if v >= 10 else f"{v:.1f}"  # noqa: E731
    rows = []
    for r in result["runs"]:
        tpot = r["decode_tpot_ms"]
        label = "off (whole prompts)" if r["budget"] == "off" else f"on, budget {r['budget']} tokens"
        rows.append(
            [
                label,
                ms(tpot["p50"]),
                ms(tpot["p90"]),
                f"**{ms(tpot['max'])}**",
                ", ".join(f"{t:.2f}" for t in r["long_ttft_s"]),
                f"{r['output_tokens_per_s']:.1f}",
                str(len(r["steps"])),
            ]
        )
    return (
        table(
            [
                "chunked prefill",
                "decode TPOT p50 (ms)",
                "p90 (ms)",
                "max (ms)",
                "long prompts' TTFT (s)",
                "output tokens/s",
                "steps",
            ],
            rows,
        )
        + "\n"
        + f"{s['decoders']} requests decoding from step 1; {len(arrivals)} prompt{plural} of {s['long_prompt']} "
        f"tokens arriving before step{plural} {when}; {model}. TPOT: the time between "
        f"two tokens of a decoding request; TTFT: from a long prompt's arrival to its first token.\n\n"
        + run_line(result)
    )


def block_prefix(results: Path, name: str) -> str:
    result = load(results, name)
    s = result["settings"]
    model = Path(result["model"]).name if "/" in result["model"] else result["model"]
    scenarios = {
        "shared": f"{s['requests']} requests: one {s['system']}-token system prompt + a question",
        "chats": f"{s['chats']} chats × {s['turns']} turns, each resending its history",
    }
    rows = [
        [
            scenarios[r["scenario"]] if r["caching"] else "″",
            "on" if r["caching"] else "off",
            f"{r['computed_prompt_tokens']:,} of {r['prompt_tokens']:,}",
            f"{100 * r['hit_rate']:.0f} %",
            f"{r['ttft_s']['median']:.2f} / {r['ttft_s']['p90']:.2f}",
            f"**{r['output_tokens_per_s']:.1f}**",
            f"{r['seconds']:.1f}",
        ]
        for r in result["runs"]
    ]
    headings = ["workload", "caching", "prompt tokens computed", "hit rate", "TTFT median / p90 (s)"]
    return (
        table(headings + ["output tokens/s", "seconds"], rows)
        + "\n"
        + f"{s['max_tokens']} output tokens per request, greedy; {model}. Greedy tokens equal with caching on "
        f"and off: {'yes' if result['correct'] else '**no**'}.\n\n" + run_line(result)
    )


def engine_step(run: dict) -> str:
    """The mean engine step during a rate, as the server timed it ("–" for a server that does not)."""
    return "–" if run.get("engine_step_ms") is None else f"{run['engine_step_ms']:.0f}"


def block_serve(results: Path, name: str) -> str:
    result = load(results, name)
    s = result["settings"]
    model = Path(result["model"]).name if "/" in result["model"] else result["model"]
    labels = {server["server"]: server["label"] for server in result["servers"]}
    several = len(labels) > 1
    ms = lambda v: "–" if v is None else f"{1000 * v:,.0f}" if v >= 0.01 else f"{1000 * v:.1f}"  # noqa: E731
    sec = lambda v: "–" if v is None else f"{v:.2f}" if v >= 0.1 else f"{v:.3f}"  # noqa: E731
    step = result.get("offline_step")
    rows = []
    for r in result["runs"]:
        ttft, tpot = r["ttft_s"], r["tpot_s"]
        done = "" if r["failed"] == 0 else f" ({r['failed']} failed)"
        ratio = r.get("tpot_over_offline_step")
        rows.append(
            ([labels[r["server"]]] if several else [])
            + [
                f"{r['rate']:g}",
                " / ".join(sec(ttft[q]) for q in ("p50", "p90", "p99")),
                " / ".join(ms(tpot[q]) for q in ("p50", "p90")),
            ]
            + ([("–" if ratio is None else f"{ratio:.2f}×"), engine_step(r)] if step else [])
            + [
                " / ".join(ms(r["itl_s"][q]) for q in ("p50", "p99")) if step else ms(r["itl_s"]["p99"]),
                "–" if r["output_tokens_per_s"] is None else f"{r['output_tokens_per_s']:.1f}",
                f"**{100 * r['goodput']:.0f} %**{done}",
            ]
        )
    headings = ["arrival rate (requests/s)", "TTFT p50 / p90 / p99 (s)", "TPOT p50 / p90 (ms)"]
    headings += ["TPOT p50 / offline step", "engine step (ms)", "ITL p50 / p99 (ms)"] if step else ["ITL p99 (ms)"]
    headings = (["server"] if several else []) + headings + ["output tokens/s", "goodput"]
    (low, high), (fewest, most) = s["prompt_len"], s["max_tokens"]
    served = "" if several else f", served by {labels.get('rosellm', 'rosellm')}"
    named = (lambda n: labels.get(n, n)) if step else (lambda n: n)  # noqa: E731
    same = "".join(
        f" Identical greedy texts, {' and '.join(named(n) for n in pair.split(' vs '))}: "
        f"{sum(r['identical'] for r in rates)} of {sum(r['requests'] for r in rates)} requests."
        for pair, rates in result.get("agreement", {}).items()
    )
    offline = (
        f" Offline decode step of the same engine, one request ({step['prompt_len']}-token prompt, "
        f"{step['max_tokens']} tokens, the same threads): **{step['ms']:.1f} ms**, what each server's TPOT p50 "
        "is set against; the engine step is the mean step during the rate, as the server timed it where the "
        "step ran (`rosellm:engine_step_seconds`)."
        if step and step.get("ms")
        else ""
    )
    return (
        table(headings, rows)
        + "\n"
        + serve_breakdown(result)
        + serve_stress(result, labels)
        + f"{s['requests']} requests per rate arriving as a Poisson process, prompts of {low}–{high} random tokens, "
        f"{fewest}–{most} output tokens each (greedy, EOS ignored), streamed over HTTP to one asyncio client on "
        f"the same machine; {model}{served}. TTFT: from sending to the first chunk; TPOT: the time per output "
        f"token after the first; ITL: the gap between two chunks; goodput: the share of requests with TTFT ≤ "
        f"{s['ttft_slo_s']:g} s and TPOT ≤ {1000 * s['tpot_slo_s']:.0f} ms.{offline}{same}\n\n"
        + server_load_lines(result)
    )


def serve_breakdown(result: dict) -> str:
    """Where a token's time goes, where the run measured it: the offline step at 1, 2, 4 rows decoding together,
    and each server's TPOT for requests sent one after another (nothing overlapping), set against the step."""
    steps, alone = result.get("offline_steps_ms"), [x for x in result["servers"] if x.get("tpot_alone_ms")]
    if not steps or not alone:
        return ""
    rows = [
        [
            x["label"],
            f"{x['tpot_alone_ms']:.1f}",
            "–" if not x.get("alone_over_offline_step") else f"{x['alone_over_offline_step']:.2f}×",
        ]
        for x in alone
    ]
    headings = ["server", "TPOT p50, requests one after another (ms)", "/ offline step"]
    together = " / ".join(f"{ms:.1f}" for ms in steps.values())
    return (
        table(headings, rows)
        + f"\nOffline decode step of the same engine with {' / '.join(steps)} requests decoding together: "
        f"**{together} ms**. A server's TPOT alone against the offline step is what the server adds to each "
        "token by itself; its TPOT under arrivals against the steps of several rows is what overlapping "
        "requests add.\n\n"
    )


def serve_stress(result: dict, labels: dict) -> str:
    """The closed-loop stress test, where the run has one: each server's throughput with more clients than it
    batches, every client sending its next request as soon as its last has ended."""
    rows = [
        [
            labels[r["server"]],
            f"{r['completed']} of {r['requests']}",
            f"**{r['request_throughput']:.2f}**",
            f"{r['output_tokens_per_s']:.1f}",
            f"{r['ttft_s']['p50']:.2f}",
            f"{1000 * r['tpot_s']['p50']:.0f}",
            engine_step(r),
        ]
        for r in result.get("stress", [])
    ]
    if not rows:
        return ""
    headings = ["server", "completed", "requests/s", "output tokens/s", "TTFT p50 (s)", "TPOT p50 (ms)"]
    s = result["settings"]
    return (
        table(headings + ["engine step (ms)"], rows)
        + f"\nStress test: {s['clients']} clients, each sending its next request as soon as its last has ended, "
        f"through {s['stress_requests']} requests of the same kinds as the rates' (seeded apart); a server batches "
        f"at most {s['max_num_seqs']} at a time.\n\n"
    )


def server_load_lines(result: dict) -> str:
    """The run line with the load the run recorded, then the share each server saw while it ran: a peer server's
    worker processes (which the benchmark starts but does not reap) count as "other processes" while it runs."""
    seen = [
        f"while {x['label']} ran, {100 * x['other_processes_cpu_share']:.0f} %"
        + (
            ""
            if x["server"].startswith("rosellm")
            else " (its own worker processes, started under it but not reaped by it, included)"
        )
        for x in result.get("servers", [])
        if x.get("other_processes_cpu_share") is not None
    ]
    per_server = f"\n*Other processes' share of the CPU, per server: {'; '.join(seen)}.*\n" if len(seen) > 1 else ""
    return run_line(result) + per_server


def block_cpu_ablation(results: Path, name: str) -> str:
    result = load(results, name)
    s, steps = result["settings"], result["steps"]
    rows = [
        [
            r["label"],
            ", ".join(f"`{k}={v!r}`" for k, v in r["options"].items()) or "defaults",
            f"**{r['output_tokens_per_s']:.1f}**",
            f"{r['speedup']:.2f}×",
            "yes" if r["same_tokens"] else "**no**",
        ]
        for r in steps
    ]
    out = table(["step", "engine options", "output tokens/s", "× chapter 10", "same tokens"], rows) + "\n"
    profiled = [r for r in steps if r.get("profile")]
    parts = [p["part"] for p in profiled[0]["profile"]["parts"]] if profiled else []
    profile_rows = [
        [part.replace("_", " ")]
        + [
            f"{p['ms_per_step']:.1f} ms ({100 * p['share']:.0f} %)"
            for r in profiled
            for p in r["profile"]["parts"]
            if p["part"] == part
        ]
        for part in parts
    ]
    if profiled:
        first = profiled[0]["profile"]
        out += (
            f"Where a step's time goes, from `torch.profiler` recording one step in {first['every']} of a second "
            f"run of the same requests (milliseconds per recorded step, and share of their time):\n\n"
            + table(["part"] + [r["label"] for r in profiled], profile_rows)
            + "\n"
        )
    return (
        out + f"{s['requests']} requests (prompts of {s['prompt_len'][0]}-{s['prompt_len'][1]} tokens, "
        f"{s['max_tokens'][0]}-{s['max_tokens'][1]} new tokens, greedy), `max_num_seqs={s['max_num_seqs']}`, "
        f"`max_num_batched_tokens={s['max_batch_tokens']}`; every step's greedy tokens equal chapter 10's: "
        f"{'yes' if result['correct'] else '**no**'}.\n\n" + run_line(result)
    )


def block_cpu_peers(results: Path, offline_name: str, latency_name: str) -> str:
    offline, latency = load(results, offline_name), load(results, latency_name)
    batch_one = {r["engine"]: r for r in latency["engines"] if "error" not in r}
    rows, done = [], [r for r in offline["engines"] if "error" not in r]
    ours = next(r["output_tokens_per_s"] for r in done if r["engine"] == "rosellm")
    for r in done:
        one = batch_one.get(r["engine"], {})
        rows.append(
            [
                r["label"],
                f"**{r['output_tokens_per_s']:.1f}**",
                f"{ours / r['output_tokens_per_s']:.3f}×",
                f"{100 * r['share_of_roofline_work']:.0f} %",
                f"{one['tpot_ms']['median'] if isinstance(one.get('tpot_ms'), dict) else one.get('tpot_ms', 0):.1f}"
                if one
                else "–",
                f"{100 * one['share_of_bandwidth_roofline']:.0f} %" if one.get("share_of_bandwidth_roofline") else "–",
            ]
        )
    headings = ["engine", "offline-cpu output tok/s", "rosellm is", "of the GEMM rate", "batch-1 ms/token"]
    gemm, bandwidth = offline["roofline"]["gemm_flops"] / 1e9, latency["roofline"]["bandwidth_bytes_per_s"] / 1e9
    return (
        table(headings + ["of the bandwidth roofline"], rows)
        + "\n"
        + f"offline-cpu: {offline['settings']['requests']} requests, all submitted at once; the dense work the "
        f"workload needs per second against the measured GEMM rate ({gemm:.0f} GFLOP/s). latency-cpu: one "
        f"request decoding alone; its decode tokens/s against reading the weights once per token at the measured "
        f"bandwidth ({bandwidth:.0f} GB/s).\n\n" + run_line(offline) + "\n" + run_line(latency)
    )


def block_chapter_row(results: Path, number: str) -> str:
    result = load(results, "chapters.json")
    rows = {row["chapter"]: row for row in result["chapters"]}
    row, first = rows[int(number)], rows[min(rows)]
    s = result["settings"]
    batch = row["options"].get("max_batch_size") or row["options"].get("max_num_seqs")
    speedup = (
        f", {row['output_tokens_per_s'] / first['output_tokens_per_s']:.1f}× chapter {min(rows):02d}"
        if row is not first
        else ""
    )
    threads = result["machine"]["torch_threads"]
    return (
        f"**Across chapters.** On the book's common small workload ({s['requests']} requests, "
        f"{s['max_tokens']} output tokens each{f', a batch of {batch}' if batch else ', one at a time'}) "
        f"this checkpoint makes **{row['output_tokens_per_s']:.1f} output tokens/s{speedup}** "
        f"([Benchmarks · chapters, row {int(number):02d}](../benchmarks.md#ch{int(number):02d}); measured on "
        f"{result['date']}, {threads} thread{'s' if threads != 1 else ''}; "
        f"{load_words(row.get('other_processes_cpu_share'))}).\n"
    )


def block_tensor_parallel(results: Path, name: str) -> str:
    """Measured: gloo all-reduce per message size, and the engine with 1 and N ranks."""
    result = load(results, name)
    runs = result["all_reduce"]
    rows = [
        [str(row["tokens"]), f"{row['bytes'] / 1024:.1f} KiB"]
        + [f"{run['rows'][i]['median_us']:.0f} µs" for run in runs]
        for i, row in enumerate(runs[0]["rows"])
    ]
    out = "**All-reduce on gloo, measured here** (median of each message size; a decode step of SmolLM2 does "
    out += "60 of them per step, each of [tokens in the step, 576] fp32):\n\n"
    out += table(["tokens", "message"] + [f"{run['ranks']} ranks" for run in runs], rows) + "\n"
    rows = []
    for e in result["engines"]:
        share = f"{100 * e['all_reduce_share']:.0f} %" if e["all_reduce"]["calls"] else "—"
        step = f"{e['all_reduce_ms_per_step']:.1f} ms" if e["all_reduce"]["calls"] else "—"
        per_call = f"{e['all_reduce_us_per_call']:.0f} µs" if e["all_reduce"]["calls"] else "—"
        per_token = f"{e['all_reduce_us_per_token']:.0f} µs" if e["all_reduce"]["calls"] else "—"
        rows.append(
            [str(e["ranks"]), f"**{e['output_tokens_per_s']:.1f}**", str(e["steps"]), share, step, per_call, per_token]
            + ["yes" if e["same_tokens"] else "**no**"]
        )
    s = result["settings"]
    out += (
        f"**The engine, measured here** ({s['requests']} requests, prompts of {s['prompt_len'][0]}–"
        f"{s['prompt_len'][1]} tokens, {s['max_tokens'][0]}–{s['max_tokens'][1]} new tokens each, greedy; "
        "the time is rank 0's, inside its all-reduces, waiting for the other ranks included):\n\n"
    )
    headings = ["ranks", "output tokens/s", "steps", "all-reduce share", "per step", "per all-reduce", "per token"]
    return out + table(headings + ["same tokens"], rows) + "\n" + run_line(result)


def block_tensor_parallel_model(results: Path, name: str) -> str:
    """Modelled: bytes per rank and a batch-1 decode step's time on GPUs, from the shapes and stated rates."""
    model = load(results, name)["modelled"]
    gpu = model["gpu"]
    rows = [
        [
            r["model"],
            str(r["ranks"]),
            f"{r['weight_gb_per_rank']:.2f} GB" + ("" if r["fits_one_gpu"] else " (too big)"),
            f"{r['kv_kb_per_token_per_rank']:.1f} KB",
            f"{r['all_reduce_bytes_per_token'] / 1024:.0f} KiB",
            f"{r['weights_ms']:.2f} ms",
            f"{r['nvlink_comm_ms']:.2f} / {r['pcie_comm_ms']:.2f} ms",
            f"{r['nvlink_tokens_per_s']:.0f} / {r['pcie_tokens_per_s']:.0f}",
            f"{r['nvlink_prefill_comm_ms']:.1f} / {r['pcie_prefill_comm_ms']:.1f} ms",
        ]
        for r in model["rows"]
    ]
    headings = ["model", "ranks", "weights per rank", "KV per token per rank", "all-reduced per token"]
    headings += ["batch 1: weights read", "batch 1: all-reduces (NVLink / PCIe)", "batch 1: tokens/s"]
    headings += [f"{model['prefill_tokens']}-token prefill: all-reduces"]
    assumed = (
        f"*Modelled, not measured*: one {gpu['name']} per rank ({gpu['hbm_gb_per_s']} GB/s of memory bandwidth), "
        f"linked by NVLink at {gpu['nvlink_gb_per_s']} GB/s or PCIe at {gpu['pcie_gb_per_s']} GB/s, "
        f"{gpu['all_reduce_latency_us']} µs of fixed cost per all-reduce; a batch-1 decode step reads the rank's "
        "weights once, then does its 2 all-reduces per layer (a ring: each rank sends and receives 2(N−1)/N of "
        "the message); compute, attention and the KV cache are left out; *too big*: over 90 % of one GPU's "
        "memory, no room left for a KV cache. The last column is the all-reduces "
        f"alone of a step of {model['prefill_tokens']} prompt tokens, where the messages are large.\n"
    )
    return table(headings, rows) + "\n" + assumed


def block_batch_one(results: Path, name: str) -> str:
    result = load(results, name)
    rows = []
    for e in sorted((e for e in result["engines"] if "error" not in e), key=lambda e: e["tpot_ms"]):
        if e["check"].get("required", True):
            check = "as transformers'" if e["check"]["passed"] else "**differ from transformers'**"
        elif "agreement_with_fp32" in e:
            check = f"{e['agreement_with_fp32']['equal_token_share']:.0%} of fp32's"
        else:
            check = "– (no fp32 run of this engine)"
        share = e["share_of_bandwidth_roofline"]
        rows.append([e["label"], f"{e['tpot_ms']:.1f}", f"{e['weight_mb_per_token']:.0f}", f"{share:.0%}", check])
    failed = [f"{e['label']} ({e['error']})" for e in result["engines"] if "error" in e]
    headings = ["engine, weights", "ms per token", "MB of weights a token reads", "of its bandwidth bound"]
    return (
        run_line(result)
        + "\n"
        + table(headings + ["greedy tokens"], rows)
        + ("\nNot run: " + "; ".join(failed) + ".\n" if failed else "")
    )


def block_quant_kernels(results: Path, name: str) -> str:
    result = load(results, name)
    columns = sorted({(p["kernel"], p["activation"]) for p in result["per_step"]})
    ms = {(p["kernel"], p["activation"], p["rows"]): p["ms"] for p in result["per_step"]}
    counts = sorted({p["rows"] for p in result["per_step"]})
    rows = [[str(n)] + [f"{ms[(k, a, n)]:.1f}" if (k, a, n) in ms else "–" for k, a in columns] for n in counts]
    headings = ["rows"] + [f"{kernel}, {activation} activations" for kernel, activation in columns]
    return (
        run_line(result)
        + "\nMilliseconds for every linear layer of one step of SmolLM2 (the 30 layers' four projections and the "
        "LM head), each layer a distinct matrix so that its weights come from memory:\n\n" + table(headings, rows)
    )


def block_decode_attention(results: Path, name: str) -> str:
    """quant-kernels' decode attention: the compiled tensor algebra against the C kernel, per dtype and batch."""
    result = load(results, name)
    ms = {(r["dtype"], r["batch"], r["way"]): r for r in result["attention"]}
    rows = []
    for dtype, batch in dict.fromkeys((r["dtype"], r["batch"]) for r in result["attention"]):
        compiled, kernel = ms[dtype, batch, "compiled"], ms[dtype, batch, "C kernel"]
        rows.append(
            [
                dtype,
                str(batch),
                f"{compiled['keys']:,}",
                f"{compiled['ms_per_step']:.1f}",
                f"{kernel['ms_per_step']:.1f}",
            ]
            + [f"{compiled['ms_per_step'] / kernel['ms_per_step']:.1f}×", f"{kernel['gb_per_s']:.1f}"]
        )
    low, high = result["settings"]["attention_context"]
    return (
        run_line(result)
        + f"\nDecode attention, milliseconds for the {result['attention_shape']['layers']} layers of one step, "
        f"sequences of {low} to {high} tokens in blocks of 16:\n\n"
        + table(["dtype", "sequences", "keys", "compiled (ms)", "C kernel (ms)", "C kernel is", "C kernel GB/s"], rows)
    )


SHORT_DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def block_kernel_choice(results: Path, name: str) -> str:
    """quant-kernels from chapter 18 on, at one CPU level: per row count (rows) and weight format on an activation
    dtype (columns), the kernel that takes least time for a step, and the one the checkpoint picks where it is
    another, with how many times the fastest's time it takes."""
    result = load(results, name)
    groups = [(g["weights"], g["activation"]) for g in result["groups"]]
    found = {(c["weights"], c["activation"], c["rows"]): c for c in result["choice"]}

    def cell(choice: dict | None) -> str:
        if choice is None:
            return "–"
        fastest = f"{choice['fastest']}, {choice['fastest_ms']:.1f} ms"
        picked = choice["pick"] == choice["fastest"]
        return fastest + (" ✓" if picked else f"; picks **{choice['pick']}**: {choice['pick_vs_fastest']:.2f}×")

    counts = sorted({c["rows"] for c in result["choice"]})
    rows = [[str(n)] + [cell(found.get((w, a, n))) for w, a in groups] for n in counts]
    headings = ["rows"] + [f"{w} weights, {SHORT_DTYPES[a]} activations" for w, a in groups]
    absent = "".join(f" Not run at this level: {kernel} ({why})." for kernel, why in result["absent"].items())
    return (
        run_line(result)
        + f"\n{cpu_level_words(result['cpu_level'])} The kernel that multiplies every matrix of one step of SmolLM2 "
        "in the least time (ms) at each number of rows, per weight format and activation dtype: ✓ where the "
        "checkpoint picks it, else the kernel it picks and how many times the fastest's time that takes."
        + absent
        + "\n\n"
        + table(headings, rows)
    )


def cpu_level_words(level: dict) -> str:
    """The CPU level a run's C kernels were built for, and PyTorch's own kernels' (which the mask leaves)."""
    where = f"ROSELLM_CPU_FEATURES on a CPU of level {level['native']}" if level["masked"] else "the CPU's own"
    return f"CPU level **{level['level']}** ({where}; PyTorch's own kernels at {level['torch']})."


def block_perplexity(results: Path, name: str) -> str:
    result = load(results, name)
    rows = []
    for r in result["variants"]:
        if r.get("error"):
            rows.append([r["label"], "–", "–", "–", "–", f"not run: {r['error']}"])
            continue
        agreement = r.get("agreement_with_fp32") or {}
        first = agreement.get("share_identical_for_first_k_tokens", {}).get("16")
        rows.append(
            [
                r["label"],
                r["compute_dtype"],
                f"{r['perplexity']:.3f}",
                f"{r['vs_fp32']:.4f}×" if r.get("vs_fp32") else "–",
                "–" if r.get("equal_token_share") is None else f"{r['equal_token_share']:.0%}",
                "–" if first is None else f"{first:.0%}",
            ]
        )
    text = result["text"]
    return (
        run_line(result)
        + f"\nPerplexity on {text['tokens']:,} tokens of `{text['source']}` ({text['windows']} windows of "
        f"{text['window']}, each scored alone); greedy agreement with fp32 on {result['settings']['requests']} "
        "requests of offline-cpu:\n\n"
        + table(
            ["weights", "compute", "perplexity", "of fp32's", "tokens equal to fp32's", "first 16 tokens equal"],
            rows,
        )
    )


def block_speculative(results: Path, name: str) -> str:
    """Each speculation method (and the vLLM peer) per set of requests and batch size."""
    if not (results / name).is_file():
        return f"_Not measured yet: `python -m benchmarks speculative` writes `benchmarks/results/{name}`._\n"
    result = load(results, name)
    rows = []
    for r in result["rows"]:
        batch = "–" if r["batch"] is None else str(r["batch"])
        if "error" in r:
            rows.append([r["set"], batch, r["label"], f"not run: {r['error']}"] + ["–"] * 5)
            continue
        rate, length = r.get("acceptance_rate"), r.get("mean_acceptance_length")
        forward = r.get("tokens_per_target_forward")
        rows.append(
            [
                r["set"],
                batch,
                r["label"],
                f"**{r['output_tokens_per_s']:.1f}**",
                f"{r['speedup']:.2f}×" if r.get("speedup") else "–",
                "–" if forward is None else f"{forward:.2f}",
                "–" if rate is None else f"{rate:.0%}",
                "–" if length is None else f"{length:.2f}",
                "yes" if r["identical"] else "**no**",
            ]
        )
    s = result["settings"]
    headings = ["prompts", "batch", "speculation", "output tokens/s", "× no speculation", "tokens per target forward"]
    headings += ["acceptance rate", "mean acceptance length", "same tokens as no speculation"]
    return (
        run_line(result)
        + f"\n{s['requests']} requests a set, {s['max_tokens']} tokens each (greedy, EOS ignored). "
        + speculative_sets(s)
        + " Batch 1 runs the requests one at a time; a larger batch, that many in one `generate`.\n\n"
        + table(headings, rows)
    )


SPECULATIVE_SETS = {
    "copy": 'a paragraph of `pydoc_data/topics.py` followed by "The same text, copied exactly:", and a function of '
    "the standard library followed by a comment announcing it with `x` renamed to `value`, as plain text to "
    "continue",
    "chat": 'the paragraphs in a chat turn that asks "Repeat this text exactly:", with the chat template',
    "random": "offline-cpu's random prompts",
}


def speculative_sets(s: dict) -> str:
    """What a speculative result's sets of prompts and its methods are, in a few sentences."""
    sets = "; ".join(f"*{name}*: {SPECULATIVE_SETS[name]}" for name in s.get("sets", ["copy", "random"]))
    methods = s.get("methods", ["none", "ngram", "draft_model"])
    ngram = f"n-gram: k = {s['num_speculative_tokens']}, lookup of {s['prompt_lookup_min']} to "
    ngram += f"{s['prompt_lookup_max']} tokens"
    if "ngram-fixed" in methods:
        ngram += " (*n-gram*: each sequence asks for as many drafts as its last verify step earned; *k every step*: k)"
    draft = "the model itself" if s["draft_quantization"] == "none" else f"the same model in {s['draft_quantization']}"
    more = f"; draft model: {draft}, k = {s['draft_tokens']}" if "draft_model" in methods else ""
    return f"{sets}. {ngram}{more}."


def block_structured(results: Path, name: str) -> str:
    """Chapter 15: each batch's decode step unconstrained, constrained and mixed, the grammar's share; compile
    times per schema; vLLM's speed beside rosellm's when it ran."""
    if not (results / name).is_file():
        return f"_Not measured yet: `python -m benchmarks structured` writes `benchmarks/results/{name}`._\n"
    result = load(results, name)

    def ms(value, digits: int = 2) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    rows = []
    for r in result["steps"]:
        overhead = r.get("overhead_pct")
        rows.append(
            [
                str(r["batch"]),
                r["constrained"],
                str(r["full_steps"]),
                f"**{ms(r['step_ms'])}**",
                ms(r["mask_ms"], 3),
                ms(r["accept_ms"], 3),
                "–" if r["grammar_share"] is None else f"{r['grammar_share']:.1%}",
                "–" if overhead is None or r["constrained"] == "none" else f"{overhead:+.1f}%",
                {True: "yes", False: "**no**"}.get(r.get("identical"), "–"),
            ]
        )
    headings = ["batch", "constrained", "full steps", "step ms", "mask ms", "accept ms", "grammar share"]
    headings += ["overhead", "unconstrained rows' tokens unchanged"]
    compiled = [[c["schema"], f"{c['cold_ms']:.1f}", f"{c['cached_ms']:.3f}"] for c in result["compile"]]
    s = result["settings"]
    text = (
        run_line(result)
        + f"\n{len(result['schemas'])} JSON schemas, greedy, at most {s['max_tokens']} tokens a request, EOS "
        "honoured; at each batch size its requests added at once. Medians over the decode steps with every "
        "request still running; *mask*: the bitmask filled and applied, *accept*: the grammar states moved "
        "past the committed tokens.\n\n"
        + table(headings, rows)
        + f"\nCompiling (the tokenizer's vocabulary analysed first, once: "
        f"{result['tokenizer_analysis_ms']:.0f} ms):\n\n" + table(["schema", "cold ms", "cached ms"], compiled)
    )
    ours = {(r["batch"], r["constrained"]): r for r in result["steps"]}
    for peer in result.get("peers", {}).values():
        label = peer.get("label", "peer")
        headings = [
            "batch",
            "constrained",
            "output tokens",
            "rosellm tokens/s",
            f"{label.split(' (')[0]} tokens/s",
            "same tokens",
        ]
        text += (
            f"\n{label}, the same requests (tokens/s over the whole run, prefill included: a constrained answer "
            "is shorter, so its run spends a larger share in prefill):\n\n"
            + table(headings, peer_structured_rows(peer, ours))
        )
    return text


def peer_structured_rows(peer: dict, ours: dict) -> list[list[str]]:
    """A peer's runs of the structured workload beside rosellm's: batch, constrained, output tokens, both
    engines' output tok/s, whether the peer's tokens equal rosellm's (or why it did not run)."""
    rows = []
    for r in peer["rows"]:
        mine = ours[r["batch"], r["constrained"]]
        head = [str(r["batch"]), r["constrained"], str(mine["output_tokens"]), f"{mine['output_tokens_per_s']:.1f}"]
        if "error" in r:
            rows.append(head + [f"not run: {r['error']}", "–"])
            continue
        agreement = r.get("agreement", {})
        same = "yes" if agreement.get("equal_token_share") == 1.0 else f"{agreement.get('equal_token_share', 0):.0%}"
        rows.append(head + [f"{r['output_tokens_per_s']:.1f}", same])
    return rows


BLOCKS = {
    "run": block_run,
    "decode-scaling": block_decode_scaling,
    "decode-scaling-pair": block_decode_scaling_pair,
    "batch-throughput": block_batch_throughput,
    "arrivals": block_arrivals,
    "long-prompts": block_long_prompts,
    "prefix": block_prefix,
    "serve": block_serve,
    "cpu-ablation": block_cpu_ablation,
    "cpu-peers": block_cpu_peers,
    "tensor-parallel": block_tensor_parallel,
    "tensor-parallel-model": block_tensor_parallel_model,
    "chapter-row": block_chapter_row,
    "batch-one": block_batch_one,
    "quant-kernels": block_quant_kernels,
    "decode-attention": block_decode_attention,
    "kernel-choice": block_kernel_choice,
    "perplexity": block_perplexity,
    "speculative": block_speculative,
    "structured": block_structured,
}
