"""serve: the OpenAI server under Poisson arrivals, as its clients feel it.

Chapter 10's server (`python -m chapters.ch10_serving.rosellm serve`) starts in a process group of its own on a
free localhost port; once `/health` answers, one asyncio client (httpx) sends it, for each arrival rate,
`requests` streamed `/v1/completions` at Poisson arrival times (exponential gaps, seeded): prompts of random
token ids (lengths uniform in `prompt_len`), `max_tokens` uniform in `max_tokens`, greedy, `ignore_eos`,
`stream_options.include_usage` for the token count. Each rate gets requests of its own (the same ones for every
server), so that no prompt is ever seen twice and prefix caching, on in both servers, finds nothing. Every chunk
is timestamped when its line arrives.

Per rate and server: TTFT (send -> first chunk), TPOT ((last chunk - first chunk) / (tokens - 1)) and the
inter-token latency (every gap between two chunks of a request) at p50/p90/p99; end-to-end latency; request
throughput and output tokens/s over the run (first send to last chunk); goodput: the requests that met both
`ttft_slo_s` and `tpot_slo_s`, as a share of all and per second.

The targets: TTFT <= 2 s, a reply that starts within two seconds still feels responsive (one 256-token prompt's
prefill alone takes a fraction of that here: what breaks it is queueing); TPOT <= 0.2 s, 5 tokens/s, about the
pace of silent reading (~240 words/min at ~1.3 tokens a word): slower, and the reader waits on the text.
The rates: SmolLM2-135M in fp32 on 2 cores decodes ~14 tokens/s alone (a ~70 ms step) and ~65 tokens/s at
best in a large batch; a request asks 40 tokens on average, so 0.25 and 0.5 requests/s leave the server mostly
idle, 1/s keeps a handful of requests decoding together near the TPOT target, and 2/s (80 tokens/s asked) is
past what it can make: the queue, and TTFT with it, grows for as long as requests keep coming.

With `--peers vllm`, vLLM's OpenAI server (its CPU build, in its own virtual environment, on the fp32 Hugging Face
folder of the same weights, with the batching limits rosellm's server runs under) gets the same schedule from
the same client. Each server is stopped (its whole process group) before the next starts, whatever happens.

`--rosellm` picks which of rosellm's servers run, each a server of its own in the result: `ch10` (the default:
chapter 10's checkpoint), and the latest package's three arrangements of chapter 16, `in-process` (the engine
in a thread of the server's process, as in chapter 10), `split` (the default server: a front end and an
engine-core process) and `dp2` (two engine cores, which share the threads between them). Every server gets the
same threads, schedule and client. With any of the latest forms, the latest `LLMEngine` first runs one request
offline in a process of its own (a prompt of the middle length, the longest `max_tokens`, greedy, after a
warm-up request): its time per output token after the first is the decode step a server's TPOT is set
against (`offline_step_ms`; each row's `tpot_over_offline_step`); then 2 and 4 such requests together, the
step of the rows that overlapping requests decode together (`offline_steps_ms`). Every server, before the
rates, also serves a few requests one after another, none overlapping (`tpot_alone_ms`): set against the
offline step, what the server itself adds to each token. Without `--json` and `--figure`, such a run writes
results/serve_ch16.json and figures/ch16_serve.png, whose figure is the inter-token latency per server.

`--clients N` adds a stress test after the rates: N clients, each sending its next request as soon as its last
one has ended (a closed loop, no arrival schedule), until `stress_requests` requests (of the same kind, seeded
apart) are served: the most each server gets through when it is never idle, with N more than it batches.

    python -m benchmarks serve [--rosellm ch10,in-process,split,dp2] [--peers vllm] [--rates 0.5,1,2]
                               [--clients 64] [--quick]
"""

import asyncio
import functools
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import chapters

from . import harness, peers

NAME = "serve"
HELP = "chapter 10's OpenAI server under Poisson arrivals: TTFT, TPOT, ITL, goodput (and --peers vllm)"
CHAPTER = 10

# --rosellm form: (server name, what it is, the latest package's `serve` options); ch10 runs chapter 10's checkpoint
FORMS = {
    "ch10": ("rosellm", "", []),
    "in-process": ("rosellm-in-process", "in-process: the engine in the server's process", ["--in-process"]),
    "split": ("rosellm-split", "split: front end + 1 engine core", []),
    "dp2": ("rosellm-dp2", "dp2: front end + 2 engine cores", ["--data-parallel-size", "2"]),
}

FULL = {"rates": [0.25, 0.5, 1.0, 2.0], "requests": 32, "prompt_len": [32, 256], "max_tokens": [16, 64], "seed": 0}
FULL |= {"ttft_slo_s": 2.0, "tpot_slo_s": 0.2, "max_num_seqs": 32, "warmup": 2, "alone": 4, "offline_rows": [1, 2, 4]}
FULL |= {"stress_requests": 128}
QUICK = {"rates": [4.0, 16.0], "requests": 6, "prompt_len": [8, 24], "max_tokens": [3, 8], "warmup": 1, "alone": 1}
QUICK |= {"offline_rows": [1], "stress_requests": 6}

MODEL_NAME = "bench"  # the name both servers serve the model under
STEP_TOKENS = 2048  # rosellm's step budget with chunked prefill (its server's default), given to vLLM too
VLLM_MEMORY_SHARE = 0.25  # vLLM's `gpu_memory_utilization`; on its CPU build, the share of memory for the KV cache
START_TIMEOUT_S = 900  # vLLM compiles its kernels for a minute or two before it answers
REQUEST_TIMEOUT_S = 600  # a request queued behind an overloaded server still waits this long for a chunk
NOTES = [
    "TTFT: from the request's send to its first chunk. TPOT: (last chunk - first chunk) / (tokens - 1), tokens "
    "from the usage chunk. ITL: every gap between two chunks of a request (a chunk may carry more than one "
    "token when text is held back or a slow client reads two steps at once).",
    "Throughput: completed requests and output tokens over the run, from the first send to the last chunk. "
    "Goodput: the requests that met both targets (TTFT and TPOT), as a share of all and per second of the run.",
    "The client runs on the same CPU as the server: its share of the cores is part of what is measured.",
]
COLUMNS = {"server": "server", "rate": "req/s in", "done": "done", "ttft_p50": "TTFT p50 s", "ttft_p90": "p90"}
COLUMNS |= {"ttft_p99": "p99", "tpot_p50": "TPOT p50 ms", "tpot_p90": "p90", "itl_p99": "ITL p99 ms"}
COLUMNS |= {"request_throughput": "req/s out", "output_tokens_per_s": "tok/s", "goodput_pct": "goodput %"}
STEP_COLUMNS = {"tpot_over_offline_step": "TPOT p50 / offline step", "engine_step_ms": "engine step ms"}
STRESS_COLUMNS = {"server": "server", "done": "done", "request_throughput": "req/s", "output_tokens_per_s": "tok/s"}
STRESS_COLUMNS |= {"ttft_p50": "TTFT p50 s", "tpot_p50": "TPOT p50 ms", "engine_step_ms": "engine step ms"}


def add_arguments(parser) -> None:
    parser.add_argument("--peers", default="", help="also serve with these peers: vllm")
    parser.add_argument(
        "--rosellm",
        default="ch10",
        help="rosellm's servers, comma-separated: ch10 (chapter 10's checkpoint), in-process, split, dp2 (the "
        "latest package's server: engine in its process, one engine core, two engine cores)",
    )
    parser.add_argument(
        "--clients", type=int, default=0, help="after the rates, this many clients in a closed loop (0: none)"
    )


def run(args, s: dict) -> dict:
    if args.clients < 0:
        raise SystemExit(f"serve: --clients {args.clients}: a number of clients, 0 for no stress test")
    chosen = peers.named(args.peers)
    if any(peer.name != "vllm" for peer in chosen):
        raise SystemExit("serve: of the peers, only vllm's OpenAI server is measured")
    forms = rosellm_forms(args.rosellm)
    for peer in chosen:
        peers.install(peer)
    wrong = "a rosellm server did not complete every request (see 'servers' and 'runs')"
    name, figure = ("serve", "ch10_serve") if forms == ["ch10"] else ("serve_ch16", "ch16_serve")
    measuring = lambda: measure(args, s, forms, chosen)  # noqa: E731
    return harness.save(args, NAME, measuring, name, plot, figure, report, wrong)


def rosellm_forms(text: str) -> list[str]:
    forms = list(dict.fromkeys(form for form in text.split(",") if form))
    unknown = [form for form in forms if form not in FORMS]
    if unknown or not forms:
        raise SystemExit(f"serve: --rosellm {text}: the forms are {', '.join(FORMS)}")
    return forms


# --- the workload: requests and their arrival times --------------------------------------------------------


def schedules(s: dict, vocab_size: int) -> list[tuple[float, list[tuple], list[float]]]:
    """(rate, requests, arrival seconds) per rate: requests of its own (seeded), Poisson arrivals from t = 0."""
    out = []
    for k, rate in enumerate(s["rates"]):
        seed = s["seed"] + 1000 * (k + 1)
        requests = harness.random_requests(s["requests"], s["prompt_len"], s["max_tokens"], vocab_size, seed)
        rng, arrivals = random.Random(seed), [0.0]
        while len(arrivals) < len(requests):
            arrivals.append(arrivals[-1] + rng.expovariate(rate))
        out.append((rate, requests, arrivals))
    return out


# --- the servers: a process group each, stopped whatever happens ------------------------------------------------


class ServerError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server process in a new session (its own process group), its output in a log file. Entering starts
    it and waits for `/health`; leaving stops the whole group: Ctrl-C (SIGINT), then SIGKILL after 30 s."""

    def __init__(self, name: str, argv: list[str], env: dict, port: int, log_dir: Path):
        self.name, self.argv, self.env, self.port = name, argv, env, port
        self.url, self.log_path, self.process = f"http://127.0.0.1:{port}", log_dir / f"{name}.log", None

    def __enter__(self):
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.argv, cwd=harness.ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def wait_ready(self) -> None:
        import httpx

        start = time.perf_counter()
        while time.perf_counter() - start < START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise ServerError(f"{self.name} exited with status {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    self.load_s = round(time.perf_counter() - start, 1)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerError(f"{self.name} did not answer /health within {START_TIMEOUT_S} s: {self.log_tail()}")

    def stop(self) -> None:
        """Stop the whole process group (the server and whatever it started) and reap the server."""
        if self.process is None:
            return
        group = self.process.pid  # the leader of a new session: its pid is the group's id
        if self.process.poll() is None:
            signal_group(group, signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                signal_group(group, signal.SIGKILL)
                self.process.wait()
        signal_group(group, signal.SIGKILL)  # anything of the group still there (worker processes)

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except (ProcessLookupError, PermissionError):
        pass  # nobody left in the group


def rosellm_environment(args) -> dict:
    """The repository first on the import path; with --threads, OMP_NUM_THREADS (torch's default follows it)."""
    env = harness.python_environment()
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def rosellm_server(args, s: dict, form: str, longest: int, log_dir: Path) -> tuple[Server, dict]:
    """One of rosellm's servers: ch10 is chapter 10's checkpoint (its own command line), whatever chapter is the
    latest; the other forms are the latest package's server, arranged as `FORMS` says."""
    name, what, options = FORMS[form]
    port, point = free_port(), chapters.checkpoint(CHAPTER) if form == "ch10" else chapters.latest()
    argv = [sys.executable, "-m", point.module, "serve", "--host", "127.0.0.1", "--port", str(port)] + options
    argv += ["--served-model-name", MODEL_NAME, "--max-num-seqs", str(s["max_num_seqs"])]
    argv += ["--max-model-len", str(longest + 1)] + (["--model", args.model] if args.model else [])
    env = rosellm_environment(args)
    label = harness.rosellm_label(point) if form == "ch10" else f"rosellm (ch{point.number:02d}, {what})"
    info = dict(label=label, form=form, version=f"chapter {point.number:02d}", argv=argv[1:])
    info |= {"environment": {"OMP_NUM_THREADS": env["OMP_NUM_THREADS"]} if args.threads else {}}
    return Server(name, argv, env, port, log_dir), info


def offline_step(args, s: dict, vocab: int, longest: int, rows: int = 1) -> dict:
    """The latest `LLMEngine`'s decode step of `rows` rows, offline, in a process of its own with the servers'
    threads and options: `rows` requests together (prompts of the middle length, the longest `max_tokens`) after
    a warm-up one; the median over them of the time per output token after the first."""
    prompt_len, tokens = sum(s["prompt_len"]) // 2, s["max_tokens"][1]
    request = harness.random_requests(rows, [prompt_len] * 2, [tokens] * 2, vocab, s["seed"] + 2)
    warmup = harness.random_requests(1, [prompt_len] * 2, [tokens] * 2, vocab, s["seed"] + 3)
    options = dict(max_num_seqs=s["max_num_seqs"], max_model_len=max(longest, prompt_len + tokens) + 1)
    spec = dict(model=args.model, threads=args.threads, requests=request, warmup=warmup, engine_options=options)
    argv = [sys.executable, "-m", "benchmarks.engines", "rosellm"]
    label = f"{harness.rosellm_label(chapters.latest(), short=True)} offline, {rows} request(s) together"
    done = harness.run_process(argv, spec, label, rosellm_environment(args))
    out = dict(rows=rows, prompt_len=prompt_len, max_tokens=tokens, engine_options=options)
    if "error" in done:
        return out | {"error": done["error"], "ms": None}
    times = zip(done["first_token_s"], done["last_token_s"], done["tokens"])
    ms = harness.percentile([1000 * (last - first) / (len(ids) - 1) for first, last, ids in times], 50)
    return out | dict(
        ms=round(ms, 3), load_s=done["load_s"], other_processes_cpu_share=done["other_processes_cpu_share"]
    )


def vllm_server(args, s: dict, peer, longest: int, log_dir: Path) -> tuple[Server, dict]:
    """vLLM's OpenAI server with the environment and batching limits its offline peer runs under."""
    port, threads = free_port(), args.threads or len(os.sched_getaffinity(0))
    argv = [
        str(peer.interpreter),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        peers.weights(peer, args.model),
    ]
    argv += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"]
    argv += ["--seed", "0", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    limits = dict(max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=STEP_TOKENS, max_model_len=longest + 1)
    for key, value in (limits | {"gpu_memory_utilization": VLLM_MEMORY_SHARE}).items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    env = peers.environment(peer, threads)
    shown = {key: value for key, value in env.items() if key.startswith("VLLM_") or key == "LD_PRELOAD"}
    info = dict(label=peer.label, argv=argv[1:], environment={"python": str(peer.interpreter), **shown})
    return Server(peer.name, argv, env, port, log_dir), info


# --- the client ----------------------------------------------------------------------------------------------


async def one_request(client, url: str, prompt: list[int], max_tokens: int, at: float, t0: float) -> dict:
    """Send at t0 + at; the times (from t0) of every chunk that carries a choice, and the usage's token count."""
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stream=True)
    body["stream_options"] = {"include_usage": True}
    sent, chunks, tokens, error, text = time.perf_counter() - t0, [], None, None, ""
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {(await response.aread())[:300].decode(errors='replace')}"
            else:
                async for line in response.aiter_lines():
                    now = time.perf_counter() - t0
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = str(chunk["error"].get("message", chunk["error"]))
                    if chunk.get("choices"):
                        chunks.append(now)
                        text += chunk["choices"][0].get("text") or ""
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
    except Exception as failure:  # the connection, the JSON: the request fails, the run goes on
        error = f"{type(failure).__name__}: {failure}"
    if error is None and (not chunks or tokens != max_tokens):
        error = f"{tokens} tokens in {len(chunks)} chunks, {max_tokens} asked"
    out = dict(prompt_len=len(prompt), max_tokens=max_tokens, sent=sent, chunks=chunks, tokens=tokens, error=error)
    return out | {"text": text}


async def send_all(url: str, requests: list[tuple], arrivals: list[float]) -> list[dict]:
    import httpx

    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.perf_counter() + 0.05  # every task is waiting before the first send
        tasks = [one_request(client, url, p, m, at, t0) for (p, m), at in zip(requests, arrivals)]
        return await asyncio.gather(*tasks)


async def closed_loop(url: str, requests: list[tuple], clients: int) -> list[dict]:
    """`clients` clients, each sending the next of `requests` as soon as its last one has ended, until none is
    left; every request's times from the first send."""
    import httpx

    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30)
    upcoming = iter(requests)  # shared: each client takes the next one

    async def one_client(client, t0: float) -> list[dict]:
        return [await one_request(client, url, prompt, tokens, 0.0, t0) for prompt, tokens in upcoming]

    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one_client(client, t0) for _ in range(clients)))
    return [request for mine in done for request in mine]


def percentiles(values: list[float], digits: int = 6) -> dict:
    return {f"p{q}": None if not values else round(harness.percentile(values, q), digits) for q in (50, 90, 99)}


def summarize(done: list[dict], rate: float, s: dict) -> dict:
    """One rate's row: latency percentiles, throughput and goodput over the requests that completed."""
    ok = [r for r in done if r["error"] is None]
    ttft = [r["chunks"][0] - r["sent"] for r in ok]
    tpot = [(r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    e2e = [r["chunks"][-1] - r["sent"] for r in ok]
    good = [
        r
        for r in ok
        if r["chunks"][0] - r["sent"] <= s["ttft_slo_s"]
        and (r["tokens"] < 2 or (r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) <= s["tpot_slo_s"])
    ]
    ends = [r["chunks"][-1] for r in done if r["chunks"]]
    duration = max(ends) if ends else None  # from t0, the first send
    tokens = sum(r["tokens"] for r in ok)
    last_arrival = max(r["sent"] for r in done)
    row = dict(rate=rate, requests=len(done), completed=len(ok), failed=len(done) - len(ok))
    row |= dict(offered_rate=round((len(done) - 1) / last_arrival, 3) if last_arrival > 0 else None)
    row |= dict(
        duration_s=duration and round(duration, 2), output_tokens=tokens, chunks=sum(len(r["chunks"]) for r in ok)
    )
    row |= dict(ttft_s=percentiles(ttft), tpot_s=percentiles(tpot), itl_s=percentiles(itl), e2e_s=percentiles(e2e))
    row |= dict(request_throughput=duration and round(len(ok) / duration, 3))
    row |= dict(output_tokens_per_s=duration and round(tokens / duration, 2))
    row |= dict(goodput=round(len(good) / len(done), 3), goodput_rps=duration and round(len(good) / duration, 3))
    errors = sorted({r["error"] for r in done if r["error"]})
    details = [
        dict(
            prompt_len=r["prompt_len"],
            max_tokens=r["max_tokens"],
            sent_s=round(r["sent"], 4),
            ttft_s=r["chunks"] and round(r["chunks"][0] - r["sent"], 4),
            last_chunk_s=r["chunks"] and round(r["chunks"][-1], 4),
            tokens=r["tokens"],
            chunks=len(r["chunks"]),
        )
        for r in done
    ]
    texts = [r["text"] if r["error"] is None else None for r in done]  # compared across servers, then dropped
    return row | ({"errors": errors[:5]} if errors else {}) | {"request_details": details, "texts": texts}


def serve_schedule(server: Server, info: dict, work: list, warmup: list, alone: list, s: dict) -> tuple[dict, list]:
    """Warm the server up (requests one at a time), time `alone` one after another, then each rate's schedule:
    the median TPOT alone, and a row per rate."""
    rows = []
    warm = asyncio.run(send_all(server.url, warmup, [4.0 * i for i in range(len(warmup))]))
    if any(r["error"] for r in warm):
        raise ServerError(f"{server.name}'s warm-up failed: {sorted({r['error'] for r in warm if r['error']})}")
    print(f"{server.name}: {len(alone)} requests one after another", flush=True)
    served = summarize([asyncio.run(send_all(server.url, [request], [0.0]))[0] for request in alone], 0.0, s)
    tpot = served["tpot_s"]["p50"]
    by_itself = {"tpot_alone_ms": tpot and round(1000 * tpot, 3), "alone_failed": served["failed"]}
    for rate, requests, arrivals in work:
        print(f"{server.name}: {len(requests)} requests at {rate:g}/s", flush=True)
        before = engine_steps(server)
        done = asyncio.run(send_all(server.url, requests, arrivals))
        row = {"server": server.name, "label": info["label"]} | summarize(done, rate, s)
        rows.append(row | mean_step(before, engine_steps(server)))
    return by_itself, rows


def stress(server: Server, info: dict, stress_work: tuple[int, list], s: dict) -> dict:
    """The closed-loop stress test's row: `clients` clients through the requests of `stress_work`."""
    clients, requests = stress_work
    print(f"{server.name}: {len(requests)} requests from {clients} clients in a closed loop", flush=True)
    before = engine_steps(server)
    done = asyncio.run(closed_loop(server.url, requests, clients))
    row = {"server": server.name, "label": info["label"], "clients": clients} | summarize(done, None, s)
    del row["rate"], row["offered_rate"], row["texts"]
    return row | mean_step(before, engine_steps(server))


def engine_steps(server: Server) -> tuple[float, float] | None:
    """(seconds, steps) of the engine's steps so far, from the server's `rosellm:engine_step_seconds`
    histogram (chapter 16's servers time each step where it runs); None where the server has no such metric."""
    import httpx

    try:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("rosellm:engine_step_seconds_"))
    if "rosellm:engine_step_seconds_sum" not in values:
        return None
    return float(values["rosellm:engine_step_seconds_sum"]), float(values["rosellm:engine_step_seconds_count"])


def mean_step(before: tuple[float, float] | None, after: tuple[float, float] | None) -> dict:
    """The mean engine step during one rate's schedule, in ms, as the server timed it (nothing if it does not)."""
    if before is None or after is None or after[1] <= before[1]:
        return {}
    return {"engine_step_ms": round(1000 * (after[0] - before[0]) / (after[1] - before[1]), 3)}


def measure(args, s: dict, forms: list[str], chosen: list) -> dict:
    vocab = harness.model_config(args.model).vocab_size
    work = schedules(s, vocab)
    warmup = harness.random_requests(s["warmup"], [8, 16], [4, 4], vocab, s["seed"] + 1)
    alone = harness.random_requests(
        s["alone"], [sum(s["prompt_len"]) // 2] * 2, [s["max_tokens"][1]] * 2, vocab, s["seed"] + 4
    )
    stressing = (
        harness.random_requests(s["stress_requests"], s["prompt_len"], s["max_tokens"], vocab, s["seed"] + 5000)
        if args.clients
        else []
    )
    stress_work = (args.clients, stressing) if args.clients else None
    longest = max(len(p) + m for _, requests, _ in work for p, m in requests + warmup + alone + stressing)
    steps = [offline_step(args, s, vocab, longest, rows) for rows in s["offline_rows"]] if forms != ["ch10"] else []
    step = steps[0] if steps else None
    servers, runs, stresses = [], [], []
    with tempfile.TemporaryDirectory(prefix="rosellm-serve-") as tmp:
        # each server is made (its port picked) only when the one before it has stopped
        makers = [functools.partial(rosellm_server, args, s, form, longest, Path(tmp)) for form in forms]
        makers += [functools.partial(vllm_server, args, s, peer, longest, Path(tmp)) for peer in chosen]
        for make in makers:
            servers.append(measure_server(*make(), work, warmup, alone, s, runs, stress_work, stresses))
    agreement = same_texts(runs)
    ours = {FORMS[form][0] for form in forms}
    correct = all(
        [r["rate"] for r in runs if r["server"] == name] == s["rates"]
        and all(r["failed"] == 0 for r in runs + stresses if r["server"] == name)
        and (not stress_work or any(r["server"] == name for r in stresses))
        for name in ours
    )
    named = dict(rosellm=forms, peers=[p.name for p in chosen], threads=args.threads, step_tokens=STEP_TOKENS)
    named |= {"clients": args.clients}
    out = dict(settings=s | named | {"model_name": MODEL_NAME}, servers=servers, runs=runs)
    out |= {"stress": stresses} if stress_work else {}
    if step is not None:
        for r in runs:
            r["tpot_over_offline_step"] = (
                step["ms"] and r["tpot_s"]["p50"] and round(1000 * r["tpot_s"]["p50"] / step["ms"], 3)
            )
        out |= {"offline_step_ms": step["ms"], "offline_step": step}
        out |= {"offline_steps_ms": {str(one["rows"]): one["ms"] for one in steps}}
        for server in servers:
            alone_ms = server.get("tpot_alone_ms")
            server["alone_over_offline_step"] = alone_ms and step["ms"] and round(alone_ms / step["ms"], 3)
    return out | dict(agreement=agreement, notes=NOTES, correct=correct)


def same_texts(runs: list[dict]) -> dict:
    """Per server and rate: how many requests got the very same greedy text from the first server and from it
    (a peer runs fp32 too, but not the same kernels: a near tie may tip either way; rosellm's forms run the same
    engine, in batches made differently). Takes the texts out of the rows."""
    texts = {(r["server"], r["rate"]): r.pop("texts") for r in runs}
    first = runs[0]["server"] if runs else None
    out = {}
    for (server, rate), theirs in texts.items():
        ours = texts.get((first, rate))
        if server != first and ours is not None:
            same = sum(a is not None and a == b for a, b in zip(ours, theirs))
            out.setdefault(f"{first} vs {server}", []).append({"rate": rate, "identical": same, "requests": len(ours)})
    return out


def measure_server(
    server: Server, info: dict, work: list, warmup: list, alone: list, s: dict, runs: list, stress_work, stresses
) -> dict:
    """Start the server, run every rate's schedule (rows appended to `runs`) and the stress test if there is one
    (its row to `stresses`), stop it; what it was and did."""
    print(f"--- {info['label']}: starting its server on port {server.port}", flush=True)
    record = {"server": server.name} | info
    try:
        # the server stops (and is reaped) before the load is sampled: its CPU time is then this process's own
        with harness.OtherLoad() as other, server:
            record |= dict(pid=server.process.pid, load_s=server.load_s)
            if not server.name.startswith("rosellm"):
                record["version"] = server_version(server)
            by_itself, rows = serve_schedule(server, info, work, warmup, alone, s)
            record |= by_itself
            runs += rows
            if stress_work:
                stresses.append(stress(server, info, stress_work, s))
    except ServerError as error:
        record["error"] = str(error)
        print(f"{server.name}: {error}", file=sys.stderr, flush=True)
    else:
        record["other_processes_cpu_share"] = other.share
    process = server.process
    return record | dict(pid=process and process.pid, exit_status=process and process.returncode)


def server_version(server: Server) -> str | None:
    import httpx

    try:
        return httpx.get(f"{server.url}/version", timeout=10).json().get("version")
    except (httpx.HTTPError, ValueError):
        return None


# --- report and figure -----------------------------------------------------------------------------------------


def table_rows(result: dict) -> list[dict]:
    rows = []
    for r in result["runs"]:
        row = dict(server=r["server"], rate=f"{r['rate']:g}", done=f"{r['completed']}/{r['requests']}")
        row |= {f"ttft_{q}": r["ttft_s"][q] for q in ("p50", "p90", "p99")}
        row |= {f"tpot_{q}": r["tpot_s"][q] and 1000 * r["tpot_s"][q] for q in ("p50", "p90")}
        row |= dict(itl_p99=r["itl_s"]["p99"] and 1000 * r["itl_s"]["p99"], goodput_pct=100 * r["goodput"])
        keys = ("request_throughput", "output_tokens_per_s", "tpot_over_offline_step", "engine_step_ms")
        row |= {key: r.get(key) for key in keys}
        rows.append(row)
    return rows


def stress_rows(result: dict) -> list[dict]:
    rows = []
    for r in result.get("stress", []):
        row = dict(server=r["server"], done=f"{r['completed']}/{r['requests']}", ttft_p50=r["ttft_s"]["p50"])
        row |= dict(tpot_p50=r["tpot_s"]["p50"] and 1000 * r["tpot_s"]["p50"])
        rows.append(row | {key: r.get(key) for key in ("request_throughput", "output_tokens_per_s", "engine_step_ms")})
    return rows


def report(result: dict) -> None:
    s = result["settings"]
    print(f"\nserve: goodput targets TTFT <= {s['ttft_slo_s']} s and TPOT <= {s['tpot_slo_s']} s")
    step = result.get("offline_step")
    harness.print_table(table_rows(result), COLUMNS | (STEP_COLUMNS if step else {}))
    if result.get("stress"):
        print(f"\nstress: {s['clients']} clients in a closed loop through {s['stress_requests']} requests")
        harness.print_table(stress_rows(result), STRESS_COLUMNS)
    if step:
        ms = "failed: " + step["error"] if step.get("error") else f"{step['ms']:.1f} ms"
        print(f"offline decode step, batch 1 ({step['prompt_len']}-token prompt, {step['max_tokens']} tokens): {ms}")
        steps = ", ".join(f"{rows} rows {ms} ms" for rows, ms in result["offline_steps_ms"].items())
        print(f"offline decode steps: {steps}")
    for server in result["servers"]:
        if "error" in server:
            print(f"{server['server']}: {server['error']}")
        elif server.get("tpot_alone_ms"):
            ratio = server.get("alone_over_offline_step")
            print(
                f"{server['server']}: TPOT p50 of requests one after another {server['tpot_alone_ms']:.1f} ms"
                + (f" ({ratio:.2f}x the offline step)" if ratio else "")
            )
    for pair, rates in result["agreement"].items():
        same = ", ".join(f"{r['identical']}/{r['requests']} at {r['rate']:g}/s" for r in rates)
        print(f"{pair}: identical greedy texts {same}")


def number(value) -> float:
    """A value to draw: a missing one (no request completed) is not drawn."""
    return math.nan if value is None else value


def plain_log_labels(ax) -> None:
    """A log y axis labelled 0.5, 2, 300 rather than 5 x 10^-1; its 2s, 3s and 5s too when it spans little."""
    from matplotlib.ticker import FuncFormatter

    low, high = ax.get_ylim()
    narrow = high / low < 30

    def minor(value, _) -> str:
        return f"{value:g}" if narrow and f"{value:.0e}"[0] in "235" else ""

    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def plot(result: dict, path) -> None:
    """Chapter 10's figure (`plot_serving`), or with the chapter 16 forms `plot_decode_gaps`."""
    if result["settings"].get("rosellm", ["ch10"]) == ["ch10"]:
        plot_serving(result, path)
    else:
        plot_decode_gaps(result, path)


COLOURS = {"rosellm": "tab:red", "vllm": "tab:blue", "rosellm-in-process": "tab:orange"}
COLOURS |= {"rosellm-split": "tab:green", "rosellm-dp2": "tab:purple"}


def plot_decode_gaps(result: dict, path) -> None:
    """ITL p50 and p99 and TPOT p50 against the arrival rate, a colour a server; the offline decode step and
    the TPOT target as grey lines."""
    fig, axes = harness.figure_axes(1, 2, (11, 6))
    (itl_ax, tpot_ax), s = axes[0], result["settings"]
    labels = {server["server"]: server["label"] for server in result["servers"]}
    for name in dict.fromkeys(r["server"] for r in result["runs"]):
        runs = [r for r in result["runs"] if r["server"] == name]
        rates, colour, label = [r["rate"] for r in runs], COLOURS.get(name, "tab:gray"), labels[name]
        for q, style in (("p50", "o-"), ("p99", "^:")):
            itl_ax.plot(rates, [1000 * number(r["itl_s"][q]) for r in runs], style, color=colour, label=f"{label} {q}")
        tpot_ax.plot(rates, [1000 * number(r["tpot_s"]["p50"]) for r in runs], "o-", color=colour, label=label)
    step = result.get("offline_step_ms")
    for ax in (itl_ax, tpot_ax):
        if step:
            ax.axhline(step, color="gray", lw=0.8, ls="-.", label=f"offline decode step, batch 1 ({step:.0f} ms)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["rates"], [f"{r:g}" for r in s["rates"]])
        ax.set(xlabel="arrival rate (requests/s, Poisson)", ylabel="ms", yscale="log")
    tpot_ax.axhline(1000 * s["tpot_slo_s"], color="gray", lw=0.8, ls="--", label="TPOT target")
    itl_ax.set_title("inter-token latency p50 (solid) and p99 (dotted)")
    tpot_ax.set_title("time per output token, p50")
    for ax in (itl_ax, tpot_ax):
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2 if ax is itl_ax else 1)
        plain_log_labels(ax)
    harness.save_figure(fig, path, result, f"{s['requests']} requests a rate; ")


def plot_serving(result: dict, path) -> None:
    """TTFT, TPOT and ITL percentiles, output tokens/s and goodput against the arrival rate, a colour a server."""
    fig, axes = harness.figure_axes(2, 2, (11, 7))
    s, colours = result["settings"], COLOURS
    styles = {"p50": "o-", "p90": "s--", "p99": "^:"}
    (ttft_ax, tpot_ax), (tps_ax, good_ax) = axes
    for name in dict.fromkeys(r["server"] for r in result["runs"]):
        runs = [r for r in result["runs"] if r["server"] == name]
        rates, colour = [r["rate"] for r in runs], colours.get(name, "tab:gray")
        for q, style in styles.items():
            ttft_ax.plot(rates, [number(r["ttft_s"][q]) for r in runs], style, color=colour, label=f"{name} {q}")
        for q, style in (("p50", "o-"), ("p90", "s--")):
            tpot_ax.plot(
                rates, [1000 * number(r["tpot_s"][q]) for r in runs], style, color=colour, label=f"{name} TPOT {q}"
            )
        tpot_ax.plot(
            rates, [1000 * number(r["itl_s"]["p99"]) for r in runs], "^:", color=colour, label=f"{name} ITL p99"
        )
        tps_ax.plot(rates, [number(r["output_tokens_per_s"]) for r in runs], "o-", color=colour, label=name)
        good_ax.plot(rates, [100 * r["goodput"] for r in runs], "o-", color=colour, label=name)
    ttft_ax.axhline(s["ttft_slo_s"], color="gray", lw=0.8, ls="--")
    tpot_ax.axhline(1000 * s["tpot_slo_s"], color="gray", lw=0.8, ls="--")
    ttft_ax.set(ylabel="time to first token (s)", yscale="log", title="TTFT (dashed grey: the target)")
    tpot_ax.set(ylabel="ms", yscale="log", title="time per output token, inter-token latency")
    tps_ax.set(ylabel="output tokens/s", title="throughput", ylim=(0, None))
    title = f"goodput: TTFT <= {s['ttft_slo_s']:g} s and TPOT <= {s['tpot_slo_s']:g} s"
    good_ax.set(ylabel="% of requests", ylim=(0, 105), title=title)
    for ax in (ttft_ax, tpot_ax, tps_ax, good_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["rates"], [f"{r:g}" for r in s["rates"]])
        ax.set_xlabel("arrival rate (requests/s, Poisson)")
        ax.legend(fontsize=7)
    for ax in (ttft_ax, tpot_ax):
        plain_log_labels(ax)
    harness.save_figure(fig, path, result, f"{s['requests']} requests a rate; ")
