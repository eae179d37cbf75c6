"""speculative: what chapter 14's speculative decoding buys, on answers that copy their prompt and on ones
that do not.

Sets of requests (`--sets`; copy and random by default), greedy, EOS ignored, `max_tokens` each:

- copy: prompts whose answer copies their context, made from text that ships with Python: a paragraph of
  `pydoc_data/topics.py` followed by "The same text, copied exactly:", and a function of the standard
  library (`inspect.getsource`, a fixed list) followed by a comment announcing the same function with its
  variable `x` renamed to `value`; half of each kind, chosen the same way on every run. They are plain text
  for the model to continue, not chat turns: asked in a chat turn to repeat a paragraph, a 135M-parameter
  model paraphrases it instead.
- chat: what a user would try: the copy set's paragraphs in a chat turn that asks for them word for word
  ("Repeat this text exactly:"), which a small model answers with its own wording as often as not, so that
  n-gram drafts are found but often rejected.
- random: offline-cpu's random prompt token ids (`harness.random_requests`, its lengths and seed).

Each set runs through the `LLM` of the checkpoint `--checkpoint` names (chapter 14's by default) at each batch
size (1: one request at a time; 8: eight requests in one `generate`) with each of `--methods`: none (no
speculation), ngram (prompt lookup, k = `num_speculative_tokens`), draft_model (the target's own weights
quantized to `draft_quantization`, k = `draft_tokens`) and, from chapter 18 on, ngram-fixed (n-gram asking
for k drafts at every step, without chapter 18's per-sequence draft length), each configuration in a process
of its own. Per row: output tokens/s; tokens per target forward (tokens /
(tokens - accepted): each forward that samples for a request gives it one token, plus the drafts it
accepted); acceptance rate (accepted / proposed); mean acceptance length (tokens per verify step); and the
greedy tokens against the row without speculation, which they must equal.

With `--peers vllm`, vLLM's CPU build runs the same requests with its own n-gram speculation (the same k and
lookup bounds) at each batch size (`max_num_seqs`), checked against rosellm's tokens before it is timed; a
configuration it refuses is recorded with vLLM's error message.

    python -m benchmarks speculative [--checkpoint 18] [--batch 1,8] [--sets copy,chat,random]
        [--methods none,ngram,ngram-fixed] [--draft-quantization int8] [--peers vllm] [--quick]
"""

import importlib
import inspect
import math
import textwrap

from . import harness, offline_cpu, peers

NAME = "speculative"
HELP = "chapter 14: speculative decoding (n-gram, a quantized draft) on copying and on random requests"
CHAPTER = 14

FULL = {"checkpoint": "14", "sets": ["copy", "random"], "methods": ["none", "ngram", "draft_model"]}
FULL |= {"requests": 8, "batch": [1, 8], "max_tokens": 128, "copy_max_chars": 600}
FULL |= {"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}  # n-gram
FULL |= {"draft_tokens": 3, "draft_quantization": "int4"}  # draft model ("none": the target's own weights)
FULL |= {key: offline_cpu.FULL[key] for key in ("prompt_len", "seed", "max_batch_tokens")}
FULL |= {"check_requests": 2, "check_tokens": 16}  # the peer's check against rosellm's tokens
FULL |= {"enforce_eager": 0}  # 1: rosellm without torch.compile (loads in a moment; the quick run's choice)
QUICK = {"requests": 2, "batch": [1, 2], "max_tokens": 8, "copy_max_chars": 60, "prompt_len": [8, 40]}
QUICK |= {"max_batch_tokens": 256, "check_tokens": 4, "enforce_eager": 1}
# Functions of the standard library with a variable `x` (module, qualified name), in pure Python on every
# platform (not replaced by a C accelerator).
FUNCTIONS = [
    ("random", "Random.shuffle"),
    ("copy", "_deepcopy_list"),
    ("reprlib", "Repr.repr_str"),
    ("statistics", "NormalDist.zscore"),
]
PARAGRAPH = "Text:\n{}\n\nThe same text, copied exactly:\n"
CHAT = "Repeat this text exactly:\n\n{}"
FUNCTION = "{}\n\n\n# The same function, with the variable `x` renamed to `value`:\n"
METHODS = {"none": "no speculation", "ngram": "n-gram", "ngram-fixed": "n-gram, k every step"}
METHODS |= {"draft_model": "draft model"}
SETS = ("copy", "chat", "random")
COLUMNS = {"set": "prompts", "batch": "batch", "label": "speculation", "output_tokens_per_s": "output tok/s"}
COLUMNS |= {"speedup": "x none", "tokens_per_target_forward": "tokens/forward", "acceptance_rate": "accepted"}
COLUMNS |= {"mean_acceptance_length": "mean length", "identical": "same tokens", "error": "error"}


def add_arguments(parser) -> None:
    parser.add_argument("--peers", default="", help="also run vLLM's CPU build with its n-gram speculation: vllm")


def run(args, s: dict) -> dict:
    chosen = peers.named(args.peers)
    if any(peer.name != "vllm" for peer in chosen):
        raise SystemExit("speculative runs one peer: vllm")
    for peer in chosen:
        peers.install(peer)
    wrong = "speculation changed greedy tokens (see each row's 'agreement')"
    return harness.save(
        args, NAME, lambda: measure(args, s, chosen), "speculative", plot, "ch14_speculative", report, wrong
    )


# --- the requests ------------------------------------------------------------------------------------------


def paragraphs(count: int, max_chars: int) -> list[str]:
    """`count` paragraphs of pydoc's topics, of max_chars / 2 to max_chars characters each: the first such
    paragraph of each topic (in the topics' alphabetical order), spread evenly over the topics that have one."""
    from pydoc_data.topics import topics

    found = []
    for key in sorted(topics):
        fits = [p for p in topics[key].split("\n\n") if max_chars // 2 <= len(p) <= max_chars and p[:1].isalpha()]
        found += fits[:1]
    if len(found) < count:
        raise SystemExit(f"pydoc's topics have {len(found)} paragraphs of {max_chars // 2}-{max_chars} characters")
    return [found[i * len(found) // count] for i in range(count)]


def function_source(module: str, qualname: str, max_chars: int) -> str:
    """A function's source, dedented, cut to its whole lines within `max_chars` characters."""
    function = importlib.import_module(module)
    for name in qualname.split("."):
        function = getattr(function, name)
    lines, kept = textwrap.dedent(inspect.getsource(function)).splitlines(keepends=True), ""
    for line in lines:
        if len(kept) + len(line) > max_chars:
            break
        kept += line
    return kept.rstrip("\n") or lines[0][:max_chars]


def tokenizer_of(model: str | None):
    from chapters import submodule

    loader = submodule("rosellm", "loader")
    return loader.load_tokenizer(loader.resolve_model_folder(model))


def copy_prompts(model: str | None, count: int, max_chars: int) -> list[list[int]]:
    """The copying prompts as token ids: paragraphs first, then functions (half of `count` each, the
    paragraphs one more when it is odd), as plain text to continue."""
    functions = count // 2
    if functions > len(FUNCTIONS):
        raise SystemExit(f"--requests {count}: at most {2 * len(FUNCTIONS)} copying prompts")
    texts = [PARAGRAPH.format(p) for p in paragraphs(count - functions, max_chars)]
    texts += [FUNCTION.format(function_source(m, q, max_chars)) for m, q in FUNCTIONS[:functions]]
    tokenizer = tokenizer_of(model)
    return [tokenizer.encode(text) for text in texts]


def chat_prompts(model: str | None, count: int, max_chars: int) -> list[list[int]]:
    """`count` of the copy set's paragraphs, each in a user's chat turn asking for it word for word, with the
    model's chat template and the assistant's turn opened (as plain text, for a model without a template)."""
    tokenizer = tokenizer_of(model)
    asks = [CHAT.format(p) for p in paragraphs(count, max_chars)]
    if tokenizer.chat_template is None:
        return [tokenizer.encode(f"{ask}\n\n") for ask in asks]
    turns = [[{"role": "user", "content": ask}] for ask in asks]
    texts = [tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True) for turn in turns]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def request_sets(model: str | None, s: dict, vocab_size: int) -> dict[str, list]:
    """{set name: [[prompt token ids, max_tokens], ...]} for each of `s["sets"]`, in that order."""
    unknown = sorted(set(s["sets"]) - set(SETS))
    if unknown:
        raise SystemExit(f"--sets {unknown}: the sets are {', '.join(SETS)}")
    n, m, chars = s["requests"], s["max_tokens"], s["copy_max_chars"]
    make = {
        "copy": lambda: copy_prompts(model, n, chars),
        "chat": lambda: chat_prompts(model, n, chars),
        "random": lambda: [p for p, _ in harness.random_requests(n, s["prompt_len"], [m, m], vocab_size, s["seed"])],
    }
    return {name: [[prompt, m] for prompt in make[name]()] for name in s["sets"]}


def speculative_configs(s: dict) -> dict[str, dict | None]:
    """Each of `s["methods"]`' `speculative_config` (vLLM's names); "none" runs without one."""
    unknown = sorted(set(s["methods"]) - set(METHODS))
    if unknown or "none" not in s["methods"]:
        raise SystemExit(f"--methods {s['methods']}: none and any of {', '.join(METHODS)}")
    ngram = dict(method="ngram", num_speculative_tokens=s["num_speculative_tokens"])
    ngram |= dict(prompt_lookup_min=s["prompt_lookup_min"], prompt_lookup_max=s["prompt_lookup_max"])
    quantization = None if s["draft_quantization"] == "none" else s["draft_quantization"]
    draft = dict(method="draft_model", num_speculative_tokens=s["draft_tokens"], quantization=quantization)
    every = {"none": None, "ngram": ngram, "ngram-fixed": ngram | {"adaptive_draft_length": False}}
    every["draft_model"] = draft
    return {method: every[method] for method in s["methods"]}


# --- the measurement ---------------------------------------------------------------------------------------


def measure(args, s: dict, chosen: list) -> dict:
    point, config = harness.named_checkpoint(s["checkpoint"]), harness.model_config(args.model)
    sets = request_sets(args.model, s, config.vocab_size)
    everything = [r for requests in sets.values() for r in requests]
    longest, batch = max(len(p) + m for p, m in everything), max(s["batch"])
    k = max(s["num_speculative_tokens"], s["draft_tokens"])
    options = dict(max_num_seqs=batch, max_num_batched_tokens=max(s["max_batch_tokens"], longest), block_size=16)
    options |= dict(max_model_len=longest + 1, enforce_eager=bool(s["enforce_eager"]))
    options["enable_prefix_caching"] = False  # each row prefills its prompts, whatever ran before (as vLLM here)
    widest = sorted(everything, key=lambda r: len(r[0]) + r[1])[-batch:]  # the most a batch can hold at once
    options |= dict(num_kv_blocks=offline_cpu.kv_blocks(widest, 16) + batch * (2 + math.ceil(k / 16)))
    warmup = [[p[:16], 8] for p, _ in everything[:2]]
    common = dict(module=point.module, model=args.model, threads=args.threads, batches=s["batch"], sets=sets)
    common |= dict(engine_options=options, warmup=warmup)
    runs = {}
    for method, speculative_config in speculative_configs(s).items():
        label = f"{harness.rosellm_label(point)}, {METHODS[method]}"
        runs[method] = harness.run_engine("speculative", common | {"speculative_config": speculative_config}, label)
    rows = rosellm_rows(runs, speculative_configs(s))
    rows += [row for peer in chosen for row in peer_rows(peer, args, s, sets, options, runs["none"])]
    unspeculated = {(r["set"], r["batch"]): r for r in rows if r["method"] == "none" and "error" not in r}
    for row in rows:
        none = unspeculated.get((row["set"], row["batch"]), {})
        if none and row.get("output_tokens_per_s"):
            row["speedup"] = round(row["output_tokens_per_s"] / none["output_tokens_per_s"], 3)
    out = dict(settings=s | {"peers": [p.name for p in chosen]}, checkpoint=point.module, engine_options=options)
    out |= dict(speculative_configs=speculative_configs(s), requests={name: summary(r) for name, r in sets.items()})
    out |= dict(rows=rows, loads={m: r.get("load_s") for m, r in runs.items()}, means=MEANS)
    ours = [row for row in rows if row["engine"] == "rosellm"]
    return out | {"correct": all("error" not in row and row["identical"] for row in ours)}


MEANS = {
    "output_tokens_per_s": "every output token of the set / the seconds of its generate calls",
    "tokens_per_target_forward": "tokens / (tokens - accepted drafts), over the set's requests",
    "acceptance_rate": "accepted drafts / proposed drafts the target checked",
    "mean_acceptance_length": "1 + accepted drafts / verify steps that checked one or more (tokens per step)",
    "identical": "every request's greedy tokens equal those of the row without speculation (same set, batch)",
}


def summary(requests: list) -> dict:
    lengths = [len(p) for p, _ in requests]
    return dict(requests=len(requests), prompt_tokens=lengths, max_tokens=requests[0][1] if requests else None)


def rosellm_rows(runs: dict, configs: dict) -> list[dict]:
    """A row per method, set and batch size; a method whose process failed keeps its error."""
    rows, baseline = [], {(r["set"], r["batch"]): r["tokens"] for r in runs["none"].get("runs", [])}
    for method, result in runs.items():
        head = dict(engine="rosellm", method=method, label=METHODS[method], speculative_config=configs[method])
        if "error" in result:
            rows.append(head | dict(set="all", batch=None, error=result["error"]))
            continue
        for run in result["runs"]:
            counts = [c for c in run["spec_decode"] if c is not None] if method != "none" else None
            row = head | dict(set=run["set"], batch=run["batch"]) | numbers(run["tokens"], run["wall_s"], counts)
            row.setdefault("tokens_per_target_forward", 1.0)  # without speculation: one token a forward
            rows.append(row | agreement(run["tokens"], baseline.get((run["set"], run["batch"]))))
    return rows


def numbers(tokens: list, wall_s: float, counts: list[dict] | None) -> dict:
    """A row's speed and, given its requests' draft counts (`counts`), its acceptance."""
    produced = sum(len(t) for t in tokens)
    out = dict(output_tokens=produced, wall_s=round(wall_s, 3), output_tokens_per_s=round(produced / wall_s, 2))
    if counts is None:
        return out
    drafts, proposed, accepted = (sum(c[key] for c in counts) for key in COUNTS)
    out |= dict(num_drafts=drafts, num_draft_tokens=proposed, num_accepted_tokens=accepted)
    out |= dict(tokens_per_target_forward=round(produced / (produced - accepted), 3))
    out |= dict(acceptance_rate=round(accepted / proposed, 4) if proposed else 0.0)
    return out | dict(mean_acceptance_length=round(1 + accepted / drafts, 3) if drafts else 1.0)


COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def agreement(tokens: list, baseline: list | None) -> dict:
    """The row's greedy tokens against the row without speculation's (`harness.agreement`)."""
    if baseline is None:
        return dict(identical=False, agreement=None)
    same = harness.agreement(tokens, baseline)
    return dict(identical=same["identical_requests"] == same["requests"], agreement=same)


def peer_rows(peer, args, s: dict, sets: dict, options: dict, none: dict) -> list[dict]:
    """vLLM with its n-gram speculation on each set at each batch size (`max_num_seqs`), one process each,
    checked against rosellm's tokens without speculation (the first `check_tokens` of `check_requests`)."""
    config = speculative_configs(s | {"methods": ["none", "ngram"]})["ngram"]
    ours = {(r["set"], r["batch"]): r["tokens"] for r in none.get("runs", [])}
    rows = []
    for name, requests in sets.items():
        for batch in s["batch"]:
            tokens = ours.get((name, batch)) or []
            reference = {str(i): t[: s["check_tokens"]] for i, t in enumerate(tokens[: s["check_requests"]])}
            limits = dict(max_num_seqs=batch, max_num_batched_tokens=options["max_num_batched_tokens"])
            limits |= dict(max_model_len=options["max_model_len"], disable_log_stats=False)
            spec = dict(threads=args.threads, requests=requests, warmup=requests[:1], reference=reference)
            result = peers.run_peer(peer, spec | {"options": limits | {"speculative_config": config}}, args.model)
            head = dict(engine=peer.name, method="ngram", label=f"{peer.label}, n-gram", set=name, batch=batch)
            head |= {key: result[key] for key in ("version", "settings", "load_s", "check") if key in result}
            if "error" in result or not result.get("tokens"):
                rows.append(head | {"error": result.get("error", "no tokens")})
                continue
            counts = [result["spec_decode"]] if result.get("spec_decode") else None
            rows.append(
                head | numbers(result["tokens"], result["wall_s"], counts) | agreement(result["tokens"], tokens)
            )
    return rows


# --- the report and the figure -----------------------------------------------------------------------------


def report(result: dict) -> None:
    s = result["settings"]
    print(f"\nspeculative: {s['requests']} requests a set, {s['max_tokens']} tokens each")
    harness.print_table(result["rows"], COLUMNS)


def plot(result: dict, path) -> None:
    """Output tokens/s of each configuration per set and batch size (left); tokens per target forward (right)."""
    rows = [r for r in result["rows"] if "error" not in r]
    groups = sorted({(r["set"], r["batch"]) for r in rows}, key=lambda g: (g[0], g[1]))
    kinds = list(dict.fromkeys((r["engine"], r["label"]) for r in rows))
    fig, ((left, right),) = harness.figure_axes(1, 2, (13, 4.6))
    width = 0.8 / max(len(kinds), 1)
    for j, (engine, label) in enumerate(kinds):
        by_group = {(r["set"], r["batch"]): r for r in rows if (r["engine"], r["label"]) == (engine, label)}
        xs = [i + (j - (len(kinds) - 1) / 2) * width for i in range(len(groups))]
        for ax, key in ((left, "output_tokens_per_s"), (right, "tokens_per_target_forward")):
            values = [(by_group.get(g) or {}).get(key) or 0 for g in groups]
            ax.bar(xs, values, width, label=label if engine == "rosellm" else f"{label} ({engine})")
    ticks = [f"{name}, batch {batch}" for name, batch in groups]
    for ax, ylabel in ((left, "output tokens/s"), (right, "tokens per target forward")):
        ax.set_xticks(range(len(groups)), ticks, fontsize=8)
        ax.set(ylabel=ylabel)
    left.set_title("speculative decoding: throughput", fontsize=10)
    right.set_title("tokens each forward of the target gives", fontsize=10)
    left.legend(fontsize=7)
    harness.save_figure(fig, path, result)
