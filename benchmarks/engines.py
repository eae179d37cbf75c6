"""One engine on one list of requests, in a process of its own: `python -m benchmarks.engines TASK SPEC OUT`.

SPEC is a JSON file (model, threads, requests as [prompt ids, max_tokens], warm-up requests, options); the
result goes to the JSON file OUT. Only the generation is timed: the model is loaded and warmed up first,
then every request is submitted at t = 0. Every request is greedy with EOS ignored.

  rosellm        rosellm's `LLMEngine` stepped by hand (each request's first and last token timestamped);
                 optionally a decode sweep over batch sizes and a `torch.profiler` profile of a run
  hf-generate    transformers `generate` in static batches, left-padded; its one-at-a-time tokens for a
                 sample of requests are the reference every engine is checked against
  hf-continuous  transformers' continuous batching (the manager behind `generate_batch`)
  checkpoint     one chapter checkpoint's `LLM.generate`
  perplexity     rosellm's `LLMEngine` scoring windows of text (`prompt_logits`), then greedy requests
  speculative    rosellm's `LLM` with or without a `speculative_config`, each set of requests at each batch
                 size: tokens, time and each request's speculative-decoding counts
"""

import contextlib
import importlib
import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .harness import random_requests
from .peer_protocol import Clock


@contextlib.contextmanager
def peak_memory():
    """The resident-set peak (MiB) of a timed section: the kernel's high-water mark is reset at the start."""
    memory = {"peak_rss_run_mib": None, "peak_is_of_run": False}
    with contextlib.suppress(OSError):  # not Linux, or not allowed: no peak
        memory["peak_is_of_run"] = Path("/proc/self/clear_refs").write_text("5") > 0
    yield memory
    if memory["peak_is_of_run"]:
        status = Path("/proc/self/status").read_text()
        memory["peak_rss_run_mib"] = round(int(status.split("VmHWM:")[1].split()[0]) / 1024, 1)


def load_timed(make):
    start = time.perf_counter()
    return make(), round(time.perf_counter() - start, 2)


def timed_run(requests: list, desc: str, submit, advance) -> dict:
    """Submit every request at t = 0 with `submit(i, prompt, max_tokens)`, then call `advance()` (which
    returns (index, token ids, finished) for each request that got a token) until all are done. Each request's
    first and last token are timed by the clock the peers' scripts time theirs with."""
    steps = 0
    with peak_memory() as memory, tqdm(total=len(requests), desc=desc, unit="req") as bar:
        clock = Clock(len(requests))
        for i, (prompt, max_tokens) in enumerate(requests):
            submit(i, prompt, max_tokens)
        while None in clock.tokens:
            advanced = advance()
            steps += 1
            for i, token_ids, finished in advanced:
                clock.token(i, token_ids if finished else None)
            bar.update(sum(finished for *_, finished in advanced))
    return clock.result() | dict(steps=steps, memory=memory, t0=clock.start)


# --- rosellm ---------------------------------------------------------------------------------------------


def greedy(engine, max_tokens: int):
    """Greedy, EOS-ignoring sampling parameters from the package an engine comes from (`rosellm` or a
    chapter's frozen copy)."""
    module = type(engine).__module__  # rosellm.engine.llm_engine, chapters.ch07_...rosellm.llm_engine
    package = importlib.import_module(module[: module.index("rosellm") + len("rosellm")])
    return package.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def rosellm_run(engine, requests: list, desc: str, prefix: str) -> dict:
    def submit(i, prompt, max_tokens):
        engine.add_request(f"{prefix}{i}", prompt, greedy(engine, max_tokens))

    def advance():
        return [(int(o.request_id.removeprefix(prefix)), o.token_ids, o.finished) for o in engine.step()]

    run = timed_run(requests, desc, submit, advance)
    del run["t0"]
    return run


def decode_sweep(engine, batch_sizes: list[int], prompt_len: int, steps: int) -> list[dict]:
    """Decode tokens/s at each batch size b: b requests are prefilled (untimed), then `steps` steps timed."""
    points, vocab_size = [], engine.model.config.vocab_size
    for b in batch_sizes:
        ids = [f"sweep-{b}-{i}" for i in range(b)]
        for request_id, (prompt, _) in zip(ids, random_requests(b, [prompt_len] * 2, [1, 1], vocab_size, b)):
            # room for the decode steps the first prompts make while later ones prefill: none finishes while timed
            engine.add_request(request_id, prompt, greedy(engine, 2 * steps + b + 2))
        while engine.scheduler.waiting:
            engine.step()
        start = time.perf_counter()
        produced = sum(len(engine.step()) for _ in range(steps))
        elapsed = time.perf_counter() - start
        for request_id in ids:
            engine.abort_request(request_id)
        point = dict(batch_size=b, decode_steps=steps, tokens=produced, seconds=round(elapsed, 4))
        points.append(point | {"tokens_per_s": round(produced / elapsed, 2)})
    return points


GEMM = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")  # and any "<package>::packed_linear"
ATTENTION = ("rosellm.attention", "scaled_dot_product", "index", "gather", "scatter")  # the label, or SDPA and KV reads
PHASES = ("schedule", "forward", "lm_head", "sample", "commit")


def kind_of(name: str) -> str | None:
    if name in GEMM or name.endswith("::packed_linear"):
        return "gemm"
    return "attention" if any(a in name for a in ATTENTION) else None


def part_of(event) -> str | None:
    """What a profiled event's time counts for: an engine phase (its labels rosellm.schedule, .forward, .lm_head,
    .sample, .commit), or inside the forward "gemm" or "attention" for the outermost such event; else None."""
    if event.name.startswith("rosellm.") and event.name[8:] in PHASES:
        return event.name[8:]
    kind, parent = kind_of(event.name), event.cpu_parent
    while kind and parent is not None and parent.name != "rosellm.forward":
        if kind_of(parent.name):
            return None  # counted with its ancestor
        parent = parent.cpu_parent
    return kind if parent is not None else None


def profile_run(engine, requests: list, every: int) -> dict:
    """Where the time of `LLMEngine.step` goes: the workload run once more, `torch.profiler` recording one step
    in `every` (a sample of the whole run, prompts and decodes, in the proportions they take), each split by
    `part_of`. The forward's rest, beyond GEMMs and attention, is element-wise work, compiled or not, and the
    attention of a compiled step whose every row decodes one token: traced into the graph, it is loops of
    Inductor's, not operators the profiler can name."""
    from torch.profiler import ProfilerActivity, profile, schedule

    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(f"profile-{i}", prompt, greedy(engine, max_tokens))
    seconds = dict.fromkeys(("gemm", "attention", *PHASES), 0.0)

    def add_sampled_step(prof):
        for event in prof.events():
            if part := part_of(event):
                seconds[part] += event.cpu_time_total / 1e6

    steps, sampled, sampled_s = 0, 0, 0.0
    cycle = schedule(wait=max(every - 2, 0), warmup=min(every - 1, 1), active=1)
    with profile(activities=[ProfilerActivity.CPU], schedule=cycle, on_trace_ready=add_sampled_step) as prof:
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            steps += 1
            if steps % every == 0:  # the step the profiler recorded
                sampled, sampled_s = sampled + 1, sampled_s + time.perf_counter() - start
            prof.step()
    parts = dict(gemm=seconds["gemm"], attention=seconds["attention"])
    parts["other_model"] = seconds["forward"] - seconds["gemm"] - seconds["attention"]
    parts |= {key: seconds[key] for key in ("lm_head", "schedule", "sample", "commit")}
    parts["python_rest"] = sampled_s - sum(seconds[key] for key in PHASES)
    rows = [
        dict(part=key, seconds=round(s, 3), share=round(s / sampled_s, 4), ms_per_step=round(1000 * s / sampled, 3))
        for key, s in parts.items()
    ]
    out = dict(steps=steps, every=every, sampled_steps=sampled, sampled_s=round(sampled_s, 3), requests=len(requests))
    return out | dict(parts=rows, legend=profile_run.__doc__)


def task_rosellm(spec: dict) -> dict:
    """rosellm's `LLMEngine`: the latest checkpoint, or `spec["module"]` (a chapter's package)."""
    rosellm = importlib.import_module(spec.get("module", "rosellm"))
    dtype, options = getattr(torch, spec["dtype"]) if spec.get("dtype") else None, spec.get("engine_options", {})
    model, device = spec.get("model"), spec.get("device", "cpu")
    engine, load_s = load_timed(lambda: rosellm.LLMEngine(model, device, dtype, **options))
    rosellm_run(engine, spec["warmup"], "rosellm warm-up", "warmup-")
    runs = [rosellm_run(engine, spec["requests"], "rosellm", f"r{k}-") for k in range(spec.get("repeats", 1))]
    result = {"engine": "rosellm", "load_s": load_s, "compute_dtype": compute_dtype(engine)}
    result |= min(runs, key=lambda r: r["wall_s"])
    result["repeat_walls_s"] = [round(r["wall_s"], 3) for r in runs]
    if sweep := spec.get("sweep"):
        result["decode_sweep"] = decode_sweep(engine, sweep["batch_sizes"], sweep["prompt_len"], sweep["steps"])
    if spec.get("profile_every"):
        result["profile"] = profile_run(engine, spec["requests"], spec["profile_every"])
    return result


def compute_dtype(engine) -> str:
    """The dtype of the engine's activations and KV cache ("float32", "bfloat16")."""
    return str(engine.model_runner.dtype).removeprefix("torch.")


def task_perplexity(spec: dict) -> dict:
    """rosellm's `LLMEngine` (`spec["module"]`, its dtype and engine options) scoring each window of
    `spec["windows"]` in one prompt pass: the negative log-likelihood of each token after the first, given the
    ones before it (summed per window); then, greedy, the requests of `spec["requests"]`, their tokens kept.
    `spec["integer_dot_rows"]`, if set, replaces chapter 18's `INTEGER_DOT_ROWS` in this process."""
    rosellm = importlib.import_module(spec["module"])
    if spec.get("integer_dot_rows"):  # chapter 18: up to this many rows take the integer kernel (prompts too)
        from chapters import submodule

        submodule(spec["module"], "quantized_linear").INTEGER_DOT_ROWS = spec["integer_dot_rows"]
    dtype, options = getattr(torch, spec["dtype"]) if spec.get("dtype") else None, spec.get("engine_options", {})
    engine, load_s = load_timed(lambda: rosellm.LLMEngine(spec.get("model"), "cpu", dtype, **options))
    sums, start = [], time.perf_counter()
    for window in tqdm(spec["windows"], desc="perplexity windows", unit="window"):
        logits = engine.prompt_logits(window).float()  # [window, vocab_size]
        targets = torch.tensor(window[1:])  # [window - 1]
        sums.append(torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum").item())
    scored_s = round(time.perf_counter() - start, 2)
    result = dict(engine="rosellm", load_s=load_s, compute_dtype=compute_dtype(engine), nll_sums=sums)
    result |= dict(scored_tokens=[len(w) - 1 for w in spec["windows"]], scoring_s=scored_s)
    if spec.get("requests"):
        result["tokens"] = rosellm_run(engine, spec["requests"], "rosellm greedy", "g-")["tokens"]
    return result


# --- transformers ---------------------------------------------------------------------------------------


def load_hf(spec: dict):
    """transformers' own model for the same weights: the GGUF file read by transformers, or the HF folder."""
    from transformers import AutoModelForCausalLM

    from chapters import submodule

    loader = submodule("rosellm", "loader")

    dtype = getattr(torch, spec["dtype"]) if spec.get("dtype") else torch.float32
    path = loader.model_source(None) if spec.get("model") is None else Path(spec["model"])
    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(path.parent if gguf else path, dtype=dtype, **gguf)
    hf = hf.to(spec.get("device", "cpu")).eval()
    hf.generation_config.eos_token_id = None  # EOS ignored: every request runs to its max_tokens
    eos, pad = hf.config.eos_token_id, hf.config.pad_token_id
    hf.generation_config.pad_token_id = pad if pad is not None else (eos[0] if isinstance(eos, list) else eos) or 0
    return hf


def hf_generate_batch(hf, prompts: list[list[int]], max_new_tokens: int) -> tuple[list, list[float]]:
    """Greedy `generate` of one left-padded static batch: (new tokens per row, the time each step's token
    was known: a logits processor notes it right after the forward)."""
    from transformers import LogitsProcessorList

    stamps = []
    width, pad = max(len(p) for p in prompts), hf.generation_config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=hf.device)  # (batch, width)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)  # (batch, width)
    stamp = LogitsProcessorList([lambda _, scores: stamps.append(time.perf_counter()) or scores])
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, logits_processor=stamp
        )  # (batch, width + max_new_tokens)
    if hf.device.type == "cuda":
        torch.cuda.synchronize()
    return out[:, width:].tolist(), stamps


def task_hf_generate(spec: dict) -> dict:
    hf, load_s = load_timed(lambda: load_hf(spec))
    requests, size = spec["requests"], spec["batch_size"]
    result = dict(engine="transformers generate", load_s=load_s, batch_size=size)
    result["attn_implementation"] = hf.config._attn_implementation
    result["reference"] = {
        str(i): hf_generate_batch(hf, [requests[i][0]], min(spec["reference_tokens"], requests[i][1]))[0][0]
        for i in spec.get("reference_sample", [])
    }
    for prompt, max_tokens in spec["warmup"]:
        hf_generate_batch(hf, [prompt], max_tokens)
    if spec.get("reference_only"):
        return result
    runs = [static_batches(hf, requests, size) for _ in range(spec.get("repeats", 1))]
    return result | min(runs, key=lambda r: r["wall_s"]) | {"repeat_walls_s": [round(r["wall_s"], 3) for r in runs]}


def static_batches(hf, requests: list, size: int) -> dict:
    """Every request submitted at t = 0, served in static batches of `size` in order. A request's last token
    is the step of its own last useful token; it is returned only with its batch's longest."""
    n = len(requests)
    first, last, returned, tokens = [None] * n, [None] * n, [None] * n, [None] * n
    padded = 0  # token positions the batches ran, padding included
    with peak_memory() as memory:
        start = time.perf_counter()
        for lo in tqdm(range(0, n, size), desc=f"transformers generate (batches of {size})", unit="batch"):
            batch = requests[lo : lo + size]
            longest = max(m for _, m in batch)
            new, stamps = hf_generate_batch(hf, [p for p, _ in batch], longest)
            done = time.perf_counter() - start
            padded += len(batch) * (max(len(p) for p, _ in batch) + longest)
            for j, (_, m) in enumerate(batch):
                first[lo + j], last[lo + j] = stamps[0] - start, stamps[m - 1] - start
                returned[lo + j], tokens[lo + j] = done, new[j][:m]
    run = dict(wall_s=max(returned), first_token_s=first, last_token_s=last, returned_s=returned, tokens=tokens)
    return run | dict(padded_token_positions=padded, memory=memory)


def task_hf_continuous(spec: dict) -> dict:
    """transformers' continuous batching through its manager, so that each request keeps its own
    max_new_tokens (`generate_batch` takes one for all). The manager stamps every token it makes."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    hf, load_s = load_timed(lambda: load_hf(spec))
    options, pad = spec.get("cb_options", {}), hf.generation_config.pad_token_id
    longest = max(m for _, m in spec["requests"])
    config = GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=-1, pad_token_id=pad)

    def session(requests: list, desc: str) -> dict:
        stamps, cb = {}, ContinuousBatchingConfig(**options)
        with hf.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=30, continuous_batching_config=cb
        ) as manager:

            def submit(i, prompt, max_tokens):
                manager.add_request(
                    prompt, request_id=str(i), max_new_tokens=max_tokens, eos_token_id=-1, record_timestamps=True
                )

            def advance():
                output = manager.get_result(timeout=1)
                if output is None and not manager.is_running():
                    raise RuntimeError("transformers' continuous-batching thread stopped")
                if output is None or not output.is_finished():
                    return []
                if output.error is not None:
                    raise RuntimeError(f"request {output.request_id} failed: {output.error}")
                stamps[int(output.request_id)] = output.timestamps
                return [(int(output.request_id), output.generated_tokens, True)]

            run = timed_run(requests, desc, submit, advance)
        t0, got = run.pop("t0"), [stamps[i] for i in range(len(requests))]
        run["first_token_s"] = [times[0] - t0 if times else None for times in got]
        run["last_token_s"] = [times[-1] - t0 if times else end for times, end in zip(got, run["last_token_s"])]
        return run

    session(spec["warmup"], "warm-up")
    run = session(spec["requests"], "transformers continuous batching")
    return {"engine": "transformers continuous batching", "load_s": load_s, "cb_options": options, **run}


def timed_generate(module, llm, prompts: list[list[int]], max_tokens: int | list[int]) -> tuple[float, list]:
    """(seconds, outputs) of one greedy, EOS-ignoring `generate` with a checkpoint `module`'s own `LLM`."""
    counts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    params = [module.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in counts]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == counts, "a request stopped early"
    return elapsed, outputs


def task_checkpoint(spec: dict) -> dict:
    """One chapter checkpoint through its public `LLM.generate` only, so that every chapter runs the same."""
    engine = importlib.import_module(spec["checkpoint"])
    llm, load_s = load_timed(lambda: engine.LLM(model=spec.get("model"), **spec.get("options", {})))
    timed_generate(engine, llm, [p for p, _ in spec["warmup"]], [m for _, m in spec["warmup"]])
    with peak_memory() as memory:
        wall, outputs = timed_generate(engine, llm, [p for p, _ in spec["requests"]], [m for _, m in spec["requests"]])
    result = dict(engine=spec["checkpoint"], chapter=engine.__chapter__, load_s=load_s, wall_s=wall)
    return result | {"tokens": [list(o.token_ids) for o in outputs], "memory": memory}


def task_speculative(spec: dict) -> dict:
    """rosellm's `LLM` (`spec["module"]`) with `spec["speculative_config"]` (None: without speculation). Each
    set of `spec["sets"]` (name -> requests) runs at each batch size b of `spec["batches"]`: its requests b at
    a time, one `generate` per group. A warm-up first makes the one-token and the many-token graphs."""
    rosellm = importlib.import_module(spec["module"])
    options = spec.get("engine_options", {})
    if spec.get("speculative_config"):
        options = options | {"speculative_config": spec["speculative_config"]}
    llm, load_s = load_timed(lambda: rosellm.LLM(spec.get("model"), "cpu", torch.float32, **options))
    for prompts in ([p for p, _ in spec["warmup"][:1]], [p for p, _ in spec["warmup"]]):
        timed_generate(rosellm, llm, prompts, [m for _, m in spec["warmup"][: len(prompts)]])
    runs = []
    for name, requests in spec["sets"].items():
        for batch in spec["batches"]:
            wall, tokens, counts = 0.0, [], []
            for lo in tqdm(range(0, len(requests), batch), desc=f"{name}, batch {batch}", unit="generate"):
                group = requests[lo : lo + batch]
                seconds, outputs = timed_generate(rosellm, llm, [p for p, _ in group], [m for _, m in group])
                wall += seconds
                tokens += [list(o.token_ids) for o in outputs]
                counts += [spec_decode_counts(o.spec_decode) for o in outputs]
            runs.append(dict(set=name, batch=batch, wall_s=wall, tokens=tokens, spec_decode=counts))
    return dict(engine="rosellm", load_s=load_s, runs=runs)


def spec_decode_counts(stats) -> dict | None:
    """A request's `SpecDecodeStats` as a dict of its three counts (None without speculation)."""
    if stats is None:
        return None
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    return {key: getattr(stats, key) for key in keys}


TASKS = {"rosellm": task_rosellm, "checkpoint": task_checkpoint, "perplexity": task_perplexity}
TASKS |= {"speculative": task_speculative}
TASKS |= {"hf-generate": task_hf_generate, "hf-continuous": task_hf_continuous}


def main(task: str, spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    Path(out_path).write_text(json.dumps(TASKS[task](spec)))


if __name__ == "__main__":
    main(*sys.argv[1:])
