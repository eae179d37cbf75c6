"""perplexity: what each of chapter 13's weight formats costs in quality.

Text: the standard library's `pydoc_data/topics.py` (the same on every machine with this Python), tokenized with
the model's tokenizer; its first `tokens` tokens cut into windows of `window`, each scored on its own in one
prompt pass (`LLMEngine.prompt_logits`). Perplexity = exp(mean negative log-likelihood of every token of a
window but its first, over all windows), once per weight format of `benchmarks.variants` (fp32, bf16, int8,
int4 and, on a GGUF model, its own tensors), on the checkpoint `--checkpoint` names (chapter 13's by default;
from chapter 18, the GGUF tensors on fp32 activations with 8-bit activations and with exact products). Chapter
18's integer kernel serves steps of at most `INTEGER_DOT_ROWS` rows; `--integer-dot-rows N` raises that to N,
so that prompt passes and large decode batches take it too and the scores show what the 8-bit activations of
a decode step cost (0: the checkpoint's own threshold).

Then offline-cpu's requests (random prompts, greedy, EOS ignored) through each format: how far its greedy tokens
follow fp32's (`harness.agreement`: the share of tokens equal at the same position, and for k = 1, 4, 16, 64 the
share of requests whose first k tokens all equal fp32's).

    python -m benchmarks perplexity [--checkpoint 18] [--variants fp32,int4] [--integer-dot-rows 100000] [--quick]
"""

import importlib.util
import math
from pathlib import Path

from . import harness, offline_cpu, variants

NAME = "perplexity"
HELP = "chapter 13: perplexity on pydoc's topics and greedy agreement with fp32, per weight format"
CHAPTER = 13

FULL = {"checkpoint": "13", "variants": "all", "tokens": 16384, "window": 512, "integer_dot_rows": 0}
FULL |= {key: offline_cpu.FULL[key] for key in ("requests", "prompt_len", "max_tokens", "seed")}
FULL |= {"max_batch_tokens": 2048}
QUICK = {"tokens": 192, "window": 64, "requests": 4, "prompt_len": [8, 24], "max_tokens": [4, 12]}
QUICK |= {"max_batch_tokens": 256}
AFTER = (1, 4, 16, 64)  # agreement: the share of requests whose first k tokens all equal fp32's
COLUMNS = {"label": "weights", "compute_dtype": "compute", "perplexity": "perplexity", "vs_fp32": "x fp32"}
COLUMNS |= {"equal_token_share": "same tokens", "first_16_identical": "first 16 same", "error": "error"}


def run(args, s: dict) -> dict:
    wrong = "a weight format failed to run (see 'variants')"
    return harness.save(args, NAME, lambda: measure(args, s), "perplexity", plot, "ch13_perplexity", report, wrong)


def text_windows(model: str | None, tokens: int, window: int) -> list[list[int]]:
    """The first `tokens` tokens of pydoc's topics, in windows of `window`."""
    from chapters import submodule

    loader = submodule("rosellm", "loader")
    load_tokenizer = loader.load_tokenizer
    resolve_model_folder = loader.resolve_model_folder

    text = Path(importlib.util.find_spec("pydoc_data.topics").origin).read_text(encoding="utf-8")
    ids = load_tokenizer(resolve_model_folder(model)).encode(text, add_special_tokens=False)
    if len(ids) < tokens:
        raise SystemExit(f"pydoc's topics are {len(ids)} tokens, fewer than --tokens {tokens}")
    return [ids[start : start + window] for start in range(0, tokens - window + 1, window)]


def measure(args, s: dict) -> dict:
    point, config = harness.named_checkpoint(s["checkpoint"]), harness.model_config(args.model)
    chosen = variants.chosen(s["variants"], point)
    if not str(args.model or ".gguf").endswith(".gguf"):  # a Hugging Face folder has no GGUF tensors to keep
        chosen = [v for v in chosen if not v.name.startswith("gguf")]
    windows = text_windows(args.model, s["tokens"], s["window"])
    requests = harness.random_requests(s["requests"], s["prompt_len"], s["max_tokens"], config.vocab_size, s["seed"])
    longest = max([s["window"]] + [len(p) + m for p, m in requests])
    options = dict(max_num_seqs=s["requests"], max_num_batched_tokens=max(s["max_batch_tokens"], s["window"]))
    options |= dict(block_size=16, max_model_len=longest + 1)
    options |= dict(num_kv_blocks=offline_cpu.kv_blocks(requests, 16) + s["requests"] + s["window"] // 16 + 1)
    rows, fp32_tokens = [], None
    for variant in chosen:
        spec = dict(module=point.module, model=args.model, threads=args.threads, dtype=variant.dtype)
        spec["integer_dot_rows"] = s["integer_dot_rows"]
        spec |= dict(engine_options=options | variant.engine_options(), windows=windows, requests=requests)
        r = harness.run_engine("perplexity", spec, f"{harness.rosellm_label(point)}, {variant.label}")
        row = dict(variant=variant.name, label=variant.label, error=r.get("error"))
        if "nll_sums" in r:
            nll = sum(r["nll_sums"]) / sum(r["scored_tokens"])
            row |= dict(compute_dtype=r["compute_dtype"], mean_nll=round(nll, 5), perplexity=round(math.exp(nll), 4))
            row |= dict(
                window_perplexity=[round(math.exp(n / k), 3) for n, k in zip(r["nll_sums"], r["scored_tokens"])]
            )
            row |= dict(load_s=r["load_s"], scoring_s=r["scoring_s"])
            fp32_tokens = fp32_tokens or (r["tokens"] if variant.name == "fp32" else None)
            row["tokens"] = r["tokens"]
        rows.append(row)
    base = next((row.get("perplexity") for row in rows if row["variant"] == "fp32"), None)
    for row in rows:
        tokens = row.pop("tokens", None)
        if base and row.get("perplexity"):
            row["vs_fp32"] = round(row["perplexity"] / base, 4)
        if fp32_tokens and tokens:
            row["agreement_with_fp32"] = harness.agreement(tokens, fp32_tokens, AFTER)
            row["equal_token_share"] = row["agreement_with_fp32"]["equal_token_share"]
            row["first_16_identical"] = row["agreement_with_fp32"]["share_identical_for_first_k_tokens"]["16"]
    text = dict(source="pydoc_data/topics.py", tokens=len(windows) * s["window"], windows=len(windows))
    text |= dict(window=s["window"], scored_tokens_per_window=s["window"] - 1)
    out = dict(settings=s, checkpoint=point.module, text=text, engine_options=options, variants=rows)
    out["agreement_means"] = harness.agreement.__doc__
    return out | {"correct": all(row.get("perplexity") for row in rows)}


def report(result: dict) -> None:
    print(f"\nperplexity on {result['text']['tokens']} tokens of pydoc's topics, {result['text']['windows']} windows")
    harness.print_table(result["variants"], COLUMNS)


def plot(result: dict, path) -> None:
    """Perplexity per weight format (left); the share of requests whose first k greedy tokens equal fp32's (right)."""
    rows = [r for r in result["variants"] if r.get("perplexity")]
    fig, ((left, right),) = harness.figure_axes(1, 2, (11, 4))
    bars = left.bar([r["variant"] for r in rows], [r["perplexity"] for r in rows], color="tab:red")
    left.bar_label(bars, [f"{r['perplexity']:.2f}" for r in rows], fontsize=8)
    left.set(ylabel="perplexity (lower is better)", title=f"pydoc topics, {result['text']['tokens']} tokens")
    for r in rows:
        shares = r.get("agreement_with_fp32", {}).get("share_identical_for_first_k_tokens", {})
        right.plot([int(k) for k in shares], [100 * v for v in shares.values()], "o-", label=r["variant"])
    right.set_xscale("log", base=2)
    right.set(xlabel="first k generated tokens", ylabel="% of requests identical to fp32", ylim=(0, 105))
    right.set_title("greedy agreement with fp32", fontsize=10)
    right.legend(fontsize=8)
    harness.save_figure(fig, path, result)
