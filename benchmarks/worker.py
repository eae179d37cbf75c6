"""One engine on one list of requests, in a process of its own: `python -m benchmarks.worker TASK SPEC OUT`.

The workloads (offline-cpu, latency-cpu, chapters, offline-gpu) start one worker per engine, so that each
engine's peak memory is its own. SPEC is a JSON file; the result goes to the JSON file OUT. Every task
times only the generation: the model is loaded and warmed up (a couple of short requests) first, and then
all requests are submitted at t = 0.

Tasks:
  rosellm          rosellm's `LLMEngine`, stepped by hand so that each request's first and last token are
                   timestamped; optionally a decode sweep over batch sizes and a per-step profile
  hf-generate      transformers `generate`, static batches with left padding (batch size 1 = latency)
  hf-continuous    transformers continuous batching (the manager behind `generate_batch`)
  checkpoint       one chapter checkpoint's `LLM.generate` (the chapters workload)
"""

import importlib
import json
import resource
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

# --- memory -----------------------------------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark of this process (Linux >= 4.0). False if impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rss_mib(field: str = "VmHWM") -> float | None:
    """VmHWM (peak resident set since the last reset) or VmRSS (now), in MiB, from /proc/self/status."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def process_peak_mib() -> float:
    """Peak resident set of the whole process life (ru_maxrss: KiB on Linux)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


class PeakMemory:
    """The resident-set peak of a timed section: reset at the start, read at the end. Where the reset is not
    possible, the whole process's peak stands in (and says so)."""

    def __enter__(self):
        self.reset = reset_peak_rss()
        self.before = rss_mib("VmRSS")
        self.cuda = cuda_in_use()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc):
        self.peak = rss_mib("VmHWM") if self.reset else None
        self.cuda_peak = None
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            self.cuda_peak = round(torch.cuda.max_memory_allocated() / 2**20, 1)

    def as_dict(self) -> dict:
        memory = {
            "rss_before_run_mib": self.before,
            "peak_rss_run_mib": self.peak,  # model + whatever the run added at its highest
            "peak_rss_process_mib": process_peak_mib(),  # includes loading (e.g. GGUF dequantization)
            "peak_is_of_run": self.reset,
        }
        if self.cuda:
            memory["peak_cuda_allocated_mib"] = self.cuda_peak  # torch's allocator, during the run
        return memory


def cuda_in_use() -> bool:
    """True when this process has initialized CUDA (never initializes it itself)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized())


def set_threads(spec: dict) -> None:
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])


def torch_dtype(name: str | None):
    import torch

    return getattr(torch, name) if name else None


# --- rosellm --------------------------------------------------------------------------------------------


def rosellm_engine(spec: dict):
    import rosellm

    return rosellm.LLMEngine(model=spec.get("model"), device=spec.get("device", "cpu"),
                             dtype=torch_dtype(spec.get("dtype")), **spec.get("engine_options", {}))


def rosellm_run(engine, requests: list, desc: str, request_prefix: str = "", progress: bool = True) -> dict:
    """All requests submitted at t=0, then one `step()` after another; each request's first and last token
    timestamped when the step that produced it returns."""
    from rosellm import SamplingParams

    n = len(requests)
    first, last, tokens = [None] * n, [None] * n, [None] * n
    steps = 0
    with tqdm(total=sum(m for _, m in requests), desc=desc, unit="tok", disable=not progress) as bar:
        start = time.perf_counter()
        for i, (prompt, max_tokens) in enumerate(requests):
            engine.add_request(f"{request_prefix}{i}", prompt,
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter() - start
            steps += 1
            for output in outputs:
                i = int(output.request_id.removeprefix(request_prefix))
                if first[i] is None:
                    first[i] = now
                if output.finished:
                    last[i] = now
                    tokens[i] = list(output.token_ids)
            bar.update(len(outputs))
    return {"wall_s": max(last), "steps": steps, "first_token_s": first, "last_token_s": last, "tokens": tokens}


def decode_sweep(engine, batch_sizes: list[int], prompt_len: int, decode_steps: int, vocab_size: int) -> list[dict]:
    """Decode tokens/s at each batch size: b requests are prefilled (untimed), then `decode_steps` steps of
    b tokens each are timed."""
    import random

    from rosellm import SamplingParams

    rng = random.Random(1)
    points = []
    for b in tqdm(batch_sizes, desc="decode sweep", unit="batch"):
        ids = [f"sweep-{b}-{i}" for i in range(b)]
        # room for the decode steps that the first prompts make while later ones prefill: nobody finishes
        # inside the timed steps
        params = SamplingParams(temperature=0.0, max_tokens=2 * decode_steps + b + 2, ignore_eos=True)
        for request_id in ids:
            prompt = [rng.randrange(min(32, vocab_size // 8), vocab_size) for _ in range(prompt_len)]
            engine.add_request(request_id, prompt, params)
        while engine.scheduler.waiting:  # prefill everyone (a step may hold several prompts)
            engine.step()
        start = time.perf_counter()
        produced = 0
        for _ in range(decode_steps):
            produced += len(engine.step())
        elapsed = time.perf_counter() - start
        for request_id in ids:
            engine.abort_request(request_id)
        points.append({"batch_size": b, "decode_steps": decode_steps, "tokens": produced,
                       "seconds": round(elapsed, 4), "tokens_per_s": round(produced / elapsed, 2)})
    return points


class StepProfile:
    """Where the time of `LLMEngine.step` goes, by wrapping (in this process only) the functions it calls:

    scheduling   Scheduler.schedule and Scheduler.finish (bookkeeping: queues, blocks, batch rows)
    metadata     building the forward's inputs: AttentionMetadata.build (positions, slot mapping, ...)
    gemm         the decoder's nn.Linear layers (q, k, v, o, gate, up, down projections)
    attention    the attention backend: store_kv + paged_attention (gather through block tables, SDPA)
    other_model  the rest of the forward: embedding, RMSNorm, rotary, SwiGLU's activation, residuals
    lm_head      LLM head on each sequence's last token (ModelRunner.sampling_logits)
    sampling     the sampler (one argmax over all the greedy rows)
    python_rest  the rest of step(): per-row bookkeeping, detokenization, outputs, Python overhead
    """

    def __init__(self, engine):
        import rosellm.attention_metadata as metadata_module
        import types

        import rosellm.llm_engine as engine_module

        self.totals = {key: 0.0 for key in ("scheduling", "metadata", "gemm", "attention", "lm_head", "sampling")}
        self.step_s = 0.0
        self.forward_s = 0.0
        self.steps = 0
        scheduler, inference = engine.scheduler, engine.model_runner
        scheduler.schedule = self._timed(scheduler.schedule, "scheduling")
        scheduler.finish = self._timed(scheduler.finish, "scheduling")
        inference.sampling_logits = self._timed(inference.sampling_logits, "lm_head")
        engine_module.sample_batch = self._timed(engine_module.sample_batch, "sampling")
        build = metadata_module.AttentionMetadata.build
        metadata_module.AttentionMetadata.build = staticmethod(self._timed(build, "metadata"))
        forward = inference.forward

        def timed_forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                self.forward_s += time.perf_counter() - start

        inference.forward = timed_forward
        backend = inference.attention_backend
        inference.attention_backend = types.SimpleNamespace(
            name=backend.name, begin_forward=self._timed(backend.begin_forward, "attention"),
            store_kv=self._timed(backend.store_kv, "attention"),
            paged_attention=self._timed(backend.paged_attention, "attention"))
        inference.model.set_attention_backend(inference.attention_backend)
        import torch

        lm_head = inference.model.lm_head
        for module in inference.model.modules():
            if isinstance(module, torch.nn.Linear) and module is not lm_head:
                module.register_forward_pre_hook(self._gemm_start)
                module.register_forward_hook(self._gemm_end)
        step = engine.step

        def timed_step():
            start = time.perf_counter()
            try:
                return step()
            finally:
                self.step_s += time.perf_counter() - start
                self.steps += 1

        engine.step = timed_step

    def _timed(self, fn, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[key] += time.perf_counter() - start
        return wrapper

    def _gemm_start(self, module, inputs):
        self._gemm_started = time.perf_counter()

    def _gemm_end(self, module, inputs, output):
        self.totals["gemm"] += time.perf_counter() - self._gemm_started

    def as_dict(self) -> dict:
        t = dict(self.totals)
        # metadata is built inside forward; the model proper is the rest of forward
        t["other_model"] = self.forward_s - t["metadata"] - t["gemm"] - t["attention"]
        t["python_rest"] = self.step_s - self.forward_s - t["scheduling"] - t["lm_head"] - t["sampling"]
        order = ["gemm", "attention", "other_model", "lm_head", "metadata", "scheduling", "sampling", "python_rest"]
        return {
            "steps": self.steps,
            "step_total_s": round(self.step_s, 3),
            "parts": [{"part": key, "seconds": round(t[key], 3),
                       "share": round(t[key] / self.step_s, 4) if self.step_s else None,
                       "ms_per_step": round(1000 * t[key] / max(self.steps, 1), 3)} for key in order],
            "legend": StepProfile.__doc__,
        }


def task_rosellm(spec: dict) -> dict:
    set_threads(spec)
    start = time.perf_counter()
    engine = rosellm_engine(spec)
    load_s = time.perf_counter() - start
    if spec.get("warmup"):
        rosellm_run(engine, spec["warmup"], "rosellm warm-up", "warmup-", progress=False)
    result = {"engine": "rosellm", "load_s": round(load_s, 2)}
    if spec.get("requests"):
        runs = []
        for repeat in range(spec.get("repeats", 1)):  # the fastest repeat is kept: other work only adds time
            with PeakMemory() as memory:
                run = rosellm_run(engine, spec["requests"], "rosellm", f"r{repeat}-")
            runs.append(run | {"memory": memory.as_dict()})
        result.update(min(runs, key=lambda r: r["wall_s"]), repeat_walls_s=[round(r["wall_s"], 3) for r in runs])
    if spec.get("sweep"):
        sweep = spec["sweep"]
        result["decode_sweep"] = decode_sweep(engine, sweep["batch_sizes"], sweep["prompt_len"],
                                              sweep["decode_steps"], engine.model.config.vocab_size)
    if spec.get("profile_requests"):
        profile = StepProfile(engine)
        run = rosellm_run(engine, spec["profile_requests"], "rosellm (profiled)", "profile-")
        result["profile"] = profile.as_dict() | {"wall_s": round(run["wall_s"], 2),
                                                 "tokens": sum(len(t) for t in run["tokens"])}
    return result


# --- transformers -----------------------------------------------------------------------------------------


def load_hf(spec: dict):
    """transformers' own model for the same weights: the GGUF file read by transformers (no rosellm code in
    between), or the Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM

    from rosellm.loader import bundled_model_path

    model = spec.get("model")
    device = spec.get("device", "cpu")
    dtype = torch_dtype(spec.get("dtype")) or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    path = bundled_model_path() if model is None else Path(model)
    kwargs = {"dtype": dtype}
    if spec.get("attn_implementation"):
        kwargs["attn_implementation"] = spec["attn_implementation"]
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    hf = hf.to(device).eval()
    # EOS is ignored, as rosellm's requests do (ignore_eos=True): every request runs to its max_tokens.
    hf.generation_config.eos_token_id = None
    pad = hf.config.pad_token_id
    if pad is None:
        eos = hf.config.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    hf.generation_config.pad_token_id = pad
    return hf


def step_clock():
    """A logits processor that only notes the time: generate calls it once per new token, right after the
    forward that produced the logits, so stamp k is when token k of the batch is known."""
    from transformers import LogitsProcessor

    class StepClock(LogitsProcessor):
        def __init__(self):
            self.stamps = []

        def __call__(self, input_ids, scores):
            self.stamps.append(time.perf_counter())
            return scores

    return StepClock()


def hf_generate_batch(hf, prompts: list[list[int]], max_new_tokens: int, device: str):
    """Greedy `generate` of one static batch, left-padded. Returns (new tokens [batch, max_new], stamps)."""
    import torch
    from transformers import LogitsProcessorList

    width = max(len(p) for p in prompts)
    pad = hf.generation_config.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    clock = step_clock()
    with torch.inference_mode():
        out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                          do_sample=False, pad_token_id=pad,
                          logits_processor=LogitsProcessorList([clock]))
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()
    new = out[:, width:]
    if new.shape[1] != max_new_tokens:
        raise RuntimeError(f"generate stopped after {new.shape[1]} of {max_new_tokens} tokens")
    return new.tolist(), clock.stamps


def reference_tokens(hf, requests: list, sample: list[int], num_tokens: int, device: str) -> dict:
    """transformers' greedy tokens for a sample of requests, one at a time (no padding): the oracle."""
    reference = {}
    for i in tqdm(sample, desc="transformers reference", unit="req"):
        prompt, max_tokens = requests[i]
        tokens, _ = hf_generate_batch(hf, [prompt], min(num_tokens, max_tokens), device)
        reference[str(i)] = tokens[0]
    return reference


def task_hf_generate(spec: dict) -> dict:
    set_threads(spec)
    device = spec.get("device", "cpu")
    start = time.perf_counter()
    hf = load_hf(spec)
    load_s = time.perf_counter() - start
    result = {"engine": "transformers generate", "load_s": round(load_s, 2), "attn_implementation":
              hf.config._attn_implementation, "batch_size": spec["batch_size"]}
    requests = spec["requests"]
    if spec.get("reference_sample"):
        result["reference"] = reference_tokens(hf, requests, spec["reference_sample"], spec["reference_tokens"],
                                               device)
    for prompt, max_tokens in spec.get("warmup", []):
        hf_generate_batch(hf, [prompt], max_tokens, device)
    if spec.get("reference_only") or not requests:
        return result
    runs = [static_batches(hf, requests, spec["batch_size"], device) for _ in range(spec.get("repeats", 1))]
    result.update(min(runs, key=lambda r: r["wall_s"]), repeat_walls_s=[round(r["wall_s"], 3) for r in runs])
    return result


def static_batches(hf, requests: list, size: int, device: str) -> dict:
    """All requests submitted at t=0 and served in static batches of `size`, in order."""
    n = len(requests)
    first, last, returned, tokens = [None] * n, [None] * n, [None] * n, [None] * n
    processed = 0  # token positions the batches ran, padding included
    with PeakMemory() as memory, tqdm(total=n, desc=f"transformers generate (batches of {size})",
                                      unit="req") as bar:
        start = time.perf_counter()
        for lo in range(0, n, size):
            batch = requests[lo: lo + size]
            longest = max(m for _, m in batch)
            new, stamps = hf_generate_batch(hf, [p for p, _ in batch], longest, device)
            done = time.perf_counter() - start
            processed += len(batch) * (max(len(p) for p, _ in batch) + longest)
            for j, (_, m) in enumerate(batch):
                first[lo + j] = stamps[0] - start
                last[lo + j] = stamps[m - 1] - start  # its own last useful token
                returned[lo + j] = done  # but it comes back with the batch's longest
                tokens[lo + j] = new[j][:m]
            bar.update(len(batch))
    return {"wall_s": max(returned), "first_token_s": first, "last_token_s": last, "returned_s": returned,
            "tokens": tokens, "padded_token_positions": processed, "memory": memory.as_dict()}


def task_hf_continuous(spec: dict) -> dict:
    """transformers' continuous batching through its manager (the engine behind `generate_batch`), so that
    each request keeps its own max_new_tokens; `generate_batch` itself takes one max_new_tokens for all."""
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    set_threads(spec)
    start = time.perf_counter()
    hf = load_hf(spec)
    load_s = time.perf_counter() - start
    requests = spec["requests"]
    options = spec.get("cb_options", {})
    generation_config = GenerationConfig(do_sample=False, max_new_tokens=max(m for _, m in requests),
                                         eos_token_id=-1, pad_token_id=hf.generation_config.pad_token_id)
    result = {"engine": "transformers continuous batching", "load_s": round(load_s, 2),
              "attn_implementation_before": hf.config._attn_implementation, "cb_options": options}

    def session(reqs: list, desc: str, timed: bool) -> dict:
        hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in reqs),
                              max_generated_length=max(m for _, m in reqs), num_requests=len(reqs))
        n = len(reqs)
        first, last, tokens = [None] * n, [None] * n, [None] * n
        with hf.continuous_batching_context_manager(
                generation_config=generation_config,
                continuous_batching_config=ContinuousBatchingConfig(**options),
                block=True, timeout=30, workload_hints=hints) as manager:
            result["attn_implementation_used"] = hf.config._attn_implementation
            start = time.perf_counter()
            for i, (prompt, max_tokens) in enumerate(reqs):
                manager.add_request(prompt, request_id=str(i), max_new_tokens=max_tokens, record_timestamps=True,
                                    eos_token_id=-1)
            finished = 0
            with tqdm(total=n, desc=desc, unit="req", disable=not timed) as bar:
                while finished < n:
                    output = manager.get_result(timeout=1)
                    if output is None:
                        if not manager.is_running():
                            raise RuntimeError("transformers' continuous-batching thread stopped")
                        continue
                    if not output.is_finished():
                        continue
                    if output.error is not None:
                        raise RuntimeError(f"request {output.request_id} failed: {output.error}")
                    i = int(output.request_id)
                    stamps = output.timestamps or []
                    first[i] = stamps[0] - start if stamps else None
                    last[i] = stamps[-1] - start if stamps else time.perf_counter() - start
                    tokens[i] = list(output.generated_tokens)
                    finished += 1
                    bar.update(1)
            if str(spec.get("device", "cpu")).startswith("cuda"):
                torch.cuda.synchronize()
        return {"wall_s": max(last), "first_token_s": first, "last_token_s": last, "tokens": tokens}

    if spec.get("warmup"):
        session(spec["warmup"], "warm-up", timed=False)
    with PeakMemory() as memory:
        run = session(requests, "transformers continuous batching", timed=True)
    result.update(run, memory=memory.as_dict())
    return result


# --- chapters -------------------------------------------------------------------------------------------


def task_checkpoint(spec: dict) -> dict:
    """One chapter checkpoint through the public API only (`LLM.generate`), so every chapter runs the same."""
    set_threads(spec)
    engine = importlib.import_module(spec["checkpoint"])
    start = time.perf_counter()
    llm = engine.LLM(model=spec.get("model"), device=spec.get("device", "cpu"), **spec.get("options", {}))
    load_s = time.perf_counter() - start

    def params(max_tokens):
        return engine.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    if spec.get("warmup"):
        llm.generate([p for p, _ in spec["warmup"]], [params(m) for _, m in spec["warmup"]], use_tqdm=False)
    requests = spec["requests"]
    with PeakMemory() as memory:
        start = time.perf_counter()
        outputs = llm.generate([p for p, _ in requests], [params(m) for _, m in requests], use_tqdm=True)
        wall = time.perf_counter() - start
    return {"engine": spec["checkpoint"], "chapter": engine.__chapter__, "load_s": round(load_s, 2),
            "wall_s": wall, "tokens": [list(o.token_ids) for o in outputs], "memory": memory.as_dict()}


TASKS = {"rosellm": task_rosellm, "hf-generate": task_hf_generate, "hf-continuous": task_hf_continuous,
         "checkpoint": task_checkpoint}


def main(argv: list[str]) -> None:
    task, spec_path, out_path = argv
    spec = json.loads(Path(spec_path).read_text())
    result = TASKS[task](spec)
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
