"""structured: what chapter 15's structured outputs cost a decode step, and what compiling a constraint costs.

The requests are chat prompts asking for JSON, each constrained (or not) by one of four JSON schemas: a
nested object, an array with `maxItems`, an enum, a bounded integer (`disable_any_whitespace=True`). They are
greedy with `max_tokens` each and nothing ignored: a constrained answer ends with EOS where its JSON may end.

At each batch size b (an engine with `max_num_seqs` = b, its b requests added at once) the same requests run
unconstrained ("none"), all constrained ("all") and, at `mixed_batch`, half constrained and half not
("half"), whose unconstrained rows must give the tokens they gave unconstrained alone: after a warm-up, each
kind in turn, `rounds` times, its steps pooled over the rounds. Every step is timed around `engine.step()`;
a decode step is one after every request has its first token, and a full one has every request of the batch
still running: the medians are over full steps, as a constrained answer often ends early and a step with
fewer rows costs less. Inside a step, the grammar's work is timed by wrapping the
engine's functions (rosellm itself is unchanged): *mask* is `grammar.mask_logits` and `mask_draft_logits`
(filling the bitmask of the constrained rows and applying it to their logits), *accept* is
`GrammarState.accept` (moving each constrained answer past its committed token).

Compiling: a fresh `GrammarCache` of the model's tokenizer first analyses the vocabulary (its `compiler`,
timed once), then compiles each schema (cold) and compiles it again (cached: found in the cache).

With `--peers vllm`, vLLM's CPU build runs the same requests at each batch size (`max_num_seqs`) with and
without the constraint (`StructuredOutputsParams(json=...)`, its xgrammar backend with
`disable_any_whitespace`), each run's first tokens checked against rosellm's (`check_tokens`,
`check_constrained_tokens`: both write compact JSON), and each run records its agreement with rosellm's.

The result file's keys:

    steps     [{batch, constrained ("none" | "all" | "half"), requests, full_steps (decode steps with every
              request of the batch running), step_ms, mask_ms, accept_ms, grammar_ms (mask + accept),
              grammar_share (of the step), overhead_pct (step_ms against the "none" row of the batch),
              all_decode_steps ({steps, median_rows} and the same medians over every decode step), output_tokens,
              output_tokens_per_s, finished_by_eos, constrained_finished_by_eos, valid_json (of those, the
              answers whose text their schema accepts: all of them), identical ("half": its unconstrained
              rows' tokens equal those of the "none" row)}]; the *_ms are medians over the full decode steps
    compile   [{schema, cold_ms, cached_ms}]
    tokenizer_analysis_ms   the vocabulary's analysis, once per tokenizer, before the first compile
    peers     {vllm: {version, settings, label, rows: [{batch, constrained, output_tokens, output_tokens_per_s,
              overhead_pct ("all": its tok/s against the "none" run's), check, agreement} or {..., error}]}}
    schemas   {name: the JSON schema}

    python -m benchmarks structured [--batch 1,8,32] [--max-tokens 64] [--peers vllm] [--quick]
"""

import json
import statistics
import time

import chapters
from chapters import submodule

from . import harness, peers

NAME = "structured"
HELP = "chapter 15: structured outputs' cost per decode step (mask, accept), compile times, vLLM's overhead"
CHAPTER = 15

FULL = {"batch": [1, 8, 32], "mixed_batch": 8, "max_tokens": 64, "rounds": 3, "enforce_eager": 0}
FULL |= {"check_tokens": 8, "check_constrained_tokens": 8}  # the peer's check against rosellm's tokens
QUICK = {"batch": [1, 2], "mixed_batch": 2, "max_tokens": 8, "rounds": 1, "check_tokens": 4, "enforce_eager": 1}
QUICK |= {"check_constrained_tokens": 4}
SCHEMAS = {
    "person": {  # a nested object
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}, "country": {"type": "string"}},
                "required": ["city", "country"],
            },
        },
        "required": ["name", "address"],
    },
    "shopping": {  # an array with maxItems
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4}},
        "required": ["items"],
    },
    "ticket": {  # an enum
        "type": "object",
        "properties": {"priority": {"enum": ["low", "medium", "high"]}, "title": {"type": "string", "maxLength": 40}},
        "required": ["priority", "title"],
    },
    "rating": {  # a bounded integer
        "type": "object",
        "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "reason": {"type": "string"}},
        "required": ["stars", "reason"],
    },
}
PROMPTS = [  # (schema, what the user asks), two for each schema
    ("person", "Describe a fictional person as JSON with their name and address (city, country)."),
    ("shopping", "Give me a shopping list for a picnic as JSON: an object with a list of items."),
    ("ticket", "My laptop will not start. Write a support ticket as JSON with a priority and a title."),
    ("rating", "Rate the movie Casablanca as JSON: stars from 1 to 5 and a short reason."),
    ("person", "Invent a famous painter and answer in JSON with the name and address (city, country)."),
    ("shopping", "List what I need to bake bread, as JSON with an items array."),
    ("ticket", "The website shows an error on login. Answer with a JSON ticket: priority and title."),
    ("rating", "How good is pizza? Answer in JSON with stars (1 to 5) and a reason."),
]
COLUMNS = {"batch": "batch", "constrained": "constrained", "full_steps": "full steps", "step_ms": "step ms"}
COLUMNS |= {"mask_ms": "mask ms", "accept_ms": "accept ms", "grammar_share": "grammar share"}
COLUMNS |= {"overhead_pct": "overhead %", "output_tokens_per_s": "tok/s", "identical": "same tokens"}


def add_arguments(parser) -> None:
    parser.add_argument("--peers", default="", help="also run vLLM's CPU build with and without the schemas: vllm")


def run(args, s: dict) -> dict:
    chosen = peers.named(args.peers)
    if any(peer.name != "vllm" for peer in chosen):
        raise SystemExit("structured runs one peer: vllm")
    for peer in chosen:
        peers.install(peer)
    wrong = "a constrained answer ended in JSON its schema refuses, or the mixed batch changed unconstrained tokens"
    return harness.save(args, NAME, lambda: measure(args, s, chosen), NAME, plot, "ch15_structured", report, wrong)


# --- the requests ------------------------------------------------------------------------------------------


def requests(package, tokenizer, count: int) -> list[tuple[list[int], str]]:
    """`count` requests, the prompts in turn: (chat prompt token ids, schema name)."""
    chat_prompt = part(package, "chat_template").chat_prompt
    chosen = [PROMPTS[i % len(PROMPTS)] for i in range(count)]
    return [
        (tokenizer.encode(chat_prompt(tokenizer, [{"role": "user", "content": ask}])), name) for name, ask in chosen
    ]


def constraint(name: str) -> dict:
    """The structured_outputs of schema `name`, as keyword arguments (rosellm's and vLLM's names)."""
    return {"json": SCHEMAS[name], "disable_any_whitespace": True}


# --- the measurement ---------------------------------------------------------------------------------------


class GrammarTimers:
    """While open, the engine's grammar functions run inside perf_counter timers: seconds so far in `mask`
    (mask_logits, mask_draft_logits, as llm_engine calls them) and `accept` (GrammarState.accept)."""

    def __init__(self, package):
        self.engine_module = part(package, "llm_engine")
        self.state_class = part(package, "grammar").GrammarState
        self.seconds = {"mask": 0.0, "accept": 0.0}

    def timed(self, function, part: str):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        return wrapper

    def __enter__(self) -> "GrammarTimers":
        self.saved = [(self.engine_module, name) for name in ("mask_logits", "mask_draft_logits")]
        self.saved = [(owner, name, getattr(owner, name)) for owner, name in self.saved]
        self.saved.append((self.state_class, "accept", self.state_class.accept))
        for owner, name, function in self.saved:
            setattr(owner, name, self.timed(function, "accept" if name == "accept" else "mask"))
        return self

    def __exit__(self, *exc_info) -> None:
        for owner, name, function in self.saved:
            setattr(owner, name, function)


def part(package, name: str):
    """A module of a checkpoint's package (`point.load()`): `part(rosellm, "grammar")` is rosellm.grammar."""
    return submodule(package, name)


def timed_steps(engine, package, batch: list, constrained: list[bool], max_tokens: int, timers) -> dict:
    """Add every request at once, step until all are done; per decode step its ms and the grammar's."""
    for i, ((prompt, name), on) in enumerate(zip(batch, constrained)):
        so = package.StructuredOutputsParams(**constraint(name)) if on else None
        engine.add_request(
            f"r{i}", prompt, package.SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)
        )
    tokens, texts, reasons = [None] * len(batch), [None] * len(batch), [None] * len(batch)
    steps, started = [], set()
    begin = time.perf_counter()
    while engine.has_unfinished_requests():
        decoding, rows = len(started) == len(batch), len(engine.scheduler.running)
        before, start = dict(timers.seconds), time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if decoding:
            grammar = {name: timers.seconds[name] - before[name] for name in before}
            steps.append(dict(step=elapsed, rows=rows, **grammar))
        for output in outputs:
            i = int(output.request_id[1:])
            started.add(i)
            if output.finished:
                tokens[i], texts[i], reasons[i] = list(output.token_ids), output.text, output.outputs[0].finish_reason
    wall = time.perf_counter() - begin
    valid = [
        matches(text, name)
        for text, (_, name), on, why in zip(texts, batch, constrained, reasons)
        if on and why == "stop"
    ]
    return dict(tokens=tokens, reasons=reasons, steps=steps, wall_s=wall, valid=valid)


def matches(text: str, name: str) -> bool:
    """`text` is JSON that schema `name` accepts."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def median_ms(steps: list[dict], key: str) -> float | None:
    return round(statistics.median(s[key] for s in steps) * 1000, 3) if steps else None


def step_row(batch: int, kind: str, run: dict) -> dict:
    """The medians over the run's full decode steps (every request of the batch still running: a constrained
    answer often ends early, and a step with fewer rows is cheaper); the medians over all its decode steps
    under `all_decode_steps`."""
    full, produced = [s for s in run["steps"] if s["rows"] == batch], sum(len(t) for t in run["tokens"])
    row = dict(batch=batch, constrained=kind, requests=len(run["tokens"]), full_steps=len(full))
    row |= medians(full)
    everything = run["steps"]
    rows = statistics.median(s["rows"] for s in everything) if everything else None
    row["all_decode_steps"] = dict(steps=len(everything), median_rows=rows) | medians(everything)
    row |= dict(output_tokens=produced, output_tokens_per_s=round(produced * run["rounds"] / run["wall_s"], 2))
    row |= dict(finished_by_eos=sum(r == "stop" for r in run["reasons"]))
    if kind != "none":
        row |= dict(constrained_finished_by_eos=len(run["valid"]), valid_json=sum(run["valid"]))
    return row


def medians(steps: list[dict]) -> dict:
    """step_ms, mask_ms, accept_ms, grammar_ms and grammar_share: medians over `steps` (None without any)."""
    steps = [s | {"grammar": s["mask"] + s["accept"]} for s in steps]
    out = {f"{key}_ms": median_ms(steps, key) for key in ("step", "mask", "accept", "grammar")}
    share = [s["grammar"] / s["step"] for s in steps]
    return out | {"grammar_share": round(statistics.median(share), 4) if share else None}


def engine_options(s: dict, prompts: list, batch: int) -> dict:
    longest = max(len(p) for p, _ in prompts) + s["max_tokens"]
    options = dict(max_num_seqs=batch, max_num_batched_tokens=max(2048, sum(len(p) for p, _ in prompts)))
    options |= dict(max_model_len=longest + 1, enable_prefix_caching=False, enforce_eager=bool(s["enforce_eager"]))
    return options


def measure_batch(args, s: dict, package, all_prompts: list, batch: int) -> tuple[list[dict], dict]:
    """The rows of one batch size ("none", "all", and "half" at `mixed_batch`), and the tokens of each."""
    import torch

    prompts = all_prompts[:batch]
    engine = package.LLMEngine(args.model, "cpu", torch.float32, **engine_options(s, all_prompts, batch))
    kinds = {"none": [False] * batch, "all": [True] * batch}
    if batch == s["mixed_batch"]:
        kinds["half"] = [i % 2 == 1 for i in range(batch)]
    runs = {kind: [] for kind in kinds}
    with GrammarTimers(package) as timers:
        for constrained in kinds.values():  # the warm-up: graphs, grammars compiled
            timed_steps(engine, package, prompts, constrained, s["max_tokens"], timers)
        for _ in range(s["rounds"]):  # in turn, so that a change of the machine's load touches every kind
            for kind, constrained in kinds.items():
                runs[kind].append(timed_steps(engine, package, prompts, constrained, s["max_tokens"], timers))
    engine.close()
    rows = [step_row(batch, kind, merged(found)) for kind, found in runs.items()]
    tokens = {kind: found[0]["tokens"] for kind, found in runs.items()}
    none = rows[0]["step_ms"]
    for row in rows:
        if none and row["step_ms"] is not None:
            row["overhead_pct"] = round(100 * (row["step_ms"] - none) / none, 2)
    if "half" in kinds:
        free = [i for i, on in enumerate(kinds["half"]) if not on]
        rows[-1]["identical"] = all(tokens["half"][i] == tokens["none"][i] for i in free)
    return rows, tokens


def merged(runs: list[dict]) -> dict:
    """The rounds of one kind as one run: their steps together, their wall times added; the first round's
    tokens, which every round must repeat (greedy)."""
    if any(run["tokens"] != runs[0]["tokens"] for run in runs):
        raise SystemExit("structured: two rounds of the same greedy requests gave different tokens")
    steps = [step for run in runs for step in run["steps"]]
    return runs[0] | dict(steps=steps, wall_s=sum(run["wall_s"] for run in runs), rounds=len(runs))


def compile_times(args, package, tokenizer) -> dict:
    """The tokenizer's analysis, then each schema compiled cold and again (cached), in a fresh GrammarCache."""
    config = harness.model_config(args.model)
    stops = {t for t in (config.eos_token_ids or (tokenizer.eos_token_id,)) if t is not None}
    cache = part(package, "grammar").GrammarCache(tokenizer, config.vocab_size, stops)
    start = time.perf_counter()
    cache.compiler  # noqa: B018 (the property builds the compiler: the vocabulary's analysis)
    analysis = round((time.perf_counter() - start) * 1000, 2)
    rows = []
    for name in SCHEMAS:
        params = package.StructuredOutputsParams(**constraint(name))
        times = []
        for _ in range(2):
            start = time.perf_counter()
            cache.compile(params)
            times.append(round((time.perf_counter() - start) * 1000, 3))
        rows.append(dict(schema=name, cold_ms=times[0], cached_ms=times[1]))
    assert cache.num_compiled == len(SCHEMAS) and cache.num_hits == len(SCHEMAS)
    return dict(tokenizer_analysis_ms=analysis, compile=rows)


def measure(args, s: dict, chosen: list) -> dict:
    point = chapters.checkpoint(CHAPTER)
    package = point.load()
    loader = part(package, "loader")
    tokenizer = loader.load_tokenizer(loader.resolve_model_folder(args.model))
    all_prompts = requests(package, tokenizer, max(s["batch"] + [s["mixed_batch"]]))
    batches = sorted(set(s["batch"]) | {s["mixed_batch"]})
    steps, tokens = [], {}
    for batch in batches:
        rows, tokens[batch] = measure_batch(args, s, package, all_prompts, batch)
        steps += [row for row in rows if batch in s["batch"] or row["constrained"] == "half"]
    out = dict(settings=s | {"peers": [p.name for p in chosen]}, checkpoint=point.module, schemas=SCHEMAS)
    out |= dict(prompts=[dict(schema=name, prompt_tokens=len(p)) for p, name in all_prompts])
    out |= dict(engine_options={b: engine_options(s, all_prompts, b) for b in batches}, steps=steps)
    out |= compile_times(args, package, tokenizer) | dict(means=MEANS)
    out["peers"] = {peer.name: peer_result(peer, args, s, all_prompts, tokens) for peer in chosen}
    ended = [row.get("valid_json") == row.get("constrained_finished_by_eos") for row in steps]
    return out | {"correct": all(row.get("identical", True) for row in steps) and all(ended)}


MEANS = {
    "full_steps": "decode steps (after every request's first token) with every request of the batch running",
    "step_ms": "median over the full decode steps of the time around engine.step()",
    "mask_ms": "median per full decode step of mask_logits + mask_draft_logits (bitmask filled and applied)",
    "accept_ms": "median per full decode step of GrammarState.accept (each constrained answer past its token)",
    "grammar_share": "median per full decode step of (mask + accept) / step",
    "overhead_pct": "100 * (step_ms - step_ms of the batch's unconstrained row) / that row's step_ms",
    "cold_ms": "the schema's first compile in a GrammarCache whose tokenizer analysis is done",
    "cached_ms": "the same constraint compiled again: found in the cache",
}


def sampling(name: str, constrained: bool) -> dict:
    """A peer request's sampling fields beside greedy and max_tokens (peer_vllm.py): EOS honoured, and the
    schema when constrained."""
    return {"ignore_eos": False} | ({"structured_outputs": constraint(name)} if constrained else {})


def peer_result(peer, args, s: dict, all_prompts: list, tokens: dict) -> dict:
    """vLLM at each batch size, without then with the schemas; tok/s and the overhead of the constrained run.
    Each run is checked against rosellm's first tokens of its first request (`check_tokens`; constrained:
    `check_constrained_tokens`), and its tokens compared with rosellm's (`agreement`). vLLM here takes
    `disable_any_whitespace` from its engine's `structured_outputs_config`, not from the request."""
    rows, head = [], {}
    for batch in s["batch"]:
        prompts, speeds = all_prompts[:batch], {}
        options = dict(max_num_seqs=batch, max_model_len=engine_options(s, all_prompts, batch)["max_model_len"])
        options["structured_outputs_config"] = {"backend": "xgrammar", "disable_any_whitespace": True}
        for kind in ("none", "all"):
            asked = [[p, s["max_tokens"], sampling(name, kind == "all")] for p, name in prompts]
            checked = s["check_tokens"] if kind == "none" else s["check_constrained_tokens"]
            reference = {"0": tokens[batch][kind][0][:checked]}
            spec = dict(threads=args.threads, requests=asked, warmup=asked, reference=reference, options=options)
            result = peers.run_peer(peer, spec, args.model)
            head = {key: result[key] for key in ("version", "settings", "label") if key in result} or head
            row = dict(batch=batch, constrained=kind, check=result.get("check"))
            if "error" in result or not result.get("tokens"):
                rows.append(row | {"error": result.get("error", "no tokens")})
                continue
            produced = sum(len(t) for t in result["tokens"])
            speeds[kind] = produced / result["wall_s"]
            row |= dict(output_tokens=produced, output_tokens_per_s=round(speeds[kind], 2))
            rows.append(row | {"agreement": harness.agreement(result["tokens"], tokens[batch][kind])})
        if len(speeds) == 2:
            rows[-1]["overhead_pct"] = round(100 * (speeds["none"] / speeds["all"] - 1), 2)
    return head | {"rows": rows}


# --- the report and the figure -----------------------------------------------------------------------------


def report(result: dict) -> None:
    s = result["settings"]
    print(f"\nstructured: {len(SCHEMAS)} JSON schemas, greedy, at most {s['max_tokens']} tokens a request")
    harness.print_table(result["steps"], COLUMNS)
    print(f"\ntokenizer analysis {result['tokenizer_analysis_ms']} ms")
    harness.print_table(result["compile"], {"schema": "schema", "cold_ms": "cold ms", "cached_ms": "cached ms"})
    for name, peer in result["peers"].items():
        print(f"\n{name}")
        harness.print_table(peer["rows"], {"batch": "batch", "constrained": "constrained"} | PEER_COLUMNS)


PEER_COLUMNS = {"output_tokens_per_s": "tok/s", "overhead_pct": "overhead %", "error": "error"}


def plot(result: dict, path) -> None:
    """Grammar ms per decode step (mask, accept) against batch size (left); the step's ms (right)."""
    rows = [r for r in result["steps"] if r["step_ms"] is not None]
    fig, ((left, right),) = harness.figure_axes(1, 2, (11, 4.2))
    constrained = [r for r in rows if r["constrained"] == "all"]
    batches = [r["batch"] for r in constrained]
    for key, label in (("mask_ms", "mask (fill + apply)"), ("accept_ms", "accept"), ("grammar_ms", "both")):
        left.plot(batches, [r[key] for r in constrained], marker="o", label=label)
    for kind, label in (("none", "unconstrained"), ("all", "all constrained"), ("half", "half constrained")):
        chosen = [r for r in rows if r["constrained"] == kind]
        right.plot([r["batch"] for r in chosen], [r["step_ms"] for r in chosen], marker="o", label=label)
    for ax, ylabel in ((left, "grammar ms per decode step"), (right, "decode step ms")):
        ax.set(xlabel="batch size", ylabel=ylabel, xscale="log", ylim=(0, None))
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.legend(fontsize=8)
    left.set_title("the grammar's work in a step (median)", fontsize=10)
    right.set_title("decode step, median", fontsize=10)
    harness.save_figure(fig, path, result)
