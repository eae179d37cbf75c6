"""The book's list of chapters, made from the checkpoints: one row per `chapters.checkpoints()` entry.

A chapter's title is the first heading of its page (`docs/chapters/chNN_slug.md`, without the "NN · ");
what a reader learns in it and what its engine can do are declared once, in `SUMMARIES`. A checkpoint with
no summary, or a summary of a chapter up to the latest that names no checkpoint, is an error: a new chapter
cannot be left out of the lists, nor a renamed one linger in them. The home page's list is made at build time by
`scripts/docs_hooks.py`, the README's by `scripts/readme.py`.
"""

import re
from pathlib import Path

# checkpoint name -> (what the reader learns, what the checkpoint can do)
SUMMARIES = {
    "ch01_naive_decode": (
        (
            "a Llama-family decoder written from scratch (RMSNorm, RoPE, GQA, SwiGLU), weights loaded from GGUF "
            "or a Hugging Face folder, tokenizer, sampling (greedy, temperature, top-k, top-p, seed), streaming "
            "detokenization, the naive loop that recomputes the whole prefix"
        ),
        "generate one request at a time",
    ),
    "ch02_kv_cache": (
        "why decoding is O(n²) without a cache; prefill vs decode; a contiguous per-request KV cache",
        "the same, O(n) per token",
    ),
    "ch03_batch_decode": (
        (
            "batching requests: padding, attention masks, position ids, ragged KV merged per step; an offline "
            "scheduler where requests may join at any step"
        ),
        "generate many requests together",
    ),
    "ch04_kv_block_manager": (
        "fixed-size KV blocks, block tables, allocate / append / free, reference counts, the batch state",
        "keep exact block bookkeeping beside the cache",
    ),
    "ch05_paged_attention": (
        (
            "the KV cache as one pool of blocks per layer; writing through a slot mapping; attention that reads "
            "through block tables"
        ),
        "run every request on the paged cache",
    ),
    "ch06_triton_kernels": (
        (
            "store-KV, paged decode attention (flash-decoding with split-K, GQA), paged prefill attention, each "
            "checked against the PyTorch reference"
        ),
        "run on GPU with its own kernels",
    ),
    "ch07_continuous_batching": (
        (
            "the scheduler: waiting and running queues, token and block budgets, preemption by recomputation, "
            "abort, online arrivals"
        ),
        "serve a stream of requests at full batch",
    ),
    "ch08_chunked_prefill": (
        (
            "splitting a long prompt over several steps under a token budget, decodes first; "
            "`num_computed_tokens` as the one counter of progress"
        ),
        "keep decoding while a long prompt is read",
    ),
    "ch09_prefix_caching": (
        (
            "block allocators in layers; full blocks named by a hash chain and shared by reference count; an LRU "
            "evictor; copy on write; parallel sampling (`n`)"
        ),
        "reuse shared prompt prefixes, and answer n times from one prefill",
    ),
    "ch10_serving": (
        (
            "an engine thread stepping back to back while the event loop answers HTTP; adds and aborts queued "
            "between steps; an OpenAI-compatible server with streaming (server-sent events); a disconnect "
            "aborting its request at once; errors that name the limit; stop strings on the text; `/metrics` "
            "(TTFT, inter-token latency)"
        ),
        "serve real clients over HTTP",
    ),
    "ch11_cpu_performance": (
        (
            "a profile first; fused QKV and gate-up projections; weights packed once for oneDNN behind a custom "
            "operator; decode attention compiled to read the pool in place; decoder layers compiled once for "
            "every token count, warmed up at start; `enforce_eager` and an ablation"
        ),
        "run the offline workload level with vLLM's CPU build (batch 1 is still behind)",
    ),
    "ch12_tensor_parallel": (
        (
            "Megatron's split: column-parallel Q/K/V and gate/up, row-parallel output and down projections, one "
            "all-reduce after each; KV heads split or replicated; rank 0 running the engine and sending each "
            "step's inputs to worker processes over `torch.distributed` (gloo on CPU); a dead worker stopping the"
            " engine; what the split costs here, measured, and buys on GPUs, modelled"
        ),
        "spread one model over several processes",
    ),
    "ch13_quantization": (
        (
            "why batch 1 is bytes and overhead; GGUF's Q4_0, Q4_1 and Q8_0 blocks read as codes, scales and "
            "minimums; int8 and int4 layers that pick a packed or a dense kernel from the rows; bf16 compute; "
            "the whole decode step as one compiled graph, attention a custom operator; perplexity and greedy "
            "agreement per format"
        ),
        "run the 4-bit GGUF file as it is, or quantize any model at load",
    ),
    "ch14_speculative_decoding": (
        (
            "why a batch-1 step checks several tokens for the price of one and a full batch cannot; proposing k "
            "tokens cheaply (n-gram prompt lookup, the int4 copy of the model as a draft with its own KV pool); "
            "verifying them as a short chunk of the paged engine; the rejection rule that keeps the target's "
            "distribution, greedy as its limit; rejected drafts' slots and blocks rolled back"
        ),
        "emit several tokens per forward at batch 1, greedy's own tokens but at a near tie",
    ),
    "ch15_structured_outputs": (
        (
            "why a mask and not a retry; a JSON schema, regex or choice list compiled once into a token automaton "
            "(xgrammar) that knows tokens straddling JSON punctuation; one automaton state per answer, moved by "
            "committed tokens only; an int32 bitmask setting forbidden logits to -inf before sampling and "
            "verification; drafts cut at the first refused token; `response_format` on the server"
        ),
        "answer in valid JSON for a schema, or to a regex or a list of choices, every time",
    ),
    "ch16_engine_core": (
        (
            "why a server and an engine sharing one interpreter lock slow each other; the engine core in a process "
            "of its own (schedule, forward, sample) behind a front end (tokenize, detokenize, stop strings, "
            "stream); messages over ZeroMQ; aborts, a dead core, no orphan; data-parallel replicas and a "
            "prefix-aware router"
        ),
        "serve with the engine in processes of its own, one or several replicas",
    ),
    "ch17_layout": (
        (
            "where each piece would live in vLLM; the package as subpackages that mirror vLLM's (entrypoints, "
            "engine, core, sample, spec_decode, structured_output, worker, executor, attention, model_executor, "
            "platforms); imports that flow one way, checked by a test; the layers' leaks closed (the LLM asks its "
            "engine, stats as a snapshot of counts, no backend named in the model)"
        ),
        "be read and extended by folder, and read next to vLLM",
    ),
    "ch18_cpu_kernels": (
        (
            "kernels that fit the machine: activations quantized to 8 bits in blocks of 32 and integer dot "
            "products against GGUF's 4-bit and 8-bit weights at batch 1 (llama.cpp's way), in C with a path per "
            "CPU level (AVX-512 VNNI, AVX2, plain C), beside the tensor algebra it must equal"
        ),
        "decode a GGUF model at batch 1 on integer dot products, on every CPU level",
    ),
}
HEADING = re.compile(r"^#\s+(?:\d+\s*·\s*)?(.+?)\s*$", re.MULTILINE)


def page_title(root: Path, name: str) -> str:
    """The first heading of chapter `name`'s page, without its number."""
    page = root / "docs" / "chapters" / f"{name}.md"
    if not page.is_file():
        raise ValueError(f"chapter {name} has no page docs/chapters/{name}.md")
    match = HEADING.search(page.read_text())
    if not match:
        raise ValueError(f"docs/chapters/{name}.md has no '# NN · Title' heading")
    return match.group(1)


def summaries_for(points) -> list[tuple[str, str]]:
    """(learns, can) per checkpoint, in order. Every checkpoint needs one, and a summary of a chapter up to the
    latest must name its checkpoint; those of later chapters are left out (at a chapter's git tag)."""
    names = [point.name for point in points]
    missing = [name for name in names if name not in SUMMARIES]
    unknown = [name for name in SUMMARIES if name not in names and int(name[2:4]) <= len(points)]
    if missing or unknown:
        raise ValueError(
            f"scripts/chapter_list.py: SUMMARIES must name the checkpoints; no summary for {missing}, "
            f"no checkpoint for {unknown}"
        )
    return [SUMMARIES[name] for name in names]


def chapter_table(root: Path, points, pages: str, learns: bool = True) -> str:
    """A Markdown table of the chapters, each linked to its page under `pages` (a folder path with no slash
    at the end); `learns=False` leaves out what the reader learns."""
    headings = ["#", "chapter"] + (["you learn"] if learns else []) + ["the engine can"]
    lines = ["| " + " | ".join(headings) + " |", "|" + " --- |" * len(headings)]
    for point, (learn, can) in zip(points, summaries_for(points)):
        cells = [f"{point.number:02d}", f"[{page_title(root, point.name)}]({pages}/{point.name}.md)"]
        lines.append("| " + " | ".join(cells + ([learn] if learns else []) + [can]) + " |")
    return "\n".join(lines) + "\n"
